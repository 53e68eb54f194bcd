//! Gradients summed across ranks on the CPU, in buckets: the small tensors packed together (one
//! call each would pay MPI's latency ~150 times a step for GPT-2), the large ones a bucket at a
//! time straight into their own memory (MPI needs a separate send buffer, and the bucket bounds
//! it).

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
    /// Sums the gradients across the ranks in buckets, onto every rank.
    pub(super) fn sum_cpu(&self, grads: &mut [Tensor]) -> Result<()> {
        let bucket = self.bucket.get();
        let mut buffers = self.buffers.take();
        for buffer in [&mut buffers.send, &mut buffers.large] {
            buffer.clear();
            buffer.reserve(bucket);
        }
        buffers.recv.resize(bucket, 0.0);
        let Buffers { send, large, mut recv } = buffers;
        let (send, large) = (RefCell::new(send), RefCell::new(large));
        // Small gradients waiting in `send`: their indices.
        let mut packed: Vec<usize> = Vec::new();
        let flush = |packed: &mut Vec<usize>, grads: &[Tensor], recv: &mut [f32]| -> Result<()> {
            let mut send = send.borrow_mut();
            self.sum_f32(&send, &mut recv[..send.len()]);
            let mut offset = 0;
            for &i in packed.iter() {
                let n = grads[i].elem_count();
                grads[i].inplace_op1(&CopyFrom(&recv[offset..offset + n]))?;
                offset += n;
            }
            send.clear();
            packed.clear();
            Ok(())
        };
        for i in 0..grads.len() {
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

/// The f32 values a CPU tensor's layout covers, which must be contiguous.
fn contiguous_f32<'a>(storage: &'a mut CpuStorage, layout: &Layout) -> candle_core::Result<&'a mut [f32]> {
    let (Some((start, end)), CpuStorage::F32(values)) = (layout.contiguous_offsets(), storage) else {
        candle_core::bail!("a tensor summed across ranks must be contiguous f32")
    };
    Ok(&mut values[start..end])
}

/// Sums a large gradient across the ranks in place, a bucket at a time: copied into `send`, the
/// sum received straight into the gradient.
struct CombineInPlace<'a> {
    world: &'a World,
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
            self.world.sum_f32(&send, chunk);
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
