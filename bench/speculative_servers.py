"""Batch-1 greedy decoding through servers, side by side: each server in turn gets the same
prompt (one request at a time, greedy, a fixed number of new tokens), prompt after prompt,
ROUNDS times; tokens/s per server (the usage's completion tokens over the requests' wall time).

    python3 bench/speculative_servers.py NAME=URL... [--prompts 8] [--max-tokens 128] [--rounds 2]

Prompts: windows of 200 characters of the corpus' validation text (its last 10%).
"""

import argparse
import json
import time
import urllib.request
from pathlib import Path


def complete(url, prompt, max_tokens):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    start = time.perf_counter()
    resp = json.load(urllib.request.urlopen(req))
    return resp["usage"]["completion_tokens"], time.perf_counter() - start, resp["choices"][0]["text"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("servers", nargs="+")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    servers = [s.split("=", 1) for s in args.servers]
    text = (Path(__file__).resolve().parent.parent / "data/tinyshakespeare.txt").read_text()
    val = text[len(text) * 9 // 10 :]
    prompts = [val[i * (len(val) - 200) // args.prompts :][:200] for i in range(args.prompts)]
    totals = {name: [0, 0.0] for name, _ in servers}
    texts = {name: [] for name, _ in servers}
    for name, url in servers:
        complete(url, "warm up", 4)
    for r in range(args.rounds):
        for p in prompts:
            for j in range(len(servers)):
                name, url = servers[(j + r) % len(servers)]
                n, secs, out = complete(url, p, args.max_tokens)
                totals[name][0] += n
                totals[name][1] += secs
                if r == 0:
                    texts[name].append(out)
    base = servers[0][0]
    for name, _ in servers:
        same = sum(a == b for a, b in zip(texts[name], texts[base]))
        rate = totals[name][0] / totals[name][1]
        print(json.dumps({"server": name, "tok_per_s": rate, "vs_first": rate / (totals[base][0] / totals[base][1]),
                          "same_text_as_first": f"{same}/{len(prompts)}"}))


if __name__ == "__main__":
    main()
