#!/usr/bin/env bash
# Training tokens/s for the GPT-2-small shape (124M parameters, 50257 tokens) at block 256 on the
# CPU: candle (train/benches/train_step.rs) and PyTorch (bench/torch_train.py), back to back.
#   bash bench/train_throughput.sh [BATCH] [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
batch=${1:-4}
steps=${2:-3}
threads=${THREADS:-$(nproc)}
THREADS=$threads cargo bench -q -p gpt-train --bench train_step -- gpt2 "$batch" 256 "$steps" 2>/dev/null | tail -1
python3 bench/torch_train.py throughput --threads "$threads" --batch-size "$batch" --block-size 256 --max-iters "$steps" 2>/dev/null
