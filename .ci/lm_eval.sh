#!/usr/bin/env bash
# EleutherAI's lm-evaluation-harness (PyPI lm_eval, unchanged) against gpt-server with
# `local-completions`: a rolling-perplexity task (loglikelihood_rolling) and a multiple-choice task
# (loglikelihood) over tinyshakespeare (tests/lm_eval). lm-eval finds the server's tokenizer
# endpoints by itself (HF_HUB_OFFLINE makes a Hugging Face fallback fail loudly). Every score must
# equal lm-eval's `hf` backend's on the same checkpoint within 1e-4 relative:
# - the byte-level BPE fixture with an end-of-text token, with lm-eval's default batch of one
#   prompt per request and with 8;
# - the character-level default model in weights/ (no end-of-text token: the rolling task's
#   prefix token is given, `\n`), also with `--matmul-precision high` where the CPU has AMX.
# Rerun alone with `.ci/lm_eval.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."

source .ci/python_env.sh
venv=$LM_EVAL_VENV
cargo build --release --locked -p gpt-server -p gpt-train  # the same set as .ci/run builds: no rebuild

out=target/ci/lm_eval
rm -rf "$out/runs"
python3 tests/lm_eval/make_data.py data/tinyshakespeare.txt "$out" 12
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
tasks=gptrs_paragraphs,gptrs_next_line
port=18184
server=
trap 'kill $server 2>/dev/null || true' EXIT

# check NAME CHECKPOINT CONTEXT EXTRA_MODEL_ARGS BATCH...
check() {
  local name=$1 checkpoint=$2 context=$3 extra=$4
  shift 4
  ./target/release/gpt-server --checkpoint "$checkpoint" --model-name "$name" --port $port --device cpu \
    > "$out/$name-server.log" 2>&1 &
  server=$!
  for _ in $(seq 100); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 0.2; done
  curl -sf http://127.0.0.1:$port/health >/dev/null || { echo "gpt-server did not start"; cat "$out/$name-server.log"; exit 1; }
  # lm-eval's max_length is the model's context (its default is 2048).
  local api="base_url=http://127.0.0.1:$port/v1/completions,model=$name,max_length=$context$extra"
  for batch in "$@"; do
    local run=$name-server-batch$batch
    "$venv/bin/lm_eval" --model local-completions --model_args "${api/prefix_token_id/custom_prefix_token_id}" \
      --batch_size "$batch" --tasks $tasks --include_path tests/lm_eval --output_path "$out/runs/$run" \
      --log_samples 2>&1 | tee "$out/$run.log"
    grep -q "remote tokenizer" "$out/$run.log" || { echo "lm-eval did not use the server's tokenizer"; exit 1; }
  done
  kill $server
  wait $server 2>/dev/null || true
  # lm-eval's windows through the API are max_length - 2 tokens long (one for the generated
  # token, one more in loglikelihood_rolling); the hf backend's are max_length.
  "$venv/bin/lm_eval" --model hf --device cpu --tasks $tasks --include_path tests/lm_eval \
    --model_args "pretrained=$checkpoint,max_length=$((context - 2)),dtype=float32$extra" \
    --output_path "$out/runs/$name-hf" --log_samples
  for batch in "$@"; do
    echo "== $name: lm-eval through gpt-server (batch $batch) vs lm-eval's hf backend"
    python3 tests/lm_eval/compare.py "$out/runs/$name-server-batch$batch" "$out/runs/$name-hf"
  done
}

check tiny-gpt2 tests/fixtures/tiny-gpt2 64 "" 1 8
check default weights 256 ",prefix_token_id=0" 8
# `--matmul-precision high` (bf16x3 on AMX tiles) where the CPU has AMX: the same scores within 1e-4.
if grep -qw amx_bf16 /proc/cpuinfo; then
  GPT_SERVER_MATMUL_PRECISION=high check default-high weights 256 ",prefix_token_id=0" 8
  grep -q "matmul_precision=high" "$out/default-high-server.log" || { echo "the server did not run at high precision"; exit 1; }
else
  echo "no AMX-BF16 on this machine: --matmul-precision high not checked against lm-eval"
fi
