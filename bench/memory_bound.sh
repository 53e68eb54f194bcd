#!/usr/bin/env bash
# Batch-1 decode against the memory bound: the weight bytes a decode step reads times the tokens
# per second, against this machine's read bandwidth on the same threads (bench/bandwidth.rs),
# for gpt-rs and (where LLAMA_BIN has llama-bench) llama.cpp on the same GGUF files (its bytes:
# the file's tensor data, every matrix read once a token).
#   FILES="a.gguf b.gguf" [ROUNDS=2] [LLAMA_BIN=target/bench/llamacpp/build/bin] [PYTHON=python3] \
#     bash bench/memory_bound.sh
set -euo pipefail
cd "$(dirname "$0")/.."
FILES=${FILES:?GGUF files}
ROUNDS=${ROUNDS:-2}
LLAMA_BIN=${LLAMA_BIN:-target/bench/llamacpp/build/bin}
PYTHON=${PYTHON:-python3}
threads=$(nproc)
mkdir -p target/bench
rustc --edition 2021 -O bench/bandwidth.rs -o target/bench/bandwidth
cargo bench -q -p gpt --bench inference --no-run 2>/dev/null
bench=$(ls -t target/release/deps/inference-* | grep -v '\.d$' | head -1)
bw=$(THREADS=$threads target/bench/bandwidth | "$PYTHON" -c "import json,sys; print(json.load(sys.stdin)['read_gb_per_s'])")
echo "read bandwidth, $threads threads: $bw GB/s"
for _ in $(seq "$ROUNDS"); do
  for f in $FILES; do
    GGUF=$f PREFILL=16 NEW_TOKENS=128 "$bench" --bench | tail -1 | "$PYTHON" -c "
import json, sys
d = json.loads(sys.stdin.read())
gbs = d['decode_weight_gb_per_s']
print(f\"gpt-rs    {sys.argv[1]:<48} {d['decode_tok_per_s']:7.1f} tok/s x {d['weight_bytes'] / 1e6:6.1f} MB = {gbs:5.1f} GB/s, {gbs / float(sys.argv[2]):.0%} of the bound\")" "$(basename "$f")" "$bw"
    if [ -x "$LLAMA_BIN/llama-bench" ]; then
      "$LLAMA_BIN/llama-bench" -m "$f" -p 0 -n 128 -t "$threads" -r 3 -o jsonl 2>/dev/null | tail -1 | "$PYTHON" -c "
import json, sys
from gguf import GGUFReader
d = json.loads(sys.stdin.read())
r = GGUFReader(sys.argv[1])
# Every matrix once a token; of the token embedding, when the head is separate, a row.
tied = not any(t.name == 'output.weight' for t in r.tensors)
data = sum(int(t.n_bytes) for t in r.tensors if tied or t.name != 'token_embd.weight')
gbs = d['avg_ts'] * data / 1e9
print(f\"llama.cpp {sys.argv[1].split('/')[-1]:<48} {d['avg_ts']:7.1f} tok/s x {data / 1e6:6.1f} MB = {gbs:5.1f} GB/s, {gbs / float(sys.argv[2]):.0%} of the bound\")" "$f" "$bw"
    fi
  done
done
