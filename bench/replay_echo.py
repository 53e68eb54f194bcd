"""lm-eval's loglikelihood requests replayed against a running gpt-server, one at a time: for each
prompt length, N prompts of `<|endoftext|>` and that many tokens of the corpus (echo,
`logprobs: 1`, `max_tokens: 1`, temperature 0, as lm-eval's `local-completions` sends them).
Prints the median and every latency in ms.

    python3 bench/replay_echo.py PORT MODEL LENGTHS [N] [OFFSET]
    python3 bench/replay_echo.py 8080 gpt2-random 8,20,40,80,160,250 9 100

Every prompt is a different stretch of the corpus (from token OFFSET on, never repeated in one
call), so that the server's prefix cache reuses at most the shared first token, as with
lm-eval's distinct paragraphs. Restart the server between compared runs: a later call with the
same OFFSET repeats the prompts, and the cache then answers them.
"""
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

CORPUS = Path(__file__).resolve().parent.parent / "data/tinyshakespeare.txt"


def main() -> None:
    port, model, lengths = sys.argv[1], sys.argv[2], [int(x) for x in sys.argv[3].split(",")]
    n = int(sys.argv[4]) if len(sys.argv) > 4 else 9
    offset = int(sys.argv[5]) if len(sys.argv) > 5 else 0

    def post(path: str, body: dict) -> dict:
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req) as r:
            return json.loads(r.read())

    need = offset + n * sum(lengths)
    ids = post("/tokenize", {"model": model, "prompt": CORPUS.read_text()[: need * 8]})["tokens"]
    if len(ids) < need:
        sys.exit(f"the corpus gives {len(ids)} tokens, {need} needed")
    eot = post("/tokenize", {"model": model, "prompt": "<|endoftext|>"})["tokens"]
    for length in lengths:
        times = []
        for _ in range(n):
            prompt = eot + ids[offset : offset + length - len(eot)]
            offset += length
            body = {"model": model, "prompt": [prompt], "max_tokens": 1, "echo": True,
                    "logprobs": 1, "temperature": 0, "seed": 1234}
            t = time.perf_counter()
            post("/v1/completions", body)
            times.append((time.perf_counter() - t) * 1000)
        print(length, f"median {statistics.median(times):.1f} ms", " ".join(f"{x:.0f}" for x in times))


if __name__ == "__main__":
    main()
