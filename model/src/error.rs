//! The crate's error type: every failure names the file, tensor or limit involved.

use std::path::PathBuf;

pub type Result<T> = std::result::Result<T, Error>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: file not found")]
    MissingFile { path: PathBuf },

    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("invalid model config: {0}")]
    InvalidConfig(String),

    #[error("{path}: invalid model config: {reason}")]
    ConfigFile { path: PathBuf, reason: String },

    #[error("{path}: not a valid safetensors file (truncated or corrupt?): {reason}")]
    CorruptCheckpoint { path: PathBuf, reason: String },

    #[error("{path}: tensor `{name}` is missing")]
    MissingTensor { path: PathBuf, name: String },

    #[error("tensor `{name}`: expected shape {expected:?}, found {actual:?}")]
    ShapeMismatch {
        name: String,
        expected: Vec<usize>,
        actual: Vec<usize>,
    },

    #[error("{path}: not UTF-8 text (invalid byte at offset {offset})")]
    NotText { path: PathBuf, offset: usize },

    #[error("{path}: tokenizer error: {reason}")]
    Tokenizer { path: PathBuf, reason: String },

    #[error("tokenizer error: {0}")]
    Tokenize(String),

    #[error("text contains {ch:?}, which is not in the character-level tokenizer's vocabulary")]
    UnknownCharacter { ch: char },

    #[error("the tokenizer has {tokenizer} tokens but the model's vocab_size is {model}")]
    VocabMismatch { tokenizer: usize, model: usize },

    #[error("token id {id} is outside the vocabulary (vocab_size {vocab_size})")]
    TokenOutOfVocab { id: u32, vocab_size: usize },

    #[error("sequence needs {needed} positions but the context length (n_positions) is {max}")]
    ContextOverflow { needed: usize, max: usize },

    /// A chat template that does not compile, or cannot render a conversation; `param` is the
    /// request's field at fault (`messages`, `chat_template`, `continue_final_message`).
    #[error("{reason}")]
    ChatTemplate { param: &'static str, reason: String },

    #[error("{path}: LoRA adapter: {reason}")]
    Adapter { path: PathBuf, reason: String },

    /// Packed windows' positions that do not fit their inputs or do not number sequences.
    #[error("positions of packed windows: {0}")]
    Positions(String),

    #[error("the draft model cannot propose for this model: {0}")]
    DraftMismatch(String),

    #[error("device: {0}")]
    Device(String),

    #[error(
        "{path}: not a checkpoint (no config.json) nor a gpt-train run directory (no best/ or latest/ checkpoint in it)"
    )]
    NotACheckpoint { path: PathBuf },

    #[error("`{id}` (Hugging Face Hub): {reason}")]
    Hub { id: String, reason: String },

    #[error("empty input: {0}")]
    EmptyInput(&'static str),

    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

impl From<gpt_kernels::ParseError> for Error {
    fn from(e: gpt_kernels::ParseError) -> Self {
        Error::InvalidConfig(e.0)
    }
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        let path = path.into();
        if source.kind() == std::io::ErrorKind::NotFound {
            Error::MissingFile { path }
        } else {
            Error::Io { path, source }
        }
    }
}
