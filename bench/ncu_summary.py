"""GPU time per kernel from Nsight Compute's raw CSV (`ncu --metrics gpu__time_duration.sum --csv
--page raw --log-file FILE PROGRAM`), summed by kernel name and divided by the number of steps
the program ran: where a training step's GPU time goes.

    python3 bench/ncu_summary.py NCU_CSV [STEPS]
"""
import collections
import csv
import sys


def main():
    path, steps = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
    rows = [r for r in csv.reader(open(path)) if r]
    head = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
    if head is None:
        sys.exit(f"{path}: no kernel table (did ncu profile anything?)")
    cols = rows[head]
    name, dur = cols.index("Kernel Name"), cols.index("gpu__time_duration.sum")
    units = rows[head + 1][dur] if len(rows) > head + 1 else "ns"
    scale = {"ns": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0, "nsecond": 1e-6}.get(units, 1e-6)
    per = collections.defaultdict(lambda: [0, 0.0])
    for r in rows[head + 1:]:
        if len(r) != len(cols):
            continue
        try:
            ms = float(r[dur].replace(",", "")) * scale
        except ValueError:
            continue  # the units row
        k = r[name].split("(")[0][:72]
        per[k][0] += 1
        per[k][1] += ms
    total = sum(v[1] for v in per.values())
    launches = sum(v[0] for v in per.values())
    print(f"{launches / steps:.0f} kernels and {total / steps:.2f} ms of GPU time per step ({steps:g} steps)")
    for k, (n, ms) in sorted(per.items(), key=lambda kv: -kv[1][1])[:25]:
        print(f"{ms / steps:8.3f} ms {100 * ms / max(total, 1e-12):5.1f}% {n / steps:6.0f}x  {k}")


if __name__ == "__main__":
    main()
