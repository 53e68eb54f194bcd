#!/usr/bin/env bash
# LoRA against full fine-tuning of the GPT-2-small shape on the CPU, with and without activation
# checkpointing (--activation-checkpointing), `gpt-train train` itself
# (metrics.jsonl's tokens/s, median after the first step; peak RSS by /usr/bin/time), and PEFT's
# own LoRA step in PyTorch (bench/lora_peft.py), side by side in pairs. The base is
# bench/make_random_gpt2.py's random GPT-2 small with GPT-2's tokenizer; batch 1 x 1024 (its context), f32.
#   bash bench/lora.sh [PAIRS] [STEPS]
# Needs GPT-2's tokenizer.json (GPT2_TOKENIZER, default target/gpt2-tokenizer/tokenizer.json) and
# a Python with transformers, torch and peft (PYTHON, default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
pairs=${1:-2}
steps=${2:-6}
rank=${LORA_R:-8}
targets=${LORA_TARGETS:-c_attn}
python=${PYTHON:-python3}
tokenizer=${GPT2_TOKENIZER:-target/gpt2-tokenizer/tokenizer.json}
base=target/bench/gpt2-random
[ -f "$base/model.safetensors" ] || "$python" bench/make_random_gpt2.py "$tokenizer" "$base"
cargo build -q --release -p gpt-train
bin=target/release/gpt-train
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export RUST_LOG=warn
args=(--data data/tinyshakespeare.txt --init-from "$base" --batch-size 1 --dropout 0
  --max-iters "$steps" --eval-interval 100000 --eval-iters 1 --log-interval 1 --warmup-iters 1
  --keep-last 1 --device cpu --threads 2)
report() {
  python3 - "$1/metrics.jsonl" "$2" <<'PY'
import json, statistics, sys
rates = [e["tokens_per_sec"] for e in map(json.loads, open(sys.argv[1])) if e["event"] == "train"][1:]
rss = [int(l.split()[-1]) for l in open(sys.argv[2]) if l.startswith("peak-rss-kb")]
print(f"{statistics.median(rates):.1f} tokens/s, peak RSS {max(rss) / 1e6:.2f} GB")
PY
}
echo "== $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, $(date -u '+%Y-%m-%d %H:%M UTC'), $(git rev-parse --short HEAD)"
for pair in $(seq "$pairs"); do
  rm -rf "$work"/*
  /usr/bin/time -f "peak-rss-kb %M" -o "$work/full.time" "$bin" train --out "$work/full" "${args[@]}" >/dev/null 2>&1
  echo "pair $pair: full fine-tuning: $(report "$work/full" "$work/full.time")"
  /usr/bin/time -f "peak-rss-kb %M" -o "$work/lora.time" "$bin" train --out "$work/lora" "${args[@]}" \
    --lora-r "$rank" --lora-targets "$targets" >/dev/null 2>&1
  echo "pair $pair: LoRA r $rank on $targets: $(report "$work/lora" "$work/lora.time")"
  /usr/bin/time -f "peak-rss-kb %M" -o "$work/lora-ac.time" "$bin" train --out "$work/lora-ac" "${args[@]}" \
    --lora-r "$rank" --lora-targets "$targets" --activation-checkpointing >/dev/null 2>&1
  echo "pair $pair: LoRA r $rank on $targets, activation checkpointing: $(report "$work/lora-ac" "$work/lora-ac.time")"
  /usr/bin/time -f "peak-rss-kb %M" -o "$work/full-ac.time" "$bin" train --out "$work/full-ac" "${args[@]}" \
    --activation-checkpointing >/dev/null 2>&1
  echo "pair $pair: full fine-tuning, activation checkpointing: $(report "$work/full-ac" "$work/full-ac.time")"
  echo "pair $pair: PEFT LoRA r $rank on $targets (PyTorch): $("$python" bench/lora_peft.py "$base" \
    --data data/tinyshakespeare.txt --r "$rank" --targets "$targets" --batch-size 1 --block-size 1024 \
    --steps "$steps" --threads 2 2>/dev/null)"
done
