"""Serving throughput at a fixed number of concurrent streams: C clients, each streaming
--requests completions one after another (a --prompt-tokens prompt of distinct words, greedy,
--max-tokens new tokens with `ignore_eos`), against a running gpt-server (or any OpenAI-compatible
server). Prints one JSON line per concurrency: aggregate completion tokens/s over the wall time,
and the median and p99 time to first token.

    python bench/serve_streams.py --url http://localhost:18080 --concurrency 1 16 64

Standard library only (a thread per stream, `http.client`), so it runs on a bare GPU machine.
"""
import argparse
import http.client
import json
import statistics
import threading
import time
import urllib.parse

WORDS = "the of and to in a is that for it as was with be by on not he this are or his from at".split()


def stream(url, body):
    """One streamed completion: (seconds to the first token, completion tokens, total seconds)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
    first, tokens = None, 0
    for line in resp:
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise RuntimeError(chunk["error"])
        if chunk.get("choices") and chunk["choices"][0].get("text") and first is None:
            first = time.perf_counter() - start
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    conn.close()
    return first, tokens, time.perf_counter() - start


def run(args, concurrency):
    ttfts, tokens, errors = [], [], []
    lock = threading.Lock()

    def client(c):
        for r in range(args.requests):
            words = [WORDS[(c * 7 + r * 3 + i * 5) % len(WORDS)] for i in range(args.prompt_tokens)]
            body = {"model": args.model[c % len(args.model)], "prompt": " ".join(words), "max_tokens": args.max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            try:
                first, n, _ = stream(args.url, body)
                with lock:
                    ttfts.append(first)
                    tokens.append(n)
            except Exception as e:  # noqa: BLE001 - counted and reported
                with lock:
                    errors.append(str(e))

    threads = [threading.Thread(target=client, args=(c,)) for c in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ttfts = sorted(t for t in ttfts if t is not None)
    print(json.dumps({
        "concurrency": concurrency,
        "requests": len(tokens),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "completion_tokens": sum(tokens),
        "wall_s": round(wall, 3),
        "tokens_per_s": round(sum(tokens) / wall, 1),
        "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1) if ttfts else None,
        "ttft_p99_ms": round(1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 1) if ttfts else None,
    }), flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="http://localhost:18080")
    p.add_argument("--model", nargs="+", help="stream c asks for model c mod the count (default: the first of /v1/models)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--requests", type=int, default=2, help="completions per stream, one after another")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=256)
    args = p.parse_args()
    if args.model is None:
        parts = urllib.parse.urlsplit(args.url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        conn.request("GET", "/v1/models")
        args.model = [json.loads(conn.getresponse().read())["data"][0]["id"]]
    for c in args.concurrency:
        run(args, c)


if __name__ == "__main__":
    main()
