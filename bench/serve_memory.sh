#!/usr/bin/env bash
# Peak memory (VmHWM) and output tokens/s of gpt-server against llama-server serving the same
# GGUF file to 16 streams at the same context (4096 positions), rounds alternating:
#   GGUF=FILE [ROUNDS=2] [LLAMA_BIN=target/bench/llamacpp/build/bin] bash bench/serve_memory.sh
# gpt-server with f32 keys and values (--kv-cache-mib 192: 4096 positions of SmolLM2-135M) and
# with f16 (--kv-cache-mib 96, the same positions), llama-server with `-np 16 -c 4096 -t 2`.
# Scale KV_MIB_F32 (and half of it for f16) to the model: 2 x layers x kv width x 4 bytes x 4096.
set -euo pipefail
cd "$(dirname "$0")/.."
GGUF=${GGUF:?a GGUF file}
ROUNDS=${ROUNDS:-2}
LLAMA_BIN=${LLAMA_BIN:-target/bench/llamacpp/build/bin}
KV_MIB_F32=${KV_MIB_F32:-192}
PORT=${PORT:-8931}
cargo build --release -p gpt-server >/dev/null
run() {
  local name=$1; shift
  "$@" >"target/bench/serve_memory_$name.log" 2>&1 &
  local pid=$!
  for _ in $(seq 120); do curl -sf "localhost:$PORT/health" >/dev/null && break; sleep 1; done
  local out
  out=$(python3 bench/serve_streams.py --url "http://127.0.0.1:$PORT" --concurrency 16 --requests 6 \
    --prompt-tokens 128 --max-tokens 64 | tail -1)
  echo "$name $(grep VmHWM "/proc/$pid/status" | tr -s ' \t' ' ') $out"
  kill "$pid"; wait "$pid" 2>/dev/null || true
}
mkdir -p target/bench
for _ in $(seq "$ROUNDS"); do
  run gpt_f32 target/release/gpt-server --checkpoint "$GGUF" --port "$PORT" --kv-cache-mib "$KV_MIB_F32" --kv-cache-dtype f32
  run gpt_f16 target/release/gpt-server --checkpoint "$GGUF" --port "$PORT" --kv-cache-mib $((KV_MIB_F32 / 2)) --kv-cache-dtype f16
  run llama "$LLAMA_BIN/llama-server" -m "$GGUF" --port "$PORT" -np 16 -c 4096 -t 2
done
