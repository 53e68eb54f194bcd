#!/usr/bin/env bash
# The soak run (bench/soak.py): gpt-server on a checkpoint, its saturation on the mix measured
# with 32 clients in a closed loop, then MINUTES of the mixed load at LOAD (default 0.8) of it; the
# report goes to target/soak/.
#   [MINUTES=30] [CALIBRATE_SECS=60] [LOAD=0.8] [PREFIX_CACHE_MIB=16] bash bench/soak.sh [CHECKPOINT]
# (default: weights/; the prefix cache small enough that the run fills it to its bound)
# For a GPT-2-small-shaped checkpoint: python bench/make_random_gpt2.py TOKENIZER_JSON DIR, then bash
# bench/soak.sh DIR. CI runs MINUTES=3 CALIBRATE_SECS=30 LOAD=0.6 GATE="no 5xx,counters agree"
# PROBE_MINUTES=0 on the default model (GATE: the checks that decide the exit status; all by
# default). The drift probe (bench/soak_probe.py, PROBE_MINUTES, default 3) compares servers of
# different histories, each pair measured at the same time under the same load: a server
# started with the soaked one and left idle through the soak (the idle one), and two fresh
# servers started after it, each of the three warmed with a minute of the load. The load is
# sent in alternating windows to the soaked server and a fresh one (whether the soaked process
# is slower than a new one, which tells the server's drift from the machine's), to the idle one
# and the same fresh one (whether a difference comes from the load served or from the process's
# age alone), then to the two fresh ones (the comparison's own noise); their verdicts go to
# probe.txt. The script's status is the soak's, or with the probe bench/soak_verdict.py's (the
# soak's checks, a latency drift of its thirds judged the machine's when the soaked server is as
# fast as the fresh one: saturated throughput within 10%, ITL p50 within 20%), in verdict.json.
set -euo pipefail
cd "$(dirname "$0")/.."
checkpoint=${1:-weights}
minutes=${MINUTES:-30}
calibrate=${CALIBRATE_SECS:-60}
probe_minutes=${PROBE_MINUTES:-3}
name=$(basename "$checkpoint")
out=target/soak/$name
mkdir -p "$out"
rm -f "$out"/report.json "$out"/probe*.json "$out"/probe.txt "$out"/verdict.json # none of an earlier run
# The set .ci/run builds (cargo unifies features over the packages built together: gpt-server
# alone is another build, which had cost CI minutes twice over).
cargo build -q --release --locked -p gpt-server -p gpt-train
serve() { # PORT LOG: a server in the background, its pid in $!; then wait_healthy PORT
  ./target/release/gpt-server --checkpoint "$checkpoint" --model-name soak --port "$1" --device cpu \
    --prefix-cache-mib "${PREFIX_CACHE_MIB:-16}" > "$2" 2>&1 &
}
wait_healthy() {
  for _ in $(seq 300); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && break; sleep 0.2; done
}
port=${PORT:-18190}
fresh_port=$((port + 1)) twin_port=$((port + 2)) idle_port=$((port + 3))
serve "$port" "$out/server.log"
server=$!
pids=$server
trap 'kill $pids 2>/dev/null || true' EXIT
wait_healthy "$port"
if [ "$probe_minutes" -gt 0 ]; then
  serve "$idle_port" "$out/idle-server.log"
  idle=$!
  pids="$pids $idle"
  wait_healthy "$idle_port"
fi
url=http://127.0.0.1:$port
rate=$(python3 bench/soak.py "$url" --pid $server --model soak --calibrate \
  --minutes "$(python3 -c "print($calibrate / 60)")" | python3 -c "import json,sys; print(json.load(sys.stdin)['saturation_rps'])")
soak_rate=$(python3 -c "print(round(${LOAD:-0.8} * $rate, 3))")
echo "saturation ${rate} requests/s; soaking ${minutes} min at ${soak_rate} requests/s"
status=0
python3 bench/soak.py "$url" --pid $server --model soak --rate "$soak_rate" --minutes "$minutes" \
  --out "$out/report.json" ${GATE:+--gate "$GATE"} || status=$?
if [ "$probe_minutes" -gt 0 ]; then
  serve "$fresh_port" "$out/fresh-server.log"
  fresh=$!
  serve "$twin_port" "$out/twin-server.log"
  twin=$!
  pids="$pids $fresh $twin"
  wait_healthy "$fresh_port"
  wait_healthy "$twin_port"
  warm() { # PORT PID: a minute of the load fills its prefix cache
    python3 bench/soak.py "http://127.0.0.1:$1" --pid "$2" --model soak --rate "$soak_rate" --minutes 1 \
      --seed 1000 --out "$out/probe-warmup-$1.json" > /dev/null || true
  }
  warm "$fresh_port" $fresh
  warm "$twin_port" $twin
  warm "$idle_port" $idle
  probe() { # FIRST SECOND NAME LABELS
    python3 bench/soak_probe.py "$1" "$2" --model soak --rate "$soak_rate" --minutes "$probe_minutes" \
      --labels "$4" --out "$out/$3.json" | tee -a "$out/probe.txt" || true
  }
  : > "$out/probe.txt"
  echo "the soaked server vs a fresh one:" | tee -a "$out/probe.txt"
  probe "$url" "http://127.0.0.1:$fresh_port" probe-soaked-vs-fresh soaked,fresh
  echo "the idle server (started with the soaked one) vs the same fresh one:" | tee -a "$out/probe.txt"
  probe "http://127.0.0.1:$idle_port" "http://127.0.0.1:$fresh_port" probe-idle-vs-fresh idle,fresh
  echo "two fresh servers (the probe's noise):" | tee -a "$out/probe.txt"
  probe "http://127.0.0.1:$twin_port" "http://127.0.0.1:$fresh_port" probe-fresh-vs-fresh fresh2,fresh
  # The soak's checks read with the probe's answer: a latency drift of the thirds, with the soaked
  # server as fast as a fresh one at the same time, is the machine's.
  echo "the verdict (bench/soak_verdict.py):"
  verdict=("$out/report.json")
  [ -f "$out/probe-soaked-vs-fresh.json" ] && verdict+=("$out/probe-soaked-vs-fresh.json")
  status=0
  python3 bench/soak_verdict.py "${verdict[@]}" ${GATE:+--gate "$GATE"} --out "$out/verdict.json" || status=$?
fi
exit $status
