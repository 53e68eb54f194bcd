#!/usr/bin/env bash
# nanoGPT's CPU recipe (the README's training command) with gpt-train, then with nanoGPT's own
# train.py from a checkout of https://github.com/karpathy/nanoGPT, back to back, same flags and
# corpus; prints each one's wall time, peak memory and best validation loss, and the share of the
# CPUs' time the hypervisor gave to other guests during it (steal, from /proc/stat: on a shared VM
# it slows whichever side it falls on).
#   bash bench/nanogpt_recipe.sh NANOGPT_DIR [PYTHON]      (PYTHON: one with torch and numpy)
set -euo pipefail
cd "$(dirname "$0")/.."
nanogpt=$(cd "$1" && pwd)
python=${2:-python3}
[[ "$python" == */* ]] && python="$(cd "$(dirname "$python")" && pwd)/$(basename "$python")" # runs elsewhere
repo=$PWD
cargo build -q --release -p gpt-train
data="$nanogpt/data/shakespeare_char"
cp data/tinyshakespeare.txt "$data/input.txt" # prepare.py downloads it otherwise
(cd "$data" && "$python" prepare.py >/dev/null)
out=$(mktemp -d)
# "steal total" jiffies of all CPUs so far.
ticks() { awk '/^cpu /{print $9, $2 + $3 + $4 + $5 + $6 + $7 + $8 + $9}' /proc/stat; }
stolen() { # ticks before, ticks after
  awk -v a="$1" -v b="$2" 'BEGIN { split(a, x, " "); split(b, y, " ");
    printf "stolen by the hypervisor: %.1f%% of the CPUs\n", 100 * (y[1] - x[1]) / (y[2] - x[2] + 1e-9) }'
}
before=$(ticks)
/usr/bin/time -f "gpt-train: wall %e s, peak %M KB" ./target/release/gpt-train train \
  --data data/tinyshakespeare.txt --out "$out/run" --device cpu --n-layer 4 --n-head 4 --n-embd 128 \
  --block-size 64 --batch-size 12 --max-iters 2000 --lr-decay-iters 2000 --dropout 0 --eval-iters 20 \
  2>&1 | grep -E "^done|wall"
stolen "$before" "$(ticks)"
before=$(ticks)
(cd "$nanogpt" && /usr/bin/time -f "nanoGPT train.py: wall %e s, peak %M KB" "$python" train.py \
  config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20 --log_interval=1 \
  --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000 \
  --lr_decay_iters=2000 --dropout=0.0 --out_dir="$out/nanogpt" 2>&1 | grep -E "val loss|wall" | tail -2)
stolen "$before" "$(ticks)"
rm -rf "$out"
cd "$repo"
