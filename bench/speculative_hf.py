"""transformers' assisted generation (its speculative decoding) on the same pair of checkpoints as
`cargo bench -p gpt --bench speculative`: batch-1 greedy decoding of the same validation prompts,
plain `generate` against `generate(assistant_model=draft)`, interleaved, on the CPU with the same
threads. Prints tokens/s and the ratio, and checks that both give the same tokens.

    python3 bench/speculative_hf.py [--target weights] [--draft weights/draft] [--prompts 8]
        [--max-new 192] [--rounds 3] [--threads 2]

Prompts are encoded with the target's tokenizer.json (the `tokenizers` library), so both sides
see the same ids; windows of validation characters as the Rust bench takes them.
"""

import argparse
import json
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import GPT2LMHeadModel


def main():
    repo = Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=str(repo / "weights"))
    ap.add_argument("--draft", default=str(repo / "weights/draft"))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=192)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = GPT2LMHeadModel.from_pretrained(args.target, torch_dtype=torch.float32).eval()
    draft = GPT2LMHeadModel.from_pretrained(args.draft, torch_dtype=torch.float32).eval()
    tokenizer = Tokenizer.from_file(str(Path(args.target) / "tokenizer.json"))
    text = open(repo / "data/tinyshakespeare.txt").read()
    val = text[len(text) * 9 // 10 :]
    context = target.config.n_positions
    window = min(context - args.max_new, 128)
    prompts = []
    for i in range(args.prompts):
        at = i * (len(val) - window) // args.prompts
        prompts.append(tokenizer.encode(val[at : at + window]).ids)
    secs = [0.0, 0.0]
    tokens = [0, 0]
    # Greedy, no end-of-text (the vocabulary has none), exactly max_new tokens each.
    common = dict(do_sample=False, max_new_tokens=args.max_new, min_new_tokens=args.max_new, pad_token_id=0)
    with torch.inference_mode():
        target.generate(torch.tensor([prompts[0]]), **{**common, "max_new_tokens": 4, "min_new_tokens": 4})
        for _ in range(args.rounds):
            for p in prompts:
                ids = torch.tensor([p])
                start = time.perf_counter()
                plain = target.generate(ids, **common)
                secs[0] += time.perf_counter() - start
                start = time.perf_counter()
                assisted = target.generate(ids, assistant_model=draft, **common)
                secs[1] += time.perf_counter() - start
                n = plain.shape[1] - ids.shape[1]
                tokens[0] += n
                tokens[1] += assisted.shape[1] - ids.shape[1]
                if not torch.equal(plain, assisted):
                    print("warning: assisted output differs from plain")
    rate = [t / s for t, s in zip(tokens, secs)]
    print(
        json.dumps(
            {
                "torch": torch.__version__,
                "threads": args.threads,
                "plain_tok_per_s": rate[0],
                "assisted_tok_per_s": rate[1],
                "assisted_vs_plain": rate[1] / rate[0],
            }
        )
    )


if __name__ == "__main__":
    main()
