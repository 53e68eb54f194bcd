#!/usr/bin/env bash
# Time to a validation loss: gpt-train's --recipe modern against nanoGPT's own train.py on
# nanoGPT's CPU recipe (4 layers, 4 heads, 128 wide, block 64, batch 12, dropout 0; the README's
# first training command), then the recipe's ablation and Muon's cost per step.
#   bash bench/recipe.sh NANOGPT_DIR [PYTHON]   (PYTHON: one with torch and numpy)
#   PAIRS=3 (alternating pairs), TARGET=1.886 (nanoGPT's final val loss after its 2000 steps),
#   PARTS="pairs whole ablation cost" (which parts to run), SEEDS="1337" (the ablation's).
# Prints one line per run; the runs' metrics.jsonl are kept in target/bench/recipe/.
set -euo pipefail
cd "$(dirname "$0")/.."
nanogpt=$(cd "$1" && pwd)
python=${2:-python3}
[[ "$python" == */* ]] && python="$(cd "$(dirname "$python")" && pwd)/$(basename "$python")"
pairs=${PAIRS:-3}
target=${TARGET:-1.886}
parts=${PARTS:-pairs whole ablation cost}
seeds=${SEEDS:-1337}
repo=$PWD
out=$repo/target/bench/recipe
mkdir -p "$out"
cargo build -q --release -p gpt-train
data="$nanogpt/data/shakespeare_char"
cp data/tinyshakespeare.txt "$data/input.txt" # prepare.py downloads it otherwise
(cd "$data" && "$python" prepare.py >/dev/null)
shape=(--device cpu --n-layer 4 --n-head 4 --n-embd 128 --block-size 64 --dropout 0 --eval-iters 20)

# gpt-train NAME FLAGS...: one run; prints its wall time, final val loss and when it first
# reached $target (step and the run's own seconds, from metrics.jsonl).
gpt_train() {
  local name=$1
  shift
  [[ -n "${only:-}" && ! "$name" =~ $only && "$name" == s[0-9]* ]] && return 0
  rm -rf "$out/$name"
  local start end
  start=$(date +%s.%N)
  ./target/release/gpt-train train --data data/tinyshakespeare.txt --out "$out/$name" "${shape[@]}" "$@" \
    >"$out/$name.log" 2>&1
  end=$(date +%s.%N)
  "$python" - "$out/$name/metrics.jsonl" "$target" "$name" "$start" "$end" <<'EOF'
import json, sys
path, target, name, start, end = sys.argv[1], float(sys.argv[2]), sys.argv[3], float(sys.argv[4]), float(sys.argv[5])
evals = [e for e in map(json.loads, open(path)) if e["event"] == "eval"]
hit = next((e for e in evals if e["val_loss"] <= target), None)
reached = f"{target} at step {hit['step']}, {hit['elapsed_s']:.1f} s" if hit else f"{target} not reached"
print(f"{name:<34} wall {end - start:6.1f} s  last val {evals[-1]['val_loss']:.4f} (step {evals[-1]['step']})  {reached}")
EOF
  rm -rf "$out/$name/checkpoints" "$out/$name/best" "$out/$name/latest"
}

nanogpt_run() {
  local log="$out/nanogpt-$1.log" start end
  start=$(date +%s.%N)
  (cd "$nanogpt" && "$python" train.py config/train_shakespeare_char.py --device=cpu --compile=False \
    --eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 \
    --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0 --out_dir="$out/nanogpt-ckpt" >"$log" 2>&1)
  end=$(date +%s.%N)
  printf "%-34s wall %6.1f s  %s\n" "nanoGPT train.py $1" "$(echo "$end - $start" | bc)" \
    "$(grep -E "val loss" "$log" | tail -1)"
  rm -rf "$out/nanogpt-ckpt"
}

modern=(--recipe modern --eval-interval 50)
if [[ " $parts " == *" pairs "* ]]; then
  echo "## time to $target: gpt-train --recipe modern (600 steps, stopping there) and nanoGPT's 2000 steps"
  for i in $(seq "$pairs"); do
    gpt_train "modern-pair$i" "${modern[@]}" --batch-size 12 --max-iters 600 --stop-at-val-loss "$target"
    nanogpt_run "pair$i"
  done
fi
if [[ " $parts " == *" whole "* ]]; then
  echo "## within nanoGPT's time: --recipe modern for 2400 steps"
  gpt_train modern-2400 --recipe modern --eval-interval 250 --batch-size 12 --max-iters 2400
fi
if [[ " $parts " == *" ablation "* ]]; then
  echo "## ablation (eval every 50 steps; batch 12 unless named)"
  only=${ONLY:-} # a regular expression: run only the rows whose name matches it
  for seed in $seeds; do
    s=(--seed "$seed" --eval-interval 50)
    gpt_train "s$seed-nanogpt-2000" "${s[@]}" --batch-size 12 --max-iters 2000
    gpt_train "s$seed-nanogpt-600" "${s[@]}" --batch-size 12 --max-iters 600
    # The recipe's optimizer and schedule on GPT-2's layout (--arch gpt2), then the layouts.
    gpt_train "s$seed-adamw-wsd-6e-3-600" "${s[@]}" --batch-size 12 --max-iters 600 --recipe modern --arch gpt2 \
      --optimizer adamw
    gpt_train "s$seed-adamw-wsd-3e-3-1400" "${s[@]}" --batch-size 12 --max-iters 1400 --recipe modern --arch gpt2 \
      --optimizer adamw --learning-rate 3e-3
    gpt_train "s$seed-muon-cosine-1e-3-600" "${s[@]}" --batch-size 12 --max-iters 600 --optimizer muon
    gpt_train "s$seed-muon-wsd-1e-3-600" "${s[@]}" --batch-size 12 --max-iters 600 --recipe modern --arch gpt2 \
      --learning-rate 1e-3
    gpt_train "s$seed-modern-600" "${s[@]}" --batch-size 12 --max-iters 600 --recipe modern
    gpt_train "s$seed-modern-gpt2-500" "${s[@]}" --batch-size 12 --max-iters 500 --recipe modern --arch gpt2
    gpt_train "s$seed-modern-gpt2-batch24-300" "${s[@]}" --max-iters 300 --recipe modern --arch gpt2 --batch-size 24
    gpt_train "s$seed-modern-gpt2-original-scale-600" "${s[@]}" --batch-size 12 --max-iters 600 --recipe modern \
      --arch gpt2 --muon-scale original
    gpt_train "s$seed-modern-gpt2-600" "${s[@]}" --batch-size 12 --max-iters 600 --recipe modern --arch gpt2
    gpt_train "s$seed-modern-llama-600" "${s[@]}" --batch-size 12 --max-iters 600 --recipe modern --arch llama
    gpt_train "s$seed-modern-qwen3-600" "${s[@]}" --batch-size 12 --max-iters 600 --recipe modern --arch qwen3
    gpt_train "s$seed-modern-gpt2-zero-init-600" "${s[@]}" --batch-size 12 --max-iters 600 --recipe modern --arch gpt2 \
      --zero-init-proj
    # Squared ReLU (Arcee's ungated MLP, 4x wide: SwiGLU's parameters) in place of the recipe's
    # SwiGLU, the head untied as the recipe's.
    gpt_train "s$seed-modern-arcee-600" "${s[@]}" --batch-size 12 --max-iters 600 --recipe modern --arch arcee \
      --untied-head
    # The batch ramped up (--batch-ramp-iters): 3 -> 12 rows over the first 200 steps; 6 -> 24
    # over 150 of 400.
    gpt_train "s$seed-modern-ramp-3-12-200-600" "${s[@]}" --batch-size 12 --max-iters 600 --recipe modern \
      --batch-ramp-iters 200 --batch-size-start 3
    gpt_train "s$seed-modern-ramp-6-24-150-400" "${s[@]}" --batch-size 24 --max-iters 400 --recipe modern \
      --batch-ramp-iters 150 --batch-size-start 6
    gpt_train "s$seed-modern-batch24-400" "${s[@]}" --batch-size 24 --max-iters 400 --recipe modern
    gpt_train "s$seed-modern-ramp-6-24-150-350" "${s[@]}" --batch-size 24 --max-iters 350 --recipe modern \
      --batch-ramp-iters 150 --batch-size-start 6
    gpt_train "s$seed-modern-batch24-350" "${s[@]}" --batch-size 24 --max-iters 350 --recipe modern
  done
fi
if [[ " $parts " == *" cost "* ]]; then
  echo "## Muon's cost: tokens/s of the training steps (metrics.jsonl), AdamW then Muon"
  step_rate() { # NAME FLAGS...: the mean tokens/s the run logged after its first 2 logs
    local name=$1
    shift
    rm -rf "$out/$name"
    ./target/release/gpt-train train --data data/tinyshakespeare.txt --out "$out/$name" --device cpu "$@" \
      >"$out/$name.log" 2>&1
    "$python" -c "
import json, sys
r = [e['tokens_per_sec'] for e in map(json.loads, open('$out/$name/metrics.jsonl')) if e['event'] == 'train'][2:]
print(f'{\"$name\":<34} {sum(r) / len(r):9.0f} tokens/s over {len(r)} logs')"
    rm -rf "$out/$name"
  }
  recipe=("${shape[@]:2}" --batch-size 12 --max-iters 300 --eval-interval 1000 --log-interval 25)
  for opt in adamw muon; do step_rate "recipe-$opt" "${recipe[@]}" --optimizer "$opt"; done
  tok=char
  [ -n "${GPT2_TOKENIZER_DIR:-}" ] && tok=$GPT2_TOKENIZER_DIR
  gpt2=(--preset gpt2 --tokenizer "$tok" --batch-size 8 --block-size 1024 --dropout 0 --max-iters 4
    --eval-interval 1000 --eval-iters 1 --log-interval 1)
  for opt in adamw muon; do step_rate "gpt2-small-$opt" "${gpt2[@]}" --optimizer "$opt"; done
fi
cd "$repo"
