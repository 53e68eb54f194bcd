//! Batches: the memory-mapped tokens of each split, read as random contiguous windows of
//! block_size + 1 tokens from a generator derived from (seed, step).

use std::sync::Arc;

use anyhow::{bail, Result};
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};

use super::token_files::TokenFile;

/// One split's tokens: ranges of memory-mapped token files, one after another.
#[derive(Clone)]
pub struct Tokens {
    parts: Vec<(Arc<TokenFile>, std::ops::Range<usize>)>,
    /// Tokens before each part.
    starts: Vec<usize>,
    len: usize,
}

impl Tokens {
    pub(super) fn new(parts: Vec<(Arc<TokenFile>, std::ops::Range<usize>)>) -> Self {
        let parts: Vec<_> = parts.into_iter().filter(|(_, r)| !r.is_empty()).collect();
        let mut starts = Vec::with_capacity(parts.len());
        let mut len = 0;
        for (_, range) in &parts {
            starts.push(len);
            len += range.len();
        }
        Self { parts, starts, len }
    }

    pub(super) fn whole(files: Vec<TokenFile>) -> Self {
        Self::new(
            files
                .into_iter()
                .map(|f| {
                    let n = f.len();
                    (Arc::new(f), 0..n)
                })
                .collect(),
        )
    }

    /// The first `at` tokens and the rest.
    pub(super) fn split_at(&self, at: usize) -> (Self, Self) {
        let (mut head, mut tail) = (Vec::new(), Vec::new());
        for ((file, range), &start) in self.parts.iter().zip(&self.starts) {
            let cut = at.saturating_sub(start).min(range.len());
            head.push((file.clone(), range.start..range.start + cut));
            tail.push((file.clone(), range.start + cut..range.end));
        }
        (Self::new(head), Self::new(tail))
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Tokens `start..start + n` (across files where a window spans two).
    pub fn window(&self, start: usize, n: usize) -> Vec<u32> {
        let mut out = Vec::with_capacity(n);
        let mut part = self.starts.partition_point(|&s| s <= start).saturating_sub(1);
        let mut at = start;
        while out.len() < n && part < self.parts.len() {
            let (file, range) = &self.parts[part];
            let offset = at - self.starts[part];
            let take = (n - out.len()).min(range.len() - offset);
            out.extend(file.window(range.start + offset, take));
            at += take;
            part += 1;
        }
        out
    }
}

pub struct Dataset {
    pub train: Tokens,
    pub val: Tokens,
}

/// A generator for one batch, derived from (seed, step, stream): the batches of a step do not
/// depend on anything that happened before it, so a resumed run draws the same ones.
pub fn batch_rng(seed: u64, step: usize, stream: u64) -> rand_chacha::ChaCha12Rng {
    rand_chacha::ChaCha12Rng::seed_from_u64(gpt_kernels::rng::key(&[seed, step as u64, stream]))
}

/// One micro-batch of windows: inputs `x` and next-token targets `y`, `(B, T)`; for packed
/// windows (chat data: several conversations in a window), each row's position in its own
/// conversation, `(B, T)` (see [`gpt::Gpt::loss_at`]).
#[derive(Debug, Clone)]
pub struct Batch {
    pub x: Tensor,
    pub y: Tensor,
    pub positions: Option<Tensor>,
}

impl Batch {
    /// Windows `start..start + len` of the batch.
    pub fn rows(&self, start: usize, len: usize) -> candle_core::Result<Self> {
        Ok(Self {
            x: self.x.narrow(0, start, len)?,
            y: self.y.narrow(0, start, len)?,
            positions: self.positions.as_ref().map(|p| p.narrow(0, start, len)).transpose()?,
        })
    }
}

impl From<(Tensor, Tensor)> for Batch {
    /// Windows of one sequence each.
    fn from((x, y): (Tensor, Tensor)) -> Self {
        Self { x, y, positions: None }
    }
}

/// `batch_size` random windows: inputs `(B, T)` and next-token targets `(B, T)`.
pub fn get_batch(
    tokens: &Tokens,
    batch_size: usize,
    block_size: usize,
    rng: &mut impl Rng,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    if tokens.len() < block_size + 1 {
        bail!(
            "split has {} tokens, but a block of {block_size} needs at least {}",
            tokens.len(),
            block_size + 1
        );
    }
    let (mut x, mut y) = (
        Vec::with_capacity(batch_size * block_size),
        Vec::with_capacity(batch_size * block_size),
    );
    for _ in 0..batch_size {
        let start = rng.random_range(0..=tokens.len() - block_size - 1);
        let w = tokens.window(start, block_size + 1);
        x.extend_from_slice(&w[..block_size]);
        y.extend_from_slice(&w[1..]);
    }
    Ok((
        Tensor::from_vec(x, (batch_size, block_size), device)?,
        Tensor::from_vec(y, (batch_size, block_size), device)?,
    ))
}
