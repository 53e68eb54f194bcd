#!/usr/bin/env bash
# Data-parallel training under Open MPI (train/tests/distributed.rs, built with --features mpi):
# 2 ranks against one process bit for bit, resume on another number of ranks, a killed rank,
# SIGTERM to mpirun, ranks started differently, and, where this runs as root and may make
# network namespaces, two ranks on two "hosts" over TCP. Installs Open MPI, libclang (the mpi
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
cargo test --release -p gpt-train --features mpi --test distributed
