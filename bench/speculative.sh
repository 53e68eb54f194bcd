#!/usr/bin/env bash
# Speculative decoding, side by side in one run (BENCHMARKS.md, "Speculative decoding"):
#  1. batch-1 greedy decoding of the default model: plain, with its draft (weights/draft), with
#     n-grams (model crate; plain and quoting prompts), and what a step over n tokens costs;
#  2. transformers' assisted generation on the same pair and prompts (its plain generate against
#     generate(assistant_model=...)), same threads;
#  3. the server by concurrency (1-16 streams), speculation allowed at every batch size, then
#     at 16 streams with the default --speculative-max-batch.
# Needs torch and transformers in python3. ROUNDS (default 3) for all.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${ROUNDS:-3}
threads=${THREADS:-$(nproc)}
echo "== $(date -u +%F) $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"
echo "== 1. model crate, batch 1"
ROUNDS=$rounds cargo bench -q -p gpt --bench speculative 2>&1 | grep -v "^$"
echo "== 2. transformers' assisted generation"
python3 bench/speculative_hf.py --rounds "$rounds" --threads "$threads" 2>&1 | grep -E "^\{|warning"
echo "== 3. server, by concurrency"
ROUNDS=$rounds cargo bench -q -p gpt-server --bench speculative -- 1 2 4 8 16 2>&1 | grep clients
ROUNDS=$((rounds * 2)) MAX_BATCH=default cargo bench -q -p gpt-server --bench speculative -- 16 2>&1 | grep clients
