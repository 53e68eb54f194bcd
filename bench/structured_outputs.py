"""Structured outputs side by side: the same JSON schema, prompts and sampling sent to two
OpenAI-compatible servers (gpt-server and llama.cpp's llama-server, both taking llama.cpp's
`json_schema` field on /v1/completions), REQUESTS requests at each CONCURRENCY, the servers
alternating in rounds. Prints per server and concurrency: completion tokens/s (all requests'
completion tokens over the round's wall time), the share of outputs that ended ("stop") and
the share that parse and validate against the schema (jsonschema), as JSON lines.

    python bench/structured_outputs.py NAME=URL NAME=URL [--requests 16] [--concurrency 1 16]
"""
import argparse
import concurrent.futures
import json
import time
import urllib.request

import jsonschema

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["king", "queen", "fool", "ghost"]},
        "lines": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 3},
        "alive": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "lines", "alive"],
    "additionalProperties": False,
}


def post(url, body):
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def one(url, i, max_tokens):
    body = {"prompt": f"Character {i} of the play, as JSON:", "max_tokens": max_tokens, "temperature": 0.8,
            "seed": i, "json_schema": SCHEMA}
    r = post(url, body)
    choice = r["choices"][0]
    tokens = r["usage"]["completion_tokens"]
    valid = False
    try:
        jsonschema.validate(json.loads(choice["text"]), SCHEMA)
        valid = True
    except Exception:
        pass
    return tokens, choice["finish_reason"] == "stop", valid


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("servers", nargs="+", help="NAME=URL")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=160)
    args = ap.parse_args()
    servers = [s.split("=", 1) for s in args.servers]
    for name, url in servers:  # warm-up (and the schema compiled)
        one(url, 0, 8)
    for c in args.concurrency:
        for rnd in range(args.rounds):
            for name, url in servers:
                start = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(c) as pool:
                    results = list(pool.map(lambda i: one(url, i, args.max_tokens), range(args.requests)))
                wall = time.perf_counter() - start
                tokens = sum(t for t, _, _ in results)
                print(json.dumps({
                    "server": name, "concurrency": c, "round": rnd, "requests": args.requests,
                    "completion_tokens": tokens, "wall_s": round(wall, 3),
                    "tokens_per_s": round(tokens / wall, 1),
                    "stopped": sum(s for _, s, _ in results) / len(results),
                    "valid": sum(v for _, _, v in results) / len(results),
                }), flush=True)


if __name__ == "__main__":
    main()
