//! Gradients summed across ranks on the CPU, in buckets: the small tensors packed together (one
//! call each would pay MPI's latency ~150 times a step for GPT-2), the large ones a bucket at a
//! time straight into their own memory (MPI needs a separate send buffer, and the bucket bounds
//! it). Also which rank owns which tensor when each rank updates only its own
//! ([`owners`]), and the broadcast that shares the result.

use std::cell::RefCell;

use anyhow::{bail, Result};
use candle_core::{CpuStorage, Layout, Tensor};

use super::World;

/// The buffers of the sums, a bucket each, kept from step to step (fresh ones would fault in
/// their pages every step).
#[derive(Default)]
pub(super) struct Buffers {
    send: Vec<f32>,
    large: Vec<f32>,
    recv: Vec<f32>,
}

impl World {
    /// Sums the gradients `indices` across the ranks in buckets: onto every rank (`root`
    /// `None`), or onto `root` only, the others' left as they were.
    pub(super) fn combine_cpu(&self, grads: &mut [Tensor], indices: &[usize], root: Option<usize>) -> Result<()> {
        let bucket = self.bucket.get();
        let mut buffers = self.buffers.take();
        for buffer in [&mut buffers.send, &mut buffers.large] {
            buffer.clear();
            buffer.reserve(bucket);
        }
        buffers.recv.resize(bucket, 0.0);
        let Buffers { send, large, mut recv } = buffers;
        let (send, large) = (RefCell::new(send), RefCell::new(large));
        let keeps = root.is_none_or(|root| root == self.rank);
        // Small gradients waiting in `send`: their indices.
        let mut packed: Vec<usize> = Vec::new();
        let flush = |packed: &mut Vec<usize>, grads: &[Tensor], recv: &mut [f32]| -> Result<()> {
            let mut send = send.borrow_mut();
            self.combine_f32(root, &send, &mut recv[..send.len()]);
            let mut offset = 0;
            for &i in packed.iter() {
                let n = grads[i].elem_count();
                if keeps {
                    grads[i].inplace_op1(&CopyFrom(&recv[offset..offset + n]))?;
                }
                offset += n;
            }
            send.clear();
            packed.clear();
            Ok(())
        };
        for &i in indices {
            if grads[i].dtype() != candle_core::DType::F32 {
                bail!("gradients are summed across ranks in f32, not {:?}", grads[i].dtype());
            }
            if !grads[i].is_contiguous() {
                grads[i] = grads[i].contiguous()?;
            }
            let n = grads[i].elem_count();
            if n >= bucket / 4 {
                grads[i].inplace_op1(&CombineInPlace {
                    world: self,
                    root,
                    send: &large,
                    bucket,
                })?;
                continue;
            }
            if send.borrow().len() + n > bucket {
                flush(&mut packed, grads, &mut recv)?;
            }
            send.borrow_mut().extend(grads[i].flatten_all()?.to_vec1::<f32>()?);
            packed.push(i);
        }
        if !packed.is_empty() {
            flush(&mut packed, grads, &mut recv)?;
        }
        self.buffers.set(Buffers {
            send: send.into_inner(),
            large: large.into_inner(),
            recv,
        });
        Ok(())
    }
}

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

/// The f32 values a CPU tensor's layout covers, which must be contiguous.
fn contiguous_f32<'a>(storage: &'a mut CpuStorage, layout: &Layout) -> candle_core::Result<&'a mut [f32]> {
    let (Some((start, end)), CpuStorage::F32(values)) = (layout.contiguous_offsets(), storage) else {
        candle_core::bail!("a tensor summed across ranks must be contiguous f32")
    };
    Ok(&mut values[start..end])
}

/// Sums a large gradient across the ranks in place (onto `root` only, if given), a bucket at a
/// time: copied into `send`, the sum received straight into the gradient.
struct CombineInPlace<'a> {
    world: &'a World,
    root: Option<usize>,
    send: &'a RefCell<Vec<f32>>,
    bucket: usize,
}

impl candle_core::InplaceOp1 for CombineInPlace<'_> {
    fn name(&self) -> &'static str {
        "sum-across-ranks"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let values = contiguous_f32(storage, layout)?;
        let mut send = self.send.borrow_mut();
        for chunk in values.chunks_mut(self.bucket) {
            send.clear();
            send.extend_from_slice(chunk);
            self.world.combine_f32(self.root, &send, chunk);
        }
        send.clear();
        Ok(())
    }
}

/// Overwrites a CPU tensor with the given values.
struct CopyFrom<'a>(&'a [f32]);

impl candle_core::InplaceOp1 for CopyFrom<'_> {
    fn name(&self) -> &'static str {
        "copy-from"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        contiguous_f32(storage, layout)?.copy_from_slice(self.0);
        Ok(())
    }
}

/// Replaces a CPU tensor by `root`'s, in place.
pub(super) struct Broadcast<'a> {
    pub world: &'a World,
    pub root: usize,
}

impl candle_core::InplaceOp1 for Broadcast<'_> {
    fn name(&self) -> &'static str {
        "broadcast"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        // A bucket at a time, as the sums: pieces that stay in cache go faster.
        for chunk in contiguous_f32(storage, layout)?.chunks_mut(self.world.bucket.get()) {
            self.world.broadcast_f32(self.root, chunk);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
