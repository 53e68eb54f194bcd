#!/usr/bin/env bash
# LoRA on a GGUF base left quantized (QLoRA) against the same adapter on the base dequantized to
# f32, full fine-tuning, and PEFT's LoRA in PyTorch on `transformers`' dequantized copy: peak RSS
# and tokens/s of the steps, one after another, ROUNDS times.
#   GGUF=FILE PYTHON=python-with-torch-peft-transformers [ROUNDS=2] bash bench/qlora.sh
# r 8 on q_proj,v_proj (PEFT's default for the Llama layout), batch 4 x 256, 2 threads.
set -euo pipefail
cd "$(dirname "$0")/.."
GGUF=${GGUF:?a GGUF file}
PYTHON=${PYTHON:-python3}
ROUNDS=${ROUNDS:-2}
cargo build -q --release -p gpt-train
out=target/bench/qlora
mkdir -p "$out"
flags=(--init-from "$GGUF" --data data/tinyshakespeare.txt --block-size 256 --batch-size 4 --max-iters 8
  --eval-interval 1000 --eval-iters 1 --log-interval 1 --threads 2)
ours() { # NAME FLAGS...
  local name=$1
  shift
  rm -rf "${out:?}/$name"
  /usr/bin/time -f "%M" -o "$out/$name.rss" ./target/release/gpt-train train "${flags[@]}" --out "$out/$name" "$@" \
    >"$out/$name.log" 2>&1
  "$PYTHON" - "$out/$name/metrics.jsonl" "$name" "$(cat "$out/$name.rss")" <<'PY'
import json, statistics, sys
r = [e["tokens_per_sec"] for e in map(json.loads, open(sys.argv[1])) if e["event"] == "train"][2:]
print(f"{sys.argv[2]:<28} {statistics.median(r):7.1f} tokens/s  peak RSS {int(sys.argv[3]) / 1e6:.2f} GB")
PY
  rm -rf "${out:?}/$name"
}
for _ in $(seq "$ROUNDS"); do
  ours lora-stored-base --lora-r 8 --lora-base stored
  ours lora-f32-base --lora-r 8
  ours full-fine-tuning
  printf "%-28s %s\n" peft-lora-f32 "$("$PYTHON" bench/lora_peft.py "$GGUF" --data data/tinyshakespeare.txt --r 8 \
    --alpha 8 --targets q_proj,v_proj --batch-size 4 --block-size 256 --steps 8 --threads 2 2>/dev/null | tail -1)"
done
