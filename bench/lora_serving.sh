#!/usr/bin/env bash
# Serving LoRA adapters: 16 streams spread over 4 adapters against 16 streams on the base, on one
# gpt-server, rounds interleaved (bench/serve_streams.py: greedy, `ignore_eos`, 2 completions per
# stream one after another). The adapters are random (bench/make_random_adapter.py): a step's
# cost does not depend on their values. Speculative decoding off, so both measure the plain step.
#   bash bench/lora_serving.sh [ROUNDS] [CHECKPOINT]
# LORA_R (8) and LORA_TARGETS (c_attn; e.g. c_attn,c_proj,c_fc) shape the adapters; MAX_TOKENS
# (128) each completion.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
base=${2:-weights}
rank=${LORA_R:-8}
targets=${LORA_TARGETS:-c_attn}
max_tokens=${MAX_TOKENS:-128}
port=18093
cargo build -q --release -p gpt-server
work=$(mktemp -d)
pid=
trap '[ -n "$pid" ] && kill $pid 2>/dev/null; rm -rf "$work"' EXIT
modules=()
for i in 1 2 3 4; do
  python3 bench/make_random_adapter.py "$base" "$work/a$i" --r "$rank" --targets "$targets" --seed "$i"
  modules+=("a$i=$work/a$i")
done
RUST_LOG=warn target/release/gpt-server --checkpoint "$base" --model-name base --port $port \
  --speculative off --lora-modules "${modules[@]}" &
pid=$!
for _ in $(seq 600); do
  curl -sf http://127.0.0.1:$port/health > /dev/null && break
  sleep 0.2
done
echo "# $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs; $base; adapters r=$rank on $targets"
streams() {
  python3 bench/serve_streams.py --url http://127.0.0.1:$port --concurrency 16 --requests 2 \
    --max-tokens "$max_tokens" --model "$@"
}
for round in $(seq "$rounds"); do
  b=$(streams base | python3 -c 'import json,sys; print(json.load(sys.stdin)["tokens_per_s"])')
  a=$(streams a1 a2 a3 a4 | python3 -c 'import json,sys; print(json.load(sys.stdin)["tokens_per_s"])')
  python3 -c "print(f'round $round: base {$b} tok/s, 4 adapters {$a} tok/s: {$a / $b:.3f}x')"
done
