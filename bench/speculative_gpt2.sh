#!/usr/bin/env bash
# Speculative decoding on a GPT-2-small-shaped pair trained here (BENCHMARKS.md, "Speculative
# decoding"): a GPT-2-small model (12 layers, 768 wide, GPT-2's vocabulary, context 256) and a
# draft (2 layers, 256 wide) trained by gpt-train on the corpus for TARGET_ITERS / DRAFT_ITERS
# steps, then batch-1 greedy decoding side by side:
#  1. the model crate: plain, with the draft, with n-grams (cargo bench -p gpt --bench speculative);
#  2. transformers' assisted generation on the same pair (bench/speculative_hf.py);
#  3. through servers, one request at a time: gpt-server plain and with the draft, llama-server
#     plain and with the draft (-md, llama.cpp's speculative decoding, at most 6 drafted tokens as
#     ours), the same weights as GGUF.
# Everything under target/bench/spec-gpt2 (never committed). Needs what bench/llamacpp_setup.sh
# says.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/llamacpp_setup.sh
llama_cpp_build llama-server
gpt2_checkpoint   # GPT-2's tokenizer.json in target/gpt2-tokenizer
cargo build -q --release --locked -p gpt-server -p gpt-train
out=target/bench/spec-gpt2
mkdir -p "$out"
tok=target/gpt2-tokenizer/tokenizer.json
train() { # NAME ITERS FLAGS...
  local name=$1 iters=$2
  shift 2
  [ -f "$out/$name/config.json" ] && return
  ./target/release/gpt-train train --data data/tinyshakespeare.txt --tokenizer "$tok" --out "$out/$name-run" \
    --block-size 256 --max-iters "$iters" --dropout 0 --eval-interval "$iters" --eval-iters 4 \
    --log-interval 25 --warmup-iters 20 --lr-decay-iters "$iters" "$@" > "$out/$name-train.log" 2>&1
  ./target/release/gpt-train export --checkpoint "$out/$name-run/best" --out "$out/$name" --dtype f32
  PYTHONPATH=$src/gguf-py "$py" "$src/convert_hf_to_gguf.py" "$out/$name" --outtype f32 \
    --outfile "$out/$name.gguf" > "$out/convert-$name.log" 2>&1
}
train target "${TARGET_ITERS:-150}" --preset gpt2 --batch-size 4 --learning-rate 6e-4
train draft "${DRAFT_ITERS:-200}" --n-layer 2 --n-head 4 --n-embd 256 --batch-size 4 --learning-rate 1e-3
grep -h "best val loss" "$out"/target-train.log "$out"/draft-train.log || true
echo "== 1. model crate, batch 1"
TARGET=$PWD/$out/target DRAFT=$PWD/$out/draft ROUNDS=${ROUNDS:-2} PROMPTS=${PROMPTS:-4} MAX_NEW=128 \
  cargo bench -q -p gpt --bench speculative 2>&1 | grep -v "^$"
echo "== 2. transformers' assisted generation"
"$py" bench/speculative_hf.py --target "$out/target" --draft "$out/draft" --rounds "${ROUNDS:-2}" \
  --prompts "${PROMPTS:-4}" --max-new 128 --threads "$threads" 2>&1 | grep -E "^\{|warning"
echo "== 3. servers"
./target/release/gpt-server --checkpoint "$out/target" --port 18201 --device cpu --speculative off \
  --prefix-cache-mib 0 > "$out/plain.log" 2>&1 &
pids=$!
./target/release/gpt-server --checkpoint "$out/target" --port 18202 --device cpu \
  --draft-checkpoint "$out/draft" --prefix-cache-mib 0 > "$out/draft.log" 2>&1 &
pids="$pids $!"
"$work/build/bin/llama-server" -m "$out/target.gguf" --port 18203 -t "$threads" -c 256 -np 1 \
  --no-cache-prompt --cache-ram 0 > "$out/llama-plain.log" 2>&1 &
pids="$pids $!"
"$work/build/bin/llama-server" -m "$out/target.gguf" -md "$out/draft.gguf" --port 18204 -t "$threads" -np 1 \
  -c 256 --spec-type draft-simple --spec-draft-n-max 6 --no-cache-prompt --cache-ram 0 > "$out/llama-draft.log" 2>&1 &
pids="$pids $!"
trap 'kill $pids 2>/dev/null || true' EXIT
for port in 18201 18202 18203 18204; do
  for _ in $(seq 300); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.2; done
done
"$py" bench/speculative_servers.py gpt-server=http://127.0.0.1:18201 gpt-server-draft=http://127.0.0.1:18202 \
  llama-server=http://127.0.0.1:18203 llama-server-draft=http://127.0.0.1:18204 \
  --prompts "${PROMPTS:-4}" --max-tokens 128 --rounds "${ROUNDS:-2}"
