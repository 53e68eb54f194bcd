//! Tokenizers through the `tokenizers` crate: GPT-2's byte-level BPE (trained with its
//! `BpeTrainer`), or nanoGPT's character-level vocabulary; both saved as `tokenizer.json`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use tokenizers::decoders::fuse::Fuse;
use tokenizers::models::bpe::{BpeTrainer, Vocab, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, DecoderWrapper};

use crate::error::{Error, Result};
use crate::files::{for_each_piece, write_atomic};

/// GPT-2's end-of-text token, added to trained BPE vocabularies.
pub const END_OF_TEXT: &str = "<|endoftext|>";

pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";

#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// A character-level vocabulary silently drops unknown characters; we report them instead.
    char_level: bool,
    /// The checkpoint's chat template (`chat_template` of its `tokenizer_config.json`), kept so
    /// that a model trained from it is saved with it.
    chat_template: Option<String>,
    /// The end-of-sequence ids the checkpoint names (a GGUF file's); empty: `<|endoftext|>`.
    eos: Vec<u32>,
    /// A token every prompt starts with (a GGUF file's BOS where `add_bos_token`), unless the
    /// text's own first token is it already (a chat template that writes `bos_token`).
    bos: Option<u32>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("char_level", &self.char_level)
            .finish()
    }
}

impl Tokenizer {
    fn wrap(mut inner: tokenizers::Tokenizer) -> Self {
        let char_level = matches!(inner.get_decoder(), Some(DecoderWrapper::Fuse(_)));
        if inner.get_pre_tokenizer().is_none() {
            // Without a pre-tokenizer the model's "word" is the whole text, and its cache (kept
            // per thread, 10,000 words of under 256 bytes, ~32 bytes a character) would keep
            // every distinct short prompt: up to ~80 MB in each thread that tokenizes, for
            // hits only on a prompt sent again.
            let mut model = inner.get_model().clone();
            model.resize_cache(0);
            inner.with_model(model);
        }
        Self {
            inner,
            char_level,
            chat_template: None,
            eos: Vec::new(),
            bos: None,
        }
    }

    /// The token every prompt starts with, where the model's file asks for one.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// This tokenizer with `bos` put before every prompt that does not start with it
    /// ([`Tokenizer::encode_prompt`]).
    pub fn with_bos(self, bos: Option<u32>) -> Self {
        Self { bos, ..self }
    }

    /// This tokenizer with the model's end-of-sequence ids (the first is the one generation
    /// stops at), where the checkpoint names them.
    pub fn with_eos(self, eos: Vec<u32>) -> Self {
        Self { eos, ..self }
    }

    /// A tokenizer built elsewhere (a GGUF file's).
    pub fn from_inner(inner: tokenizers::Tokenizer) -> Self {
        Self::wrap(inner)
    }

    /// This tokenizer with a chat template to save with it ([`Tokenizer::hf_config`]).
    pub fn with_chat_template(self, chat_template: Option<String>) -> Self {
        Self { chat_template, ..self }
    }

    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Loads a `tokenizer.json` (GPT-2's own, or one saved here).
    pub fn from_file(path: &Path) -> Result<Self> {
        if !path.exists() {
            return Err(Error::MissingFile {
                path: path.to_path_buf(),
            });
        }
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| Error::Tokenizer {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        Ok(Self::wrap(inner))
    }

    /// GPT-2's byte-level BPE from the older files a Hub repository may have instead of
    /// `tokenizer.json`: `vocab.json` and `merges.txt` (what `transformers`' slow `GPT2Tokenizer`
    /// reads), with GPT-2's byte-level pre-tokenizer and decoder and `<|endoftext|>` special.
    pub fn from_vocab_merges(vocab: &Path, merges: &Path) -> Result<Self> {
        let error = |path: &Path, reason: String| Error::Tokenizer {
            path: path.to_path_buf(),
            reason,
        };
        for path in [vocab, merges] {
            if !path.exists() {
                return Err(Error::MissingFile {
                    path: path.to_path_buf(),
                });
            }
        }
        let (vocab_str, merges_str) = (vocab.to_string_lossy(), merges.to_string_lossy());
        let bpe = BPE::from_file(&vocab_str, &merges_str)
            .build()
            .map_err(|e| error(vocab, format!("with {}: {e}", merges.display())))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
        inner.with_decoder(Some(ByteLevel::new(false, true, true)));
        inner.with_post_processor(Some(ByteLevel::new(false, true, true)));
        if inner.token_to_id(END_OF_TEXT).is_some() {
            inner
                .add_special_tokens([AddedToken::from(END_OF_TEXT, true)])
                .map_err(|e| error(vocab, e.to_string()))?;
        }
        Ok(Self::wrap(inner))
    }

    /// Writes `tokenizer.json` atomically.
    pub fn save(&self, path: &Path) -> Result<()> {
        let json = self.inner.to_string(true).map_err(|e| Error::Tokenizer {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        write_atomic(path, json.as_bytes())
    }

    /// nanoGPT's character vocabulary: the sorted set of characters in the corpus. This is a
    /// BPE model without merges, so each character is one token, and a `Fuse` decoder that joins
    /// them back without separators.
    pub fn train_char(files: &[PathBuf]) -> Result<Self> {
        let mut chars = BTreeSet::new();
        for path in files {
            for_each_piece(path, 1 << 20, |piece| {
                chars.extend(piece.chars());
                Ok(())
            })?;
        }
        if chars.is_empty() {
            return Err(Error::EmptyInput("the corpus for the character vocabulary is empty"));
        }
        let vocab: Vocab = chars
            .iter()
            .enumerate()
            .map(|(i, c)| (c.to_string(), i as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, vec![])
            .build()
            .map_err(|e| Error::Tokenize(e.to_string()))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner.with_decoder(Some(Fuse::new()));
        Ok(Self::wrap(inner))
    }

    /// GPT-2's byte-level BPE, trained on `files` up to `vocab_size` tokens (256 byte tokens,
    /// `<|endoftext|>`, then merges).
    pub fn train_bpe(files: &[PathBuf], vocab_size: usize) -> Result<Self> {
        let min = ByteLevel::alphabet().len() + 1;
        if vocab_size < min {
            return Err(Error::Tokenize(format!(
                "a byte-level BPE vocabulary needs at least {min} tokens (256 bytes + {END_OF_TEXT}), got {vocab_size}"
            )));
        }
        for path in files {
            if for_each_piece(path, 1 << 20, |_| Ok(()))? == 0 {
                return Err(Error::Tokenizer {
                    path: path.clone(),
                    reason: "file is empty".into(),
                });
            }
        }
        let mut trainer: TrainerWrapper = BpeTrainer::builder()
            .vocab_size(vocab_size)
            .min_frequency(2)
            .show_progress(false)
            .special_tokens(vec![AddedToken::from(END_OF_TEXT, true)])
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .build()
            .into();
        let mut inner = tokenizers::Tokenizer::new(BPE::default());
        inner.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
        inner.with_post_processor(Some(ByteLevel::default().trim_offsets(false)));
        inner.with_decoder(Some(ByteLevel::default()));
        let files = files.iter().map(|p| p.to_string_lossy().into_owned()).collect();
        inner
            .train_from_files(&mut trainer, files)
            .map_err(|e| Error::Tokenize(format!("training BPE: {e}")))?;
        Ok(Self::wrap(inner))
    }

    /// Number of token ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn is_char_level(&self) -> bool {
        self.char_level
    }

    /// The end-of-sequence id: the checkpoint's own where it names one (a GGUF file's), else
    /// `<|endoftext|>`'s, where the vocabulary has it.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos
            .first()
            .copied()
            .or_else(|| self.inner.token_to_id(END_OF_TEXT))
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        if self.char_level {
            if let Some(ch) = text.chars().find(|c| self.inner.token_to_id(&c.to_string()).is_none()) {
                return Err(Error::UnknownCharacter { ch });
            }
        }
        let encoding = self
            .inner
            .encode(text, false)
            .map_err(|e| Error::Tokenize(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// A prompt's ids: [`Tokenizer::encode`], starting with the BOS where the checkpoint asks for
    /// one ([`Tokenizer::with_bos`]) and the text does not begin with it already. `encode` alone
    /// is for pieces of text (a grammar's, a stop string's).
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = self.encode(text)?;
        if let Some(bos) = self.bos.filter(|&b| ids.first() != Some(&b)) {
            ids.insert(0, bos);
        }
        Ok(ids)
    }

    /// The text of `ids`, special tokens (`<|endoftext|>`) included.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| Error::Tokenize(e.to_string()))
    }

    /// The text of `ids` without special tokens: what a generation shows (as vLLM's
    /// `skip_special_tokens`, on by default).
    pub fn decode_skip_special(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, true).map_err(|e| Error::Tokenize(e.to_string()))
    }

    /// `tokenizer_config.json` for `transformers`: without it, `AutoTokenizer` takes a `gpt2`
    /// checkpoint's tokenizer for GPT-2's own and re-applies its byte-level rules, which drops the
    /// spaces and newlines of a character vocabulary. With it, `tokenizer.json` is used as it is,
    /// with GPT-2's end-of-text token (where the vocabulary has it) as both ends of a text.
    pub fn hf_config(&self, model_max_length: usize) -> serde_json::Value {
        let eot = self.eos_token_id().map(|_| END_OF_TEXT);
        let mut config = serde_json::json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": model_max_length,
            "bos_token": eot,
            "eos_token": eot,
            "clean_up_tokenization_spaces": false,
        });
        if let Some(template) = &self.chat_template {
            config["chat_template"] = template.clone().into();
        }
        config
    }

    /// The `tokenizers` object, for what this wrapper does not cover.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}
