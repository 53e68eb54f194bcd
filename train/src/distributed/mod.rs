//! Data-parallel training across processes: the ranks of an MPI job (`mpirun -np N gpt-train
//! train ...`, or Slurm's `srun`), each training its share of every batch's rows, their
//! gradients summed by allreduce so that every rank applies the same AdamW update.
//!
//! [`World`] is the job as one rank sees it: a process alone (the default build, or a run without
//! a launcher: every collective is then the identity), or a rank of an MPI job (feature `mpi`),
//! its gradients summed by MPI on the CPU or by NCCL on GPUs (feature `nccl`). The transport is
//! always the MPI implementation's or NCCL's own; this module only decides what is summed when.
//! [`agree`] holds the checks that the ranks run the same job.

pub mod agree;
mod launch;
#[cfg(feature = "mpi")]
mod mpi;
#[cfg(feature = "nccl")]
mod nccl;

use std::cell::{Cell, RefCell};
use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::{CpuStorage, Layout, Tensor};

pub use launch::launched_ranks;

/// The default size of the buckets gradients are summed in (`--allreduce-bucket-mb`), 1 MB:
/// small tensors are packed together (one call each would pay MPI's latency ~150 times a step
/// for GPT-2), large ones are summed a bucket at a time straight into their own memory (MPI needs
/// a separate send buffer). Buckets that stay in cache sum faster: GPT-2 small's gradients took
/// 101-120 ms in 1 MB buckets in 7 runs of 8, 200-260 ms in 16 MB ones (PyTorch DDP's 25 MB
/// default) in all 4, two ranks in shared memory on the EPYC (`examples/allreduce.rs`).
pub const DEFAULT_BUCKET_MB: f64 = 1.0;

/// Time this rank spent in collectives since the last [`World::take_comm_time`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CommTime {
    /// Waiting for the other ranks to reach the gradient sum (the slowest rank's lead).
    pub wait_s: f64,
    /// Summing the gradients once every rank is there.
    pub allreduce_s: f64,
}

/// This process's place in the job.
pub struct World {
    rank: usize,
    size: usize,
    local_rank: usize,
    #[cfg(feature = "mpi")]
    mpi: Option<mpi::Comm>,
    #[cfg(feature = "nccl")]
    nccl: std::cell::OnceCell<nccl::Comm>,
    time: Cell<CommTime>,
    /// Values per bucket of [`World::sum_grads`] on the CPU.
    bucket: Cell<usize>,
    buffers: Cell<Buffers>,
}

/// The buffers of the CPU's gradient sum, a bucket each.
#[derive(Default)]
struct Buffers {
    send: Vec<f32>,
    large: Vec<f32>,
    recv: Vec<f32>,
}

impl Buffers {
    fn resize(&mut self, bucket: usize) {
        for buffer in [&mut self.send, &mut self.large] {
            buffer.clear();
            buffer.reserve(bucket);
        }
        self.recv.resize(bucket, 0.0);
    }
}

impl World {
    /// A process training alone.
    pub fn single() -> Self {
        Self {
            rank: 0,
            size: 1,
            local_rank: 0,
            #[cfg(feature = "mpi")]
            mpi: None,
            #[cfg(feature = "nccl")]
            nccl: std::cell::OnceCell::new(),
            time: Cell::new(CommTime::default()),
            bucket: Cell::new((DEFAULT_BUCKET_MB * 262_144.0) as usize),
            buffers: Cell::new(Buffers::default()),
        }
    }

    /// Sums gradients in buckets of `mb` megabytes (at least one value).
    pub fn set_bucket_mb(&self, mb: f64) {
        self.bucket.set(((mb * 262_144.0) as usize).max(1));
    }

    /// The job this process was started in: a rank of an MPI job when a launcher started it (and
    /// this build has MPI), else a process alone. A build without MPI started as one of several
    /// ranks is an error: each would train alone and write the same `--out`.
    pub fn init() -> Result<Self> {
        let launched = launched_ranks();
        #[cfg(feature = "mpi")]
        if launched.is_some() {
            let comm = mpi::Comm::init()?;
            let mut world = Self::single();
            (world.rank, world.size, world.local_rank) = (comm.rank(), comm.size(), comm.local_rank());
            world.mpi = Some(comm);
            return Ok(world);
        }
        if let Some(launched) = launched.filter(|l| l.size > 1) {
            bail!(
                "this gpt-train was started as one of {} processes ({}) but was built without MPI, so each \
                 would train alone and write the same --out; build it with `cargo build --release -p gpt-train \
                 --features mpi` (and `--features cuda,nccl` for GPUs)",
                launched.size,
                launched.source
            );
        }
        Ok(Self::single())
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// The rank among those on this host: the GPU it uses.
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// Rank 0: the one that writes checkpoints, metrics and the progress line.
    pub fn is_root(&self) -> bool {
        self.rank == 0
    }

    #[cfg(feature = "mpi")]
    fn comm(&self) -> Option<&mpi::Comm> {
        self.mpi.as_ref().filter(|_| self.size > 1)
    }

    /// Returns once every rank has called it.
    pub fn barrier(&self) {
        #[cfg(feature = "mpi")]
        if let Some(comm) = self.comm() {
            comm.barrier();
        }
    }

    /// Sums `values` element-wise across the ranks, in place.
    pub fn sum_f64(&self, values: &mut [f64]) {
        #[cfg(feature = "mpi")]
        if let Some(comm) = self.comm() {
            comm.sum_f64(values);
        }
        let _ = values;
    }

    /// Whether `flag` is set on any rank.
    pub fn any(&self, flag: bool) -> bool {
        let mut v = [f64::from(u8::from(flag))];
        self.sum_f64(&mut v);
        v[0] > 0.0
    }

    /// Every rank's `values`, concatenated in rank order.
    pub fn all_gather_f64(&self, values: &[f64]) -> Vec<f64> {
        #[cfg(feature = "mpi")]
        if let Some(comm) = self.comm() {
            return comm.all_gather_f64(values);
        }
        values.to_vec()
    }

    /// `root`'s `bytes` on every rank (the others' are replaced).
    pub fn broadcast_bytes(&self, root: usize, bytes: &mut Vec<u8>) {
        #[cfg(feature = "mpi")]
        if let Some(comm) = self.comm() {
            comm.broadcast_bytes(root, bytes);
        }
        let _ = (root, bytes);
    }

    /// Ends every rank of the job now, with exit status `code` (MPI's abort; a process alone
    /// just exits).
    pub fn abort(&self, code: i32) -> ! {
        #[cfg(feature = "mpi")]
        if let Some(comm) = self.comm() {
            comm.abort(code);
        }
        std::process::exit(code)
    }

    /// The time spent in collectives since the last call.
    pub fn take_comm_time(&self) -> CommTime {
        self.time.take()
    }

    /// Sums each gradient across the ranks, in place: first every rank waits for the others (a
    /// barrier, timed as waiting), then the sum (timed as allreduce). On the CPU MPI sums them
    /// in buckets ([`World::set_bucket_mb`]); on a GPU NCCL does, on the device's stream.
    /// Gradients are f32.
    pub fn sum_grads(&self, grads: &mut [Tensor]) -> Result<()> {
        if self.size == 1 || grads.is_empty() {
            return Ok(());
        }
        let start = Instant::now();
        self.barrier();
        let reached = Instant::now();
        if grads[0].device().is_cuda() {
            self.sum_grads_cuda(grads)?;
        } else {
            self.sum_grads_cpu(grads)?;
        }
        let mut time = self.time.get();
        time.wait_s += (reached - start).as_secs_f64();
        time.allreduce_s += reached.elapsed().as_secs_f64();
        self.time.set(time);
        Ok(())
    }

    #[cfg(not(feature = "nccl"))]
    fn sum_grads_cuda(&self, _grads: &mut [Tensor]) -> Result<()> {
        bail!("training on GPUs across ranks needs NCCL: build gpt-train with `--features cuda,nccl`")
    }

    #[cfg(feature = "nccl")]
    fn sum_grads_cuda(&self, grads: &mut [Tensor]) -> Result<()> {
        let device = grads[0].device().clone();
        let comm = match self.nccl.get() {
            Some(comm) => comm,
            None => {
                let comm = nccl::Comm::init(self, &device)?;
                self.nccl.get_or_init(|| comm)
            }
        };
        for g in grads.iter_mut() {
            if !g.is_contiguous() {
                *g = g.contiguous()?;
            }
        }
        comm.group(|| {
            for g in grads.iter() {
                g.inplace_op1(&nccl::SumInPlace(comm))?;
            }
            Ok(())
        })?;
        // The sums are queued on the model's stream; waiting here makes their time the
        // allreduce's in the metrics, not the next operation's.
        Ok(device.synchronize()?)
    }

    fn sum_grads_cpu(&self, grads: &mut [Tensor]) -> Result<()> {
        let bucket = self.bucket.get();
        // The small gradients packed into one bucket, and a bucket of a large one: buffers kept
        // from step to step (fresh ones would fault in their pages every step).
        let mut buffers = self.buffers.take();
        buffers.resize(bucket);
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
                grads[i].inplace_op1(&SumInPlace {
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

    /// `recv = Σ over ranks of send`.
    fn sum_f32(&self, send: &[f32], recv: &mut [f32]) {
        #[cfg(feature = "mpi")]
        if let Some(comm) = self.comm() {
            comm.sum_f32(send, recv);
            return;
        }
        recv.copy_from_slice(send);
    }
}

/// The f32 values a CPU tensor's layout covers, which must be contiguous.
fn contiguous_f32<'a>(storage: &'a mut CpuStorage, layout: &Layout) -> candle_core::Result<&'a mut [f32]> {
    let (Some((start, end)), CpuStorage::F32(values)) = (layout.contiguous_offsets(), storage) else {
        candle_core::bail!("a gradient summed across ranks must be contiguous f32")
    };
    Ok(&mut values[start..end])
}

/// Sums a large gradient across the ranks in place, a bucket at a time (copied into `send`, the
/// sum received straight into the gradient).
struct SumInPlace<'a> {
    world: &'a World,
    send: &'a RefCell<Vec<f32>>,
    bucket: usize,
}

impl candle_core::InplaceOp1 for SumInPlace<'_> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_alone_sums_to_its_own_gradients() -> Result<()> {
        let world = World::single();
        let g = Tensor::arange(0f32, 10.0, &candle_core::Device::Cpu)?;
        let mut grads = vec![g.clone()];
        world.sum_grads(&mut grads)?;
        assert_eq!(grads[0].to_vec1::<f32>()?, g.to_vec1::<f32>()?);
        assert!(!world.any(false) && world.any(true));
        assert_eq!(world.all_gather_f64(&[1.5]), vec![1.5]);
        Ok(())
    }
}
