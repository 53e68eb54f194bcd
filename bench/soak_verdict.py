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
fresh one, given the same windows of the same requests in turn on the same machine, within 20%
(or 5 ms) of each other on every latency and neither answering a 5xx, and the move was the
machine's, not a drift of the server; otherwise it was the server's, or cannot be told from it,
and the check fails. Without a probe, the thirds decide alone.

Exit status 0 when every gated check (`--gate`, comma-separated; default all) passes.
"""
import argparse
import json
import sys

LATENCY = "latency steady"


def verdict(report, probe=None):
    """{check: (pass, detail)}: the report's checks, "latency steady" read with the probe (None:
    no probe ran) when the thirds failed it."""
    checks = {name: (c["pass"], c["detail"]) for name, c in report["checks"].items()}
    if LATENCY in checks and not checks[LATENCY][0] and probe is not None:
        thirds = checks[LATENCY][1]
        ratios = ", ".join(f"{k} {d['ratio']}x" for k, d in probe.get("latency", {}).items())
        if probe.get("pass"):
            checks[LATENCY] = (True, f"the thirds moved ({thirds}), but the soaked server against a fresh one at "
                                     f"the same time under the same load is within 20% ({ratios}): the machine's "
                                     f"move, not the server's")
        else:
            errors = probe.get("5xx_or_client_errors", {})
            checks[LATENCY] = (False, f"the thirds moved ({thirds}), and the soaked server against a fresh one at "
                                      f"the same time is not within 20% ({ratios}; 5xx or client errors {errors})")
    return checks


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("report")
    ap.add_argument("probe", nargs="?", default=None)
    ap.add_argument("--gate", default=None, help="comma-separated checks that decide the exit status (default: all)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    loaded = []
    for path in (args.report, args.probe):
        if path is None:
            loaded.append(None)
            continue
        try:
            with open(path) as f:
                loaded.append(json.load(f))
        except (OSError, ValueError) as e:
            sys.exit(f"{path}: {e}")
    report, probe = loaded
    if not isinstance(report.get("checks"), dict):
        sys.exit(f"{args.report}: no \"checks\" (not a bench/soak.py report)")
    checks = verdict(report, probe)
    gate = [g.strip() for g in args.gate.split(",")] if args.gate else list(checks)
    unknown = [g for g in gate if g not in checks]
    if unknown:
        sys.exit(f"--gate: no check named {unknown}; the checks are {list(checks)}")
    ok = all(checks[g][0] for g in gate)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"checks": {n: {"pass": p, "detail": d} for n, (p, d) in checks.items()},
                       "gate": gate, "pass": ok}, f, indent=1)
    for name, (passed, detail) in checks.items():
        print(f"{'PASS' if passed else 'FAIL'} {name}: {detail}")
    if probe is not None and report["checks"].get(LATENCY, {}).get("pass"):
        print("the soaked server against a fresh one (reported, the thirds passed): "
              + ", ".join(f"{k} {d['ratio']}x" for k, d in probe.get("latency", {}).items()))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
