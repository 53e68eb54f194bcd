"""A soak run against gpt-server: mixed load at a fixed arrival rate for a while, then a report.

    python3 bench/soak.py URL --minutes 30 --rate 4 --pid SERVER_PID [--model NAME] [--out report.json]

Standard library only (a thread per request in flight, `http.client`), so it runs wherever
Python does. Requests arrive as a Poisson process at `--rate` per second (`--spacing even`:
evenly spaced), drawn from this mix;
by default (`--arrivals replay`) one minute of them is drawn and sent again every minute, the same
requests (sampling seeds included) at the same offsets, so that the minutes whose latencies are
compared carry the same load:

| share | request |
|---|---|
| 25% | streamed completion (`stream_options.include_usage`); about one in ten of all streams (12% of the completion streams, made long enough to be still generating) is dropped by the client after 3 chunks, unless so much of it has arrived unread that the server may have ended it already |
| 15% | whole completion |
| 15% | chat completion, streamed or not |
| 5%  | completion with `n` 2 or 3 |
| 5%  | beam search (`use_beam_search`, `best_of` 2) |
| 5%  | `echo` with `logprobs` (`max_tokens` 0 or a few) |
| 5%  | `/v1/attention` |
| 10% | `/tokenize` |
| 15% | completion sharing a long prefix with earlier ones (the prefix cache), streamed |

Per minute it records the server's resident memory (`/proc/PID/status`) with the bytes its
prefix cache and KV-buffer pool hold (`/metrics`), and time to first token
and inter-token latency (p50, p99) of the streams that started in that minute, with the CPU time
of the machine (busy, and stolen by the hypervisor), the server and this client, the server's
page faults, the tokens the server processed per CPU-second, and the CPU time a fixed piece of
work took in this client (`work_ms`, median of one a second: the machine's speed, which on a
shared host moves with the other guests' load even where nothing is stolen). At the end it
reads `/metrics` and compares it with its own counts: completion and chat requests by status,
generated tokens of the requests that ended normally, and streams dropped (read again until they
agree, for at most 30 s: the server counts a dropped stream a moment after its client went).
The report (JSON) has `pass` and the reason of each check; the exit status is 0 when every check
passes.

Pass: no 5xx; resident memory after warm-up (the first minute, and until the prefix cache is at
its bound) grows by at most 5%; no latency drifting by more than 20% (or 5 ms) either way: for
each of TTFT and ITL, p50 and p99, the median of the per-minute values over the run's last third
against their median over its first third, the first minute (warm-up) left out (runs of 7 minutes
and more); the counters equal exactly. Reported beside them, not a check: how many minutes' values
are within 20% of the first minute's (a minute's p99 is a few streams: it moves by tens of
percent with the bursts in that minute, in either direction, where a drift moves the run), and
the rank correlation over the minutes between each latency and the CPU time the hypervisor stole,
and `work_ms` (the machine's part in those moves). `bench/soak_probe.py` tells the server's drift
from the machine's: the soaked server against a fresh one, measured at the same time.
"""
import argparse
import http.client
import json
import os
import random
import re
import socket
import statistics
import sys
import threading
import time
import urllib.parse

# The events the server's engine generates ahead of a stream's handler before it pauses the
# sequence (`STREAM_BUFFER` in server/src/engine/channel.rs).
STREAM_BUFFER = 64

LATENCIES = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99")

PARAGRAPH = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
    "First Citizen:\nYou are all resolved rather to die than to famish?\n\n"
)


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.status = {}  # (route, status) -> count
        self.completion_tokens = 0  # of completion/chat requests that ended normally
        self.dropped = 0
        self.ttft = {}  # minute -> [s]
        self.itl = {}  # minute -> [s]
        self.errors = []

    def count(self, route, status):
        with self.lock:
            self.status[(route, status)] = self.status.get((route, status), 0) + 1


def connection(url):
    parts = urllib.parse.urlsplit(url)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)


def request(url, path, body, model, stats, minute, stream=False, drop=False):
    """One request, recorded in `stats`; returns its status (None when the client failed)."""
    route = "chat" if "chat" in path else ("completions" if "completions" in path else path)
    conn = connection(url)
    try:
        payload = dict(body)
        if model and path.startswith("/v1/") and "attention" not in path:
            payload["model"] = model
        if stream:
            payload["stream"] = True
            payload["stream_options"] = {"include_usage": True}
        data = json.dumps(payload)
        start = time.monotonic()
        method = "GET" if body is None else "POST"
        conn.request(method, path, body=None if body is None else data,
                     headers={"content-type": "application/json"})
        resp = conn.getresponse()
        stats.count(route, resp.status)
        if resp.status >= 500:
            stats.errors.append((path, resp.status, resp.read()[:200].decode(errors="replace")))
            return resp.status
        if not stream:
            out = json.loads(resp.read() or b"null")
            if resp.status == 200 and isinstance(out, dict) and "usage" in out and route in ("completions", "chat"):
                with stats.lock:
                    stats.completion_tokens += out["usage"]["completion_tokens"]
            return resp.status
        last, chunks, usage, ended = None, 0, None, False
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.decode(errors="replace").strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                ended = True
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"]
            now = time.monotonic()
            if chunk.get("choices"):
                with stats.lock:
                    if last is None:
                        stats.ttft.setdefault(minute, []).append(now - start)
                    else:
                        stats.itl.setdefault(minute, []).append(now - last)
                last = now
                chunks += 1
            if drop and chunks >= 3:
                pending = received(resp, conn.sock)
                conn.sock.settimeout(600)
                if chunks + pending.count(b"data: ") + STREAM_BUFFER + 16 >= payload["max_tokens"]:
                    # The server may have generated this stream to its end already (a busy client
                    # can fall that far behind, and the engine runs up to STREAM_BUFFER tokens
                    # ahead of what its handler has sent): the client cannot tell a drop from a
                    # whole stream, so it reads this one to its end as a whole one.
                    drop = False
                    continue
                with stats.lock:
                    stats.dropped += 1
                return resp.status  # closing the connection: the server drops the sequence
        if ended and usage is not None and route in ("completions", "chat"):
            with stats.lock:
                stats.completion_tokens += usage["completion_tokens"]
        return resp.status
    except Exception as e:  # a client-side failure is a failure of the run too
        stats.errors.append((path, "exception", repr(e)))
    finally:
        conn.close()


def received(resp, sock):
    """The bytes of a response that have reached the client but are not read yet (the reader's
    buffer, then the socket's queue), without waiting for more."""
    sock.setblocking(False)
    try:
        buffered = resp.fp.peek(1 << 20) or b""
    except (BlockingIOError, OSError, ValueError):
        buffered = b""
    try:
        queued = sock.recv(1 << 22, socket.MSG_PEEK)
    except (BlockingIOError, OSError):
        queued = b""
    return buffered + queued


def prefixes(url):
    """The shared prefixes of the mix: up to half the served model's context (in characters, at
    most as many tokens), so that prefix, prompt and output fit a small model's context too.
    (Roman numerals: a character-level vocabulary from Shakespeare has few digits.)"""
    conn = connection(url)
    conn.request("GET", "/v1/models")
    context = json.loads(conn.getresponse().read())["data"][0]["max_model_len"]
    conn.close()
    return [(f"Scene {n}.\n" + PARAGRAPH * 2)[: context // 2] for n in ("I", "II", "III", "IV")]


def pick(rng, prefix_pool):
    """One request of the mix: (path, body, stream, drop)."""
    x = rng.random()
    prompt = PARAGRAPH[: rng.randint(20, len(PARAGRAPH))]
    # A stream the client drops must still be generating when it goes (else the server counts it
    # whole and the client dropped): long, and past end-of-text; chat streams (which end at the
    # template's stop string) are never dropped, so completion streams are dropped a little more
    # often, for one in ten streams in all.
    drop = rng.random() < 0.12
    long = {"max_tokens": 200, "ignore_eos": True} if drop else {}
    if x < 0.25:
        return "/v1/completions", {"prompt": prompt, "max_tokens": rng.randint(16, 64), "temperature": 0.8,
                                   "seed": rng.randint(0, 1 << 30), **long}, True, drop
    if x < 0.40:
        return "/v1/completions", {"prompt": prompt, "max_tokens": rng.randint(8, 48), "temperature": 0}, False, False
    if x < 0.55:
        stream = rng.random() < 0.5
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt[:60]}],
                                        "max_completion_tokens": rng.randint(8, 40), "temperature": 0.7},\
            stream, False
    if x < 0.60:
        return "/v1/completions", {"prompt": prompt, "max_tokens": 24, "n": rng.randint(2, 3),
                                   "temperature": 1.0}, False, False
    if x < 0.65:
        return "/v1/completions", {"prompt": prompt, "max_tokens": 16, "use_beam_search": True,
                                   "best_of": 2, "n": 1, "temperature": 0}, False, False
    if x < 0.70:
        return "/v1/completions", {"prompt": prompt, "max_tokens": rng.choice([0, 4]), "echo": True,
                                   "logprobs": 3, "temperature": 0}, False, False
    if x < 0.75:
        return "/v1/attention", {"prompt": prompt[:80]}, False, False
    if x < 0.85:
        return "/tokenize", {"prompt": prompt}, False, False
    prefix = rng.choice(prefix_pool)
    return "/v1/completions", {"prompt": prefix + prompt[:rng.randint(5, 40)], "max_tokens": 24,
                               "temperature": 0, **long}, True, drop


def server_rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def metrics(url):
    conn = connection(url)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, value = line.rsplit(" ", 1)
        out[name] = float(value)
    return out


def memory_sample(args, start, now):
    """(minute, RSS KiB, prefix cache KiB, KV pool KiB, heap allocated KiB, heap free KiB, tokens,
    step seconds): the server's memory, its two bounded caches, whose filling is warm-up, the C
    heap's live and free bytes (a leak grows the first, fragmentation the second), the prompt and
    generated tokens it has processed so far (its work, for the work per CPU-second of each
    minute), and the wall time its engine has spent in steps (`gpt_step_duration_seconds`)."""
    try:
        m = metrics(args.url)
    except OSError:
        m = {}
    return (round((now - start) / 60, 2), server_rss_kib(args.pid),
            int(m.get("gpt_prefix_cache_bytes", 0) // 1024), int(m.get("gpt_kv_pool_bytes", 0) // 1024),
            int(m.get("gpt_heap_allocated_bytes", 0) // 1024), int(m.get("gpt_heap_free_bytes", 0) // 1024),
            int(m.get("gpt_prompt_tokens_total", 0) + m.get("gpt_generated_tokens_total", 0)),
            m.get("gpt_step_duration_seconds_sum", 0.0))


def cpu_sample(pid):
    """(the machine's jiffies: busy, steal, all; the server's CPU seconds; this client's; the
    server's minor page faults): per minute, whether a slow minute was the machine's (steal: time
    the hypervisor gave to other guests) or the processes' own (faults: memory it touched anew)."""
    with open("/proc/stat") as f:
        jiffies = [int(x) for x in f.readline().split()[1:]]
    idle, steal = jiffies[3] + jiffies[4], jiffies[7] if len(jiffies) > 7 else 0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        server = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        faults = int(fields[7])
    except OSError:
        server, faults = 0.0, 0
    client = sum(os.times()[:2])
    return (sum(jiffies) - idle - steal, steal, sum(jiffies), server, client, faults)


def work_ms(samples, stop, start):
    """Until `stop` is set, once a second: the CPU time (of this thread: time spent waiting for a
    core, stolen or not, is not counted) that a fixed piece of Python work takes, into
    `samples[minute]`, in ms. It is the machine's speed as a program sees it: a core shared with a
    busy hyperthread sibling, or caches and memory shared with other guests, make the same work
    take longer, which the steal figure does not show."""
    while not stop.wait(1.0):
        t = time.thread_time()
        x = 0
        for i in range(100_000):
            x += i * i
        samples.setdefault(int((time.monotonic() - start) // 60), []).append((time.thread_time() - t) * 1000)


def cpu_rows(samples, memory):
    """Per minute from consecutive `cpu_sample`s and `memory_sample`s: the machine's busy and steal
    shares of its CPU time, the server's and this client's CPU seconds, the tokens the server
    processed per CPU-second (with the same requests every minute, a minute where that falls
    while the server's CPU time does not is a slower machine, or a server doing more per token),
    and the wall time of its engine's steps per 1000 tokens processed and as a share of the
    minute. The CPU figure moves little: the server's threads spin between steps for the time it
    does not compute, so its CPU time is about the same each minute whatever its speed. The step
    time is the server's speed without the queue: how long its steps took for the same work."""
    rows = {}
    for m, (a, b) in enumerate(zip(samples, samples[1:])):
        total = max(1, b[2] - a[2])
        cpu_s = b[3] - a[3]
        rows[m] = {"machine_busy": round((b[0] - a[0]) / total, 3), "steal": round((b[1] - a[1]) / total, 3),
                   "server_cpu_s": round(cpu_s, 1), "client_cpu_s": round(b[4] - a[4], 1),
                   "server_faults": b[5] - a[5]}
        if m + 1 < len(memory):
            tokens = memory[m + 1][6] - memory[m][6]
            step_s = memory[m + 1][7] - memory[m][7]
            rows[m]["tokens_per_cpu_s"] = round(tokens / max(cpu_s, 1e-3), 1)
            rows[m]["engine_busy"] = round(step_s / max(1e-3, 60 * (memory[m + 1][0] - memory[m][0])), 3)
            if tokens > 0:
                rows[m]["step_ms_per_1k_tokens"] = round(1e6 * step_s / tokens, 1)
    return rows


def memory_check(rss):
    """Growth of the resident memory after warm-up: the first minute, and until the prefix cache
    has filled (85% of the most it held: whole prefixes of ~1/8 of the bound each, it sits below
    its bound by up to one; the soak sizes it so that it fills). Also the growth not held by the
    two bounded caches, the part a leak would show in."""
    fullest = max((s[2] for s in rss), default=0)
    warm = [s for s in rss if s[0] >= 1.0 and s[2] >= 0.85 * fullest] or rss[-1:]
    first, last = warm[0], rss[-1]
    growth = (last[1] - first[1]) / first[1] if first[1] else 0.0
    other = ((last[1] - last[2] - last[3]) - (first[1] - first[2] - first[3])) / first[1] if first[1] else 0.0
    from_one = [s for s in rss if s[0] >= 1.0] or rss
    early = (last[1] - from_one[0][1]) / from_one[0][1] if from_one[0][1] else 0.0
    detail = (f"RSS from minute {first[0]:.0f} (prefix cache filled, {first[2]} KiB) {first[1]} -> "
              f"{last[1]} KiB ({growth:+.1%}; outside the prefix cache and the KV pool {other:+.1%}); "
              f"from minute 1 {early:+.1%}; C heap allocated {first[4]} -> {last[4]} KiB, free {first[5]} -> "
              f"{last[5]} KiB")
    return growth <= 0.05, detail


def quantile(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def overall(stats):
    """Each latency (TTFT and ITL, p50 and p99) over every stream of the run."""
    out = {}
    for name, table in (("ttft", stats.ttft), ("itl", stats.itl)):
        values = [v for m in table.values() for v in m]
        for q in (0.5, 0.99):
            out[f"{name}_p{int(q * 100)}"] = quantile(values, q)
    return out


def arrivals(rng, rate, prefix_pool, seconds, spacing="poisson"):
    """`rate` arrivals per second over `seconds`, as a Poisson process or evenly spaced:
    [(offset s, request of the mix)]."""
    gap = (lambda: rng.expovariate(rate)) if spacing == "poisson" else (lambda: 1.0 / rate)
    out, t = [], gap()
    while t < seconds:
        out.append((t, pick(rng, prefix_pool)))
        t += gap()
    return out or [(0.0, pick(rng, prefix_pool))]


def calibrate(args, prefix_pool):
    """The server's saturation on this mix: `--concurrency` clients, each sending the mix's
    requests back to back (a closed loop: the batch stays full and the queue never refuses), for
    `--minutes`; the requests completed per second after the first tenth of the time (warm-up).
    An open-loop overload instead measures at most the rate it offers (40 requests/s gave the
    default model 37.4 of its 61-67), and its 503s fall mostly on the slow requests, so that the
    ones served are the cheap part of the mix."""
    stats = Stats()
    start = time.monotonic()
    warm, end = start + args.minutes * 6, start + args.minutes * 60
    done = []  # completion times of the requests served

    def client(seed):
        rng = random.Random(seed)
        while time.monotonic() < end:
            path, body, stream, drop = pick(rng, prefix_pool)
            status = request(args.url, path, body, args.model, stats, 0, stream, drop)
            if status is not None and status < 400:
                with stats.lock:
                    done.append(time.monotonic())

    threads = [threading.Thread(target=client, args=(args.seed * 1000 + i,), daemon=True)
               for i in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=args.minutes * 60 + 600)
    served = sum(1 for t in done if warm <= t < end)
    refused = sum(n for (_, status), n in stats.status.items() if status >= 500 or status == 429)
    return {"saturation_rps": round(served / (end - warm), 3), "concurrency": args.concurrency,
            "refused": refused, "errors": stats.errors[:5],
            "requests": {f"{r} {s}": n for (r, s), n in sorted(stats.status.items())}}


def close(a, b):
    """The latency rule's tolerance: `b` within 20% of `a`, or within 5 ms."""
    return abs(b - a) <= max(0.2 * a, 0.005)


def gated(checks, gate):
    """(names, pass): the checks `--gate` names (comma-separated; None: all of them) and whether
    each passes; exits naming any it does not know. `checks`: {name: (pass, detail)}."""
    names = [g.strip() for g in gate.split(",")] if gate else list(checks)
    unknown = [g for g in names if g not in checks]
    if unknown:
        sys.exit(f"--gate: no check named {unknown}; the checks are {list(checks)}")
    return names, all(checks[g][0] for g in names)


def latency_drift(per_minute, keys=LATENCIES):
    """Each latency's drift over the run: its per-minute values' median over the run's first third
    and over its last third (minute 0, the warm-up, left out), and their ratio. A drift is judged
    on thirds, not on single minutes: a minute's p99 is a few of its slowest streams, and at 80%
    of saturation one burst of arrivals moves it by tens of percent either way
    (BENCHMARKS.md, "Soak"), where a server that slows as it runs moves every minute after some
    point. Empty for runs under 7 minutes (two minutes a third). `keys`: other per-minute figures
    judged the same way (the step time per token)."""
    rows = [r for r in per_minute[1:] if all(r.get(k) is not None for k in keys)]
    third = len(rows) // 3
    if third < 2:
        return {}
    out = {}
    for k in keys:
        first = statistics.median(r[k] for r in rows[:third])
        last = statistics.median(r[k] for r in rows[-third:])
        out[k] = {"first_third": first, "last_third": last, "ratio": round(last / first, 3) if first else None}
    return out


def steady(drift):
    """The latency check on `latency_drift`: every latency's last third within 20% (or 5 ms) of
    its first, either way. (pass, detail), or None when the run is too short to judge."""
    if not drift:
        return None
    moved = [f"{k} {d['last_third'] * 1000:.1f} ms vs {d['first_third'] * 1000:.1f} ms ({d['ratio']}x)"
             for k, d in drift.items() if not close(d["first_third"], d["last_third"])]
    return (not moved, "; ".join(moved) or "the last third of the run within 20% of the first, each latency: "
            + ", ".join(f"{k} {d['ratio']}x" for k, d in drift.items()))


def step_time_drift(per_minute):
    """Reported, not a check: the wall time of the engine's steps per 1000 tokens, the median of
    the run's last third against its first (`latency_drift`'s thirds), {first_third, last_third,
    ratio}, or None when the run is too short or the server has no step metric. The queue is not
    in it, but it understates a slowdown: at 80% of saturation the engine steps for 90-95% of each
    minute, and a slower server takes more sequences into each step, so the same tokens cost it
    at most the rest of the minute more (1 / busy share) before its queue grows. It tells a
    server doing much more work per token; the probe's saturated throughput tells a few percent."""
    drift = latency_drift(per_minute, keys=("step_ms_per_1k_tokens",)).get("step_ms_per_1k_tokens")
    return drift if drift and drift["first_third"] else None


def rank_correlation(xs, ys):
    """Spearman's rank correlation of two equally long lists (tied values given their mean rank),
    or None for fewer than 5 pairs or a constant list. (`statistics.correlation(method="ranked")`
    is Python 3.12's; CI's Python is 3.11.)"""
    if len(xs) < 5:
        return None

    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        start = 0
        while start < len(order):
            end = start
            while end + 1 < len(order) and v[order[end + 1]] == v[order[start]]:
                end += 1
            for i in order[start:end + 1]:
                out[i] = (start + end) / 2
            start = end + 1
        return out

    a, b = ranks(xs), ranks(ys)
    ma, mb = statistics.mean(a), statistics.mean(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    var = sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b)
    if not var:  # a constant list: all its ranks tie
        return None
    return round(cov / var ** 0.5, 2)


def machine_vs_latency(per_minute, key):
    """Reported, not a check: for each latency, the rank correlation over the minutes (after the
    first) between a measure of the machine, `key` of the per-minute rows (`steal`: the CPU time
    the hypervisor took; `work_ms`: how long a fixed piece of work took), and the latency: how
    much of the minutes' differences the machine explains."""
    rows = [r for r in per_minute[1:] if r.get(key) is not None]
    return {k: rank_correlation([r[key] for r in rows if r.get(k) is not None],
                                [r[k] for r in rows if r.get(k) is not None]) for k in LATENCIES}


def minutes_vs_first(per_minute):
    """Reported, not a check: for each latency, the minutes (after the first) within 20% (or
    5 ms) of the first minute's value, as "k of n"."""
    base, rows = (per_minute[0], per_minute[1:]) if per_minute else ({}, [])
    out = {}
    for k in LATENCIES:
        pairs = [(base.get(k), r.get(k)) for r in rows if base.get(k) is not None and r.get(k) is not None]
        within = sum(1 for a, b in pairs if close(a, b))
        out[k] = f"{within} of {len(pairs)}"
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--arrivals", choices=("replay", "poisson"), default="replay",
                    help="replay: one minute of Poisson arrivals from the mix, the same requests at the same "
                         "offsets every minute, so that minutes differ only by the server and the machine "
                         "(default); poisson: drawn afresh for the whole run")
    ap.add_argument("--spacing", choices=("poisson", "even"), default="poisson",
                    help="the arrivals' times: a Poisson process (default) or evenly spaced")
    ap.add_argument("--rate", type=float, default=4.0, help="requests per second")
    ap.add_argument("--pid", type=int, required=True, help="the server's process id, for its memory")
    ap.add_argument("--model", default=None)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--gate", default=None,
                    help="comma-separated checks that decide the exit status (default: all); the others are "
                         "reported only (CI's short soak gates on 'no 5xx,counters agree': a minute's p99 on a "
                         "shared 2-core machine moves by tens of percent)")
    ap.add_argument("--calibrate", action="store_true",
                    help="print the server's saturation on this mix, requests per second, measured with "
                         "--concurrency clients in a closed loop for --minutes")
    ap.add_argument("--concurrency", type=int, default=32,
                    help="clients of --calibrate: enough to keep the batch full (default 32: two batches at "
                         "gpt-server's default --max-batch-size, under its batch plus --max-queue)")
    args = ap.parse_args()

    rng = random.Random(args.seed)
    prefix_pool = prefixes(args.url)
    if args.calibrate:
        print(json.dumps(calibrate(args, prefix_pool)))
        return
    stats = Stats()
    before = metrics(args.url)
    start = time.monotonic()
    end = start + args.minutes * 60
    threads, rss, cpu, work = [], [], [], {}
    next_sample = start
    stop = threading.Event()
    worker = threading.Thread(target=work_ms, args=(work, stop, start), daemon=True)
    worker.start()
    # The requests and their arrival times: one minute's, sent again every minute (`replay`), or
    # drawn afresh for the whole run (`poisson`).
    period = 60.0 if args.arrivals == "replay" else args.minutes * 60
    plan = arrivals(rng, args.rate, prefix_pool, period, args.spacing)
    for k in range(len(plan) * int(args.minutes * 60 / period + 1)):
        cycle, i = divmod(k, len(plan))
        offset, (path, body, stream, drop) = plan[i]
        at = start + cycle * period + offset
        if at >= end:
            break
        while (now := time.monotonic()) < at:
            if now >= next_sample:
                cpu.append(cpu_sample(args.pid))
                rss.append(memory_sample(args, start, now))
                next_sample += 60
            time.sleep(max(0.0, min(at, next_sample) - time.monotonic()))
        minute = int((at - start) // 60)
        t = threading.Thread(target=request, args=(args.url, path, body, args.model, stats, minute, stream, drop),
                             daemon=True)
        t.start()
        threads.append(t)
        threads = [t for t in threads if t.is_alive()]
    for t in threads:
        t.join(timeout=600)
    stop.set()
    worker.join()
    cpu.append(cpu_sample(args.pid))
    rss.append(memory_sample(args, start, time.monotonic()))
    routes = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
    served = {(routes[r], s): n for (r, s), n in stats.status.items() if r in routes}

    def mismatches(after):
        """The server's counters since the start against the client's own counts."""
        def delta(name):
            return after.get(name, 0.0) - before.get(name, 0.0)
        out = []
        for (route, status), n in served.items():
            got = delta(f'gpt_requests_total{{route="{route}",status="{status}"}}')
            if got != n:
                out.append(f"{route} status {status}: server {got:.0f}, client {n}")
        got_tokens = delta("gpt_completion_tokens_total")
        if got_tokens != stats.completion_tokens:
            out.append(f"completion tokens: server {got_tokens:.0f}, client {stats.completion_tokens}")
        got_dropped = delta("gpt_cancelled_total")
        if got_dropped != stats.dropped:
            out.append(f"cancelled: server {got_dropped:.0f}, client {stats.dropped}")
        return out

    # The server counts a dropped stream once its handler sees the connection gone, a moment
    # after the client closed it: the counters are read until they agree, for at most 30 s (a
    # count still missing then is a failure), and the wait is reported.
    waited = time.monotonic()
    while True:
        time.sleep(0.5)
        mismatched = mismatches(metrics(args.url))
        if not mismatched or time.monotonic() - waited > 30:
            break
    waited = round(time.monotonic() - waited, 1)

    checks = {}
    fivexx = sum(n for (route, status), n in stats.status.items() if status >= 500)
    checks["no 5xx"] = (fivexx == 0 and not stats.errors, f"{fivexx} 5xx, client errors: {stats.errors[:5]}")
    checks["memory flat"] = memory_check(rss)
    minutes = sorted(set(stats.ttft) | set(stats.itl))
    per_minute = []
    machine = cpu_rows(cpu, rss)
    for m in minutes:
        row = {"minute": m, **machine.get(m, {})}
        if work.get(m):
            row["work_ms"] = round(statistics.median(work[m]), 2)
        for name, table in (("ttft", stats.ttft), ("itl", stats.itl)):
            for q in (0.5, 0.99):
                row[f"{name}_p{int(q * 100)}"] = quantile(table.get(m, []), q)
        per_minute.append(row)
    drift = latency_drift(per_minute)
    judged = steady(drift)
    vs_first = minutes_vs_first(per_minute)
    vs_machine = {key: machine_vs_latency(per_minute, key) for key in ("steal", "work_ms")}
    if judged is not None:
        checks["latency steady"] = judged
    step_drift = step_time_drift(per_minute)
    checks["counters agree"] = (not mismatched, "; ".join(mismatched) + f" after {waited} s" if mismatched else
                                f"requests, tokens, cancellations equal ({waited} s after the last response)")
    report = {
        "minutes": args.minutes,
        "rate": args.rate,
        "requests": {f"{r} {s}": n for (r, s), n in sorted(stats.status.items())},
        "dropped_streams": stats.dropped,
        "completion_tokens": stats.completion_tokens,
        "memory_kib": [{"minute": m, "rss": r, "prefix_cache": p, "kv_pool": k, "heap_allocated": a,
                        "heap_free": f, "tokens": t, "step_s": round(st, 3)} for m, r, p, k, a, f, t, st in rss],
        "per_minute": per_minute,
        "overall": overall(stats),
        "latency_drift": drift,
        "step_time_drift": step_drift,
        "minutes_vs_first": vs_first,
        "machine_vs_latency": vs_machine,
        "checks": {name: {"pass": ok, "detail": detail} for name, (ok, detail) in checks.items()},
        "pass": all(ok for ok, _ in checks.values()),
    }
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    for name, (ok, detail) in checks.items():
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")
    if judged is None:
        print("latency steady: not judged, the run is too short (under 7 minutes)")
    if step_drift:
        print(f"engine step time per 1000 tokens (reported, not a check): {step_drift['last_third']:.1f} ms in "
              f"the last third vs {step_drift['first_third']:.1f} ms in the first ({step_drift['ratio']}x)")
    print("minutes within 20% of the first (reported, not a check):",
          ", ".join(f"{k} {v}" for k, v in vs_first.items()))
    for key, what in (("steal", "stolen CPU"), ("work_ms", "time for a fixed piece of work")):
        print(f"rank correlation of a minute's {what} with its latency (reported, not a check):",
              ", ".join(f"{k} {v}" for k, v in vs_machine[key].items()))
    _, ok = gated(checks, args.gate)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
