"""Checks `gpt-train export --out FILE.gguf` against llama.cpp itself: every decoder-family
checkpoint of tests/fixtures/families (random weights `transformers` saved, with its greedy
continuation in expected.json) exported to llama.cpp's GGUF file, served by llama.cpp's
`llama-server`, and its greedy tokens for the fixture's prompt (given as token ids, no BOS)
compared with `transformers`'. Prints one line a case; exits non-zero on a mismatch.

    bash -c 'source bench/llamacpp_setup.sh && llama_cpp_build llama-server'
    cargo build --release -p gpt-train
    python3 bench/llamacpp_export_check.py target/bench/llamacpp/build/bin/llama-server [DTYPE]

DTYPE (default f32) is the export's; with a quantized one the comparison with `transformers`
fails on these random-weight models by design (their next-token distributions are nearly flat, and
llama.cpp also rounds the activations to 8 bits in its q8_0 products: near-ties flip).
"""
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Not mistral-window: llama.cpp runs Mistral as its `llama` architecture, which has no sliding
# window (its tokens part from transformers' once the context passes the window, 2026-12-06);
# nor gemma3-scalar, whose query scalar llama.cpp cannot express (export refuses it).
CASES = ["llama-gqa", "llama3-scaled", "qwen2-bias", "qwen3-qknorm", "arcee-relu2", "mistral", "gemma2-softcap", "gemma3-local"]


def post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def main(server: str, dtype: str = "f32") -> None:
    env = {**os.environ, "LD_LIBRARY_PATH": str(pathlib.Path(server).resolve().parent)}
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, case in enumerate(CASES):
            src = ROOT / "tests/fixtures/families" / case
            gguf = pathlib.Path(tmp) / f"{case}.gguf"
            subprocess.run([ROOT / "target/release/gpt-train", "export", "--checkpoint", src, "--out", gguf,
                            "--dtype", dtype], check=True, capture_output=True)
            expected = json.loads((src / "expected.json").read_text())
            port = 18400 + i
            proc = subprocess.Popen([server, "-m", gguf, "--port", str(port), "-t", "2", "-c", "64", "-np", "1",
                                     "--no-warmup"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            try:
                for _ in range(100):
                    try:
                        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                        break
                    except OSError:
                        if proc.poll() is not None:
                            raise RuntimeError(f"{case}: llama-server exited: {proc.stderr.read().decode()[-2000:]}")
                        time.sleep(0.2)
                out = post(f"http://127.0.0.1:{port}/completion", {
                    "prompt": expected["greedy_prompt"], "n_predict": len(expected["greedy"]), "temperature": 0,
                    "samplers": ["top_k"], "top_k": 1, "return_tokens": True, "cache_prompt": False,
                    "ignore_eos": True,
                })
            finally:
                proc.kill()
                proc.wait()
            same = out["tokens"] == expected["greedy"]
            print(f"{case} ({dtype}): llama.cpp {out['tokens']} {'==' if same else '!='} transformers {expected['greedy']}")
            if not same:
                failed.append(case)
    if failed:
        sys.exit(f"llama.cpp's greedy tokens differ for {failed}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
