#!/usr/bin/env bash
# The soak run (bench/soak.py): gpt-server on a checkpoint, its saturation found by a short
# overload, then MINUTES of the mixed load at 80% of it; the report goes to target/soak/.
#   [MINUTES=30] [CALIBRATE_SECS=60] [PREFIX_CACHE_MIB=16] bash bench/soak.sh [CHECKPOINT]
# (default: weights/; the prefix cache small enough that the run fills it to its bound)
# For a GPT-2-small-shaped checkpoint: python bench/make_random_gpt2.py DIR, then bash
# bench/soak.sh DIR. CI runs MINUTES=3 CALIBRATE_SECS=30 GATE="no 5xx,counters agree" on the
# default model (GATE: the checks that decide the exit status; all by default).
set -euo pipefail
cd "$(dirname "$0")/.."
checkpoint=${1:-weights}
minutes=${MINUTES:-30}
calibrate=${CALIBRATE_SECS:-60}
name=$(basename "$checkpoint")
out=target/soak/$name
mkdir -p "$out"
cargo build -q --release --locked -p gpt-server
port=${PORT:-18190}
./target/release/gpt-server --checkpoint "$checkpoint" --model-name soak --port "$port" --device cpu \
  --prefix-cache-mib "${PREFIX_CACHE_MIB:-16}" \
  > "$out/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 300); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.2; done
url=http://127.0.0.1:$port
rate=$(python3 bench/soak.py "$url" --pid $server --model soak --calibrate --rate 40 \
  --minutes "$(python3 -c "print($calibrate / 60)")" | python3 -c "import json,sys; print(json.load(sys.stdin)['saturation_rps'])")
soak_rate=$(python3 -c "print(round(0.8 * $rate, 3))")
echo "saturation ${rate} requests/s; soaking ${minutes} min at ${soak_rate} requests/s"
python3 bench/soak.py "$url" --pid $server --model soak --rate "$soak_rate" --minutes "$minutes" \
  --out "$out/report.json" ${GATE:+--gate "$GATE"}
