#!/usr/bin/env bash
# guidellm (the vLLM project's load-testing tool, from PyPI, unchanged) against gpt-server and
# llama.cpp's llama-server, side by side on the same GPT-2-small-shaped weights (random, GPT-2's
# tokenizer; f32 and q8_0), the same synthetic prompts (128 tokens) and outputs (64 tokens):
#   1. guidellm's `sweep` profile (synchronous, throughput, then constant rates between them);
#   2. its `concurrent` profile at 1, 4, 16 and 64 streams.
# Both servers are set up for 64 sequences at once on all cores, with their prompt caches off:
# guidellm sends the same synthetic prompts again in each benchmark of a run, and llama-server's
# 8 GiB host prompt cache (its default) then answered nearly every prompt from cache (154 of 155
# tokens) while gpt-server's 256 MiB prefix cache, scanned in order, kept none; with both off each
# request is computed, which is what the comparison is for. guidellm's JSON and HTML reports
# go to target/bench/guidellm/<server>-<weights>-<profile>.{json,html}; bench/guidellm_plot.py
# draws output tokens/s and inter-token latency against request rate for both (docs/guidellm.png)
# and prints the Markdown tables of BENCHMARKS.md.
#
#   bash bench/guidellm.sh                        # everything (about 50 minutes on 2 cores)
#   SERVERS=gpt-server ...                        # one server only (no llama.cpp build)
#   CHECKPOINT=weights SERVERS=gpt-server WEIGHTS=f32 PROFILES=concurrent STREAMS=4 DURATION=20 \
#     OUT=target/bench/guidellm-ci PLOT=target/bench/guidellm-ci/plot.png bash bench/guidellm.sh  # CI
#   GGUF=path/model.gguf PROFILES=concurrent STREAMS=16 bash bench/guidellm.sh
#                                                 # both servers on one GGUF file (guidellm's tokenizer
#                                                 # from the file, through transformers:
#                                                 # TOKENIZER_PYTHON, one with torch and gguf)
# Fails if guidellm saw any request error.
# Needs what bench/llamacpp_setup.sh says (for llama-server), and Python 3 for guidellm's venv.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/llamacpp_setup.sh
weights=${WEIGHTS:-f32 q8_0}
servers=${SERVERS:-gpt-server llama-server}
profiles=${PROFILES:-sweep concurrent}
streams=${STREAMS:-1,4,16,64}
duration=${DURATION:-60}                    # seconds per sweep step (25 s held 20-80 requests: a p99 of few)
concurrent_duration=${DURATION:-45}         # per concurrency (64 streams need a few rounds)
sweep_size=${SWEEP_SIZE:-7}
prompt_tokens=${PROMPT_TOKENS:-128}
output_tokens=${OUTPUT_TOKENS:-64}
parallel=64
port=${PORT:-18190}
out=${OUT:-target/bench/guidellm}
mkdir -p "$out"

venv=${GUIDELLM_VENV:-target/bench/guidellm-venv}
if [ ! -x "$venv/bin/guidellm" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "guidellm[plot]==${GUIDELLM_VERSION:-0.8.1}"
fi
[ "${SETUP_ONLY:-}" = 1 ] && exit 0  # (.ci/prefetch.sh: the environment made, nothing run)

if [ -n "${GGUF:-}" ]; then
  GGUF=$(cd "$(dirname "$GGUF")" && pwd)/$(basename "$GGUF")
  weights=$(basename "$GGUF" .gguf)
  [[ $servers == *llama-server* ]] && llama_cpp_build llama-server
  # guidellm counts and makes its synthetic prompts with a Hugging Face tokenizer: the file's own.
  model=$out/tokenizer-$weights
  [ -f "$model/tokenizer.json" ] || "${TOKENIZER_PYTHON:-$venv/bin/python}" -c "
import os, sys
from transformers import AutoTokenizer
path, out = sys.argv[1], sys.argv[2]
AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path)).save_pretrained(out)" \
    "$GGUF" "$model"
elif [ -n "${CHECKPOINT:-}" ]; then
  [[ $servers == *llama-server* ]] && { echo "CHECKPOINT= serves gpt-server only (llama-server reads GGUF)"; exit 1; }
  model=$CHECKPOINT
elif [[ $servers == *llama-server* ]]; then
  llama_cpp_build llama-server llama-quantize
  gpt2_checkpoint $weights
else
  gpt2_checkpoint
fi
# The set .ci/run builds (cargo unifies features over the packages built together: gpt-server
# alone is another build, which had cost CI minutes twice over).
cargo build -q --release --locked -p gpt-server -p gpt-train

server_pid=
stop_server() { [ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null; server_pid=; }
trap stop_server EXIT

start_server() { # SERVER WEIGHTS
  local log=$out/$1-$2.log
  case $1 in
    gpt-server)
      local source=(--checkpoint "$model" --dtype "$2")
      [ -n "${GGUF:-}" ] && source=(--checkpoint "$GGUF")
      ./target/release/gpt-server "${source[@]}" --port "$port" --device cpu \
        --model-name gpt2 --max-batch-size $parallel --max-queue 1024 --prefix-cache-mib 0 > "$log" 2>&1 & ;;
    llama-server)
      # One slot per stream, each with room for a request (the context is shared among slots).
      "$work/build/bin/llama-server" -m "${GGUF:-$work/gpt2-$2.gguf}" --port "$port" -t "$threads" \
        --parallel $parallel -c $((parallel * 256)) --alias gpt2 --no-cache-prompt --cache-ram 0 > "$log" 2>&1 & ;;
  esac
  server_pid=$!
  for _ in $(seq 300); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && return; sleep 0.2; done
  echo "$1 did not start:"; cat "$log"; exit 1
}

for w in $weights; do
  for s in $servers; do
    start_server "$s" "$w"
    for p in $profiles; do
      case $p in
        # Its throughput step at 16 requests in flight: with more (guidellm's default is 512; 64
        # take ~20 s to prefill and decode here) few or none finish within a step, and the rates
        # the sweep derives from it come out below the synchronous one.
        sweep) profile=(--profile "kind=sweep,sweep_size=$sweep_size,max_concurrency=16")
          seconds=$duration ;;
        concurrent) profile=(--profile kind=concurrent --override profile.streams "$streams")
          seconds=$concurrent_duration ;;
      esac
      echo "== $s $w $p"
      "$venv/bin/guidellm" run --backend "kind=openai_http,target=http://127.0.0.1:$port" "${profile[@]}" \
        --data "kind=synthetic_text,prompt_tokens=$prompt_tokens,output_tokens=$output_tokens" \
        --constraint "kind=max_duration,seconds=$seconds" \
        --tokenizer "kind=huggingface_auto,model=$model" \
        --output "kind=json,path=$out/$s-$w-$p.json" --output "kind=html,path=$out/$s-$w-$p.html" \
        --disable-console-interactive > "$out/$s-$w-$p.txt" 2>&1 ||
        { echo "guidellm failed:"; tail -40 "$out/$s-$w-$p.txt"; exit 1; }
    done
    stop_server
  done
done
"$venv/bin/python" bench/guidellm_plot.py "$out" "${PLOT:-docs/guidellm.png}"
