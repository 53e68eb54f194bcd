#!/usr/bin/env bash
# The CPU benchmark against llama.cpp, side by side on this machine, from a clean checkout:
#   1. builds llama.cpp's llama-bench and llama-quantize from the llama-cpp-python source package
#      on PyPI (it bundles llama.cpp), under target/bench/llamacpp (never committed);
#   2. writes a GPT-2-small-shaped checkpoint with random weights (bench/make_random_gpt2.py, with
#      GPT-2's tokenizer as .ci/run makes it), converts it with llama.cpp's convert_hf_to_gguf.py
#      (f32, f16) and quantizes it (q8_0, q4_0);
#   3. prefill (128 tokens) and decode (128 tokens) tokens/s at batch 1 on all cores: llama-bench
#      against `cargo bench -p gpt --bench inference` in each weight format;
#   4. gpt-server: 1, 4 and 16 concurrent streams and the time to first token with a cached
#      512-token prefix against cold (`cargo bench -p gpt-server --bench concurrency`).
# Prints a Markdown table and the raw JSON lines (also in target/bench/llamacpp/results.jsonl).
#
#   bash bench/cpu_llamacpp.sh
# Needs what bench/llamacpp_setup.sh says.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/llamacpp_setup.sh
results=$work/results.jsonl
: > "$results"

# 1. llama.cpp
llama_cpp_build llama-bench llama-quantize

# 2. The checkpoint, converted and quantized
gpt2_checkpoint f32 f16 q8_0 q4_0

# 3. Batch-1 prefill and decode, each format, llama.cpp then gpt-rs
cargo bench -q -p gpt --bench inference --no-run 2>/dev/null
cargo bench -q -p gpt-server --bench concurrency --no-run 2>/dev/null
for w in f32 f16 bf16 q8_0 q4_0; do
  if [ -f "$work/gpt2-$w.gguf" ]; then
    "$work/build/bin/llama-bench" -m "$work/gpt2-$w.gguf" -p 128 -n 128 -t "$threads" -r 3 -o jsonl 2>/dev/null |
      "$py" -c "import json,sys
for l in sys.stdin:
    d = json.loads(l); kind = 'prefill_tok_per_s' if d['n_prompt'] else 'decode_tok_per_s'
    print(json.dumps({'impl': 'llama.cpp', 'weights': '$w', kind: d['avg_ts']}))" >> "$results"
  fi
  WEIGHTS=$w PREFILL=128 NEW_TOKENS=128 RAYON_NUM_THREADS=$threads \
    cargo bench -q -p gpt --bench inference 2>/dev/null | tail -1 >> "$results"
done

# 4. Serving: concurrent streams and a cached prefix
cargo bench -q -p gpt-server --bench concurrency -- 64 1 4 16 2>/dev/null | grep '^{' >> "$results"

cat "$results"
"$py" - "$results" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
table = {}
for r in rows:
    if "impl" in r:
        t = table.setdefault(r["weights"], {})
        for k in ("prefill_tok_per_s", "decode_tok_per_s"):
            if k in r:
                t[(r["impl"], k)] = r[k]
print("\n| weights | gpt-rs prefill | llama.cpp prefill | gpt-rs decode | llama.cpp decode | decode ratio |")
print("|---|---|---|---|---|---|")
f = lambda v: "-" if v is None else f"{v:.1f}"
for w, t in table.items():
    g, l = t.get(("candle", "decode_tok_per_s")), t.get(("llama.cpp", "decode_tok_per_s"))
    print(f"| {w} | {f(t.get(('candle', 'prefill_tok_per_s')))} | {f(t.get(('llama.cpp', 'prefill_tok_per_s')))} "
          f"| {f(g)} | {f(l)} | {'-' if not (g and l) else f'{g / l:.2f}'} |")
PY
