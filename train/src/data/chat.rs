//! Chat fine-tuning's data (`--data-format chat`): JSON lines of conversations, each rendered
//! with the model's chat template ([`gpt::chat::ChatTemplate::training_pieces`], the code
//! gpt-server renders requests with) and tokenised piece by piece, so that the text before each
//! assistant turn is tokenised as the server tokenises the prompt it answers. Only the assistant's
//! tokens are targets: every other position's target is [`gpt_kernels::IGNORE`].
//!
//! A line holds `messages` (OpenAI's roles, as Hugging Face chat datasets hold them), or
//! `prompt` and `completion`: two strings (the completion trained on, no template), or two lists
//! of messages (rendered together, the completion's assistant turns trained on).
//!
//! Short conversations are packed into windows, one after another, each from position 0 as the
//! server sees it: the batch carries every row's position in its own conversation, and the model
//! ([`gpt::Gpt::loss_at`]) restarts the position embeddings there and keeps each conversation's
//! attention to itself, so a conversation trains as it would alone in a window. A conversation
//! longer than a window is cut to one window. What a window has left over is padding, its
//! targets ignored.

use std::io::BufRead;
use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use gpt::chat::{ChatTemplate, Message, RenderOptions};
use gpt::Tokenizer;
use rand::Rng;
use serde_json::Value;

use super::sources::{Kind, Source};
use super::Batch;

/// One conversation's tokens, and which of them are trained on (the assistant's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Example {
    pub tokens: Vec<u32>,
    pub trained: Vec<bool>,
}

/// The conversations of each split.
pub struct Conversations {
    pub train: Vec<Example>,
    pub val: Vec<Example>,
}

/// The conversations of `sources` (JSON lines), rendered with `template` and tokenised. An error
/// names the file and line.
pub fn read(sources: &[Source], template: &ChatTemplate, tokenizer: &Tokenizer) -> Result<Vec<Example>> {
    let mut out = Vec::new();
    for source in sources {
        if source.kind != Kind::JsonLines {
            bail!(
                "{}: chat data (--data-format chat) is JSON lines (.jsonl), one conversation a line",
                source.path.display()
            );
        }
        let file = std::fs::File::open(&source.path).with_context(|| format!("opening {}", source.path.display()))?;
        for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
            let line = line.with_context(|| format!("reading {}", source.path.display()))?;
            if line.trim().is_empty() {
                continue;
            }
            let example = example(&line, template, tokenizer)
                .with_context(|| format!("{} line {}", source.path.display(), n + 1))?;
            out.push(example);
        }
    }
    Ok(out)
}

/// One line's conversation as tokens.
pub fn example(line: &str, template: &ChatTemplate, tokenizer: &Tokenizer) -> Result<Example> {
    let v: Value = serde_json::from_str(line).context("not valid JSON")?;
    let messages = |key: &str| -> Result<Vec<Message>> {
        serde_json::from_value(v[key].clone())
            .with_context(|| format!("`{key}` must be a list of messages, each with a `role` and a string `content`"))
    };
    let pieces = match (v.get("messages"), v.get("prompt"), v.get("completion")) {
        (Some(_), _, _) => template.training_pieces(&messages("messages")?)?,
        (None, Some(Value::String(p)), Some(Value::String(c))) => vec![(p.clone(), false), (c.clone(), true)],
        (None, Some(Value::Array(_)), Some(Value::Array(_))) => {
            let prompt = messages("prompt")?;
            let mut all = prompt.clone();
            all.extend(messages("completion")?);
            // The prompt's own assistant turns are context, not targets.
            let prompt_len = template.render_with(&prompt, &RenderOptions::default())?.len();
            let mut at = 0;
            let mut pieces = template.training_pieces(&all)?;
            for (text, trained) in pieces.iter_mut() {
                *trained &= at >= prompt_len;
                at += text.len();
            }
            pieces
        }
        _ => bail!(
            "expected `messages` (a list of messages), or `prompt` and `completion` (two strings, or two lists of \
             messages)"
        ),
    };
    let mut tokens = Vec::new();
    let mut trained = Vec::new();
    for (text, is_trained) in pieces {
        let ids = tokenizer.encode(&text)?;
        trained.extend(std::iter::repeat_n(is_trained, ids.len()));
        tokens.extend(ids);
    }
    if !trained.iter().skip(1).any(|&t| t) {
        bail!("the conversation has no assistant tokens to train on");
    }
    Ok(Example { tokens, trained })
}

/// The split of `examples` into training and validation: `val` if given, else the last
/// `val_fraction` of them (at least one each).
pub fn split(mut examples: Vec<Example>, val: Option<Vec<Example>>, val_fraction: f64) -> Result<Conversations> {
    let val = match val {
        Some(val) => val,
        None => {
            let n = ((examples.len() as f64 * val_fraction).round() as usize).max(1);
            if examples.len() < n + 1 {
                bail!(
                    "{} conversations cannot be split into training and validation ({} for validation); add \
                     more or pass --val-data",
                    examples.len(),
                    n
                );
            }
            examples.split_off(examples.len() - n)
        }
    };
    if examples.is_empty() || val.is_empty() {
        bail!("chat data: no conversations in the training or the validation split");
    }
    Ok(Conversations { train: examples, val })
}

/// `batch_size` windows of `block_size` packed with random conversations: each window takes
/// conversations, drawn in turn, while the next one fits (its tokens but the last, which is only
/// a target), and the one that does not fit opens the next window; a conversation longer than a
/// window is cut to fill one. Inputs `(B, T)`, targets `(B, T)` ([`gpt_kernels::IGNORE`]
/// wherever the next token is not the assistant's, and over the padding that ends a window) and
/// each row's position in its conversation (the padding counts from 0 as one more sequence).
pub fn get_batch(
    examples: &[Example],
    batch_size: usize,
    block_size: usize,
    rng: &mut impl Rng,
    device: &Device,
) -> Result<Batch> {
    if examples.is_empty() {
        bail!("no conversations to draw a batch from");
    }
    let t = block_size;
    let mut x = vec![0u32; batch_size * t];
    let mut y = vec![gpt_kernels::IGNORE; batch_size * t];
    let mut positions = vec![0u32; batch_size * t];
    let mut waiting: Option<&Example> = None;
    for row in (0..batch_size).map(|b| b * t) {
        let mut used = 0;
        while used < t {
            let e = match waiting.take() {
                Some(e) => e,
                None => &examples[rng.random_range(0..examples.len())],
            };
            if e.tokens.len() < 2 {
                bail!("a conversation of {} tokens has nothing to predict", e.tokens.len());
            }
            let n = (e.tokens.len() - 1).min(t); // the positions it takes
            if used + n > t {
                waiting = Some(e);
                break;
            }
            let at = row + used;
            x[at..at + n].copy_from_slice(&e.tokens[..n]);
            for i in 0..n {
                positions[at + i] = i as u32;
                if e.trained[i + 1] {
                    y[at + i] = e.tokens[i + 1];
                }
            }
            used += n;
        }
        for (i, p) in positions[row + used..row + t].iter_mut().enumerate() {
            *p = i as u32;
        }
    }
    let shape = (batch_size, t);
    Ok(Batch {
        x: Tensor::from_vec(x, shape, device)?,
        y: Tensor::from_vec(y, shape, device)?,
        positions: Some(Tensor::from_vec(positions, shape, device)?),
    })
}

/// The chat template of the checkpoint in `dir` (the model being fine-tuned or resumed), else
/// the fallback play script.
pub fn template(dir: Option<&Path>) -> Result<ChatTemplate> {
    Ok(match dir {
        Some(dir) => ChatTemplate::for_checkpoint(dir, None)?,
        None => ChatTemplate::fallback()?,
    })
}
