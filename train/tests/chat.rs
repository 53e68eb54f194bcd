//! Chat fine-tuning (`--data-format chat`): conversations rendered with the checkpoint's chat
//! template, the very text gpt-server renders for the same messages; the loss on the assistant's
//! tokens only (the other positions carry no gradient; a batch of none is 0, not NaN); full and
//! LoRA fine-tuning alike, the template kept in the checkpoints; bad lines named.

mod common;

use std::path::{Path, PathBuf};

use anyhow::Result;
use candle_core::{DType, Device, Tensor, D};
use common::stderr;
use gpt::chat::{ChatTemplate, Message, RenderOptions};
use gpt_test_support as support;
use gpt_train::data::chat;

fn s(path: &Path) -> &str {
    path.to_str().unwrap_or_default()
}

/// A template of the corpus's own characters (the tiny base's vocabulary is the corpus's).
const TEMPLATE: &str = "{% for m in messages %}{{ m.role | upper }}: {{ m.content }}\n{% endfor %}\
{% if add_generation_prompt %}ASSISTANT: {% endif %}";

/// A tiny base trained for 10 steps on the corpus (character vocabulary, a context of 128), with
/// `TEMPLATE` as its chat template, in `dir/base/best`.
fn base(dir: &Path) -> Result<PathBuf> {
    let out = dir.join("base");
    let o = common::train(
        &support::shakespeare_path(),
        &out,
        &["--max-iters", "10", "--block-size", "128"],
    )?;
    anyhow::ensure!(o.status.success(), "{}", stderr(&o));
    let best = out.join("best");
    let config_path = best.join(gpt::checkpoint::TOKENIZER_CONFIG_FILE);
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&config_path)?)?;
    config["chat_template"] = TEMPLATE.into();
    std::fs::write(&config_path, serde_json::to_string(&config)?)?;
    Ok(best)
}

/// Question-and-answer conversations from the corpus: a speech ending in a question, and the
/// next speaker's reply; as `messages` lines, and every fourth as a `prompt`/`completion` pair.
fn conversations(dir: &Path) -> Result<PathBuf> {
    let text = support::shakespeare(200_000)?;
    let speeches: Vec<&str> = text.split("\n\n").map(str::trim).collect();
    let mut lines = Vec::new();
    for pair in speeches.windows(2) {
        let (Some((_, q)), Some((_, a))) = (pair[0].split_once('\n'), pair[1].split_once('\n')) else {
            continue;
        };
        if !q.ends_with('?') || q.len() > 50 || a.len() > 50 {
            continue;
        }
        let line = if lines.len() % 4 == 3 {
            serde_json::json!({"prompt": q, "completion": a})
        } else {
            serde_json::json!({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
        };
        lines.push(line.to_string());
    }
    anyhow::ensure!(lines.len() > 40, "{} conversations", lines.len());
    common::write(dir, "chat.jsonl", lines.join("\n") + "\n")
}

#[test]
fn a_conversation_trains_on_the_assistants_tokens_after_the_prompt_the_server_renders() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let best = base(tmp.path())?;
    let tokenizer = gpt::checkpoint::load_tokenizer(&best, usize::MAX)?;
    // The trainer's template is the checkpoint's, as gpt-server loads it.
    let template = chat::template(Some(&best))?;
    assert_eq!(template.source, TEMPLATE);
    assert_eq!(ChatTemplate::for_checkpoint(&best, None)?.source, template.source);
    let messages = vec![
        Message::new("user", "Who is it that says most?"),
        Message::new("assistant", "Which can say more."),
        Message::new("user", "Than this rich praise?"),
        Message::new("assistant", "That you alone are you."),
    ];
    let line = serde_json::json!({ "messages": messages }).to_string();
    let example = chat::example(&line, &template, &tokenizer)?;
    let whole = template.render_with(
        &messages,
        &RenderOptions {
            add_generation_prompt: Some(false),
            ..RenderOptions::default()
        },
    )?;
    assert_eq!(tokenizer.decode(&example.tokens)?, whole);
    // The trained runs: each assistant turn with its end of turn; before each, the prompt the
    // server renders for the messages before it, token for token.
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for (i, &t) in example.trained.iter().enumerate() {
        match runs.last_mut() {
            Some((_, end)) if t && *end == i => *end += 1,
            _ if t => runs.push((i, i + 1)),
            _ => {}
        }
    }
    let turns: Vec<String> = runs
        .iter()
        .map(|&(a, b)| tokenizer.decode(&example.tokens[a..b]))
        .collect::<gpt::Result<_>>()?;
    assert_eq!(turns, ["Which can say more.\n", "That you alone are you.\n"]);
    for (&(start, _), turn) in runs.iter().zip([1, 3]) {
        let prompt = template.render(&messages[..turn])?;
        assert_eq!(example.tokens[..start], tokenizer.encode(&prompt)?[..]);
    }

    // A prompt/completion pair of strings: the completion alone is trained on.
    let pair = chat::example(
        r#"{"prompt": "Speak.", "completion": " I will."}"#,
        &template,
        &tokenizer,
    )?;
    assert_eq!(tokenizer.decode(&pair.tokens)?, "Speak. I will.");
    assert_eq!(pair.trained.iter().filter(|&&t| t).count(), " I will.".len());
    assert!(!pair.trained[.."Speak.".len()].iter().any(|&t| t));
    Ok(())
}

#[test]
fn only_the_assistants_tokens_are_targets_and_none_is_a_zero_loss() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let best = base(tmp.path())?;
    let data = conversations(tmp.path())?;
    let (model, tokenizer) = gpt::load_dir(&best, DType::F32, &Device::Cpu)?;
    let template = chat::template(Some(&best))?;
    let sources = gpt_train::data::sources::sources(&[data], gpt_train::data::token_files::DataFormat::Chat)?;
    let examples = chat::read(&sources, &template, &tokenizer)?;
    let mut rng = gpt_train::data::batch_rng(1, 0, 0);
    let batch = chat::get_batch(&examples, 4, 128, &mut rng, &Device::Cpu)?;
    let (x, y) = (&batch.x, &batch.y);
    let positions = batch
        .positions
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("chat batches are packed"))?;
    // The windows are packed: each sequence of positions from 0 is a drawn conversation's
    // tokens from its start, its targets the next tokens where they are the assistant's (or
    // the window's padding, with no targets). The loss is the mean negative log-likelihood of
    // the targets that are not IGNORE, each conversation scored as it is alone.
    let loss = model.loss_at(x, positions, y, None, 0.0)?.to_scalar::<f32>()?;
    let (inputs, targets, pos) = (x.to_vec2::<u32>()?, y.to_vec2::<u32>()?, positions.to_vec2::<u32>()?);
    let (mut nll, mut n, mut packed) = (0f64, 0, 0);
    for b in 0..4 {
        let starts: Vec<usize> = (0..128).filter(|&t| pos[b][t] == 0).chain([128]).collect();
        packed += starts.len() - 2; // conversations beyond the first (or the padding)
        for w in starts.windows(2) {
            let (from, to) = (w[0], w[1]);
            let ids = &inputs[b][from..to];
            let Some(e) = examples
                .iter()
                .find(|e| e.tokens.len() > ids.len() && e.tokens[..ids.len()] == *ids)
            else {
                assert!(
                    targets[b][from..to].iter().all(|&t| t == gpt_kernels::IGNORE),
                    "padding with targets"
                );
                continue;
            };
            let alone = model.forward(&Tensor::new(ids, &Device::Cpu)?.unsqueeze(0)?, None)?;
            let log_p = candle_nn::ops::log_softmax(&alone, D::Minus1)?.to_vec3::<f32>()?;
            for (i, &target) in targets[b][from..to].iter().enumerate() {
                let want = if e.trained[i + 1] {
                    e.tokens[i + 1]
                } else {
                    gpt_kernels::IGNORE
                };
                assert_eq!(target, want, "window {b}, row {}", from + i);
                if target != gpt_kernels::IGNORE {
                    nll -= log_p[0][i][target as usize] as f64;
                    n += 1;
                }
            }
        }
    }
    assert!(packed > 0, "no window holds two conversations");
    assert!(n > 0 && n < 4 * 128, "{n} targets");
    assert!(
        (loss as f64 - nll / n as f64).abs() < 1e-4,
        "{loss} vs {}",
        nll / n as f64
    );
    // Masked positions carry no gradient: changing their targets changes nothing.
    let mut other = targets.clone();
    for row in other.iter_mut() {
        for t in row.iter_mut().filter(|t| **t == gpt_kernels::IGNORE) {
            *t = 5;
        }
    }
    let other = Tensor::new(other, &Device::Cpu)?;
    let (with_ignored, with_fives) = (
        model.loss_at(x, positions, y, None, 0.0)?,
        model.loss_at(x, positions, &other, None, 0.0)?,
    );
    assert_ne!(with_ignored.to_scalar::<f32>()?, with_fives.to_scalar::<f32>()?);
    // A batch without one assistant token: loss 0 and finite gradients, not NaN.
    let none = Tensor::full(gpt_kernels::IGNORE, (4, 128), &Device::Cpu)?;
    let train = Some(gpt::Dropout { key: 1, first_row: 0 });
    let varmap = candle_nn::VarMap::new();
    let trained = gpt::Gpt::new(
        candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
        model.config(),
    )?;
    let zero = trained.loss_at(x, positions, &none, train, 0.0)?;
    assert_eq!(zero.to_scalar::<f32>()?, 0.0);
    let grads = zero.backward()?;
    for var in varmap.all_vars() {
        if let Some(g) = grads.get(var.as_tensor()) {
            let max = g.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(max == 0.0, "a gradient of {max} from no targets");
        }
    }
    Ok(())
}

#[test]
fn full_and_lora_chat_fine_tuning_run_and_keep_the_template() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let best = base(tmp.path())?;
    let data = conversations(tmp.path())?;
    for (name, extra) in [("full", &[][..]), ("lora", &["--lora-r", "4"][..])] {
        let out = tmp.path().join(name);
        let args = [
            &[
                "--init-from",
                s(&best),
                "--data-format",
                "chat",
                "--max-iters",
                "12",
                "--block-size",
                "128",
            ][..],
            extra,
        ]
        .concat();
        let run = common::train(&data, &out, &args)?;
        assert!(run.status.success(), "{name}: {}", stderr(&run));
        let losses = common::train_losses(&out)?;
        assert!(losses.iter().all(|(_, l)| l.is_finite()), "{name}: {losses:?}");
        // The checkpoint keeps the base's chat template: gpt-server renders with it.
        assert_eq!(
            ChatTemplate::for_checkpoint(&out.join("latest"), None)?.source,
            TEMPLATE,
            "{name}"
        );
    }
    // A line that is not a conversation is refused with its file and line.
    let bad = common::write(tmp.path(), "bad.jsonl", "{\"messages\": []}\n{\"text\": \"x\"}\n")?;
    let err = common::fails(
        &common::train_args(
            &bad,
            &tmp.path().join("never"),
            &["--init-from", s(&best), "--data-format", "chat", "--block-size", "128"],
        )
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>(),
    )?;
    assert!(
        err.contains("bad.jsonl line 1") && err.contains("at least one message"),
        "{err}"
    );
    Ok(())
}
