//! Training data, one way: `--data`'s documents ([`sources`]: text files, JSON lines, parquet,
//! directories of them, Hub datasets; or token files, [`token_files`]) → token ids
//! ([`tokenize`], documents separated by the end-of-text token where the tokenizer has one) →
//! the token cache under `OUT/tokens/` ([`cache`], split into train and val) → random windows
//! of block_size + 1 tokens ([`batches`]). A corpus of any size needs little memory: it is
//! tokenised piece by piece into a file that is then memory-mapped. [`export`] writes the cache
//! as llm.c's or nanoGPT's token files. Chat fine-tuning reads conversations instead ([`chat`]).

pub mod batches;
pub mod cache;
pub mod chat;
pub mod export;
pub mod sources;
pub mod token_files;
pub mod tokenize;

pub use batches::{batch_rng, get_batch, Batch, Dataset, Tokens};
pub use cache::prepare;
pub use export::write_token_files;
pub use sources::Reading;
pub use tokenize::{checked_sources, text_files, tokens_of};

/// What a run trains on: a token stream of its text, or conversations (`--data-format chat`).
pub enum Corpus {
    Text(Dataset),
    Chat(chat::Conversations),
}

impl Corpus {
    /// A batch of the training split (`train`) or the validation split, drawn from `rng`.
    pub fn batch(
        &self,
        train: bool,
        batch_size: usize,
        block_size: usize,
        rng: &mut impl rand::Rng,
        device: &candle_core::Device,
    ) -> anyhow::Result<Batch> {
        match self {
            Corpus::Text(d) => Ok(get_batch(
                if train { &d.train } else { &d.val },
                batch_size,
                block_size,
                rng,
                device,
            )?
            .into()),
            Corpus::Chat(c) => chat::get_batch(
                if train { &c.train } else { &c.val },
                batch_size,
                block_size,
                rng,
                device,
            ),
        }
    }

    /// Tokens in a split (all conversations' for chat data).
    pub fn tokens(&self, train: bool) -> usize {
        match self {
            Corpus::Text(d) => (if train { &d.train } else { &d.val }).len(),
            Corpus::Chat(c) => (if train { &c.train } else { &c.val })
                .iter()
                .map(|e| e.tokens.len())
                .sum(),
        }
    }
}
