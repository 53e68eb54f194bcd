#!/usr/bin/env bash
# Runs the candle and PyTorch CPU inference benchmarks back to back with the same thread count
# and prompt length and prints both results and the candle/PyTorch ratios.
#
#   [THREADS=2] [PREFILL=128] [PRECISION=highest|high] bash bench/inference.sh
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${THREADS:-$(nproc)}
cargo bench -q -p gpt --bench inference > /dev/null 2>&1 || true   # build first, off the clock
candle=$(RAYON_NUM_THREADS=$threads cargo bench -q -p gpt --bench inference 2>/dev/null | tail -1)
torch=$(python3 bench/torch_inference.py --threads "$threads" --prefill "${PREFILL:-128}" 2>/dev/null | tail -1)
echo "$candle"
echo "$torch"
python3 - "$candle" "$torch" <<'PY'
import json, sys
c, t = (json.loads(s) for s in sys.argv[1:3])
for k in ("prefill_tok_per_s", "decode_tok_per_s"):
    print(f"{k}: candle {c[k]:.1f}, pytorch {t[k]:.1f}, ratio {c[k] / t[k]:.2f}")
PY
