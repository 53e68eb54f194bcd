"""Reads the guidellm reports bench/guidellm.sh wrote (<server>-<weights>-<profile>.json) and
draws, for every server and weight format, output tokens/s, median inter-token latency and p99
time to first token against the achieved request rate of the sweep; prints the Markdown tables
of BENCHMARKS.md (concurrent streams side by side, and each sweep's highest sustainable rate).

    python bench/guidellm_plot.py target/bench/guidellm docs/guidellm.png

Exits non-zero if any request errored.
"""
import json
import pathlib
import sys

SERVERS = ("gpt-server", "llama-server")


def points(path: pathlib.Path) -> list[dict]:
    """One row per benchmark of a guidellm report, with the figures its console table shows."""
    rows = []
    for b in json.loads(path.read_text())["benchmarks"]:
        m, strategy = b["metrics"], b["config"]["strategy"]
        rows.append({
            "strategy": strategy["type_"],
            "target_rate": strategy.get("rate"),
            "streams": strategy.get("streams"),
            "rate": m["requests_per_second"]["total"]["mean"],
            "output_tps": m["output_tokens_per_second"]["total"]["mean"],
            "itl_p50": m["inter_token_latency_ms"]["successful"]["median"],
            "ttft_p50": m["time_to_first_token_ms"]["successful"]["median"],
            "ttft_p99": m["time_to_first_token_ms"]["successful"]["percentiles"]["p99"],
            "ok": m["request_totals"]["successful"],
            "errored": m["request_totals"]["errored"],
        })
    return rows


def sustainable(rows: list[dict]) -> dict | None:
    """The sweep's highest constant rate that the server kept up with: no errors, and requests
    completed at no less than 90% of the rate they were sent."""
    kept = [r for r in rows if r["strategy"] in ("constant", "poisson") and not r["errored"]
            and r["rate"] >= 0.9 * r["target_rate"]]
    return max(kept, key=lambda r: r["target_rate"], default=None)


def main() -> None:
    out, png = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    reports = {}
    for path in sorted(out.glob("*.json")):
        server = next((s for s in SERVERS if path.stem.startswith(s + "-")), None)
        if server:
            weights, profile = path.stem[len(server) + 1:].rsplit("-", 1)
            reports[(server, weights, profile)] = points(path)
    weights = sorted({w for _, w, _ in reports})

    errored = sum(r["errored"] for rows in reports.values() for r in rows)
    print(f"\nerrored requests, all runs: {errored}")
    print("\n| weights | streams | gpt-server output tok/s | llama-server output tok/s | ratio "
          "| TTFT p99 gpt-server / llama-server (ms) |")
    print("|---|---|---|---|---|---|")
    for w in weights:
        ours = {r["streams"]: r for r in reports.get(("gpt-server", w, "concurrent"), [])}
        theirs = {r["streams"]: r for r in reports.get(("llama-server", w, "concurrent"), [])}
        for n in sorted(set(ours) | set(theirs)):
            a, b = ours.get(n), theirs.get(n)
            ratio = f"{a['output_tps'] / b['output_tps']:.2f}x" if a and b and b["output_tps"] else "-"
            f = lambda r, k: f"{r[k]:.1f}" if r else "-"
            print(f"| {w} | {n} | {f(a, 'output_tps')} | {f(b, 'output_tps')} | {ratio} "
                  f"| {f(a, 'ttft_p99')} / {f(b, 'ttft_p99')} |")
    print("\n| weights | server | highest sustainable rate (req/s) | output tok/s there | TTFT p99 there (ms) "
          "| ITL p50 there (ms) |")
    print("|---|---|---|---|---|---|")
    for w in weights:
        for s in SERVERS:
            top = sustainable(reports.get((s, w, "sweep"), []))
            if top:
                print(f"| {w} | {s} | {top['target_rate']:.2f} | {top['output_tps']:.1f} "
                      f"| {top['ttft_p99']:.0f} | {top['itl_p50']:.1f} |")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = [("output_tps", "output tokens/s"), ("itl_p50", "inter-token latency p50 (ms)"),
              ("ttft_p99", "time to first token p99 (ms)")]
    colors = {"gpt-server": "#0077b6", "llama-server": "#d00000"}
    for ax, (key, label) in zip(axes, panels):
        for (s, w, profile), rows in sorted(reports.items()):
            if profile != "sweep":
                continue
            rows = sorted((r for r in rows if r["strategy"] != "throughput"), key=lambda r: r["rate"])
            ax.plot([r["rate"] for r in rows], [r[key] for r in rows], marker="o", color=colors[s],
                    linestyle="-" if w == weights[0] else "--", label=f"{s} {w}")
        ax.set_xlabel("achieved request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[2].set_yscale("log")
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend()
    fig.suptitle("guidellm sweep, GPT-2-small shape, 128-token prompts, 64 output tokens, 2 cores")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    print(f"\nwrote {png}")
    if errored:
        sys.exit(f"guidellm saw {errored} errored requests")


if __name__ == "__main__":
    main()
