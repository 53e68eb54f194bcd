"""PyTorch reference for model/benches/inference.rs: GPT2LMHeadModel (eager, f32, random weights,
GPT-2-small shape) on CPU, batch 1. Prefill tokens/s for a 128-token prompt; greedy decode tokens/s
with the KV cache (16-token prompt, 128 new tokens) in a hand-written cache loop, as the Rust bench
does. Prints one JSON object.

    python bench/torch_inference.py [--threads N]
"""
import argparse
import json
import statistics
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

PREFILL, PROMPT, NEW_TOKENS, REPEATS = 128, 16, 128, 5


def prompt(n: int, vocab: int) -> torch.Tensor:
    return torch.tensor([[(i * 7919 + 13) % vocab for i in range(n)]])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = GPT2Config()  # GPT-2 small: 12 layers, 12 heads, 768, 50257 tokens, 1024 positions
    model = GPT2LMHeadModel(cfg).eval()

    prefill = []
    ids = prompt(PREFILL, cfg.vocab_size)
    with torch.inference_mode():
        for _ in range(REPEATS + 1):
            start = time.perf_counter()
            model(ids, use_cache=True).logits[:, -1].argmax(-1)
            prefill.append(time.perf_counter() - start)
        prefill = prefill[1:]

        decode = []
        ids = prompt(PROMPT, cfg.vocab_size)
        for _ in range(min(REPEATS, 3)):
            out = model(ids, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            start = time.perf_counter()
            for _ in range(NEW_TOKENS):
                out = model(nxt, past_key_values=past, use_cache=True)
                past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            decode.append(time.perf_counter() - start)

    print(json.dumps({
        "impl": f"pytorch {torch.__version__} transformers eager",
        "threads": torch.get_num_threads(),
        "prefill_tokens": PREFILL,
        "prefill_tok_per_s": PREFILL / statistics.median(prefill),
        "decode_prompt": PROMPT,
        "decode_new_tokens": NEW_TOKENS,
        "decode_tok_per_s": NEW_TOKENS / statistics.median(decode),
    }))


if __name__ == "__main__":
    main()
