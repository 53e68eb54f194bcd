"""Speculation under concurrency, side by side: bursts of CONCURRENCY sampled requests at once
(temperature 0.8, 160 tokens each, ignore_eos, prompts of 200 characters of the corpus'
validation text), to each server in turn, ROUNDS times; tokens/s per server and each server's
ratio to the first (the first round is a warm-up). The speculative issue's case: 32 streams,
`--speculative off` against the default (the draft of weights/draft).

    ./target/release/gpt-server --port 18501 --speculative off &
    ./target/release/gpt-server --port 18502 &
    python3 bench/speculative_streams.py off=http://127.0.0.1:18501 on=http://127.0.0.1:18502 \\
        [--concurrency 32] [--rounds 7] [--temperature 0.8]
"""
import argparse
import concurrent.futures
import json
import time
import urllib.request
from pathlib import Path


def complete(url, prompt, seed, temperature):
    body = {"prompt": prompt, "max_tokens": 160, "temperature": temperature, "seed": seed, "ignore_eos": True}
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=600))["usage"]["completion_tokens"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("servers", nargs="+")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--temperature", type=float, default=0.8)
    args = ap.parse_args()
    servers = dict(s.split("=", 1) for s in args.servers)
    text = (Path(__file__).resolve().parent.parent / "data" / "tinyshakespeare.txt").read_text()
    val = text[int(len(text) * 0.9):]
    prompts = [val[i * 300: i * 300 + 200] for i in range(args.concurrency)]
    results = {name: [] for name in servers}
    for r in range(args.rounds):
        for name, url in servers.items():
            start = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
                tokens = sum(pool.map(lambda ip: complete(url, ip[1], 1000 * r + ip[0], args.temperature),
                                      enumerate(prompts)))
            results[name].append(round(tokens / (time.perf_counter() - start), 1))
    print(json.dumps(results))
    names = list(servers)
    for name in names[1:]:
        ratios = [round(a / b, 3) for a, b in zip(results[name][1:], results[names[0]][1:])]
        print(f"{name} / {names[0]} after the warm-up round: {ratios}")


if __name__ == "__main__":
    main()
