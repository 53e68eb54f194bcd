"""A LoRA adapter in PEFT's format with random A and B, for a GPT-2-layout checkpoint: what
bench/lora_serving.sh serves (the tokens/s of a step does not depend on the values).

    python bench/make_random_adapter.py BASE_DIR OUT_DIR [--r 8] [--targets c_attn] [--seed 0]
"""
import argparse
import json
import os

import numpy as np
from safetensors.numpy import save_file


def main():
    p = argparse.ArgumentParser()
    p.add_argument("base")
    p.add_argument("out")
    p.add_argument("--r", type=int, default=8)
    p.add_argument("--targets", default="c_attn", help="comma-separated: c_attn, c_proj, c_fc")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    cfg = json.load(open(os.path.join(args.base, "config.json")))
    c = cfg["n_embd"]
    mlp = cfg.get("n_inner") or 4 * c
    shapes = {"attn.c_attn": (c, 3 * c), "attn.c_proj": (c, c), "mlp.c_fc": (c, mlp), "mlp.c_proj": (mlp, c)}
    targets = args.targets.split(",")
    rng = np.random.default_rng(args.seed)
    tensors = {}
    for i in range(cfg["n_layer"]):
        for layer, (d_in, d_out) in shapes.items():
            if layer.split(".")[1] not in targets:
                continue
            name = f"base_model.model.transformer.h.{i}.{layer}"
            tensors[f"{name}.lora_A.weight"] = rng.normal(0, 0.02, (args.r, d_in)).astype(np.float32)
            tensors[f"{name}.lora_B.weight"] = rng.normal(0, 0.02, (d_out, args.r)).astype(np.float32)
    os.makedirs(args.out, exist_ok=True)
    save_file(tensors, os.path.join(args.out, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": args.base,
        "r": args.r, "lora_alpha": 2 * args.r, "lora_dropout": 0.0, "target_modules": targets,
        "fan_in_fan_out": True, "bias": "none", "use_rslora": False, "inference_mode": True,
    }
    json.dump(config, open(os.path.join(args.out, "adapter_config.json"), "w"), indent=2)


if __name__ == "__main__":
    main()
