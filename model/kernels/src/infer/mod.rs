//! Kernels of generation only: attention of a step's new tokens against their sequences' KV
//! caches, and LoRA adapters' updates of some of a step's rows.

mod attention;
mod lora;
mod rotate;

pub use attention::{
    cached_attention, cached_attention_masked, cached_attention_on, grouped_attention, CachedKv, Masking, WriteRows,
};
pub use lora::lora_rows;
pub use rotate::{rotate_qkv, QkNorm, QkvHeads};
#[cfg(feature = "cuda")]
pub mod decode_attention;
#[cfg(feature = "cuda")]
pub use decode_attention::{decode_attention, DECODE_SHARED_FLOATS};
