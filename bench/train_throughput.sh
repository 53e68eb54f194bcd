#!/usr/bin/env bash
# Training tokens/s at block 256 on the CPU: candle (train/benches/train_step.rs) and PyTorch
# (bench/torch_train.py), back to back, ROUNDS alternating pairs, each under /usr/bin/time for
# its peak resident memory (printed after its JSON line as `peak_rss_kb`).
#   [SHAPE=gpt2|smollm2] [BF16=1] [ROUNDS=1] bash bench/train_throughput.sh [BATCH] [STEPS]
# SHAPE=gpt2: the GPT-2-small shape (124M parameters, 50257 tokens) against bench/torch_train.py's
# GPT-2; SHAPE=smollm2: SmolLM2-135M's (Llama family) against `transformers`' LlamaForCausalLM.
# BF16=1: bf16 products on both sides (gpt-train's autocast, PyTorch's CPU autocast).
set -euo pipefail
cd "$(dirname "$0")/.."
batch=${1:-4}
steps=${2:-3}
threads=${THREADS:-$(nproc)}
shape=${SHAPE:-gpt2}
python=${PYTHON:-python3}
autocast=off torch_bf16=()
[ "${BF16:-0}" = 1 ] && autocast=bf16 torch_bf16=(--bf16)
cargo bench -q -p gpt-train --bench train_step --no-run 2>/dev/null
peak() { /usr/bin/time -f "peak_rss_kb %M" "$@" 2>&1 | grep -E '^\{|^peak_rss_kb' | tail -2; }
for _ in $(seq "${ROUNDS:-1}"); do
  AUTOCAST=$autocast THREADS=$threads peak cargo bench -q -p gpt-train --bench train_step -- "$shape" "$batch" 256 "$steps"
  peak "$python" bench/torch_train.py throughput --arch "$shape" "${torch_bf16[@]}" --threads "$threads" \
    --batch-size "$batch" --block-size 256 --max-iters "$steps"
done
