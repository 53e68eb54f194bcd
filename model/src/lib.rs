//! `gpt`: a GPT-2-style decoder-only transformer on candle.
//!
//! Data flow at inference: text → [`Tokenizer`] → token ids → [`Gpt::forward_step`] (with one
//! [`KvCache`] per sequence) → logits. At training: token windows → [`Gpt::forward_t`] → logits →
//! cross-entropy. Checkpoints are Hugging Face GPT-2 directories (`config.json`,
//! `model.safetensors`, `tokenizer.json`), see [`checkpoint`].

pub mod attention;
pub mod beam;
pub mod checkpoint;
pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda_ops;
pub mod device;
pub mod error;
pub mod files;
pub mod generate;
pub mod gguf;
pub mod gpt;
pub mod hub;
pub mod layers;
pub mod ops;
pub mod rng;
pub mod sampling;
pub mod tokenizer;

pub use attention::{fill_kv_pool, kv_pool_bytes, set_kv_pool_limit, KvCache};
pub use checkpoint::{load_dir, load_dir_as, load_model, save_dir, save_gguf_dir};
pub use config::{Activation, Config, PositionEmbedding};
pub use device::{device_name, parse_device};
pub use error::{Error, Result};
pub use generate::generate;
pub use gpt::{Gpt, LogitsFor, SeqStep};
pub use layers::{Autocast, Dropout, Weight};
pub use ops::{MatmulPrecision, WeightFormat};
pub use sampling::{Sampler, SamplingParams};
pub use tokenizer::Tokenizer;
