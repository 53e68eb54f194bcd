//! Data-parallel training across processes: the ranks of an MPI job (`mpirun -np N gpt-train
//! train ...`, or Slurm's `srun`), each training its share of every batch's rows, their
//! gradients summed across the ranks so that every rank ends each step with the same weights (on
//! GPUs every rank applies the whole update; on CPUs each applies it to the parameters it owns
//! and sends them to the others).
//!
//! [`World`] is the job as one rank sees it: a process alone (the default build, or a run without
//! a launcher: every collective is then the identity), or a rank of an MPI job (feature `mpi`),
//! its gradients summed by MPI on the CPU or by NCCL on GPUs (feature `nccl`). The transport is
//! always the MPI implementation's or NCCL's own; this module only decides what is summed when.
//! [`agree`] holds the checks that the ranks run the same job. On CPUs the sum can also start
//! during the backward pass, each gradient as it is final (`overlap`, PyTorch DDP's overlap).

pub mod agree;
mod buckets;
mod launch;
#[cfg(feature = "mpi")]
mod mpi;
#[cfg(feature = "nccl")]
mod nccl;
mod overlap;
mod owned;

use std::cell::Cell;
use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::Tensor;

pub use launch::launched_ranks;
pub use owned::owners;

/// The default size of the buckets gradients are summed in (`--allreduce-bucket-mb`), 1 MB:
/// small tensors are packed together (one call each would pay MPI's latency ~150 times a step
/// for GPT-2), large ones are summed a bucket at a time straight into their own memory (MPI needs
/// a separate send buffer). Buckets that stay in cache sum faster: GPT-2 small's gradients took
/// 101-120 ms in 1 MB buckets in 7 runs of 8, 200-260 ms in 16 MB ones (PyTorch DDP's 25 MB
/// default) in all 4, two ranks in shared memory on the EPYC (`examples/allreduce.rs`).
pub const DEFAULT_BUCKET_MB: f64 = 1.0;

/// MPI counts are C ints: no call moves more values than this.
const MAX_COUNT: usize = 1 << 30;

/// Time this rank spent in collectives since the last [`World::take_comm_time`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CommTime {
    /// Waiting for the other ranks to reach the gradient sum (how far the slowest is behind).
    pub wait_s: f64,
    /// Summing the gradients once every rank is there (and, on CPUs, sending the updated
    /// parameters from their owners).
    pub allreduce_s: f64,
}

/// This process's place in the job.
pub struct World {
    rank: usize,
    size: usize,
    local_rank: usize,
    hosts: usize,
    #[cfg(feature = "mpi")]
    mpi: Option<mpi::Comm>,
    #[cfg(feature = "nccl")]
    nccl: std::cell::OnceCell<nccl::Comm>,
    time: Cell<CommTime>,
    /// Values per bucket of [`World::sum_grads`] on the CPU.
    bucket: Cell<usize>,
    buffers: Cell<buckets::Buffers>,
}

impl World {
    /// A process training alone.
    pub fn single() -> Self {
        Self {
            rank: 0,
            size: 1,
            local_rank: 0,
            hosts: 1,
            #[cfg(feature = "mpi")]
            mpi: None,
            #[cfg(feature = "nccl")]
            nccl: std::cell::OnceCell::new(),
            time: Cell::new(CommTime::default()),
            bucket: Cell::new((DEFAULT_BUCKET_MB * 262_144.0) as usize),
            buffers: Cell::new(buckets::Buffers::default()),
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
        if let Some(launched) = &launched {
            let comm = mpi::Comm::init()?;
            // An MPI library that is not the launcher's (an Open MPI build under MPICH's
            // mpiexec, say) starts each process as a job of its own: N runs writing one --out.
            if comm.size() != launched.size {
                bail!(
                    "the launcher started {} processes ({}) but MPI joined {} into this job: the MPI \
                     this gpt-train was built with is not the launcher's (Open MPI's mpirun for an Open \
                     MPI build, MPICH's mpiexec for an MPICH one; under Slurm, `srun --mpi=pmix` or the \
                     plugin `srun --mpi=list` names for it)",
                    launched.size,
                    launched.source,
                    comm.size()
                );
            }
            let mut world = Self::single();
            (world.rank, world.size, world.local_rank) = (comm.rank(), comm.size(), comm.local_rank());
            world.hosts = comm.hosts();
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

    /// The hosts the job spans: groups of ranks that share memory (MPI's shared-memory split).
    pub fn hosts(&self) -> usize {
        self.hosts
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
            self.sum_cpu(grads)?;
        }
        self.add_time(reached - start, reached.elapsed());
        Ok(())
    }

    /// Sums each gradient across the ranks onto the rank that owns it (`owners[i]` for
    /// gradient i), in place there; the others' copies are left as they were. CPU tensors,
    /// timed as [`World::sum_grads`] is.
    pub fn reduce_to_owners(&self, grads: &mut [Tensor], owners: &[usize]) -> Result<()> {
        if self.size == 1 || grads.is_empty() {
            return Ok(());
        }
        let start = Instant::now();
        self.barrier();
        let reached = Instant::now();
        self.reduce_scatter_owned(grads, owners)?;
        self.add_time(reached - start, reached.elapsed());
        Ok(())
    }

    /// Replaces each tensor by its owner's (`owners[i]` for tensor i), in place. CPU tensors,
    /// timed as allreduce.
    pub fn broadcast_from_owners(&self, tensors: &[Tensor], owners: &[usize]) -> Result<()> {
        if self.size == 1 {
            return Ok(());
        }
        let start = Instant::now();
        self.all_gather_owned(tensors, owners)?;
        self.add_time(std::time::Duration::ZERO, start.elapsed());
        Ok(())
    }

    /// Counts `time` as this rank's allreduce time (a sum timed by its caller).
    pub fn add_allreduce_time(&self, time: std::time::Duration) {
        self.add_time(std::time::Duration::ZERO, time);
    }

    fn add_time(&self, wait: std::time::Duration, allreduce: std::time::Duration) {
        let mut time = self.time.get();
        time.wait_s += wait.as_secs_f64();
        time.allreduce_s += allreduce.as_secs_f64();
        self.time.set(time);
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

    /// `recv = Σ over ranks of send` on every rank.
    fn sum_f32(&self, send: &[f32], recv: &mut [f32]) {
        #[cfg(feature = "mpi")]
        if let Some(comm) = self.comm() {
            comm.sum_f32(send, recv);
            return;
        }
        recv.copy_from_slice(send);
    }

    /// `Σ over ranks of send` into `recv` on rank `root` (which passes `Some`), yielding the core
    /// between tests of it (for a thread beside the backward pass).
    fn reduce_f32_yielding(&self, root: usize, send: &[f32], recv: Option<&mut [f32]>) {
        #[cfg(feature = "mpi")]
        if let Some(comm) = self.comm() {
            comm.reduce_f32_yielding(root, send, recv);
            return;
        }
        let _ = root;
        if let Some(recv) = recv {
            recv.copy_from_slice(send);
        }
    }

    /// Sends `send` to rank `to` and receives `recv` from rank `from` at once (a process alone
    /// is both: `recv` is `send`).
    fn exchange_f32(&self, to: usize, send: &[f32], from: usize, recv: &mut [f32]) {
        #[cfg(feature = "mpi")]
        if let Some(comm) = self.comm() {
            comm.exchange_f32(to, send, from, recv);
            return;
        }
        let _ = (to, from);
        recv.copy_from_slice(send);
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

    /// NCCL's path on a GPU with one rank (a machine with one GPU cannot hold two): NCCL loads,
    /// a communicator of one forms, and the grouped sums, queued on candle's stream, of whole
    /// tensors, a transposed one (made contiguous first) and a part of one leave every value as
    /// it was and the rest of the tensor untouched. Run where a GPU is (`bench/gpu.sh nccl`);
    /// without one it says so and passes.
    #[cfg(feature = "nccl")]
    #[test]
    fn nccl_sums_of_one_rank_keep_the_gradients() -> Result<()> {
        let Ok(device) = candle_core::Device::new_cuda(0) else {
            eprintln!("no CUDA device: NCCL not checked");
            return Ok(());
        };
        let world = World::single();
        let whole = Tensor::arange(0f32, 3000.0, &device)?.reshape((30, 100))?;
        let before = whole.to_vec2::<f32>()?;
        let transposed = (Tensor::arange(0f32, 600.0, &device)?.reshape((20, 30))? * 0.5)?.t()?;
        let transposed_before = transposed.to_vec2::<f32>()?;
        let parent = Tensor::arange(0f32, 500.0, &device)?;
        let part = parent.narrow(0, 100, 300)?;
        let mut grads = vec![whole.clone(), transposed, part.clone()];
        for round in 0..2 {
            // The second round reuses the communicator.
            world.sum_grads_cuda(&mut grads)?;
            assert_eq!(grads[0].to_vec2::<f32>()?, before, "round {round}");
            assert!(grads[1].is_contiguous());
            assert_eq!(grads[1].to_vec2::<f32>()?, transposed_before, "round {round}");
            assert_eq!(parent.to_vec1::<f32>()?, (0..500).map(|i| i as f32).collect::<Vec<_>>());
        }
        assert!(world.nccl.get().is_some(), "the sums ran through NCCL");
        Ok(())
    }
}
