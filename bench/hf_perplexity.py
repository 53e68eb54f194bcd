"""Perplexity of a checkpoint on a text with `transformers`, windowed exactly as `gpt-train eval`
windows it (the first window scores the first `block` tokens, each later one the next `stride`
with the `block` tokens before them as context), so that the two can be compared number for
number.

    python bench/hf_perplexity.py CHECKPOINT_DIR TEXT_FILE [--block 256] [--stride 128]

Prints one JSON object: tokens_scored, mean_nll, perplexity, bits_per_byte.
"""
import argparse
import json
import math

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("text")
    ap.add_argument("--block", type=int, default=None)
    ap.add_argument("--stride", type=int, default=None)
    args = ap.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, torch_dtype=torch.float32)
    model.eval()
    tok = PreTrainedTokenizerFast(tokenizer_file=f"{args.checkpoint}/tokenizer.json")
    text = open(args.text, encoding="utf-8").read()
    ids = tok(text, add_special_tokens=False).input_ids
    block = args.block or model.config.n_positions
    stride = args.stride or max(block // 2, 1)
    total, scored, start = 0.0, 0, 1
    with torch.no_grad():
        while start < len(ids):
            step = block if start == 1 else stride
            end = min(start + step, len(ids))
            lo = max(end - 1 - block, 0)
            inputs = torch.tensor([ids[lo:end - 1]])
            logp = torch.log_softmax(model(inputs).logits[0].double(), dim=-1)
            for t in range(start, end):
                total -= logp[t - 1 - lo, ids[t]].item()
                scored += 1
            start = end
    mean = total / scored
    print(json.dumps({
        "tokens_scored": scored,
        "mean_nll": mean,
        "perplexity": math.exp(mean),
        "bits_per_byte": total / math.log(2) / len(text.encode("utf-8")),
    }))


if __name__ == "__main__":
    main()
