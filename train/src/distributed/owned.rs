//! The collectives of a job on CPUs where each rank updates only the parameters it owns (as
//! PyTorch's ZeRO-1 shards the optimizer): the gradients summed onto their owners (MPI's
//! reduce-scatter), then the updated parameters sent from their owners to every rank (MPI's
//! allgather).
//!
//! Each rank's owned tensors, one after another, form its stream of values. Both collectives
//! move a bucket of every rank's stream per call, so that every rank sums (or copies) its own
//! part at the same time; one reduce or broadcast per owner would have the ranks work in turn,
//! the others waiting. The last buckets of a shorter stream are padded with zeros.

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

/// Each rank's owned tensors, in their order.
struct Streams<'a> {
    tensors: Vec<Vec<&'a Tensor>>,
    lens: Vec<usize>,
}

impl<'a> Streams<'a> {
    fn new(tensors: &'a [Tensor], owners: &[usize], ranks: usize) -> Result<Self> {
        let mut streams = vec![Vec::new(); ranks];
        for (t, &owner) in tensors.iter().zip(owners) {
            if t.dtype() != candle_core::DType::F32 || !t.device().is_cpu() || !t.is_contiguous() {
                bail!(
                    "tensors shared between ranks on CPUs must be contiguous f32, not {:?} on {:?}",
                    t.dtype(),
                    t.device()
                );
            }
            streams[owner].push(t);
        }
        let lens = streams.iter().map(|s| s.iter().map(|t| t.elem_count()).sum()).collect();
        Ok(Self { tensors: streams, lens })
    }

    /// Calls of `per` values per rank that cover the longest stream.
    fn rounds(&self, per: usize) -> usize {
        self.lens.iter().max().copied().unwrap_or(0).div_ceil(per)
    }
}

/// A place in a stream: the tensor, and the offset in it.
#[derive(Clone, Copy, Default)]
struct Cursor {
    tensor: usize,
    offset: usize,
}

impl Cursor {
    /// Fills `out` with the stream's next values (zeros past its end) and moves past them.
    fn read(&mut self, stream: &[&Tensor], out: &mut [f32]) -> Result<()> {
        let mut filled = 0;
        while filled < out.len() && self.tensor < stream.len() {
            let (storage, layout) = stream[self.tensor].storage_and_layout();
            let Storage::Cpu(cpu) = &*storage else {
                bail!("tensors shared between ranks on CPUs must be on the CPU")
            };
            let values = gpt_kernels::f32_slice(cpu, layout, "shared between ranks")?;
            let n = (values.len() - self.offset).min(out.len() - filled);
            out[filled..filled + n].copy_from_slice(&values[self.offset..self.offset + n]);
            filled += n;
            self.advance(n, values.len());
        }
        out[filled..].fill(0.0);
        Ok(())
    }

    /// Writes `values` over the stream's next values, as many as it has left, and moves past them.
    fn write(&mut self, stream: &[&Tensor], values: &[f32]) -> Result<()> {
        let mut done = 0;
        while done < values.len() && self.tensor < stream.len() {
            let t = stream[self.tensor];
            let n = (t.elem_count() - self.offset).min(values.len() - done);
            t.inplace_op1(&CopyInto {
                at: self.offset,
                values: &values[done..done + n],
            })?;
            done += n;
            self.advance(n, t.elem_count());
        }
        Ok(())
    }

    fn advance(&mut self, n: usize, len: usize) {
        self.offset += n;
        if self.offset == len {
            self.tensor += 1;
            self.offset = 0;
        }
    }
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
        let (Some((start, _)), CpuStorage::F32(values)) = (layout.contiguous_offsets(), storage) else {
            candle_core::bail!("a tensor shared between ranks must be contiguous f32")
        };
        let start = start + self.at;
        values[start..start + self.values.len()].copy_from_slice(self.values);
        Ok(())
    }
}

impl World {
    /// Values of each rank's stream per collective call.
    fn per_rank(&self) -> usize {
        (self.bucket.get() / self.size).clamp(1, super::MAX_COUNT)
    }

    /// Sums each gradient across the ranks onto its owner (`owners[i]` for gradient `i`), in
    /// place there; the others' copies are left as they were.
    pub(super) fn reduce_scatter_owned(&self, grads: &mut [Tensor], owners: &[usize]) -> Result<()> {
        for g in grads.iter_mut() {
            if !g.is_contiguous() {
                *g = g.contiguous()?;
            }
        }
        let streams = Streams::new(grads, owners, self.size)?;
        let per = self.per_rank();
        let (mut send, mut recv) = (vec![0f32; per * self.size], vec![0f32; per]);
        let mut read = vec![Cursor::default(); self.size];
        let mut write = Cursor::default();
        let mine = &streams.tensors[self.rank];
        for _ in 0..streams.rounds(per) {
            for (rank, (cursor, out)) in read.iter_mut().zip(send.chunks_mut(per)).enumerate() {
                cursor.read(&streams.tensors[rank], out)?;
            }
            self.reduce_scatter_f32(&send, &mut recv);
            write.write(mine, &recv)?;
        }
        Ok(())
    }

    /// Replaces each tensor by its owner's (`owners[i]` for tensor `i`), in place.
    pub(super) fn all_gather_owned(&self, tensors: &[Tensor], owners: &[usize]) -> Result<()> {
        let streams = Streams::new(tensors, owners, self.size)?;
        let per = self.per_rank();
        let (mut send, mut recv) = (vec![0f32; per], vec![0f32; per * self.size]);
        let mut read = Cursor::default();
        let mut write = vec![Cursor::default(); self.size];
        for _ in 0..streams.rounds(per) {
            read.read(&streams.tensors[self.rank], &mut send)?;
            self.all_gather_f32(&send, &mut recv);
            for (rank, (cursor, values)) in write.iter_mut().zip(recv.chunks(per)).enumerate() {
                if rank != self.rank {
                    cursor.write(&streams.tensors[rank], values)?;
                }
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
    fn cursors_walk_a_stream_across_tensors_and_pad_its_end() -> Result<()> {
        let a = Tensor::arange(0f32, 5.0, &Device::Cpu)?;
        let b = Tensor::arange(5f32, 7.0, &Device::Cpu)?.reshape((1, 2))?;
        let stream = [&a, &b];
        let mut cursor = Cursor::default();
        let mut out = [9f32; 3];
        let mut seen = Vec::new();
        for _ in 0..3 {
            cursor.read(&stream, &mut out)?;
            seen.extend_from_slice(&out);
        }
        assert_eq!(seen, [0., 1., 2., 3., 4., 5., 6., 0., 0.]);
        let mut cursor = Cursor::default();
        for chunk in [[10f32, 11., 12.], [13., 14., 15.], [16., 99., 99.]] {
            cursor.write(&stream, &chunk)?;
        }
        assert_eq!(a.to_vec1::<f32>()?, [10., 11., 12., 13., 14.]);
        assert_eq!(b.flatten_all()?.to_vec1::<f32>()?, [15., 16.]);
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
