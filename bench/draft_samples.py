"""Text written by the model a running gpt-server serves, for distilling a draft model
(weights/README.md, "The draft model"): N requests of a random 32-character opening of the
training text (the first 90% of the corpus) and 224 characters sampled at temperature 1, 16 at a
time, each opening followed by its continuation and a blank line, on stdout.

    python3 bench/draft_samples.py N [--url http://127.0.0.1:18300]
"""

import argparse
import json
import random
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("n", type=int)
    ap.add_argument("--url", default="http://127.0.0.1:18300")
    args = ap.parse_args()
    text = (Path(__file__).resolve().parent.parent / "data/tinyshakespeare.txt").read_text()
    train = text[: len(text) * 9 // 10]

    def one(i):
        rng = random.Random(i)
        at = rng.randrange(0, len(train) - 64)
        opening = train[at : at + 32]
        body = json.dumps({"prompt": opening, "max_tokens": 224, "temperature": 1.0, "seed": i}).encode()
        req = urllib.request.Request(f"{args.url}/v1/completions", body, {"Content-Type": "application/json"})
        return opening + json.load(urllib.request.urlopen(req))["choices"][0]["text"]

    with ThreadPoolExecutor(16) as pool:
        for sample in pool.map(one, range(args.n)):
            sys.stdout.write(sample + "\n\n")


if __name__ == "__main__":
    main()
