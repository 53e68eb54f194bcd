#!/usr/bin/env bash
# The GPU checks and benchmarks, run on a machine with an NVIDIA GPU from the repository root,
# with the binaries that bench/gpu_build.sh packed into .gpu/ (no Rust toolchain needed here).
#   bash bench/gpu.sh check   CPU vs CUDA (tests/cuda.rs), gpt-server on the GPU (streams,
#                             batching, f32/bf16/f16 greedy text), gpt-train eval on both devices
#   bash bench/gpu.sh speed   decode, then steps
#   bash bench/gpu.sh decode  decode tokens/s (batch 1, 8 and 64, f32 and bf16; the batched
#                             decode kernel on, then off) against transformers
#   bash bench/gpu.sh steps   every CPU-vs-CUDA test, then training tokens/s: GPT-2 small
#                             (8 x 1024) against nanoGPT's model.py, and the shakespeare-char
#                             step with fused ops off/on and bf16
#   bash bench/gpu.sh serve   gpt-server --device cuda on a GPT-2-small-shaped checkpoint (random
#                             weights): 1, 16 and 64 concurrent streams, tokens/s and TTFT
#   bash bench/gpu.sh nanogpt nanoGPT's own train.py (shakespeare-char config, eager and
#                             torch.compile) for its ms/iteration; needs .gpu/nanogpt (gpu_build.sh)
#   bash bench/gpu.sh session one lease's whole experiment in SESSION_SECS (see the stage)
#   bash bench/gpu.sh kernels the training kernels' tests, speed and profile, in ~2 minutes
#   bash bench/gpu.sh train   nanoGPT's shakespeare-char configuration with gpt-train (the
#                             default model): log, metrics, loss plot and the f16 export;
#                             TRAIN_FLAGS adds flags (e.g. "--dtype bf16"), TRAIN_SECS stops it
#                             (as Ctrl-C does: a checkpoint is saved) after that many seconds
# Results go to $OUT (default gpu-out/). RUN_DEVICE=cpu dry-runs the script's own logic on the
# CPU (with a CUDA build, that needs a libcuda.so.1 on the loader path, e.g. the toolkit's stub).
set -uo pipefail
stage=${1:?usage: bash bench/gpu.sh check|speed|decode|steps|serve|nanogpt|train|session|kernels}
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
bin=/tmp/gpt-bin
mkdir -p $bin
# GPU images may lack zstd: gpu_build.sh packs this machine's (and the libraries it links).
if ! command -v zstd > /dev/null; then
  zstd() { LD_LIBRARY_PATH="$PWD/.gpu/tools" "$PWD/.gpu/tools/zstd" "$@"; }
fi
[[ -x $bin/gpt-train ]] || zstd -q -d --long=28 -c .gpu/bin.tar.zst | tar -C $bin -xf -
for f in .gpu/*.txt.zst .gpu/*.json.zst; do
  [[ -e "$bin/$(basename "$f" .zst)" ]] || zstd -q -d -f "$f" -o "$bin/$(basename "$f" .zst)"
done
chmod +x $bin/gpt-train $bin/gpt-server $bin/cuda-tests $bin/nccl-tests $bin/inference $bin/train-step
corpus=$bin/corpus.txt
export RUST_LOG=${RUST_LOG:-info}
dev=${RUN_DEVICE:-cuda}
log() { echo "== $*"; }

# The CUDA 13 libraries the binaries link (cuBLAS, cuRAND, NVRTC, cudart): from the system's
# toolkit where the loader finds them, else from the CUDA wheels beside PyTorch.
if ldd $bin/gpt-train | grep -q "not found"; then
  for lib in $(ldd $bin/gpt-train | awk '/not found/ {print $1}'); do
    found=$(find /usr/local /opt /usr/lib -name "$lib" 2> /dev/null | head -n 1)
    [[ -n $found ]] && export LD_LIBRARY_PATH="$(dirname "$found")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  done
  ldd $bin/gpt-train | grep "not found" && echo "libraries missing (above)"
fi

# Starts gpt-server on the GPU with the given flags; waits for /health.
start_server() {
  pkill -f "$bin/gpt-server" 2> /dev/null && sleep 1
  $bin/gpt-server --port 18080 --device "$dev" "$@" > "$bin/server.log" 2>&1 &
  server=$!
  for _ in $(seq 1 120); do curl -sf localhost:18080/health > /dev/null && return 0; sleep 0.5; done
  cat "$bin/server.log"; return 1
}
stop_server() { kill -TERM "$server"; wait "$server"; }
complete() {
  curl -s localhost:18080/v1/completions -H 'content-type: application/json' -d "$1"
}

case $stage in
check)
  exec > >(tee "$OUT/check.log") 2>&1
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  # The CPU side of the comparisons runs the project's CPU kernels, which pick AMX, AVX-512 or AVX2 here.
  echo "host CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2), $(nproc) threads, flags: $(grep -m1 -o -w -E 'amx_bf16|avx512f|avx512_bf16|avx2' /proc/cpuinfo | sort -u | tr '\n' ' ')"
  log "CPU vs CUDA (tests/cuda.rs)"
  $bin/cuda-tests --test-threads 1 --nocapture
  log "CPU vs CUDA, candle's own ops (GPT_CUDA_FUSED=0)"
  GPT_CUDA_FUSED=0 $bin/cuda-tests --test-threads 1 --skip fused_kernels

  log "gpt-train eval of weights/ on the last 10% of the corpus"
  tail -c 111540 "$corpus" > $bin/val.txt
  for d in cpu "$dev"; do $bin/gpt-train eval --checkpoint weights --data $bin/val.txt --device "$d" --json; done

  log "gpt-server --device $dev: 16 concurrent streams"
  start_server --checkpoint weights
  pids=()
  for i in $(seq 1 16); do
    complete "{\"prompt\":\"ROMEO:\",\"max_tokens\":200,\"temperature\":0.8,\"seed\":$i,\"stream\":true}" \
      > "$bin/stream$i.txt" &
    pids+=($!)
  done
  peak=0
  while kill -0 "${pids[@]}" 2> /dev/null; do
    b=$(curl -s localhost:18080/metrics | awk '/^gpt_batch_size /{print $2}')
    [[ ${b:-0} -gt $peak ]] && peak=$b
    sleep 0.05
  done
  wait "${pids[@]}"
  for i in $(seq 1 16); do
    echo "stream $i: $(grep -c '^data: {' "$bin/stream$i.txt") chunks, last: $(tail -n 2 "$bin/stream$i.txt" | head -c 60)"
  done
  echo "largest batch seen in /metrics: $peak"
  curl -s localhost:18080/metrics | grep -E '^gpt_(requests|generated|batch)'
  stop_server

  log "greedy text by dtype (default model, 3 prompts, 100 tokens)"
  for dtype in f32 bf16 f16; do
    start_server --checkpoint weights --dtype "$dtype"
    n=0
    for p in "ROMEO:" "First Citizen:\nBefore we proceed" "KING HENRY:\nWhat"; do
      n=$((n + 1))
      complete "{\"prompt\":\"$p\",\"max_tokens\":100,\"temperature\":0}" \
        | python3 -c 'import json,sys; sys.stdout.write(json.load(sys.stdin)["choices"][0]["text"])' \
        > "$bin/greedy-$dtype-$n.txt"
    done
    stop_server
  done
  # Per prompt: how many leading characters each dtype shares with f32, and the texts.
  python3 - "$bin" <<'PY'
import sys
d = sys.argv[1]
for n in (1, 2, 3):
    ref = open(f"{d}/greedy-f32-{n}.txt").read()
    for dtype in ("f32", "bf16", "f16"):
        t = open(f"{d}/greedy-{dtype}-{n}.txt").read()
        same = next((i for i, (a, b) in enumerate(zip(ref, t)) if a != b), min(len(ref), len(t)))
        print(f"prompt {n} {dtype:4}: {'identical' if t == ref else f'first {same} chars as f32'} | {t[:70]!r}")
PY
  ;;

speed)
  bash "$0" decode
  bash "$0" steps
  ;;

serve)
  exec > >(tee "$OUT/serve.log") 2>&1
  log "gpt-server --device $dev, GPT-2-small shape (random weights): 1, 16, 64 concurrent streams"
  python3 bench/make_random_gpt2.py $bin/gpt2-tokenizer.json $bin/gpt2-random > /dev/null
  for dtype in f32 bf16; do
    start_server --checkpoint $bin/gpt2-random --dtype $dtype --max-batch-size 64 --max-queue 256 || continue
    echo "dtype $dtype"
    python3 bench/serve_streams.py --url http://localhost:18080 --concurrency 1 16 64 --requests 2 \
      | tee -a "$OUT/serve.jsonl"
    curl -s localhost:18080/metrics | grep -E '^gpt_(batch_size|requests_total)'
    stop_server
  done
  ;;

decode)
  exec > >(tee "$OUT/decode.log") 2>&1
  log "decode, GPT-2-small shape: batched decode kernel on, then off (GPT_CUDA_FUSED=0); transformers"
  for dtype in f32 bf16; do
    for batch in 1 8 64; do
      DEVICE=$dev DTYPE=$dtype BATCH=$batch NEW_TOKENS=256 $bin/inference | tee -a "$OUT/decode.jsonl"
    done
  done
  for batch in 8 64; do
    GPT_CUDA_FUSED=0 DEVICE=$dev BATCH=$batch NEW_TOKENS=256 $bin/inference | tee -a "$OUT/decode.jsonl"
  done
  python3 bench/torch_inference.py --device "$dev" --dtype f32 bf16 --batch 1 8 64 --new-tokens 256 \
    | tee -a "$OUT/decode.jsonl"
  ;;

steps)
  exec > >(tee "$OUT/steps.log") 2>&1
  log "CPU vs CUDA: every test, then one training step with candle's ops (GPT_CUDA_FUSED=0)"
  $bin/cuda-tests --test-threads 1
  GPT_CUDA_FUSED=0 $bin/cuda-tests --test-threads 1 training_step
  log "training step, shakespeare-char shape (6 x 6 x 384, 64 x 256): fused kernels off/on, bf16"
  GPT_CUDA_FUSED=0 DEVICE=$dev $bin/train-step shakespeare-char 64 256 20 | tee -a "$OUT/steps.jsonl"
  DEVICE=$dev $bin/train-step shakespeare-char 64 256 20 | tee -a "$OUT/steps.jsonl"
  AUTOCAST=bf16 DEVICE=$dev $bin/train-step shakespeare-char 64 256 20 | tee -a "$OUT/steps.jsonl"
  log "training step, GPT-2-small shape, batch 8 x 1024: candle f32+TF32 and bf16; nanoGPT model.py"
  DEVICE=$dev $bin/train-step gpt2 8 1024 10 | tee -a "$OUT/steps.jsonl"
  AUTOCAST=bf16 DEVICE=$dev $bin/train-step gpt2 8 1024 10 | tee -a "$OUT/steps.jsonl"
  if [[ -d .gpu/nanogpt ]]; then
    for dtype in bfloat16 float32; do
      python3 bench/nanogpt_throughput.py .gpu/nanogpt --device "$dev" --dtype $dtype \
        --batch-size 8 --block-size 1024 --max-iters 10
    done
  fi
  ;;

nanogpt)
  exec > >(tee "$OUT/nanogpt.log") 2>&1
  log "nanoGPT train.py, shakespeare-char config, 300 iterations: eager, then torch.compile"
  ng=$bin/nanogpt
  rm -rf $ng && cp -r .gpu/nanogpt $ng
  for compile in False True; do
    echo "compile=$compile"
    (cd $ng && python3 train.py config/train_shakespeare_char.py --compile=$compile --max_iters=300 \
      --lr_decay_iters=5000 --eval_interval=100000 --eval_iters=1 --log_interval=20 \
      --out_dir=$ng/out 2>&1 | grep -E "^iter|dtype|error|Error")
  done
  ;;

train)
  exec > >(tee "$OUT/train.log") 2>&1
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  run=$bin/shakespeare-char
  log "gpt-train train: nanoGPT's shakespeare-char defaults (6 x 6 x 384, block 256, batch 64, 5000 iters)"
  start=$(date +%s)
  # shellcheck disable=SC2086
  timeout -s INT -k 60 "${TRAIN_SECS:-100000}" \
    $bin/gpt-train train --data "$corpus" --out $run --device "$dev" ${TRAIN_FLAGS:-}
  echo "wall: $(( $(date +%s) - start )) s"
  $bin/gpt-train export --checkpoint $run/best --out $bin/model --dtype f16 || \
    $bin/gpt-train export --checkpoint $run --out $bin/model --dtype f16
  cp $bin/model/config.json $bin/model/tokenizer.json $run/metrics.jsonl $run/loss.svg "$OUT/"
  split -b 15M -d $bin/model/model.safetensors "$OUT/model.safetensors.part"
  log "samples from gpt-server --device $dev"
  start_server --checkpoint $bin/model
  for p in "ROMEO:" "JULIET:\nO Romeo" "First Citizen:"; do
    complete "{\"prompt\":\"$p\",\"max_tokens\":200,\"temperature\":0.8,\"seed\":42}" \
      | python3 -c 'import json,sys; d=json.load(sys.stdin); print(json.dumps(d["choices"][0]["text"] if "choices" in d else d))'
  done
  stop_server
  $bin/gpt-train eval --checkpoint $bin/model --data "$corpus" --device "$dev" --json
  ;;
session)
  # One lease's whole experiment, most valuable first, each stage bounded so that the whole ends
  # within SESSION_SECS (default 480): the CPU-vs-CUDA tests with the GPU's tape (GPT_CUDA_TAPE=1)
  # and without, NCCL with one rank, the shakespeare-char step on the tape and off it, serving 64
  # streams against the engine's own batch-64 decode, nanoGPT's train.py (eager, compiled) on
  # the same machine, GPT-2-small steps, and a per-kernel profile of the step (ncu). $OUT gets
  # session.log and ncu.csv.
  deadline=$(( $(date +%s) + ${SESSION_SECS:-480} ))
  left() { echo $(( deadline - $(date +%s) )); }
  bounded() { # bounded SECS CMD...: CMD with at most SECS, or not at all when too little is left
    local secs=$1; shift
    (( $(left) < secs )) && secs=$(left)
    (( secs < 10 )) && { echo "skipped (time): $*"; return 1; }
    timeout -k 5 "$secs" "$@"
  }
  exec > >(tee "$OUT/session.log") 2>&1
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  log "CPU vs CUDA (tests/cuda.rs), with the GPU's tape (GPT_CUDA_TAPE=1), then a training step without"
  (export GPT_CUDA_TAPE=1; bounded 150 $bin/cuda-tests --test-threads 1 > $bin/tests.log 2>&1)
  grep -E '^test |test result|differs|panicked|rror' $bin/tests.log
  bounded 60 $bin/cuda-tests --test-threads 1 a_training_step 2>&1 | grep -E '^test |differs|panicked'

  log "NCCL with one rank (gpt-train's tests, feature nccl)"
  nccl_lib=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2> /dev/null)
  if [[ -z $nccl_lib ]]; then
    found=$(find /usr /opt -name 'libnccl.so.2*' 2> /dev/null | head -n 1)
    [[ -n $found ]] && nccl_lib=$(dirname "$found")
  fi
  echo "libnccl from: ${nccl_lib:-the loader path}"
  (export LD_LIBRARY_PATH="$PWD/.gpu/mpi:${nccl_lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    bounded 60 $bin/nccl-tests --test-threads 1 --nocapture nccl 2>&1 | grep -E '^test |test result|NCCL|panicked|error')

  log "training step, shakespeare-char shape (64 x 256, no dropout): on the GPU's tape, candle's backward, the tape again"
  for env in "GPT_CUDA_TAPE=1" "X=1" "GPT_CUDA_TAPE=1"; do
    echo "$env: $(export "$env" DEVICE=$dev; bounded 60 $bin/train-step shakespeare-char 64 256 30)"
  done

  log "serving: the engine's batch-64 decode (inference bench), then gpt-server with 1, 16, 64 streams (GPT-2-small shape, f32)"
  python3 bench/make_random_gpt2.py $bin/gpt2-tokenizer.json $bin/gpt2-random > /dev/null
  (export DEVICE=$dev DTYPE=f32 BATCH=64 NEW_TOKENS=256; bounded 60 $bin/inference)
  if start_server --checkpoint $bin/gpt2-random --dtype f32 --max-batch-size 64 --max-queue 256; then
    bounded 90 python3 bench/serve_streams.py --url http://localhost:18080 --concurrency 1 16 64 --requests 2
    curl -s localhost:18080/metrics | grep -E '^gpt_(batch_size|requests_total)'
    stop_server
  fi

  if [[ -d .gpu/nanogpt ]]; then
    log "nanoGPT train.py, shakespeare-char config, 300 iterations: eager, then torch.compile"
    ng=$bin/nanogpt
    rm -rf $ng && cp -r .gpu/nanogpt $ng
    for compile in False True; do
      echo "compile=$compile"
      (cd $ng && bounded 90 python3 train.py config/train_shakespeare_char.py --compile=$compile --max_iters=300 \
        --lr_decay_iters=5000 --eval_interval=100000 --eval_iters=1 --log_interval=50 \
        --out_dir=$ng/out 2>&1 | grep -E "^iter|rror")
    done
  fi

  log "training step, GPT-2-small shape, 8 x 1024, f32 (TF32): on the GPU's tape, then candle's backward"
  (export DEVICE=$dev GPT_CUDA_TAPE=1; bounded 45 $bin/train-step gpt2 8 1024 10)
  (export DEVICE=$dev; bounded 45 $bin/train-step gpt2 8 1024 10)

  log "per-kernel GPU time of the shakespeare-char step on the tape (ncu; train-step runs 3 steps)"
  ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2> /dev/null | head -n 1)
  export DEVICE=$dev GPT_CUDA_TAPE=1
  bounded 90 "$ncu_bin" --clock-control none --metrics gpu__time_duration.sum --csv --page raw \
    --log-file "$OUT/ncu.csv" $bin/train-step shakespeare-char 64 256 1 > /dev/null
  python3 bench/ncu_summary.py "$OUT/ncu.csv" 3
  log "done, $(left) s to spare"
  ;;

kernels)
  # A short lease's check of the training kernels: the CPU-vs-CUDA tests, the shakespeare-char
  # step with the attention kernels on and off, GPT-2-small steps, and the step's kernel profile.
  exec > >(tee "$OUT/kernels.log") 2>&1
  log "CPU vs CUDA (tests/cuda.rs)"
  timeout 100 $bin/cuda-tests --test-threads 1 2>&1 | grep -E '^test |test result|differs|panicked'
  log "training step, shakespeare-char shape (64 x 256, no dropout): as built; attention kernels off"
  for env in "X=1" "GPT_CUDA_ATTENTION=0"; do
    echo "$env: $(export "$env" DEVICE=$dev; timeout 40 $bin/train-step shakespeare-char 64 256 20)"
  done
  log "training step, GPT-2-small shape, 8 x 1024: f32+TF32, bf16"
  DEVICE=$dev timeout 40 $bin/train-step gpt2 8 1024 10
  AUTOCAST=bf16 DEVICE=$dev timeout 40 $bin/train-step gpt2 8 1024 10
  log "per-kernel GPU time of the shakespeare-char step (ncu; train-step runs 3 steps)"
  ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2> /dev/null | head -n 1)
  DEVICE=$dev timeout 90 "$ncu_bin" --clock-control none --metrics gpu__time_duration.sum --csv --page raw \
    --log-file "$OUT/ncu.csv" $bin/train-step shakespeare-char 64 256 1 > /dev/null
  python3 bench/ncu_summary.py "$OUT/ncu.csv" 3
  ;;
*) echo "unknown stage $stage" >&2; exit 2 ;;
esac
