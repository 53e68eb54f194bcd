#!/usr/bin/env bash
# Fuzzes gpt-server through its own OpenAPI document with schemathesis (PyPI): every request the
# document calls valid must be accepted, every invalid one refused with a 4xx, no 5xx, every
# response as documented; then the server must still answer. Rerun alone with
# `.ci/schemathesis.sh` (SEED=... MAX_EXAMPLES=... to vary the run).
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${SCHEMATHESIS_VENV:-target/ci/venv-schemathesis}
if [ ! -x "$venv/bin/st" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "schemathesis==4.32.5"
fi
[ "${SETUP_ONLY:-}" = 1 ] && exit 0  # (.ci/prefetch.sh: the environment made, nothing run)
cargo build --release --locked -p gpt-server -p gpt-train

# A tiny model with a long context, trained for one step with the fixture's byte-level BPE: the
# one limit JSON Schema cannot state is a string prompt's length in tokens, and 4096 positions hold
# the longest strings the fuzzer sends. --max-tokens-cap keeps its largest requests quick.
mkdir -p target/ci
model=target/ci/fuzz-model
if [ ! -f "$model/latest/config.json" ]; then
  ./target/release/gpt-train train --data data/tinyshakespeare.txt --out "$model" \
    --tokenizer tests/fixtures/tiny-gpt2/tokenizer.json --n-layer 1 --n-head 2 --n-embd 32 \
    --block-size 4096 --batch-size 1 --max-iters 1 --eval-iters 1 --eval-interval 1 >/dev/null
fi

port=18183
./target/release/gpt-server --checkpoint "$model/latest" --port $port --device cpu --max-tokens-cap 16 \
  > target/ci/schemathesis-server.log 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 100); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 0.2; done
curl -sf http://127.0.0.1:$port/health >/dev/null || { echo "gpt-server did not start"; cat target/ci/schemathesis-server.log; exit 1; }

"$venv/bin/st" --config-file .ci/schemathesis.toml run "http://127.0.0.1:$port/openapi.json" --max-examples "${MAX_EXAMPLES:-300}" --seed "${SEED:-1}"
curl -sf http://127.0.0.1:$port/health >/dev/null || { echo "gpt-server died under the fuzzer"; cat target/ci/schemathesis-server.log; exit 1; }
echo "schemathesis: no failures, and the server is alive"
