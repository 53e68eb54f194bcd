#!/usr/bin/env bash
# Structured outputs against llama.cpp's llama-server: the same random GPT-2-small-shaped weights
# (f32; GGUF for llama.cpp), the same JSON schema through llama.cpp's `json_schema` field, the same
# prompts and sampling, 1 and 16 concurrent requests, servers alternating
# (bench/structured_outputs.py). BENCHMARKS.md, "Structured outputs".
#
#   bash bench/structured.sh            # REQUESTS=16 ROUNDS=2 CONCURRENCY="1 16"
#
# Needs what bench/llamacpp_setup.sh says, and jsonschema for Python.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/llamacpp_setup.sh
llama_cpp_build llama-server
gpt2_checkpoint f32
cargo build -q --release --locked -p gpt-server
parallel=16
out=target/bench/structured
mkdir -p "$out"
./target/release/gpt-server --checkpoint "$model" --port 18191 --device cpu --model-name gpt2 \
  --max-batch-size $parallel --prefix-cache-mib 0 > "$out/gpt-server.log" 2>&1 &
pids=$!
"$work/build/bin/llama-server" -m "$work/gpt2-f32.gguf" --port 18192 -t "$threads" --parallel $parallel \
  -c $((parallel * 256)) --alias gpt2 --no-cache-prompt --cache-ram 0 > "$out/llama-server.log" 2>&1 &
pids="$pids $!"
trap 'kill $pids 2>/dev/null || true' EXIT
for port in 18191 18192; do
  for _ in $(seq 300); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.2; done
done
# One server computes at a time: the other idles between its rounds.
"$py" bench/structured_outputs.py gpt-server=http://127.0.0.1:18191 llama-server=http://127.0.0.1:18192 \
  --requests "${REQUESTS:-16}" --rounds "${ROUNDS:-2}" --concurrency ${CONCURRENCY:-1 16} | tee "$out/results.jsonl"
