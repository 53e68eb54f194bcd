#!/usr/bin/env bash
# Builds the CUDA binaries on a machine without a GPU and packs them into .gpu/ (git-ignored) for
# a GPU machine without a Rust toolchain, where bench/gpu.sh unpacks and runs them:
#   gpt-train, gpt-server, the CPU-vs-CUDA test binary (tests/cuda.rs), and the inference and
#   training-step benchmarks, all with `--features cuda`; plus the corpus (compressed).
#   bash bench/gpu_build.sh [CORPUS]    (default data/tinyshakespeare.txt)
# Needs a CUDA toolkit: nvcc on PATH or CUDA_ROOT set, else /opt/cuda13 from ../shared/cuda/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
corpus=${1:-data/tinyshakespeare.txt}
if ! command -v nvcc > /dev/null && [[ -z ${CUDA_ROOT:-} ]]; then
  [[ -f /opt/cuda13/env.sh ]] || { cargo fetch -q && bash ../shared/cuda/setup.sh; }
  # shellcheck disable=SC1091
  source /opt/cuda13/env.sh
fi
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
target=target-cuda
cargo build --release --features cuda -p gpt-train -p gpt-server --target-dir $target

# The executable of target $1 that `cargo test|bench ... --no-run` builds (it also builds the
# package's binaries, so pick by name).
executable() {
  local name=$1
  shift
  cargo "$@" --no-run --features cuda --target-dir $target --message-format json 2> /dev/null \
    | python3 -c 'import json, sys
paths = [m["executable"] for m in map(json.loads, sys.stdin)
         if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]]
print(paths[-1])' "$name"
}
tests=$(executable cuda test --release -p gpt-e2e --test cuda)
inference=$(executable inference bench -p gpt --bench inference)
train_step=$(executable train_step bench -p gpt-train --bench train_step)

rm -rf .gpu && mkdir -p .gpu
for pair in "gpt-train:$target/release/gpt-train" "gpt-server:$target/release/gpt-server" \
            "cuda-tests:$tests" "inference:$inference" "train-step:$train_step"; do
  name=${pair%%:*} path=${pair#*:}
  strip -o ".gpu/$name" "$path"
  zstd -q -19 -T0 --rm ".gpu/$name" -o ".gpu/$name.zst"
done
zstd -q -19 -T0 "$corpus" -o .gpu/corpus.txt.zst
git rev-parse HEAD > .gpu/commit
du -sh .gpu
