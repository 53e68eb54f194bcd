#!/usr/bin/env bash
# Data-parallel training on one machine: the job's tokens/s of N ranks x T threads under mpirun
# against one process of N*T threads, side by side in pairs, and each side's peak memory per
# process. GPT-2-small shape (12 layers, 12 heads, 768 wide, GPT-2's 50257-token BPE) on
# tinyshakespeare, batch BATCH x 256 (default 4; ACCUM micro-batches of it a step:
# --gradient-accumulation-steps, default 1), `gpt-train train` itself (metrics.jsonl's tokens/s
# per step, median after the first).
#   [BATCH=8] [ACCUM=4] [OVERLAP=on|off] bash bench/data_parallel.sh [PAIRS] [STEPS]
# (OVERLAP: the ranks' --overlap-allreduce, default auto: off on one host)
# Needs Open MPI (`apt-get install openmpi-bin libopenmpi-dev libclang-dev`) and GPT-2's
# tokenizer.json (GPT2_TOKENIZER, default target/gpt2-tokenizer/tokenizer.json, which .ci/run
# makes).
set -euo pipefail
cd "$(dirname "$0")/.."
pairs=${1:-3}
steps=${2:-8}
ranks=${RANKS:-2}
threads=${THREADS:-1}
accum=${ACCUM:-1}
batch=${BATCH:-4}
overlap=${OVERLAP:-auto}
tokenizer=${GPT2_TOKENIZER:-target/gpt2-tokenizer/tokenizer.json}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 RUST_LOG=warn
cargo build -q --release -p gpt-train --features mpi
bin=target/release/gpt-train
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
args=(--data data/tinyshakespeare.txt --tokenizer "$tokenizer" --n-layer 12 --n-head 12 --n-embd 768
  --block-size 256 --batch-size "$batch" --gradient-accumulation-steps "$accum" --dropout 0 --max-iters "$steps" --eval-interval 100000
  --eval-iters 1 --log-interval 1 --keep-last 1 --device cpu)
# The median tokens/s of the logged steps after the first, and the largest peak RSS (GB) of the
# processes, from /usr/bin/time's lines.
report() {
  python3 - "$1/metrics.jsonl" "$2" <<'PY'
import json, statistics, sys
rates = [e["tokens_per_sec"] for e in map(json.loads, open(sys.argv[1])) if e["event"] == "train"][1:]
rss = [int(l.split()[-1]) for l in open(sys.argv[2]) if l.startswith("peak-rss-kb")]
extra = ""
last = [e for e in map(json.loads, open(sys.argv[1])) if e["event"] == "train"][-1]
if "allreduce_s" in last:
    extra = f", last step: allreduce {max(last['allreduce_s']):.3f} s, wait {max(last['wait_s']):.3f} s"
print(f"{statistics.median(rates):.1f} tokens/s (steps {len(rates)}), peak RSS per process {max(rss) / 1e6:.2f} GB x {len(rss)}{extra}")
PY
}
echo "== $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, $(date -u '+%Y-%m-%d %H:%M UTC'), $(git rev-parse --short HEAD)"
for pair in $(seq "$pairs"); do
  rm -rf "$work"/*
  /usr/bin/time -f "peak-rss-kb %M" -o "$work/one.time" \
    "$bin" train --out "$work/one" "${args[@]}" --threads $((ranks * threads)) >/dev/null 2>&1
  echo "pair $pair: 1 process x $((ranks * threads)) threads: $(report "$work/one" "$work/one.time")"
  mpirun -np "$ranks" -x RUST_LOG /usr/bin/time -f "peak-rss-kb %M" -a -o "$work/dp.time" \
    "$bin" train --out "$work/dp" "${args[@]}" --threads "$threads" --overlap-allreduce "$overlap" >/dev/null 2>&1
  echo "pair $pair: $ranks ranks x $threads threads (overlap $overlap): $(report "$work/dp" "$work/dp.time")"
done
