"""The soak's verdict, its own checks read with the drift probe's answer (`bench/soak.sh` runs this
last when it ran the probe).

    python3 bench/soak_verdict.py REPORT [PROBE] [--gate CHECKS] [--out verdict.json]

REPORT is `bench/soak.py`'s report, PROBE `bench/soak_probe.py`'s of the soaked server against a
fresh one. Every check of the report stands as it is but one: latency drift. The soak judges it
by the run's last third against its first, which compares the server at two times and the machine
at two times: on a 2-core virtual machine with nothing stolen by the hypervisor, the same replayed
minute of requests came 26-29% faster in TTFT at the end of a run than at its start, as a fixed
piece of work in the load generator sped up by 8% (BENCHMARKS.md, "Soak"): at 80% of saturation
the queue turns a few percent of the machine's speed into tens of percent of latency. So when the
thirds moved by more than 20%, the probe decides whose the move was: the soaked server and a
fresh one, given the same windows of the same requests in turn on the same machine, and then the
same saturating load. The move was the machine's, not a drift of the server, when the soaked
server's saturated throughput is within 10% of the fresh one's, its inter-token latency (p50)
within 20%, and neither answered a 5xx; otherwise it was the server's, or cannot be told from
it, and the check fails. The probe's TTFT and p99s do not decide: they carry the queue's bursts
in a few minutes of windows (TTFT p99 0.40x between two fresh servers; 0.56x between a soaked and
a fresh one whose saturated throughput was 1% apart; BENCHMARKS.md, "Soak"). Without a probe,
the thirds decide alone.

Exit status 0 when every gated check (`--gate`, comma-separated; default all) passes.
"""
import argparse
import json
import sys

import soak

LATENCY = "latency steady"


def as_fast_as_fresh(probe):
    """(pass, detail): the probe's soaked server as fast as a fresh one at the same time, by its
    saturated throughput (within 10%) and its ITL p50 (within 20%), with no 5xx."""
    latency = probe.get("latency", {})
    itl = latency.get("itl_p50", {}).get("ratio")
    saturated = (probe.get("saturated") or {}).get("time_ratio")
    errors = probe.get("5xx_or_client_errors", {})
    ok = (itl is not None and saturated is not None and 1 / 1.2 <= itl <= 1.2
          and 1 / 1.1 <= saturated <= 1.1 and not any(errors.values()))
    ratios = ", ".join(f"{k} {d['ratio']}x" for k, d in latency.items())
    return ok, (f"saturated time {saturated}x, ITL p50 {itl}x (TTFT and p99s, reported: {ratios}); "
                f"5xx or client errors {errors}")


def verdict(report, probe=None):
    """{check: (pass, detail)}: the report's checks, "latency steady" read with the probe (None:
    no probe ran) when the thirds failed it."""
    checks = {name: (c["pass"], c["detail"]) for name, c in report["checks"].items()}
    if LATENCY in checks and not checks[LATENCY][0] and probe is not None:
        ok, detail = as_fast_as_fresh(probe)
        how, whose = ("but the soaked server is", ": the machine's move, not the server's") if ok else \
            ("and the soaked server is not", "")
        checks[LATENCY] = (ok, f"the thirds moved ({checks[LATENCY][1]}), {how} as fast as a fresh one at the "
                               f"same time ({detail}){whose}")
    return checks


def load(path):
    """The JSON object at `path`; exits naming the file when it cannot be read or is not an object."""
    try:
        with open(path) as f:
            loaded = json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"{path}: {e}")
    if not isinstance(loaded, dict):
        sys.exit(f"{path}: not a JSON object (a bench/soak.py or bench/soak_probe.py report)")
    return loaded


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("report")
    ap.add_argument("probe", nargs="?", default=None)
    ap.add_argument("--gate", default=None, help="comma-separated checks that decide the exit status (default: all)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    report = load(args.report)
    probe = load(args.probe) if args.probe else None
    if not isinstance(report.get("checks"), dict):
        sys.exit(f"{args.report}: no \"checks\" (not a bench/soak.py report)")
    checks = verdict(report, probe)
    gate, ok = soak.gated(checks, args.gate)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"checks": {n: {"pass": p, "detail": d} for n, (p, d) in checks.items()},
                       "gate": gate, "pass": ok}, f, indent=1)
    for name, (passed, detail) in checks.items():
        print(f"{'PASS' if passed else 'FAIL'} {name}: {detail}")
    if probe is not None and report["checks"].get(LATENCY, {}).get("pass"):
        print(f"the soaked server against a fresh one (reported, the thirds passed): {as_fast_as_fresh(probe)[1]}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
