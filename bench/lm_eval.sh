#!/usr/bin/env bash
# lm-evaluation-harness's rolling perplexity over N paragraphs of tinyshakespeare (default 200) on
# a GPT-2-small-shaped checkpoint with random weights and GPT-2's BPE: wall time through
# gpt-server (lm-eval's batch of 8 prompts per request) against lm-eval's hf backend, side by
# side on this machine, and their scores compared (1e-4 relative).
#
#   [GPT_SERVER_MATMUL_PRECISION=high] [GPT_SERVER_DTYPE=bf16 HF_DTYPE=bfloat16] bash bench/lm_eval.sh [N]
# (HF_DTYPE: the hf backend's dtype, default float32; a score mismatch fails the script after the
# timings are printed)
# Needs: target/gpt2-tokenizer (made by .ci/run), and the venv of .ci/lm_eval.sh (LM_EVAL_VENV).
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-200}
venv=${LM_EVAL_VENV:-target/ci/venv-lm-eval}
out=target/bench/lm_eval
model=target/bench/gpt2-random
[ -f "$model/config.json" ] || "$venv/bin/python" bench/make_random_gpt2.py target/gpt2-tokenizer/tokenizer.json "$model"
cargo build --release --locked -p gpt-server -p gpt-train  # the same set as .ci/run builds: no rebuild
rm -rf "$out/runs"
python3 tests/lm_eval/make_data.py data/tinyshakespeare.txt "$out" "$n"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
lm_eval() { "$venv/bin/lm_eval" --tasks gptrs_paragraphs --include_path tests/lm_eval --log_samples "$@"; }
# The task reads its data from target/ci/lm_eval: point it at this run's paragraphs.
mkdir -p target/ci/lm_eval && cp "$out/paragraphs.jsonl" target/ci/lm_eval/paragraphs.jsonl

port=18185
./target/release/gpt-server --checkpoint "$model" --model-name gpt2-random --port $port --device cpu \
  > "$out/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 300); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 0.2; done

t0=$(date +%s.%N)
lm_eval --model local-completions --batch_size 8 --output_path "$out/runs/server" \
  --model_args base_url=http://127.0.0.1:$port/v1/completions,model=gpt2-random,max_length=1024 > "$out/server-run.log" 2>&1
t1=$(date +%s.%N)
kill $server; wait $server 2>/dev/null || true
lm_eval --model hf --device cpu --output_path "$out/runs/hf" \
  --model_args pretrained=$model,dtype=${HF_DTYPE:-float32} > "$out/hf-run.log" 2>&1
t2=$(date +%s.%N)
compared=0
python3 tests/lm_eval/compare.py "$out/runs/server" "$out/runs/hf" || compared=$?
python3 - "$t0" "$t1" "$t2" "$n" "$out/server.log" "$out/server-run.log" "$out/hf-run.log" <<'PY'
import re, sys
from datetime import datetime
t0, t1, t2, n = map(float, sys.argv[1:5])
s, h = t1 - t0, t2 - t1
print(f"{int(n)} paragraphs: gpt-server {s:.1f} s, hf backend {h:.1f} s, speed-up {h / s:.2f}x")
# Where the server command's time went, from the server's request log: lm-eval's start-up before
# its first request, the requests (the server's own latency summed), and lm-eval's work after
# the last one.
line = re.compile(r"^(\S+)Z .*path=(\S+)}.*finished processing request latency=(\d+) ms")
spans = []
for entry in open(sys.argv[5]):
    if (m := line.match(entry)) and m[2] != "/health":
        end = datetime.fromisoformat(m[1] + "+00:00").timestamp()
        spans.append((end - int(m[3]) / 1e3, end, m[2], int(m[3]) / 1e3))
if spans:
    first, last = spans[0][0], spans[-1][1]
    busy = sum(d for *_, p, d in spans if p == "/v1/completions")
    print(f"gpt-server command: {first - t0:.1f} s before lm-eval's first request, "
          f"{last - first:.1f} s of requests ({busy:.2f} s inside the server's completions), "
          f"{t1 - last:.1f} s after the last")
# Both commands' scoring phase alike, from lm-eval's own log (whole seconds): from "Running
# loglikelihood_rolling requests" to "Saving results", everything else being lm-eval's start-up
# (and the hf backend's model loading) and its writing of the results.
stamp = re.compile(r"(\d{4}-\d\d-\d\d:\d\d:\d\d:\d\d) \w+ +\[[^]]*\] (Running loglikelihood_rolling|Saving results)")
def phase(log):
    marks = {}
    for m in stamp.finditer(open(log, errors="replace").read()):
        marks.setdefault(m[2], datetime.strptime(m[1], "%Y-%m-%d:%H:%M:%S").timestamp())
    return marks["Saving results"] - marks["Running loglikelihood_rolling"] if len(marks) == 2 else float("nan")
ps, ph = phase(sys.argv[6]), phase(sys.argv[7])
print(f"scoring phase (lm-eval's log, whole seconds): gpt-server {ps:.0f} s, hf backend {ph:.0f} s, "
      f"{ph / ps:.2f}x; the rest: {s - ps:.0f} s and {h - ph:.0f} s")
PY
exit $compared
