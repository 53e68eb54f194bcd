#!/usr/bin/env bash
# The soak run (bench/soak.py): gpt-server on a checkpoint, its saturation on the mix measured
# with 32 clients in a closed loop, then MINUTES of the mixed load at 80% of it; the report goes
# to target/soak/.
#   [MINUTES=30] [CALIBRATE_SECS=60] [PREFIX_CACHE_MIB=16] bash bench/soak.sh [CHECKPOINT]
# (default: weights/; the prefix cache small enough that the run fills it to its bound)
# For a GPT-2-small-shaped checkpoint: python bench/make_random_gpt2.py DIR, then bash
# bench/soak.sh DIR. CI runs MINUTES=3 CALIBRATE_SECS=30 GATE="no 5xx,counters agree"
# PROBE_ROUNDS=0 on the default model (GATE: the checks that decide the exit status; all by
# default). After the soak, PROBE_ROUNDS (default 2) rounds of PROBE_MINUTES (default 1) of the
# same load against a fresh server started beside the soaked one, then against the soaked one
# (bench/soak_probe.py): whether the soaked process is slower than a new one measured at the same
# time, which tells the server's drift from the machine's. The soak's status is the script's.
set -euo pipefail
cd "$(dirname "$0")/.."
checkpoint=${1:-weights}
minutes=${MINUTES:-30}
calibrate=${CALIBRATE_SECS:-60}
name=$(basename "$checkpoint")
out=target/soak/$name
mkdir -p "$out"
cargo build -q --release --locked -p gpt-server
serve() { # PORT LOG: a server in the background, its pid in $!; then wait_healthy PORT
  ./target/release/gpt-server --checkpoint "$checkpoint" --model-name soak --port "$1" --device cpu \
    --prefix-cache-mib "${PREFIX_CACHE_MIB:-16}" > "$2" 2>&1 &
}
wait_healthy() {
  for _ in $(seq 300); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && break; sleep 0.2; done
}
port=${PORT:-18190}
serve "$port" "$out/server.log"
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
wait_healthy "$port"
url=http://127.0.0.1:$port
rate=$(python3 bench/soak.py "$url" --pid $server --model soak --calibrate \
  --minutes "$(python3 -c "print($calibrate / 60)")" | python3 -c "import json,sys; print(json.load(sys.stdin)['saturation_rps'])")
soak_rate=$(python3 -c "print(round(0.8 * $rate, 3))")
echo "saturation ${rate} requests/s; soaking ${minutes} min at ${soak_rate} requests/s"
status=0
python3 bench/soak.py "$url" --pid $server --model soak --rate "$soak_rate" --minutes "$minutes" \
  --out "$out/report.json" ${GATE:+--gate "$GATE"} || status=$?
rounds=${PROBE_ROUNDS:-2}
if [ "$rounds" -gt 0 ]; then
  fresh_port=$((port + 1))
  serve "$fresh_port" "$out/fresh-server.log"
  fresh=$!
  trap 'kill $server $fresh 2>/dev/null || true' EXIT
  wait_healthy "$fresh_port"
  probe() { # URL PID SEED OUT: one probe run; its own checks are not the point here
    python3 bench/soak.py "$1" --pid "$2" --model soak --rate "$soak_rate" --minutes "${PROBE_MINUTES:-1}" \
      --seed "$3" --out "$4" > /dev/null || true
  }
  probe "http://127.0.0.1:$fresh_port" $fresh 1000 "$out/probe-warmup.json" # fills its prefix cache
  reports=()
  for r in $(seq "$rounds"); do # the same requests to each, in a round
    probe "http://127.0.0.1:$fresh_port" $fresh $((1000 + r)) "$out/probe-fresh-$r.json"
    probe "$url" $server $((1000 + r)) "$out/probe-soaked-$r.json"
    reports+=("$out/probe-fresh-$r.json" "$out/probe-soaked-$r.json")
  done
  python3 bench/soak_probe.py "${reports[@]}" | tee "$out/probe.txt" || true
fi
exit $status
