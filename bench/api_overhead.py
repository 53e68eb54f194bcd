"""Each protocol's overhead against /v1/chat/completions on one running gpt-server: the same
greedy chat request (the same prompt, up to 64 tokens) through OpenAI's chat
completions, OpenAI's Responses, Anthropic's Messages and Ollama's chat, streamed, at 1 and 16
concurrent streams; output tokens/s of each (the server's own token counts), rounds alternating
between the protocols so that the machine's drift falls on all alike.

    gpt-server --checkpoint MODEL --port 18190 &
    python bench/api_overhead.py http://127.0.0.1:18190 MODEL [ROUNDS] [REQUESTS_PER_STREAM]

Then, with `EMBED=1`, embeddings: /v1/embeddings against another server's (llama.cpp's
`llama-server --embeddings` on the same GGUF file, `OTHER=http://host:port`), texts of about 100
tokens, 1 and 16 concurrent clients, embeddings per second.
"""
import concurrent.futures
import json
import os
import statistics
import sys
import time
import urllib.request

base, model = sys.argv[1], sys.argv[2]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
per_stream = int(sys.argv[4]) if len(sys.argv) > 4 else 2
TOKENS = 64
question = "Tell me a long story about a knight and a dragon."


def post(url, body, headers=None):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json", **(headers or {})})
    return urllib.request.urlopen(req, timeout=600)


def sse_events(resp):
    for raw in resp:
        line = raw.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def chat():
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": TOKENS,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    usage = [e["usage"] for e in sse_events(post(base + "/v1/chat/completions", body)) if e.get("usage")]
    return usage[-1]["completion_tokens"]


def responses():
    body = {"model": model, "input": question, "max_output_tokens": TOKENS, "temperature": 0, "stream": True}
    done = [e for e in sse_events(post(base + "/v1/responses", body)) if e["type"] in ("response.completed", "response.incomplete")]
    return done[-1]["response"]["usage"]["output_tokens"]


def messages():
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": TOKENS,
            "temperature": 0, "stream": True}
    deltas = [e for e in sse_events(post(base + "/v1/messages", body)) if e["type"] == "message_delta"]
    return deltas[-1]["usage"]["output_tokens"]


def ollama():
    body = {"model": model, "messages": [{"role": "user", "content": question}],
            "options": {"temperature": 0, "num_predict": TOKENS}}
    last = [json.loads(line) for line in post(base + "/api/chat", body)][-1]
    return last["eval_count"]


def measure(call, streams):
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        tokens = sum(pool.map(lambda _: call(), range(streams * per_stream)))
    return tokens / (time.perf_counter() - start)


if os.environ.get("EMBED") != "1":
    # "chat again": the same protocol twice, the spread that no protocol causes.
    protocols = {"chat": chat, "responses": responses, "messages": messages, "ollama": ollama, "chat again": chat}
    for streams in (1, 16):
        rates = {name: [] for name in protocols}
        for _ in range(rounds):
            for name, call in protocols.items():
                rates[name].append(measure(call, streams))
        base_rate = statistics.median(rates["chat"])
        for name, r in rates.items():
            print(f"{streams:>2} streams  {name:<10} {' / '.join(f'{x:6.1f}' for x in r)} tok/s  median {statistics.median(r):6.1f}"
                  f"  {statistics.median(r) / base_rate:.3f}x chat")
else:
    other = os.environ["OTHER"]
    texts = [f"{i}: " + "The quick brown fox jumps over the lazy dog near the river bank. " * 8 for i in range(64)]

    def embed_at(url):
        def one(text):
            out = json.load(post(url + "/v1/embeddings", {"model": model, "input": text}))
            return len(out["data"])
        return one

    for streams in (1, 16):
        for name, url in (("gpt-server", base), ("other", other)):
            rs = []
            for _ in range(rounds):
                start = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(streams) as pool:
                    n = sum(pool.map(embed_at(url), texts))
                rs.append(n / (time.perf_counter() - start))
            print(f"{streams:>2} clients  {name:<10} {' / '.join(f'{x:6.1f}' for x in rs)} embeddings/s  median {statistics.median(rs):6.1f}")
