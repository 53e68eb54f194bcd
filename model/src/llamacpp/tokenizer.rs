//! The tokenizer a llama.cpp GGUF file describes (`tokenizer.ggml.*`), built with the `tokenizers`
//! crate as the model's own `tokenizer.json` would be: byte-level BPE (`gpt2`: Llama 3, Qwen,
//! SmolLM) or SentencePiece's BPE (`llama`: Llama 2, TinyLlama, Mistral 7B, Gemma).

use super::File;
use crate::config::Config;
use crate::error::Result;
use crate::tokenizer::Tokenizer;

/// The pre-tokenizers of llama.cpp's `tokenizer.ggml.pre` names: the regular expressions its
/// `llama-vocab.cpp` splits text with before byte-level BPE (the same as the models'
/// `tokenizer.json`).
pub(super) const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
pub(super) const QWEN2_SPLIT: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
pub(super) const PRE_TOKENIZERS: &str = "gpt-2, default, smollm, llama3 (llama-bpe), qwen2";

/// The tokenizer the file describes: `tokenizer.ggml.model` `gpt2` (byte-level BPE with its
/// merges and the pre-tokenizer `tokenizer.ggml.pre` names) or `llama` (SentencePiece: pieces
/// merged by their scores, bytes for what no piece holds), special tokens by their
/// `token_type`, a BOS prefix where `add_bos_token`, and the chat template.
pub(super) fn tokenizer(f: &File, cfg: &Config) -> Result<Tokenizer> {
    use tokenizers::AddedToken;

    let model = f
        .string("tokenizer.ggml.model")?
        .ok_or_else(|| f.corrupt("no `tokenizer.ggml.model`".into()))?;
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
    let types = f.ints("tokenizer.ggml.token_type")?.unwrap_or_default();
    let bad = |e: tokenizers::Error| f.corrupt(format!("tokenizer: {e}"));
    let mut inner = match model {
        "gpt2" => byte_level_bpe(f, &tokens)?,
        "llama" => sentencepiece(f, &tokens, &types)?,
        other => {
            return Err(f.corrupt(format!(
            "tokenizer.ggml.model `{other}` is not supported (supported: gpt2, byte-level BPE; llama, SentencePiece)"
        )))
        }
    };
    // Control (3) and user-defined (4) tokens are matched whole before the BPE, as
    // `tokenizer.json`'s added tokens are (and llama.cpp's `tokenizer_st_partition`); control
    // tokens are special (skipped in output).
    let (mut special, mut user) = (Vec::new(), Vec::new());
    for (token, &kind) in tokens.iter().zip(&types) {
        match kind {
            3 => special.push(AddedToken::from(token.to_string(), true)),
            4 => user.push(AddedToken::from(token.to_string(), false).normalized(false)),
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

/// Byte-level BPE (`tokenizer.ggml.model` `gpt2`): the merges of `tokenizer.ggml.merges` and the
/// pre-tokenizer `tokenizer.ggml.pre` names.
fn byte_level_bpe(f: &File, tokens: &[&str]) -> Result<tokenizers::Tokenizer> {
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::pre_tokenizers::digits::Digits;
    use tokenizers::pre_tokenizers::sequence::Sequence;
    use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
    use tokenizers::{PreTokenizerWrapper, SplitDelimiterBehavior};

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
        "gpt-2" | "gpt2" | "default" => (ByteLevel::new(false, true, true).into(), false),
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
        .map_err(bad)?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    inner.with_pre_tokenizer(Some(pre_tokenizer));
    inner.with_decoder(Some(ByteLevel::new(false, true, true)));
    Ok(inner)
}

/// SentencePiece's BPE as llama.cpp runs it (`llm_tokenizer_spm`): spaces written `▁`, a `▁`
/// before each run of text where `tokenizer.ggml.add_space_prefix` (the default; Gemma's files
/// turn it off), then the adjacent pieces whose concatenation is a piece merged, the
/// highest-scoring first (`tokenizer.ggml.scores`), and what no piece holds as its UTF-8 bytes'
/// tokens (`<0x..>`). As `transformers`' converter does for these models (`LlamaConverter`), the
/// scores become BPE merges: every piece that splits into two pieces is a merge of them, ranked
/// by its score, which the `tokenizers` crate's BPE then applies in the same order.
fn sentencepiece(f: &File, tokens: &[&str], types: &[i64]) -> Result<tokenizers::Tokenizer> {
    use tokenizers::decoders::{byte_fallback::ByteFallback, fuse::Fuse, sequence::Sequence as Decoders, strip::Strip};
    use tokenizers::normalizers::{Prepend, Replace, Sequence as Normalizers};
    use tokenizers::{DecoderWrapper, NormalizerWrapper};

    let bad = |e: tokenizers::Error| f.corrupt(format!("tokenizer: {e}"));
    let scores = f.floats("tokenizer.ggml.scores")?;
    if let Some(scores) = scores.as_ref().filter(|s| s.len() != tokens.len()) {
        return Err(f.corrupt(format!(
            "tokenizer.ggml.scores has {} scores for {} tokens",
            scores.len(),
            tokens.len()
        )));
    }
    // Without scores, the earlier piece ranks first (SentencePiece's BPE scores fall with the id).
    let score = |id: usize| scores.as_ref().map_or(-(id as f32), |s| s[id]);
    let mut vocab = tokenizers::models::bpe::Vocab::default();
    for (id, token) in tokens.iter().enumerate() {
        vocab.entry(token.to_string()).or_insert(id as u32);
    }
    let mut merges: Vec<(f32, usize, &str, &str)> = Vec::new();
    for (id, token) in tokens.iter().enumerate() {
        // Byte and control pieces are never made by merging.
        if matches!(types.get(id), Some(3 | 6)) {
            continue;
        }
        for (at, _) in token.char_indices().skip(1) {
            let (a, b) = token.split_at(at);
            if vocab.contains_key(a) && vocab.contains_key(b) {
                merges.push((score(id), id, a, b));
            }
        }
    }
    // The highest score first; a piece's own splits in order (only one of them can apply at a
    // place, so their order among themselves does not matter).
    merges.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)));
    let merges: Vec<(String, String)> = merges.into_iter().map(|(_, _, a, b)| (a.into(), b.into())).collect();
    let unk = types
        .iter()
        .position(|&t| t == 2)
        .and_then(|id| tokens.get(id))
        .map(|t| t.to_string());
    let mut builder = tokenizers::models::bpe::BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(unk) = unk {
        builder = builder.unk_token(unk);
    }
    let bpe = builder.build().map_err(bad)?;
    let prefix = f.bool("tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
    let mut normalizers: Vec<NormalizerWrapper> = Vec::new();
    if prefix {
        normalizers.push(Prepend::new("\u{2581}".into()).into());
    }
    normalizers.push(Replace::new(" ", "\u{2581}").map_err(bad)?.into());
    let mut decoders: Vec<DecoderWrapper> = vec![
        Replace::new("\u{2581}", " ").map_err(bad)?.into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if prefix {
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    let mut inner = tokenizers::Tokenizer::new(bpe);
    inner
        .with_normalizer(Some(Normalizers::new(normalizers)))
        .map_err(bad)?;
    inner.with_decoder(Some(Decoders::new(decoders)));
    Ok(inner)
}
