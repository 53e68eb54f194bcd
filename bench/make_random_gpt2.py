"""Writes a GPT-2-small-shaped checkpoint with random weights (transformers' own init, seeded)
and a given tokenizer.json, in the Hugging Face layout that both gpt-server and transformers load:

    python bench/make_random_gpt2.py target/gpt2-tokenizer/tokenizer.json target/bench/gpt2-random

Without torch (PyTorch's own index is out of reach on some machines, and PyPI's wheel pulls the
CUDA libraries), the same layout and the same init's distributions are drawn with numpy and
written with safetensors: weights normal with std 0.02 (the residual projections 0.02 /
sqrt(2 * layers)), LayerNorm weights one, biases zero. Speed and memory are the same; the values
differ from torch's.
"""
import json
import pathlib
import shutil
import sys


def with_numpy(out: pathlib.Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file
    from transformers import GPT2Config

    config = GPT2Config()
    rng = np.random.default_rng(0)
    d, layers, std = config.n_embd, config.n_layer, config.initializer_range

    def normal(*shape, scale=std):
        return rng.normal(0.0, scale, shape).astype(np.float32)

    def ones(n):
        return np.ones(n, np.float32)

    def zeros(n):
        return np.zeros(n, np.float32)

    t = {"transformer.wte.weight": normal(config.vocab_size, d), "transformer.wpe.weight": normal(config.n_positions, d),
         "transformer.ln_f.weight": ones(d), "transformer.ln_f.bias": zeros(d)}
    proj = std / (2 * layers) ** 0.5
    for i in range(layers):
        p = f"transformer.h.{i}."
        t |= {p + "ln_1.weight": ones(d), p + "ln_1.bias": zeros(d), p + "ln_2.weight": ones(d),
              p + "ln_2.bias": zeros(d), p + "attn.c_attn.weight": normal(d, 3 * d), p + "attn.c_attn.bias": zeros(3 * d),
              p + "attn.c_proj.weight": normal(d, d, scale=proj), p + "attn.c_proj.bias": zeros(d),
              p + "mlp.c_fc.weight": normal(d, 4 * d), p + "mlp.c_fc.bias": zeros(4 * d),
              p + "mlp.c_proj.weight": normal(4 * d, d, scale=proj), p + "mlp.c_proj.bias": zeros(d)}
    out.mkdir(parents=True, exist_ok=True)
    save_file(t, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**config.to_dict(), "architectures": ["GPT2LMHeadModel"]}, indent=2))


def main() -> None:
    tokenizer, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    try:
        import torch
        from transformers import GPT2LMHeadModel, GPT2Config
    except ImportError:
        with_numpy(out)
    else:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config())  # 12 layers, 12 heads, 768, 50257 tokens, 1024 positions
        model.save_pretrained(out)
    shutil.copy(tokenizer, out / "tokenizer.json")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
