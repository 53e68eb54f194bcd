//! Kernels of generation only: attention of a step's new tokens against their sequences' KV
//! caches.

mod attention;

pub use attention::{cached_attention, cached_attention_on, CachedKv, WriteRows};
