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
    hosts: usize,
}

use super::MAX_COUNT;

impl Comm {
    pub fn init() -> Result<Self> {
        // Only the main thread calls MPI (the step's worker threads never do).
        let (universe, _) = mpi::initialize_with_threading(mpi::Threading::Funneled)
            .context("MPI could not be initialised (or was already)")?;
        let world = universe.world();
        let local_rank = world.split_shared(world.rank()).rank();
        // Each host's first rank counts its host.
        let first = [f64::from(u8::from(local_rank == 0))];
        let mut hosts = [0.0];
        world.all_reduce_into(&first[..], &mut hosts[..], SystemOperation::sum());
        Ok(Self {
            _universe: universe,
            world,
            local_rank: usize::try_from(local_rank).unwrap_or(0),
            hosts: hosts[0] as usize,
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

    /// Sends `send` to rank `to` while receiving `recv` from rank `from` (MPI's sendrecv; at
    /// most `MAX_COUNT` values each way).
    pub fn exchange_f32(&self, to: usize, send: &[f32], from: usize, recv: &mut [f32]) {
        let to = self.world.process_at_rank(i32::try_from(to).unwrap_or(0));
        let from = self.world.process_at_rank(i32::try_from(from).unwrap_or(0));
        mpi::point_to_point::send_receive_into(send, &to, recv, &from);
    }

    /// `Σ over ranks of send` into `recv` on rank `root` (which passes `Some`; the others pass
    /// `None`), for a thread beside the backward pass: MPI's blocking calls poll in
    /// a busy loop, which takes a core from the pass (measured: the overlap then lost time);
    /// this one starts the reduce and tests it, yielding the core between tests to any thread
    /// that waits for it. Sleeping between tests instead starved shared memory's transfers,
    /// which move a fragment per test (67 s a step for GPT-2 small against 0.2 s).
    pub fn reduce_f32_yielding(&self, root: usize, send: &[f32], recv: Option<&mut [f32]>) {
        let root = self.world.process_at_rank(i32::try_from(root).unwrap_or(0));
        mpi::request::scope(|scope| {
            let mut request = match recv {
                Some(recv) => root.immediate_reduce_into_root(scope, send, recv, SystemOperation::sum()),
                None => root.immediate_reduce_into(scope, send, SystemOperation::sum()),
            };
            loop {
                match request.test() {
                    Ok(_) => break,
                    Err(pending) => {
                        request = pending;
                        std::thread::yield_now();
                    }
                }
            }
        });
    }

    /// The number of hosts the job spans (groups of ranks that share memory).
    pub fn hosts(&self) -> usize {
        self.hosts
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
