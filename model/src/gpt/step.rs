//! One generation step for several sequences at once ([`Gpt::forward_step`]): the new tokens of
//! every sequence packed into one `(N, C)` matrix, each sequence against its own KV cache, and
//! each with its own LoRA adapter or none ([`Gpt::forward_step_adapted`]). What the server's
//! continuous batching, speculative decoding's checks and beam search run.

use candle_core::{DType, Device, Tensor};

use super::Gpt;
use crate::error::{Error, Result};
use crate::kv_cache::KvCache;
use crate::layers::{layer_norm, RowUpdate};

/// The adapters' updates of one block's layers in a packed step, in the order of
/// [`crate::lora::block_products`].
pub(super) type BlockUpdates<'a> = [Vec<RowUpdate<'a>>; 4];

/// Each distinct adapter of a step (the same adapter by address) with the rows of its
/// sequences, `lens[s]` rows for sequence `s`, as indices and as a u32 tensor on `device`.
fn adapter_rows<'a>(
    adapters: &[Option<&'a crate::lora::Adapter>],
    lens: &[usize],
    device: &Device,
) -> candle_core::Result<Vec<(&'a crate::lora::Adapter, Vec<u32>, Tensor)>> {
    let mut groups: Vec<(&crate::lora::Adapter, Vec<u32>)> = Vec::new();
    let mut start = 0u32;
    for (adapter, &len) in adapters.iter().zip(lens) {
        let rows = start..start + len as u32;
        start += len as u32;
        let Some(adapter) = adapter else { continue };
        match groups.iter_mut().find(|(a, _)| std::ptr::eq(*a, *adapter)) {
            Some((_, ids)) => ids.extend(rows),
            None => groups.push((adapter, rows.collect())),
        }
    }
    groups
        .into_iter()
        .map(|(a, ids)| {
            let n = ids.len();
            let tensor = Tensor::from_vec(ids.clone(), n, device)?;
            Ok((a, ids, tensor))
        })
        .collect()
}

/// The updates of block `layer`'s products that the adapters of `groups` make.
fn block_updates<'a>(
    groups: &'a [(&'a crate::lora::Adapter, Vec<u32>, Tensor)],
    cfg: &crate::Config,
    layer: usize,
) -> BlockUpdates<'a> {
    if groups.is_empty() {
        return Default::default(); // no names to format: a step without adapters
    }
    crate::lora::block_products(cfg, layer).map(|name| {
        groups
            .iter()
            .filter_map(|(adapter, rows, ids)| adapter.compute.get(&name).map(|lora| RowUpdate { rows, ids, lora }))
            .collect()
    })
}

/// One sequence's part in a batched generation step: its new tokens and its cache.
pub struct SeqStep<'a> {
    pub tokens: &'a [u32],
    pub cache: &'a mut KvCache,
}

/// Which positions of a generation step get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsFor {
    /// The last new token of each sequence: `(n_seqs, vocab)`. What sampling needs.
    Last,
    /// Every new token, sequences in order: `(Σ new tokens, vocab)`.
    All,
}

impl Gpt {
    /// Checks one sequence's part in a step against the model's limits: no tokens, a token
    /// outside the vocabulary, or more positions than the context are errors. [`Gpt::forward_step`]
    /// checks every sequence this way before touching any cache.
    pub fn check_step(&self, seq: &SeqStep<'_>) -> Result<()> {
        if seq.tokens.is_empty() {
            return Err(Error::EmptyInput("a sequence has no new tokens"));
        }
        let needed = seq.cache.len() + seq.tokens.len();
        if needed > self.cfg.n_positions {
            return Err(Error::ContextOverflow {
                needed,
                max: self.cfg.n_positions,
            });
        }
        if let Some(&id) = seq.tokens.iter().find(|&&id| id as usize >= self.cfg.vocab_size) {
            return Err(Error::TokenOutOfVocab {
                id,
                vocab_size: self.cfg.vocab_size,
            });
        }
        Ok(())
    }

    /// One generation step for several sequences at once, each with its own cache and length.
    /// The new tokens of all sequences are packed into one matrix, so the projections, the MLP
    /// and the LM head run once per step; attention runs per sequence against its cache. Each
    /// cache grows by its sequence's new tokens. Returns f32 logits, see [`LogitsFor`].
    ///
    /// Every input is checked before any cache is touched: on error no cache has changed.
    pub fn forward_step(&self, seqs: &mut [SeqStep<'_>], which: LogitsFor) -> Result<Tensor> {
        let which = vec![which; seqs.len()];
        self.logits(&self.forward_step_hidden(seqs, &which)?)
    }

    /// [`Gpt::forward_step`] without the LM head, with a choice of rows per sequence: the final
    /// hidden states `(rows, C)` of sequence `s`'s last new token (`which[s]` is
    /// [`LogitsFor::Last`]) or of all of them ([`LogitsFor::All`]), sequences in order. Turn rows
    /// into logits with [`Gpt::logits`], in chunks where there are many (the `(rows, V)` logits of
    /// long prompts are the largest tensor of a step).
    pub fn forward_step_hidden(&self, seqs: &mut [SeqStep<'_>], which: &[LogitsFor]) -> Result<Tensor> {
        self.forward_step_adapted(seqs, which, &[])
    }

    /// [`Gpt::forward_step_hidden`] with a LoRA adapter, or none, for each sequence
    /// (`adapters[s]`; an empty slice: none for any). The base's products run once for the whole
    /// step, and each adapter's low-rank updates only on its own sequences' rows (Punica's and
    /// S-LoRA's batching), so that every sequence gets what it gets in a step of its own. The
    /// adapters must be for a model of this one's shape ([`crate::lora::Adapter::load`]).
    pub fn forward_step_adapted(
        &self,
        seqs: &mut [SeqStep<'_>],
        which: &[LogitsFor],
        adapters: &[Option<&crate::lora::Adapter>],
    ) -> Result<Tensor> {
        if !adapters.is_empty() && adapters.len() != seqs.len() {
            return Err(Error::InvalidConfig(format!(
                "forward_step_adapted: {} adapters for {} sequences",
                adapters.len(),
                seqs.len()
            )));
        }
        if seqs.is_empty() {
            return Err(Error::EmptyInput("no sequences in the step"));
        }
        if which.len() != seqs.len() {
            return Err(Error::InvalidConfig(format!(
                "forward_step_hidden: {} row choices for {} sequences",
                which.len(),
                seqs.len()
            )));
        }
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        for seq in seqs.iter() {
            self.check_step(seq)?;
            ids.extend_from_slice(seq.tokens);
            positions.extend((seq.cache.len()..seq.cache.len() + seq.tokens.len()).map(|p| p as u32));
        }
        let lens: Vec<usize> = seqs.iter().map(|s| s.tokens.len()).collect();
        let n_rows = ids.len();
        let device = self.device();
        let ids = Tensor::from_vec(ids, n_rows, device)?;
        let positions = Tensor::from_vec(positions, n_rows, device)?;
        let mut x = self.embed(&ids)?; // (N, C)
        if let Some(wpe) = &self.wpe {
            x = (x + wpe.embedding(&positions)?)?;
        }
        let groups = adapter_rows(adapters, &lens, device)?;
        let mut normed = None; // the next block's ln_1 of x, where the last one gave it
        for (layer, block) in self.blocks.iter().enumerate() {
            let mut caches: Vec<_> = seqs.iter_mut().map(|s| s.cache.layer(layer)).collect();
            let updates = block_updates(&groups, &self.cfg, layer);
            let input = match normed.take() {
                Some(n) => n,
                None => layer_norm(&block.ln_1, &x, false)?,
            };
            let next = self.blocks.get(layer + 1).map(|b| &b.ln_1);
            (x, normed) = block.forward_packed(&x, &input, next, &lens, &positions, &mut caches, &updates)?;
            // (N, C)
        }
        for (seq, &len) in seqs.iter_mut().zip(&lens) {
            seq.cache.advance(len);
        }
        let x = if which.iter().all(|&w| w == LogitsFor::All) {
            x
        } else {
            let mut rows: Vec<u32> = Vec::new();
            let mut start = 0;
            for (&len, &w) in lens.iter().zip(which) {
                match w {
                    LogitsFor::All => rows.extend((start..start + len).map(|r| r as u32)),
                    LogitsFor::Last => rows.push((start + len - 1) as u32),
                }
                start += len;
            }
            let n = rows.len();
            x.index_select(&Tensor::from_vec(rows, n, device)?, 0)? // (rows, C)
        };
        Ok(layer_norm(&self.ln_f, &x, false)?)
    }

    /// The LM head: final hidden states `(rows, C)` → f32 logits `(rows, V)`.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        Ok(self.head_logits(hidden)?.to_dtype(DType::F32)?)
    }
}
