#!/usr/bin/env bash
# Summing the gradients during the backward pass (`--overlap-allreduce on`, PyTorch DDP's
# overlap) against after it (`off`), where the sum waits on a network: 2 ranks on two "hosts"
# (network namespaces joined by a veth pair, one rank in each, Open MPI over TCP), the link held
# to RATE by a token bucket (`tc ... tbf`, default 1gbit: a 1 Gb/s Ethernet). GPT-2-small shape
# (12 layers, 12 heads, 768 wide, GPT-2's BPE) on tinyshakespeare, batch 4 x 256, 1 thread a
# rank, `gpt-train train` itself: the median of metrics.jsonl's tokens/s over the steps after the
# first, and the median of rank 0's allreduce seconds a step; the two settings in turn. As root.
#   [RATE=1gbit] bash bench/overlap.sh [PAIRS] [STEPS]
# Needs openmpi-bin libopenmpi-dev libclang-dev iproute2, and GPT-2's tokenizer.json
# (GPT2_TOKENIZER, default target/gpt2-tokenizer/tokenizer.json, which .ci/run makes).
set -euo pipefail
cd "$(dirname "$0")/.."
pairs=${1:-2}
steps=${2:-6}
rate=${RATE:-1gbit}
tokenizer=${GPT2_TOKENIZER:-target/gpt2-tokenizer/tokenizer.json}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 RUST_LOG=warn
cargo build -q --release -p gpt-train --features mpi
bin=$PWD/target/release/gpt-train
agent=$PWD/tests/fixtures/netns_rsh_agent.sh
work=$(mktemp -d)
subnet=10.79.$(($$ % 250))
extra_cleanup() { rm -rf "$work"; }
source bench/two_hosts.sh
ip netns exec "$a" tc qdisc add dev "va$$" root tbf rate "$rate" burst 256kb latency 100ms
ip netns exec "$b" tc qdisc add dev "vb$$" root tbf rate "$rate" burst 256kb latency 100ms
args=(--data "$PWD/data/tinyshakespeare.txt" --tokenizer "$PWD/$tokenizer" --n-layer 12 --n-head 12 --n-embd 768
  --block-size 256 --batch-size 4 --dropout 0 --max-iters "$steps" --eval-interval 100000 --eval-iters 1
  --log-interval 1 --keep-last 1 --device cpu --threads 1)
report() {
  python3 - "$1/metrics.jsonl" <<'PY'
import json, statistics, sys
steps = [e for e in map(json.loads, open(sys.argv[1])) if e["event"] == "train"][1:]
rate = statistics.median(e["tokens_per_sec"] for e in steps)
allreduce = statistics.median(e["allreduce_s"][0] for e in steps)
print(f"{rate:.1f} tokens/s, rank 0's allreduce {allreduce:.2f} s a step (steps {len(steps)})")
PY
}
echo "== $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, $(date -u '+%Y-%m-%d %H:%M UTC'), $(git rev-parse --short HEAD), link $rate"
for pair in $(seq "$pairs"); do
  for overlap in off on; do
    rm -rf "${work:?}/run"
    ip netns exec "$a" mpirun --host "$subnet.1:1,$subnet.2:1" -np 2 --bind-to none --mca plm_rsh_agent "$agent" \
      --mca btl tcp,self --mca btl_tcp_if_include "$subnet.0/24" --mca oob_tcp_if_include "$subnet.0/24" \
      -x OMPI_ALLOW_RUN_AS_ROOT -x OMPI_ALLOW_RUN_AS_ROOT_CONFIRM -x RUST_LOG \
      "$bin" train --out "$work/run" "${args[@]}" --overlap-allreduce "$overlap" >/dev/null 2>"$work/err" \
      || { tail -5 "$work/err"; exit 1; }
    echo "pair $pair: overlap $overlap: $(report "$work/run")"
  done
done
