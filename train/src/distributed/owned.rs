//! The collectives of a job on CPUs where each rank updates only the parameters it owns (as
//! PyTorch's ZeRO-1 shards the optimizer): the gradients summed onto their owners (a
//! reduce-scatter), then the updated parameters sent from their owners to every rank (an
//! allgather).
//!
//! Each rank's owned tensors, one after another, form its stream of values, cut into chunks of at
//! most a bucket, each within one tensor. Both collectives run as a pairwise exchange over MPI's
//! sendrecv (the algorithm MPICH uses for long reduce-scatters): in round k = 1..n, each rank sends
//! to rank + k and receives from rank − k, every chunk straight from and into the tensors' own
//! memory. MPI's own `reduce_scatter_block` and `allgather` take one buffer holding every rank's
//! block in rank order, which separate tensors are not, and copying the gradients in and the
//! results out cost more than the transfers: GPT-2 small's gradients, 2 ranks in shared memory,
//! took 146 ms to sum and 75 ms to return through MPI's collectives against 70 and 59 ms this way
//! (EPYC Zen 3, `examples/allreduce.rs`, medians of 9).

use anyhow::{bail, Result};
use candle_core::{CpuStorage, Layout, Storage, Tensor};

use super::World;

/// The rank that owns each of tensors of these sizes among `ranks`: whole tensors, the largest
/// first to the rank with the fewest values so far (ties to the lower rank), so that the ranks'
/// shares are as even as whole tensors allow.
pub fn owners(sizes: &[usize], ranks: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(sizes[i]), i));
    let mut load = vec![0usize; ranks.max(1)];
    let mut owner = vec![0; sizes.len()];
    for i in order {
        let rank = (0..load.len()).min_by_key(|&r| (load[r], r)).unwrap_or(0);
        owner[i] = rank;
        load[rank] += sizes[i];
    }
    owner
}

/// A run of values in one tensor: the tensor and the range in it.
#[derive(Clone, Copy)]
struct Chunk<'a> {
    tensor: &'a Tensor,
    at: usize,
    len: usize,
}

/// Each rank's owned tensors, in their order, cut into chunks of at most `per` values; the same
/// on every rank (the owners are), so every pair of ranks agrees on each message's size.
fn streams<'a>(tensors: &'a [Tensor], owners: &[usize], ranks: usize, per: usize) -> Result<Vec<Vec<Chunk<'a>>>> {
    let mut streams = vec![Vec::new(); ranks];
    for (tensor, &owner) in tensors.iter().zip(owners) {
        if tensor.dtype() != candle_core::DType::F32 || !tensor.device().is_cpu() || !tensor.is_contiguous() {
            bail!(
                "tensors shared between ranks on CPUs must be contiguous f32, not {:?} on {:?}",
                tensor.dtype(),
                tensor.device()
            );
        }
        let Some(stream) = streams.get_mut(owner) else {
            bail!("a tensor's owner is rank {owner}, but the job has {ranks} ranks")
        };
        let n = tensor.elem_count();
        stream.extend((0..n).step_by(per.max(1)).map(|at| Chunk {
            tensor,
            at,
            len: per.min(n - at),
        }));
    }
    Ok(streams)
}

/// `f` on a chunk's values (the lock on the tensor's storage held meanwhile), or on no values.
fn with_chunk<T>(chunk: Option<&Chunk>, f: impl FnOnce(&[f32]) -> T) -> Result<T> {
    let Some(chunk) = chunk else {
        return Ok(f(&[]));
    };
    let (storage, layout) = chunk.tensor.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        bail!("tensors shared between ranks on CPUs must be on the CPU")
    };
    let values = gpt_kernels::f32_slice(cpu, layout, "shared between ranks")?;
    Ok(f(&values[chunk.at..chunk.at + chunk.len]))
}

/// The two ranks a rank exchanges with in round `k`: it sends to the first and receives from the
/// second.
fn partners(rank: usize, ranks: usize, k: usize) -> (usize, usize) {
    ((rank + k) % ranks, (rank + ranks - k) % ranks)
}

/// The `len` values of a contiguous f32 CPU tensor from offset `at`.
fn values_at<'a>(
    storage: &'a mut CpuStorage,
    layout: &Layout,
    at: usize,
    len: usize,
) -> candle_core::Result<&'a mut [f32]> {
    let (Some((start, _)), CpuStorage::F32(values)) = (layout.contiguous_offsets(), storage) else {
        candle_core::bail!("a tensor shared between ranks must be contiguous f32")
    };
    Ok(&mut values[start + at..start + at + len])
}

/// Writes values into a contiguous f32 CPU tensor from offset `at`.
pub(super) struct CopyInto<'a> {
    pub(super) at: usize,
    pub(super) values: &'a [f32],
}

impl candle_core::InplaceOp1 for CopyInto<'_> {
    fn name(&self) -> &'static str {
        "copy-into"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        values_at(storage, layout, self.at, self.values.len())?.copy_from_slice(self.values);
        Ok(())
    }
}

/// Adds values into a contiguous f32 CPU tensor from offset `at`.
struct AddInto<'a> {
    at: usize,
    values: &'a [f32],
}

impl candle_core::InplaceOp1 for AddInto<'_> {
    fn name(&self) -> &'static str {
        "add-into"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        for (v, x) in values_at(storage, layout, self.at, self.values.len())?
            .iter_mut()
            .zip(self.values)
        {
            *v += x;
        }
        Ok(())
    }
}

/// Sends `send` to rank `to` while receiving a tensor's values from `at` (`len` of them) from
/// rank `from`, straight into the tensor's memory.
struct ExchangeInto<'a> {
    world: &'a World,
    to: usize,
    send: &'a [f32],
    from: usize,
    at: usize,
    len: usize,
}

impl candle_core::InplaceOp1 for ExchangeInto<'_> {
    fn name(&self) -> &'static str {
        "exchange-into"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let recv = values_at(storage, layout, self.at, self.len)?;
        self.world.exchange_f32(self.to, self.send, self.from, recv);
        Ok(())
    }
}

impl World {
    /// Values per chunk of the streams.
    fn per_chunk(&self) -> usize {
        self.bucket.get().clamp(1, super::MAX_COUNT)
    }

    /// Sums each gradient across the ranks onto its owner (`owners[i]` for gradient `i`), in
    /// place there; the others' copies are left as they were. The owner adds the others'
    /// contributions in the order of the rounds (rank − 1, rank − 2, ...).
    pub(super) fn reduce_scatter_owned(&self, grads: &mut [Tensor], owners: &[usize]) -> Result<()> {
        for g in grads.iter_mut() {
            if !g.is_contiguous() {
                *g = g.contiguous()?;
            }
        }
        let streams = streams(grads, owners, self.size, self.per_chunk())?;
        let rounds = streams.iter().map(Vec::len).max().unwrap_or(0);
        let mine = &streams[self.rank];
        let mut recv = vec![0f32; mine.iter().map(|c| c.len).max().unwrap_or(0)];
        for k in 1..self.size {
            let (to, from) = partners(self.rank, self.size, k);
            for j in 0..rounds {
                let into = mine.get(j);
                let recv = &mut recv[..into.map_or(0, |c| c.len)];
                with_chunk(streams[to].get(j), |send| self.exchange_f32(to, send, from, recv))?;
                if let Some(c) = into {
                    c.tensor.inplace_op1(&AddInto { at: c.at, values: recv })?;
                }
            }
        }
        Ok(())
    }

    /// Replaces each tensor by its owner's (`owners[i]` for tensor `i`), in place.
    pub(super) fn all_gather_owned(&self, tensors: &[Tensor], owners: &[usize]) -> Result<()> {
        let streams = streams(tensors, owners, self.size, self.per_chunk())?;
        let rounds = streams.iter().map(Vec::len).max().unwrap_or(0);
        for k in 1..self.size {
            let (to, from) = partners(self.rank, self.size, k);
            for j in 0..rounds {
                with_chunk(streams[self.rank].get(j), |send| match streams[from].get(j) {
                    Some(c) => c.tensor.inplace_op1(&ExchangeInto {
                        world: self,
                        to,
                        send,
                        from,
                        at: c.at,
                        len: c.len,
                    }),
                    None => {
                        self.exchange_f32(to, send, from, &mut []);
                        Ok::<_, candle_core::Error>(())
                    }
                })??;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn owners_share_whole_tensors_evenly_and_alike_on_every_rank() {
        // GPT-2-like: one large embedding, then layers of a few sizes.
        let sizes = [38_597_376, 786_432, 768, 2_359_296, 768, 589_824, 768, 2_359_296, 3072];
        let two = owners(&sizes, 2);
        assert_eq!(two, owners(&sizes, 2));
        let load = |r: usize| -> usize { sizes.iter().zip(&two).filter(|(_, &o)| o == r).map(|(s, _)| s).sum() };
        assert_eq!(two[0], 0, "the largest goes first, to rank 0");
        assert!(load(1) > 0);
        // One tensor larger than all the rest together: it alone on one rank, the rest on the other.
        assert!(two[1..].iter().all(|&o| o == 1));
        assert_eq!(owners(&sizes, 1), vec![0; sizes.len()]);
        let even = owners(&[4, 4, 4, 4], 2);
        assert_eq!(even, vec![0, 1, 0, 1]);
    }

    #[test]
    fn streams_cut_each_owners_tensors_into_chunks_within_one_tensor() -> Result<()> {
        let t: Vec<Tensor> = [5usize, 2, 3]
            .iter()
            .map(|&n| Tensor::zeros(n, candle_core::DType::F32, &Device::Cpu))
            .collect::<candle_core::Result<_>>()?;
        let s = streams(&t, &[0, 1, 0], 2, 2)?;
        let cut = |r: usize| -> Vec<(usize, usize)> { s[r].iter().map(|c| (c.at, c.len)).collect() };
        assert_eq!(cut(0), [(0, 2), (2, 2), (4, 1), (0, 2), (2, 1)]);
        assert_eq!(cut(1), [(0, 2)]);
        assert!(std::ptr::eq(s[0][3].tensor, &t[2]) && std::ptr::eq(s[1][0].tensor, &t[1]));
        assert!(streams(&t, &[0, 2, 0], 2, 2).is_err(), "an owner outside the job");
        assert_eq!(partners(0, 3, 1), (1, 2));
        assert_eq!(partners(2, 3, 2), (1, 0));
        Ok(())
    }

    #[test]
    fn a_process_alone_keeps_its_own_values() -> Result<()> {
        let world = World::single();
        world.set_bucket_mb(4.0 / 262_144.0); // 4 values a call
        let grads: Vec<Tensor> = (0..3)
            .map(|i| Tensor::arange(i as f32 * 10.0, i as f32 * 10.0 + 7.0, &Device::Cpu))
            .collect::<candle_core::Result<_>>()?;
        let before: Vec<Vec<f32>> = grads.iter().map(|g| g.to_vec1()).collect::<candle_core::Result<_>>()?;
        let mut summed = grads.clone();
        world.reduce_scatter_owned(&mut summed, &[0, 0, 0])?;
        world.all_gather_owned(&summed, &[0, 0, 0])?;
        for (g, b) in summed.iter().zip(&before) {
            assert_eq!(&g.to_vec1::<f32>()?, b);
        }
        Ok(())
    }
}
