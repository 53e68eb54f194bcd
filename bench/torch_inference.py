"""PyTorch reference for model/benches/inference.rs: GPT2LMHeadModel (eager, random weights,
GPT-2-small shape). Prefill tokens/s for a --prefill-token prompt (batch 1), the LM head on the
last position only (`logits_to_keep=1`, as the Rust bench's `LogitsFor::Last`); greedy decode
tokens/s, all sequences together, with the KV cache (16-token prompt, then --new-tokens for each
of --batch sequences) in a hand-written cache loop, as the Rust bench does. Prints one JSON object.

    python bench/torch_inference.py [--threads N] [--device cpu|cuda] [--dtype f32|bf16|f16]
        [--prefill 128] [--batch 1 [8 ...]] [--new-tokens 128]

With several --dtype or --batch values, one line per (dtype, batch), in one process.
"""
import argparse
import json
import statistics
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

PROMPT, REPEATS = 16, 5
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def prompt(n: int, vocab: int, batch: int, device: str) -> torch.Tensor:
    return torch.tensor([[(i * 7919 + 13) % vocab for i in range(n)]] * batch, device=device)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=DTYPES, nargs="+", default=["f32"])
    parser.add_argument("--prefill", type=int, default=128)
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for dtype in args.dtype:
        for batch in args.batch:
            run(args, dtype, batch)


def run(args, dtype: str, batch: int) -> None:
    torch.manual_seed(0)
    cfg = GPT2Config()  # GPT-2 small: 12 layers, 12 heads, 768, 50257 tokens, 1024 positions
    model = GPT2LMHeadModel(cfg).eval().to(args.device, DTYPES[dtype])
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    prefill = []
    ids = prompt(args.prefill, cfg.vocab_size, 1, args.device)
    with torch.inference_mode():
        for _ in range(REPEATS + 1):
            start = time.perf_counter()
            model(ids, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1).tolist()
            prefill.append(time.perf_counter() - start)
        prefill = prefill[1:]

        decode = []
        ids = prompt(PROMPT, cfg.vocab_size, batch, args.device)
        for _ in range(min(REPEATS, 3)):
            out = model(ids, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            start = time.perf_counter()
            for _ in range(args.new_tokens):
                out = model(nxt, past_key_values=past, use_cache=True)
                past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                nxt.tolist()  # the token is read back each step, as a server must (and as the Rust bench does)
            sync()
            decode.append(time.perf_counter() - start)

    print(json.dumps({
        "impl": f"pytorch {torch.__version__} transformers eager",
        "device": args.device,
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "prefill_tokens": args.prefill,
        "prefill_tok_per_s": args.prefill / statistics.median(prefill),
        "batch": batch,
        "decode_prompt": PROMPT,
        "decode_new_tokens": args.new_tokens,
        "decode_tok_per_s": batch * args.new_tokens / statistics.median(decode),
    }), flush=True)


if __name__ == "__main__":
    main()
