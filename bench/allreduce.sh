#!/usr/bin/env bash
# The gradient allreduce of data-parallel training (train/examples/allreduce.rs: 4 MB, 64 MB and
# GPT-2 small's 124M f32 gradients, summed as gpt-train sums them), between 2 ranks: in shared
# memory, over TCP on loopback, and over TCP between two network namespaces joined by a veth pair
# (two "hosts" on one machine); against the raw TCP rate of each link (iperf3). As root.
#   bash bench/allreduce.sh [REPEATS]
# Needs openmpi-bin libopenmpi-dev libclang-dev iperf3 iproute2. The OSU micro-benchmarks, MPI's
# usual yardstick, are not packaged in Debian 12, so iperf3 is the reference.
set -euo pipefail
cd "$(dirname "$0")/.."
repeats=${1:-15}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cargo build -q --release -p gpt-train --features mpi --example allreduce
bin=$PWD/target/release/examples/allreduce
agent=$PWD/tests/fixtures/netns_rsh_agent.sh
subnet=10.78.$(($$ % 250))
source bench/two_hosts.sh
# iperf3's rate over a link: a server in the namespace $1 at $2, the client in $3.
iperf() {
  ip netns exec "$1" iperf3 -s -1 -B "$2" >/dev/null 2>&1 &
  sleep 0.5
  ip netns exec "$3" iperf3 -c "$2" -t 5 -J | python3 -c \
    'import json, sys; r = json.load(sys.stdin)["end"]["sum_received"]; print("%.2f GB/s" % (r["bits_per_second"] / 8e9))'
  wait
}
echo "== $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, $(date -u '+%Y-%m-%d %H:%M UTC'), $(git rev-parse --short HEAD)"
echo "-- shared memory (Open MPI's vader), 2 ranks"
mpirun -np 2 "$bin" "$repeats"
echo "-- TCP over loopback, 2 ranks; iperf3 on loopback: $(iperf "$a" 127.0.0.1 "$a")"
ip netns exec "$a" mpirun -np 2 --mca btl tcp,self "$bin" "$repeats"
echo "-- TCP between two namespaces over a veth pair, 1 rank in each; iperf3 across it: $(iperf "$b" "$subnet.2" "$a")"
# --bind-to none: each "host" would bind its first rank to its core 0, here the same core for both.
ip netns exec "$a" mpirun --host "$subnet.1:1,$subnet.2:1" -np 2 --bind-to none --mca plm_rsh_agent "$agent" \
  --mca btl tcp,self --mca btl_tcp_if_include "$subnet.0/24" --mca oob_tcp_if_include "$subnet.0/24" \
  -x OMPI_ALLOW_RUN_AS_ROOT -x OMPI_ALLOW_RUN_AS_ROOT_CONFIRM "$bin" "$repeats"
