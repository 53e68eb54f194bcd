"""Training tokens/s of nanoGPT's own model (its `model.py` and `configure_optimizers`, from a
checkout of https://github.com/karpathy/nanoGPT), the peer of `cargo bench -p gpt-train --bench
train_step`: the same shape, batch and steps, forward + backward + clip + AdamW, eager PyTorch.

    python bench/nanogpt_throughput.py NANOGPT_DIR [--threads 2] [--batch-size 4] [--block-size 256]
        [--max-iters 3] [--dtype float32|bfloat16] [--device cpu|cuda]

On CUDA, float32 products use TF32 (as nanoGPT's train.py sets) and bfloat16 is autocast, as there.

Prints one line: `nanoGPT model.py: <tokens/s> tokens/s, <s/step> s/step (median of N), peak RSS <MB>`.
"""
import argparse
import resource
import statistics
import sys
import time

import torch


def main():
    p = argparse.ArgumentParser()
    p.add_argument("nanogpt_dir")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--max-iters", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = p.parse_args()
    sys.path.insert(0, args.nanogpt_dir)
    from model import GPT, GPTConfig  # nanoGPT's own

    torch.set_num_threads(args.threads)
    torch.manual_seed(1337)
    # GPT-2 small as nanoGPT's train.py builds it from scratch (bias, no dropout: both as here).
    cfg = GPTConfig(block_size=args.block_size, vocab_size=50257, n_layer=12, n_head=12, n_embd=768,
                    dropout=0.0, bias=True)
    dev = args.device
    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    model = GPT(cfg).to(dev)
    opt = model.configure_optimizers(weight_decay=0.1, learning_rate=6e-4, betas=(0.9, 0.95), device_type=dev)
    bf16 = args.dtype == "bfloat16"
    ctx = torch.autocast(dev, dtype=torch.bfloat16) if bf16 else torch.autocast(dev, enabled=False)
    x = torch.randint(0, 50257, (args.batch_size, args.block_size), device=dev)
    y = torch.randint(0, 50257, (args.batch_size, args.block_size), device=dev)
    times = []
    for i in range(args.max_iters + 1):
        t0 = time.perf_counter()
        with ctx:
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if i > 0:  # the first step warms up
            times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    tokens = args.batch_size * args.block_size
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"nanoGPT model.py ({args.dtype}, {dev}): {tokens / step:.1f} tokens/s, {step:.2f} s/step "
          f"(median of {len(times)}), peak RSS {rss:.0f} MB")


if __name__ == "__main__":
    main()
