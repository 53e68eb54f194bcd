//! The collectives of a job started by an MPI launcher, through the `mpi` crate (Open MPI or
//! MPICH, whichever the build found).

use anyhow::{Context, Result};
use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

pub struct Comm {
    /// Finalises MPI when dropped.
    _universe: Universe,
    world: SimpleCommunicator,
    local_rank: usize,
}

/// MPI counts are C ints: larger buffers go in pieces of this many values.
const MAX_COUNT: usize = 1 << 30;

impl Comm {
    pub fn init() -> Result<Self> {
        // Only the main thread calls MPI (the step's worker threads never do).
        let (universe, _) = mpi::initialize_with_threading(mpi::Threading::Funneled)
            .context("MPI could not be initialised (or was already)")?;
        let world = universe.world();
        let local_rank = world.split_shared(world.rank()).rank();
        Ok(Self {
            _universe: universe,
            world,
            local_rank: usize::try_from(local_rank).unwrap_or(0),
        })
    }

    pub fn rank(&self) -> usize {
        usize::try_from(self.world.rank()).unwrap_or(0)
    }

    pub fn size(&self) -> usize {
        usize::try_from(self.world.size()).unwrap_or(1)
    }

    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    pub fn barrier(&self) {
        self.world.barrier();
    }

    pub fn sum_f64(&self, values: &mut [f64]) {
        let send = values.to_vec();
        self.world.all_reduce_into(&send[..], values, SystemOperation::sum());
    }

    pub fn sum_f32(&self, send: &[f32], recv: &mut [f32]) {
        for (send, recv) in send.chunks(MAX_COUNT).zip(recv.chunks_mut(MAX_COUNT)) {
            self.world.all_reduce_into(send, recv, SystemOperation::sum());
        }
    }

    /// `recv = Σ over ranks of send` on `root`; the others' `recv` is not written.
    pub fn reduce_f32(&self, root: usize, send: &[f32], recv: &mut [f32]) {
        let root_process = self.world.process_at_rank(i32::try_from(root).unwrap_or(0));
        for (send, recv) in send.chunks(MAX_COUNT).zip(recv.chunks_mut(MAX_COUNT)) {
            if self.rank() == root {
                root_process.reduce_into_root(send, recv, SystemOperation::sum());
            } else {
                root_process.reduce_into(send, SystemOperation::sum());
            }
        }
    }

    pub fn broadcast_f32(&self, root: usize, values: &mut [f32]) {
        let root = self.world.process_at_rank(i32::try_from(root).unwrap_or(0));
        for chunk in values.chunks_mut(MAX_COUNT) {
            root.broadcast_into(chunk);
        }
    }

    pub fn all_gather_f64(&self, values: &[f64]) -> Vec<f64> {
        let mut all = vec![0.0; values.len() * self.size()];
        self.world.all_gather_into(values, &mut all[..]);
        all
    }

    pub fn broadcast_bytes(&self, root: usize, bytes: &mut Vec<u8>) {
        let root = self.world.process_at_rank(i32::try_from(root).unwrap_or(0));
        let mut len = bytes.len() as u64;
        root.broadcast_into(&mut len);
        bytes.resize(len as usize, 0);
        for chunk in bytes.chunks_mut(MAX_COUNT) {
            root.broadcast_into(chunk);
        }
    }

    pub fn abort(&self, code: i32) -> ! {
        self.world.abort(code)
    }
}
