#!/usr/bin/env bash
# nanoGPT's CPU recipe on tinyshakespeare (character level), gpt-train and the PyTorch reference
# (bench/torch_train.py) back to back with the same thread count; prints both JSON results.
#   bash bench/train_cpu.sh [DATA]
set -euo pipefail
cd "$(dirname "$0")/.."
data=${1:-data/tinyshakespeare.txt}
threads=${THREADS:-$(nproc)}
out=$(mktemp -d)
cargo build -q --release -p gpt-train
start=$(date +%s.%N)
RAYON_NUM_THREADS=$threads ./target/release/gpt-train train --data "$data" --out "$out/run" --device cpu \
  --n-layer 4 --n-head 4 --n-embd 128 --block-size 64 --batch-size 12 --max-iters 2000 \
  --lr-decay-iters 2000 --learning-rate 1e-3 --min-lr 1e-4 --warmup-iters 100 --beta2 0.99 \
  --weight-decay 0.1 --dropout 0 --grad-clip 1.0 --eval-iters 20 --eval-interval 250 \
  --log-interval 100 > "$out/log" 2>&1
end=$(date +%s.%N)
python3 - "$out/run" "$start" "$end" <<'PY'
import json, sys
state = json.load(open(f"{sys.argv[1]}/latest/trainer_state.json"))
events = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl")]
final = [e for e in events if e["event"] == "eval"][-1]
rates = sorted(e["tokens_per_sec"] for e in events if e["event"] == "train")
ms_per_iter = 1e3 * 12 * 64 / rates[len(rates) // 2]  # median over logged intervals, evals excluded
print(json.dumps({"impl": "gpt-train (candle)", "wall_s": float(sys.argv[3]) - float(sys.argv[2]),
                  "ms_per_iter": ms_per_iter, "best_val_loss": state["best_val_loss"],
                  "final": {"step": final["step"], "train": final["train_loss"], "val": final["val_loss"]}}))
PY
python3 bench/torch_train.py recipe --data "$data" --threads "$threads" 2>/dev/null
rm -rf "$out"
