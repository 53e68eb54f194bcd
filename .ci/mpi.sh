#!/usr/bin/env bash
# Data-parallel training under Open MPI (train/tests/distributed.rs, built with --features mpi):
# 2 ranks against one process bit for bit, resume on another number of ranks, a killed rank,
# SIGTERM to mpirun, ranks started differently, and, where this runs as root and may make
# network namespaces, two ranks on two "hosts" over TCP, and, where this runs as root, two ranks
# started by `srun` in an `sbatch` job on a one-node Slurm cluster (tests/fixtures/slurm_cluster.sh,
# stopped at the end). Installs Open MPI, libclang (the mpi
# crate's bindings) and iproute2 when missing. Runs alone too: `bash .ci/mpi.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v mpirun >/dev/null || ! command -v ip >/dev/null \
  || ! dpkg -s libopenmpi-dev libclang-dev >/dev/null 2>&1; then
  sudo=$(command -v sudo || true)
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q openmpi-bin libopenmpi-dev libclang-dev iproute2
fi
mpirun --version | head -1
source tests/fixtures/slurm_cluster.sh
slurm_dir=$(mktemp -d)
if slurm_start "$slurm_dir"; then
  trap 'slurm_stop "$slurm_dir"; rm -rf "$slurm_dir"' EXIT
  sinfo --version
else
  echo "no Slurm cluster: the srun test will be reported as ignored"
  unset SLURM_CONF
fi
# Over the whole workspace, as the tests stage builds it: `-p gpt-train` alone resolves the shared
# crates' features otherwise, and CI rebuilt candle and the tokenizers for it (5.5 min).
cargo test --release --workspace --features gpt-train/mpi --test distributed
