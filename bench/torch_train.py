"""PyTorch reference for the training benchmarks (eager, CPU), written to match gpt-train:
the same GPT-2 model (pre-LayerNorm blocks, tanh GELU, tied head), character vocabulary, 90/10
split, random windows, AdamW decaying only 2-D weights, warmup + cosine schedule, clipping at 1.0,
and evaluation of --eval-iters batches every --eval-interval steps.

    python bench/torch_train.py recipe --data data/tinyshakespeare.txt --threads 2
        nanoGPT's CPU recipe (4 layers, 4 heads, 128 wide, block 64, batch 12, 2000 iterations)
    python bench/torch_train.py throughput --threads 2 [--device cuda --bf16 --tf32]
        GPT-2-small shape (50257 tokens, 12x12x768), block 256, random tokens: training tokens/s
    python bench/torch_train.py throughput --arch smollm2 --threads 2 [--bf16]
        SmolLM2-135M's shape in `transformers`' own LlamaForCausalLM (random weights, sdpa
        attention, tied head), the same AdamW: training tokens/s

Prints one JSON object.
"""
import argparse
import json
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(n_embd)
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.mlp_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.n_head)
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), diagonal=1)
        att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab, block, n_layer, n_head, n_embd):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.T
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def lr_at(it, a):
    if it < a.warmup_iters:
        return a.learning_rate * (it + 1) / (a.warmup_iters + 1)
    if it > a.lr_decay_iters:
        return a.min_lr
    ratio = (it - a.warmup_iters) / (a.lr_decay_iters - a.warmup_iters)
    return a.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (a.learning_rate - a.min_lr)


def optimizer(model, a):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": a.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=a.learning_rate, betas=(0.9, a.beta2), eps=1e-8, foreach=True)


def batch(data, a, gen):
    ix = torch.randint(len(data) - a.block_size - 1, (a.batch_size,), generator=gen)
    x = torch.stack([data[i : i + a.block_size] for i in ix])
    y = torch.stack([data[i + 1 : i + 1 + a.block_size] for i in ix])
    return x, y


def recipe(a):
    text = open(a.data, encoding="utf-8").read()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text])
    n = int(0.9 * len(data))
    train, val = data[:n], data[n:]
    torch.manual_seed(a.seed)
    gen = torch.Generator().manual_seed(a.seed)
    model = GPT(len(chars), a.block_size, a.n_layer, a.n_head, a.n_embd)
    opt = optimizer(model, a)
    best, evals, train_time = float("inf"), [], 0.0
    start = time.perf_counter()
    for it in range(a.max_iters + 1):
        if it % a.eval_interval == 0 or it == a.max_iters:
            model.eval()
            with torch.no_grad():
                losses = {name: sum(model(*batch(split, a, gen)).item() for _ in range(a.eval_iters)) / a.eval_iters
                          for name, split in (("train", train), ("val", val))}
            model.train()
            best = min(best, losses["val"])
            evals.append({"step": it, **losses})
        if it == a.max_iters:
            break
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(it, a)
        loss = model(*batch(train, a, gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        train_time += time.perf_counter() - t0
    return {"wall_s": time.perf_counter() - start, "ms_per_iter": 1e3 * train_time / a.max_iters,
            "best_val_loss": best, "final": evals[-1]}


def smollm2(block_size):
    """`transformers`' LlamaForCausalLM in SmolLM2-135M's shape, returning the mean loss."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=max(block_size, 2048),
                      rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg)

    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, idx, targets):
            logits = self.inner(input_ids=idx).logits
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    return Wrapped(), 49152


def throughput(a):
    torch.manual_seed(0)
    if a.arch == "smollm2":
        model, vocab = smollm2(a.block_size)
        model = model.to(a.device)
    else:
        model, vocab = GPT(50257, a.block_size, 12, 12, 768).to(a.device), 50257
    opt = optimizer(model, a)
    gen = torch.Generator().manual_seed(0)
    times = []
    for it in range(a.max_iters + 1):
        x = torch.randint(vocab, (a.batch_size, a.block_size), generator=gen).to(a.device)
        t0 = time.perf_counter()
        with torch.autocast(a.device.split(":")[0], dtype=torch.bfloat16, enabled=a.bf16):
            loss = model(x, torch.roll(x, -1, 1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step = sorted(times[1:])[len(times[1:]) // 2]  # median, after a warm-up step
    return {"arch": a.arch, "parameters": sum(p.numel() for p in model.parameters()),
            "device": a.device, "bf16_autocast": a.bf16, "batch_size": a.batch_size, "block_size": a.block_size,
            "s_per_step": step, "tokens_per_sec": a.batch_size * a.block_size / step}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["recipe", "throughput"])
    p.add_argument("--data", default="data/tinyshakespeare.txt")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--max-iters", type=int, default=2000)
    p.add_argument("--lr-decay-iters", type=int, default=2000)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--warmup-iters", type=int, default=100)
    p.add_argument("--beta2", type=float, default=0.99)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-interval", type=int, default=250)
    p.add_argument("--eval-iters", type=int, default=20)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="cpu", help="throughput mode: cpu or cuda")
    p.add_argument("--arch", default="gpt2", choices=["gpt2", "smollm2"], help="throughput mode: the shape")
    p.add_argument("--bf16", action="store_true", help="throughput mode: bf16 autocast")
    p.add_argument("--tf32", action="store_true", help="allow TF32 matmuls on CUDA")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.backends.cuda.matmul.allow_tf32 = a.tf32
    result = recipe(a) if a.mode == "recipe" else throughput(a)
    print(json.dumps({"impl": f"pytorch {torch.__version__} eager", "threads": torch.get_num_threads(), **result}))


if __name__ == "__main__":
    main()
