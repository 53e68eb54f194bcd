"""Whether a soaked gpt-server has drifted: its latencies against a fresh server's, both measured
at the same time under the soak's load (`bench/soak.sh` runs this after the soak).

    python3 bench/soak_probe.py SOAKED_URL FRESH_URL --rate R [--minutes 3] [--window 10] [--out probe.json]

A drift is a server slower (or faster) than it was at its start. Comparing a soak's last minutes
with its first compares two different machines on a shared host: on the 2-core machine of
BENCHMARKS.md ("Soak") the same minute of requests, replayed, had an ITL p50 of 4.4 ms in one
minute and 7.1 ms in another, and at 80% of saturation the queue turns such moves into TTFT p99s
2.6x apart. So the soaked server is compared with a server at its start, a fresh process, on the
same machine at the same time. The soak's load (its replayed minute of requests, at its rate) is
cut into windows of `--window` seconds; each window is sent to one server, then, once that
server has finished it, to the other, the two strictly alternating (`schedule`). Both servers
get the same requests at the same offsets, never at once (the idle one's threads sleep), and a
change of the machine's speed slower than a window or two falls on both alike. Each window
starts on an idle server, so its latencies run a little below the soak's. The first window is
sent to each server once before any is measured (warm-up).

For each of TTFT and inter-token latency, p50 and p99 over the streams each server served:
soaked / fresh; reported beside them, not judged, each server's engine step time (wall, from
`gpt_step_duration_seconds`) and CPU time (the process found by the port it listens on, or
`--pids`) per token it processed (prompt and generated, from `/metrics`), which the queue does
not move: whether a slower server is slower at the same work. Both understate a difference:
the server's threads spin between steps, so a faster one spins for longer, and a slower one
batches more sequences per step, each step doing more tokens for its time. So, last, each
server's saturated throughput: the same list of requests (about 10 s of work) sent by 32 clients
in a closed loop, to one server and then the other, `--saturated-rounds` times each: time
soaked / fresh, neither amplified by a queue nor flattened by batching. Pass (exit status 0)
when each latency is within 20% (or 5 ms) and neither server answered a 5xx. Two servers of
the same age measured this way (both fresh: `bench/soak.sh` does this after the soaked and idle
ones) show the comparison's own noise. Standard library only, as `bench/soak.py`, whose
requests it sends.
"""
import argparse
import json
import math
import os
import random
import sys
import threading
import time
import urllib.parse

import soak


def windows(plan, window):
    """The replayed minute's arrivals cut into windows of `window` seconds: [[(offset, request)]]."""
    out = [[] for _ in range(max(1, math.ceil(60.0 / window)))]
    for offset, req in plan:
        out[min(len(out) - 1, int(offset // window))].append((offset, req))
    return out


def schedule(minutes, n):
    """The order the windows are sent in: [(server, minute, window)], the two servers strictly
    alternating, each window to server 0 and then to server 1. So each of a server's runs follows
    one run of the other's, and both have as many. (An order that alternated which server went
    first from window to window gave one server a run of one window where the other had two back
    to back, and one run more: the server named first came out slower in 7 of 8 one-minute pairs,
    BENCHMARKS.md, "Soak".)"""
    return [(i, m, w) for m in range(minutes) for w in range(n) for i in (0, 1)]


def listening_pid(url):
    """The pid of the process listening on `url`'s port (Linux: the listening sockets of
    /proc/net/tcp and tcp6, then the process holding one), or None."""
    port = urllib.parse.urlsplit(url).port
    sockets = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                for line in list(f)[1:]:
                    cols = line.split()
                    if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                        sockets.add(f"socket:[{cols[9]}]")
        except OSError:
            continue
    for pid in filter(str.isdigit, os.listdir("/proc")) if sockets else ():
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in sockets for fd in os.listdir(f"/proc/{pid}/fd")):
                return int(pid)
        except OSError:
            continue
    return None


def work(url, pid):
    """(the server's CPU seconds, or None without its pid; the tokens it has processed: prompt and
    generated; the wall time its engine has spent in steps), or None without its /metrics."""
    try:
        m = soak.metrics(url)
    except OSError:
        return None
    cpu = soak.cpu_sample(pid)[3] if pid is not None else None
    return (cpu, m.get("gpt_prompt_tokens_total", 0) + m.get("gpt_generated_tokens_total", 0),
            m.get("gpt_step_duration_seconds_sum", 0.0))


def per_token(before, after):
    """Between two `work` readings: {tokens, cpu_s, cpu_ms_per_1k_tokens, step_s,
    step_ms_per_1k_tokens} (the CPU figures None without the pid), or None."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    tokens, step = after[1] - before[1], after[2] - before[2]
    cpu = after[0] - before[0] if after[0] is not None and before[0] is not None else None
    return {"tokens": int(tokens),
            "cpu_s": round(cpu, 2) if cpu is not None else None,
            "cpu_ms_per_1k_tokens": round(1e6 * cpu / tokens, 1) if cpu is not None else None,
            "step_s": round(step, 3), "step_ms_per_1k_tokens": round(1e6 * step / tokens, 1)}


def saturated(url, work, model, concurrency):
    """Seconds `concurrency` clients take to send `work` (the same list of requests each time, a
    closed loop: each client sends its next request when its last one has ended) to `url`, and
    the 5xx or client errors among them."""
    stats, queue, lock = soak.Stats(), list(reversed(work)), threading.Lock()

    def client():
        while True:
            with lock:
                if not queue:
                    return
                path, body, stream, drop = queue.pop()
            soak.request(url, path, body, model, stats, 0, stream, drop)

    start = time.monotonic()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    return time.monotonic() - start, len(stats.errors)  # each 5xx and each client failure


def compare(soaked, fresh):
    """soaked / fresh for each latency, with the check: ({latency: {...}}, pass, detail)."""
    out, moved = {}, []
    for k in soak.LATENCIES:
        a, b = fresh.get(k), soaked.get(k)
        if a is None or b is None:
            moved.append(f"{k}: no streams")
            continue
        out[k] = {"soaked": b, "fresh": a, "ratio": round(b / a, 3) if a else None}
        if not soak.close(a, b):
            moved.append(f"{k} {b * 1000:.1f} ms vs {a * 1000:.1f} ms ({b / a:.2f}x)")
    detail = "; ".join(moved) or "each latency of the first server within 20% of the second's: " + ", ".join(
        f"{k} {d['ratio']}x" for k, d in out.items())
    return out, not moved, detail


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("soaked")
    ap.add_argument("fresh")
    ap.add_argument("--rate", type=float, required=True, help="requests per second (the soak's)")
    ap.add_argument("--minutes", type=int, default=3,
                    help="times the minute of requests is sent to each server (default 3)")
    ap.add_argument("--window", type=float, default=10.0,
                    help="seconds of the minute's arrivals sent to one server, then to the other (default 10)")
    ap.add_argument("--spacing", choices=("poisson", "even"), default="poisson")
    ap.add_argument("--model", default=None)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--labels", default="soaked,fresh", help="the two servers' names in the printout")
    ap.add_argument("--saturated-rounds", type=int, default=3,
                    help="rounds of the same requests sent to each server in turn by 32 clients in a "
                         "closed loop, for its throughput (default 3; 0: none)")
    ap.add_argument("--pids", default=None,
                    help="the two servers' pids, comma-separated (default: the processes listening on their ports)")
    args = ap.parse_args()
    labels = args.labels.split(",")
    if len(labels) != 2:
        sys.exit(f"--labels {args.labels!r}: two names, comma-separated")
    if args.minutes < 1:
        sys.exit(f"--minutes {args.minutes}: 1 or more")
    if not 1 <= args.window <= 60:
        sys.exit(f"--window {args.window}: between 1 and 60 seconds")
    urls = (args.soaked, args.fresh)
    pids = [int(p) for p in args.pids.split(",")] if args.pids else [listening_pid(u) for u in urls]
    if len(pids) != 2:
        sys.exit(f"--pids {args.pids!r}: two pids, comma-separated")
    pool = soak.prefixes(args.soaked)
    plan = soak.arrivals(random.Random(args.seed), args.rate, pool, 60.0, args.spacing)
    cut = windows(plan, args.window)

    def send(i, w, stats):
        """Window `w`'s arrivals to server `i`, at their offsets; returns once it has served them
        all, so that one server is loaded at a time."""
        start = time.monotonic() - w * args.window
        threads = []
        for offset, (path, body, stream, drop) in cut[w]:
            time.sleep(max(0.0, start + offset - time.monotonic()))
            t = threading.Thread(target=soak.request, daemon=True,
                                 args=(urls[i], path, body, args.model, stats, 0, stream, drop))
            t.start()
            threads.append(t)
        for t in threads:
            t.join(timeout=600)

    # Warm-up, not counted: the first window to each server, so that the first measured window
    # carries neither the client's own start nor whatever a server idled into before the probe.
    for i in (0, 1):
        send(i, 0, soak.Stats())
    stats = (soak.Stats(), soak.Stats())
    before = [work(u, p) for u, p in zip(urls, pids)]
    for i, _, w in schedule(args.minutes, len(cut)):
        send(i, w, stats[i])
    used = [per_token(b, work(u, p)) for b, u, p in zip(before, urls, pids)]
    # Throughput: about 10 s of a saturated server's work (the rate is 80% of its saturation).
    rng = random.Random(args.seed + 1)
    batch = [soak.pick(rng, pool) for _ in range(max(32, round(args.rate / 0.8 * 10)))]
    elapsed, failed = [0.0, 0.0], [0, 0]
    for r in range(args.saturated_rounds):
        for i in (0, 1):
            seconds, bad = saturated(urls[i], batch, args.model, 32)
            elapsed[i] += seconds
            failed[i] += bad
    soaked, fresh = soak.overall(stats[0]), soak.overall(stats[1])
    ratios, ok, detail = compare(soaked, fresh)
    fivexx = [len(s.errors) + f for s, f in zip(stats, failed)]  # `soak.request` lists each 5xx there
    throughput = None
    if args.saturated_rounds and all(elapsed):
        rps = [round(len(batch) * args.saturated_rounds / e, 2) for e in elapsed]
        throughput = {"requests": len(batch), "rounds": args.saturated_rounds, "concurrency": 32,
                      "seconds": [round(e, 2) for e in elapsed], "requests_per_s": rps,
                      "time_ratio": round(elapsed[0] / elapsed[1], 3)}
    report = {"minutes": args.minutes, "rate": args.rate, "window_s": args.window, "latency": ratios,
              "requests": [{f"{r} {s}": n for (r, s), n in sorted(st.status.items())} for st in stats],
              "5xx_or_client_errors": {"soaked": fivexx[0], "fresh": fivexx[1]},
              "errors": [st.errors[:5] for st in stats],
              "per_token": {"soaked": used[0], "fresh": used[1]}, "saturated": throughput}
    ok = ok and not any(fivexx)
    report["pass"] = ok
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    for k, d in ratios.items():
        print(f"{k}: {labels[0]} {d['soaked'] * 1000:.1f} ms, {labels[1]} {d['fresh'] * 1000:.1f} ms, {d['ratio']}x")
    for key, what in (("step_ms_per_1k_tokens", "engine step time"), ("cpu_ms_per_1k_tokens", "server CPU")):
        if all(u and u[key] for u in used):
            a, b = (u[key] for u in used)
            print(f"{what} per 1000 tokens processed: {labels[0]} {a} ms ({used[0]['tokens']} tokens), "
                  f"{labels[1]} {b} ms ({used[1]['tokens']} tokens), {round(a / b, 3)}x")
    if throughput:
        print(f"saturated, the same {len(batch)} requests from 32 clients, {args.saturated_rounds} times each: "
              f"{labels[0]} {throughput['requests_per_s'][0]} requests/s, {labels[1]} "
              f"{throughput['requests_per_s'][1]} requests/s; time {throughput['time_ratio']}x")
    print(f"{'PASS' if ok else 'FAIL'} {labels[0]} vs {labels[1]}: {detail}; 5xx or client errors: "
          f"{labels[0]} {fivexx[0]}, {labels[1]} {fivexx[1]}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
