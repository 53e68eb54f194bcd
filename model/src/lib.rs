//! `gpt`: a GPT-2-style decoder-only transformer on candle.
//!
//! The network's entry points are few: at inference, text → [`Tokenizer`] → token ids →
//! [`Gpt::forward_step`] (a step of several sequences, each with its [`KvCache`]) → logits; at
//! training and evaluation, token windows → [`Gpt::loss`] (the forward pass with the LM head and
//! the cross-entropy fused; [`Gpt::forward`] gives the windows' logits). The rest is built on
//! them. Checkpoints are Hugging Face GPT-2 directories (`config.json`,
//! `model.safetensors`, `tokenizer.json`), see [`checkpoint`]. The kernels underneath (products,
//! attention, element-wise ops, on the CPU and CUDA) are the `gpt-kernels` crate.

pub mod arch;
pub mod attention;
pub mod beam;
pub mod chat;
pub mod checkpoint;
pub mod config;
pub mod device;
pub mod error;
pub mod files;
pub mod generate;
pub mod gguf;
pub mod gpt;
pub mod hub;
pub mod kv_cache;
pub mod kv_pool;
pub mod layers;
pub mod llamacpp;
pub mod lora;
pub mod sampling;
pub mod speculative;
pub mod tokenizer;

pub use checkpoint::{load_dir, load_dir_as, load_model, save_dir, save_gguf_dir};
pub use config::{Activation, Config, PositionEmbedding};
pub use device::{device_name, parse_device};
pub use error::{Error, Result};
pub use generate::generate;
pub use gpt::{Gpt, LogitsFor, SeqStep};
pub use gpt_kernels::{MatmulPrecision, WeightFormat};
pub use kv_cache::{fill_kv_pool, KvCache, KvCacheDtype};
pub use kv_pool::{kv_pool_bytes, set_kv_pool_limit};
pub use layers::{Autocast, Dropout, Weight};
pub use lora::Adapter;
pub use sampling::{Sampler, SamplingParams};
pub use tokenizer::Tokenizer;
