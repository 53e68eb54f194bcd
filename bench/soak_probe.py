"""Compares the latencies of a soaked gpt-server with a fresh one, from `bench/soak.py` reports
of the same load run against each in turn (`bench/soak.sh` does this after the soak).

    python3 bench/soak_probe.py probe-fresh-1.json probe-soaked-1.json [probe-fresh-2.json ...]

A server that drifts (slower steps, a cache that degrades, a leak that costs time) is slower than
a fresh process started on the same machine and measured right beside it; a machine whose speed
drifts slows both alike. The reports alternate fresh, soaked, fresh, soaked, ...; for each pair
and each of TTFT and inter-token latency p50 and p99 over the whole run it prints soaked / fresh,
and at the end whether every ratio is within 20% (exit status 0) or not (1).
"""
import json
import sys


def main():
    paths = sys.argv[1:]
    if not paths or len(paths) % 2:
        sys.exit("usage: soak_probe.py FRESH SOAKED [FRESH SOAKED ...]")
    keys = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99")
    worst, rows = 0.0, []
    for i in range(0, len(paths), 2):
        fresh, soaked = (json.load(open(p))["overall"] for p in paths[i:i + 2])
        row = {"round": i // 2 + 1}
        for k in keys:
            if fresh.get(k) and soaked.get(k):
                ratio = soaked[k] / fresh[k]
                row[k] = f"{soaked[k] * 1000:.1f} / {fresh[k] * 1000:.1f} ms = {ratio:.2f}"
                worst = max(worst, abs(ratio - 1.0))
        rows.append(row)
        print(json.dumps(row))
    ok = worst <= 0.2
    print(f"{'PASS' if ok else 'FAIL'} soaked vs fresh: the largest departure of a ratio from 1 is {worst:.0%} "
          "(limit 20%)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
