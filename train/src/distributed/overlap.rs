//! The gradient sum started during the backward pass, as PyTorch's DDP starts it: each gradient
//! is summed onto the rank that owns it as soon as the backward pass has finished it
//! ([`crate::step::accumulate_grads_handing_over`]), in buckets of gradients that became ready
//! together, while the pass computes the rest. The last block's gradients are final first, so
//! most of the sum is done by the time the pass ends. It pays where the sum waits on a network
//! (ranks on several hosts); on one host the sum is copying and adding on the cores the pass
//! runs on, and the sum after the pass ([`World::reduce_to_owners`]) is as fast.
//!
//! Every rank is handed the gradients in the same order (it depends on the model and the
//! settings only), so every rank makes the same buckets and calls the same reduces.

use std::sync::mpsc::Receiver;

use anyhow::{bail, Result};
use candle_core::{Storage, Tensor};

use super::owned::CopyInto;
use super::World;

impl World {
    /// Sums each gradient onto its owner (`owners[i]` for gradient i, as
    /// [`World::reduce_to_owners`] does) as `ready` hands them over, `count` of them: small ones
    /// in buckets of those ready together, large ones a bucket at a time; each bucket reduced
    /// onto each owner of a part of it. Returns once all are summed, or early if `ready` closes
    /// (the pass failed, and its error is the caller's to report). Runs the collectives on this
    /// thread, which must be the one that may call MPI; the pass runs on another.
    pub fn reduce_to_owners_as_ready(
        &self,
        ready: &Receiver<(usize, Tensor)>,
        count: usize,
        owners: &[usize],
    ) -> Result<()> {
        let bucket = self.bucket.get();
        let mut buffers = Buffers {
            send: Vec::with_capacity(bucket),
            recv: vec![0f32; bucket],
        };
        let mut pending: Vec<(usize, Tensor)> = Vec::new();
        let mut pending_len = 0;
        for _ in 0..count {
            let Ok((i, g)) = ready.recv() else {
                return Ok(());
            };
            if owners.get(i).is_none() {
                bail!("gradient {i} has no owner among {} ranks", self.size);
            }
            let n = g.elem_count();
            if n >= bucket / 4 {
                self.reduce_bucket(&mut pending, owners, &mut buffers)?;
                pending_len = 0;
                self.reduce_large(&g, owners[i], bucket, &mut buffers)?;
                continue;
            }
            if pending_len + n > bucket {
                self.reduce_bucket(&mut pending, owners, &mut buffers)?;
                pending_len = 0;
            }
            pending.push((i, g));
            pending_len += n;
        }
        self.reduce_bucket(&mut pending, owners, &mut buffers)
    }

    /// The small gradients of one bucket, each owner's part reduced onto it (every rank calls
    /// the same reduces: the owners are the same everywhere). Empties `pending`.
    fn reduce_bucket(&self, pending: &mut Vec<(usize, Tensor)>, owners: &[usize], buffers: &mut Buffers) -> Result<()> {
        for owner in 0..self.size {
            let part: Vec<&Tensor> = pending
                .iter()
                .filter(|(i, _)| owners[*i] == owner)
                .map(|(_, g)| g)
                .collect();
            if part.is_empty() {
                continue;
            }
            buffers.send.clear();
            for g in &part {
                with_values(g, |values| buffers.send.extend_from_slice(values))?;
            }
            let len = buffers.send.len();
            if owner != self.rank {
                self.reduce_f32_yielding(owner, &buffers.send, None);
                continue;
            }
            self.reduce_f32_yielding(owner, &buffers.send, Some(&mut buffers.recv[..len]));
            let mut offset = 0;
            for g in part {
                let n = g.elem_count();
                g.inplace_op1(&CopyInto {
                    at: 0,
                    values: &buffers.recv[offset..offset + n],
                })?;
                offset += n;
            }
        }
        pending.clear();
        Ok(())
    }

    /// One large gradient reduced onto its owner a bucket at a time.
    fn reduce_large(&self, g: &Tensor, owner: usize, bucket: usize, buffers: &mut Buffers) -> Result<()> {
        let n = g.elem_count();
        let mut at = 0;
        while at < n {
            let len = bucket.min(n - at);
            buffers.send.clear();
            with_values(g, |values| buffers.send.extend_from_slice(&values[at..at + len]))?;
            if owner == self.rank {
                self.reduce_f32_yielding(owner, &buffers.send, Some(&mut buffers.recv[..len]));
                g.inplace_op1(&CopyInto {
                    at,
                    values: &buffers.recv[..len],
                })?;
            } else {
                self.reduce_f32_yielding(owner, &buffers.send, None);
            }
            at += len;
        }
        Ok(())
    }
}

/// The send and receive buffers of a bucket.
struct Buffers {
    send: Vec<f32>,
    recv: Vec<f32>,
}

/// `f` on a contiguous f32 CPU tensor's values (the lock on them released after).
fn with_values(t: &Tensor, f: impl FnOnce(&[f32])) -> Result<()> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        bail!("gradients summed during the backward pass must be on the CPU")
    };
    f(gpt_kernels::f32_slice(cpu, layout, "summed across ranks")?);
    Ok(())
}
