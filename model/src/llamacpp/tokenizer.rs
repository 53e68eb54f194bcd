//! The tokenizer a llama.cpp GGUF file describes (`tokenizer.ggml.*`), built with the `tokenizers`
//! crate as the model's own `tokenizer.json` would be.

use super::File;
use crate::config::Config;
use crate::error::Result;
use crate::tokenizer::Tokenizer;

/// The pre-tokenizers of llama.cpp's `tokenizer.ggml.pre` names: the regular expressions its
/// `llama-vocab.cpp` splits text with before byte-level BPE (the same as the models'
/// `tokenizer.json`).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const PRE_TOKENIZERS: &str = "gpt2, default, smollm, llama3 (llama-bpe), qwen2";

/// The tokenizer the file describes: `tokenizer.ggml.model` `gpt2` (byte-level BPE with its
/// merges and the pre-tokenizer `tokenizer.ggml.pre` names), special tokens by their
/// `token_type`, a BOS prefix where `add_bos_token`, and the chat template.
pub(super) fn tokenizer(f: &File, cfg: &Config) -> Result<Tokenizer> {
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::pre_tokenizers::digits::Digits;
    use tokenizers::pre_tokenizers::sequence::Sequence;
    use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
    use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

    let model = f
        .string("tokenizer.ggml.model")?
        .ok_or_else(|| f.corrupt("no `tokenizer.ggml.model`".into()))?;
    if model != "gpt2" {
        return Err(f.corrupt(format!(
            "tokenizer.ggml.model `{model}` is not supported yet (supported: gpt2, llama.cpp's byte-level BPE)"
        )));
    }
    let tokens = f
        .strings("tokenizer.ggml.tokens")?
        .ok_or_else(|| f.corrupt("no `tokenizer.ggml.tokens`".into()))?;
    if tokens.len() > cfg.vocab_size || tokens.len() > u32::MAX as usize {
        return Err(f.corrupt(format!(
            "tokenizer.ggml.tokens has {} tokens, more than the embedding's {} rows",
            tokens.len(),
            cfg.vocab_size
        )));
    }
    let mut vocab = tokenizers::models::bpe::Vocab::default();
    for (id, token) in tokens.iter().enumerate() {
        vocab.entry(token.to_string()).or_insert(id as u32);
    }
    let merges = f
        .strings("tokenizer.ggml.merges")?
        .unwrap_or_default()
        .iter()
        .enumerate()
        .map(|(i, m)| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| f.corrupt(format!("tokenizer.ggml.merges[{i}] `{m}` is not two tokens")))
        })
        .collect::<Result<Vec<_>>>()?;
    let pre = f.string("tokenizer.ggml.pre")?.unwrap_or("default");
    let bad = |e: tokenizers::Error| f.corrupt(format!("tokenizer: {e}"));
    let split = |pattern: &str| -> Result<PreTokenizerWrapper> {
        Ok(Split::new(
            SplitPattern::Regex(pattern.into()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(bad)?
        .into())
    };
    let (pre_tokenizer, ignore_merges): (PreTokenizerWrapper, bool) = match pre {
        "gpt2" | "default" => (ByteLevel::new(false, true, true).into(), false),
        "smollm" => (
            Sequence::new(vec![Digits::new(true).into(), ByteLevel::new(false, true, true).into()]).into(),
            false,
        ),
        "llama3" | "llama-bpe" | "llama-v3" => (
            Sequence::new(vec![split(LLAMA3_SPLIT)?, ByteLevel::new(false, true, false).into()]).into(),
            true,
        ),
        "qwen2" => (
            Sequence::new(vec![split(QWEN2_SPLIT)?, ByteLevel::new(false, true, false).into()]).into(),
            false,
        ),
        other => {
            return Err(f.corrupt(format!(
                "tokenizer.ggml.pre `{other}` is not supported (supported: {PRE_TOKENIZERS})"
            )))
        }
    };
    let bpe = tokenizers::models::bpe::BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(ignore_merges)
        .build()
        .map_err(|e| f.corrupt(format!("tokenizer: {e}")))?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    inner.with_pre_tokenizer(Some(pre_tokenizer));
    inner.with_decoder(Some(ByteLevel::new(false, true, true)));
    // Control (3) and user-defined (4) tokens are matched whole before the BPE, as
    // `tokenizer.json`'s added tokens are; control tokens are special (skipped in output).
    let types = f.ints("tokenizer.ggml.token_type")?.unwrap_or_default();
    let (mut special, mut user) = (Vec::new(), Vec::new());
    for (token, &kind) in tokens.iter().zip(&types) {
        match kind {
            3 => special.push(AddedToken::from(token.to_string(), true)),
            4 => user.push(AddedToken::from(token.to_string(), false)),
            _ => {}
        }
    }
    inner.add_special_tokens(special).map_err(bad)?;
    inner.add_tokens(user).map_err(bad)?;
    // `add_bos_token` (Llama 2 and 3, TinyLlama): every text starts with the BOS, once (a chat
    // template that writes `bos_token` is not given a second), as llama.cpp tokenizes prompts.
    let bos = match f.bool("tokenizer.ggml.add_bos_token")?.unwrap_or(false) {
        true => Some(cfg.bos_token_id.ok_or_else(|| {
            f.corrupt("`tokenizer.ggml.add_bos_token` is set but there is no `tokenizer.ggml.bos_token_id`".into())
        })?),
        false => None,
    };
    let template = f.string("tokenizer.chat_template")?.map(str::to_string);
    Ok(Tokenizer::from_inner(inner)
        .with_eos(cfg.eos_ids())
        .with_bos(bos)
        .with_chat_template(template))
}
