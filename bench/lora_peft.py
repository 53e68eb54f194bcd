"""PEFT's own LoRA training step in PyTorch (eager, CPU), for bench/lora.sh: the base checkpoint
loaded by transformers, a LoRA adapter from PEFT (`get_peft_model`, fan_in_fan_out for GPT-2's
Conv1D), AdamW over the adapter's parameters only, batches of random windows of the corpus
tokenized by the base's tokenizer.

    python bench/lora_peft.py BASE --data data/tinyshakespeare.txt --r 8 --targets c_attn \
        --batch-size 4 --block-size 256 --steps 6 --threads 2

BASE may be a GGUF file (`transformers` loads it dequantized to f32, with its tokenizer): PEFT's
LoRA on the model a QLoRA run here holds quantized (`--targets q_proj,v_proj`).

Prints one JSON object: the median tokens/s of the steps after the first, and the peak RSS.
"""
import argparse
import json
import resource
import statistics
import time

import torch
from peft import LoraConfig, get_peft_model
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2LMHeadModel


def main():
    p = argparse.ArgumentParser()
    p.add_argument("base")
    p.add_argument("--data", required=True)
    p.add_argument("--r", type=int, default=8)
    p.add_argument("--alpha", type=float, default=8.0)
    p.add_argument("--targets", default="c_attn")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    gguf = a.base.endswith(".gguf")
    if gguf:
        import os

        where, name = os.path.dirname(os.path.abspath(a.base)), os.path.basename(a.base)
        ids = AutoTokenizer.from_pretrained(where, gguf_file=name)(open(a.data).read()).input_ids
        model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, torch_dtype=torch.float32)
    else:
        ids = Tokenizer.from_file(f"{a.base}/tokenizer.json").encode(open(a.data).read()).ids
        model = GPT2LMHeadModel.from_pretrained(a.base)
    data = torch.tensor(ids, dtype=torch.long)
    config = LoraConfig(
        r=a.r, lora_alpha=a.alpha, lora_dropout=0.0, target_modules=a.targets.split(","), fan_in_fan_out=not gguf
    )
    model = get_peft_model(model, config)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.1)
    times = []
    for _ in range(a.steps):
        starts = torch.randint(len(data) - a.block_size - 1, (a.batch_size,))
        x = torch.stack([data[s : s + a.block_size] for s in starts])
        t0 = time.perf_counter()
        loss = model(x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    tokens = a.batch_size * a.block_size
    print(
        json.dumps(
            {
                "tokens_per_sec": tokens / statistics.median(times[1:]),
                "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
                "trainable": sum(p.numel() for p in trainable),
                "torch": torch.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
