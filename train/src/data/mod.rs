//! Training data, one way: `--data`'s documents ([`sources`]: text files, JSON lines, parquet,
//! directories of them, Hub datasets; or token files, [`token_files`]) → token ids
//! ([`tokenize`], documents separated by the end-of-text token where the tokenizer has one) →
//! the token cache under `OUT/tokens/` ([`cache`], split into train and val) → random windows
//! of block_size + 1 tokens ([`batches`]). A corpus of any size needs little memory: it is
//! tokenised piece by piece into a file that is then memory-mapped. [`export`] writes the cache
//! as llm.c's or nanoGPT's token files.

pub mod batches;
pub mod cache;
pub mod export;
pub mod sources;
pub mod token_files;
pub mod tokenize;

pub use batches::{batch_rng, get_batch, Dataset, Tokens};
pub use cache::prepare;
pub use export::write_token_files;
pub use sources::Reading;
pub use tokenize::{checked_sources, text_files, tokens_of};
