"""What a burst leaves in gpt-server's memory: bursts of the soak's mix sent all at once, each
followed by as many requests 8 at a time (the load going on), and the server's RSS and C heap
after each, once it has settled.

    python3 bench/burst_memory.py URL --pid SERVER_PID [--size 300] [--bursts 3]

Start the server as bench/soak.sh does (`--prefix-cache-mib 16`); the default queue bound (256)
refuses a few of a 300-request burst with 503, which is expected. Standard library only.
"""
import argparse
import random
import threading
import time

import soak


def show(url, pid, label):
    m = soak.metrics(url)
    print(f"{label}: RSS {soak.server_rss_kib(pid)} KiB, heap live "
          f"{m.get('gpt_heap_allocated_bytes', 0) / 2**20:.1f} MiB, free "
          f"{m.get('gpt_heap_free_bytes', 0) / 2**20:.1f} MiB, trims {m.get('gpt_heap_trims_total', 0):.0f}",
          flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("url")
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--size", type=int, default=300, help="requests in a burst")
    ap.add_argument("--bursts", type=int, default=3)
    ap.add_argument("--settle", type=float, default=2.0, help="seconds to wait before reading")
    args = ap.parse_args()
    pool = soak.prefixes(args.url)
    stats = soak.Stats()
    rng = random.Random(7)

    def one(req):
        path, body, stream, drop = req
        soak.request(args.url, path, body, "", stats, 0, stream, drop)

    def eight_at_a_time(reqs):
        threads = [threading.Thread(target=lambda c=reqs[i::8]: [one(r) for r in c]) for i in range(8)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        time.sleep(args.settle)

    eight_at_a_time([soak.pick(rng, pool) for _ in range(200)])  # warm-up: fills the prefix cache
    show(args.url, args.pid, "after warm-up (200 requests, 8 at a time)")
    for b in range(1, args.bursts + 1):
        reqs = [soak.pick(rng, pool) for _ in range(args.size)]
        threads = [threading.Thread(target=one, args=(r,)) for r in reqs]
        [t.start() for t in threads]
        [t.join() for t in threads]
        time.sleep(args.settle)
        show(args.url, args.pid, f"after burst {b} ({args.size} at once)")
        eight_at_a_time(reqs)
        show(args.url, args.pid, f"  then {args.size} more, 8 at a time")
    print("statuses:", {f"{route} {status}": n for (route, status), n in sorted(stats.status.items())})


if __name__ == "__main__":
    main()
