"""Writes a GPT-2-small-shaped checkpoint with random weights (transformers' own init, seeded)
and a given tokenizer.json, in the Hugging Face layout that both gpt-server and transformers load:

    python bench/make_random_gpt2.py target/gpt2-tokenizer/tokenizer.json target/bench/gpt2-random
"""
import pathlib
import shutil
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel


def main() -> None:
    tokenizer, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config())  # 12 layers, 12 heads, 768, 50257 tokens, 1024 positions
    model.save_pretrained(out)
    shutil.copy(tokenizer, out / "tokenizer.json")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
