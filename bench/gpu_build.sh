#!/usr/bin/env bash
# Builds the CUDA binaries on a machine without a GPU and packs them into .gpu/ (git-ignored) for
# a GPU machine without a Rust toolchain, where bench/gpu.sh unpacks and runs them:
#   gpt-train, gpt-server, the CPU-vs-CUDA test binary (tests/cuda.rs), gpt-train's tests with
#   NCCL, and the inference and training-step benchmarks, all with `--features cuda`; plus the corpus (compressed), and when
#   they are at hand, GPT-2's tokenizer.json (for gpu.sh serve; GPT2_TOKENIZER, default
#   target/gpt2-tokenizer/tokenizer.json) and nanoGPT's own code and shakespeare_char data (for
#   gpu.sh nanogpt and speed; NANOGPT_DIR, a checkout of github.com/karpathy/nanoGPT).
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
# gpt-train's own tests with NCCL (its one-rank check; MPI's libraries travel in .gpu/mpi).
nccl_tests=$(executable gpt_train test --release -p gpt-train --lib --features nccl)
inference=$(executable inference bench -p gpt --bench inference)
train_step=$(executable train_step bench -p gpt-train --bench train_step)

rm -rf .gpu && mkdir -p .gpu/bin
for pair in "gpt-train:$target/release/gpt-train" "gpt-server:$target/release/gpt-server" \
            "cuda-tests:$tests" "nccl-tests:$nccl_tests" "inference:$inference" "train-step:$train_step"; do
  name=${pair%%:*} path=${pair#*:}
  strip -o ".gpu/bin/$name" "$path"
done
# One archive with a long window: the five binaries share most of their code (candle, its
# kernels), so together they compress to ~18 MB against ~50 MB one by one.
tar -C .gpu/bin -cf - . | zstd -q -19 --long=28 -T0 -o .gpu/bin.tar.zst
rm -rf .gpu/bin
zstd -q -19 -T0 "$corpus" -o .gpu/corpus.txt.zst
tokenizer=${GPT2_TOKENIZER:-target/gpt2-tokenizer/tokenizer.json}
[[ -f $tokenizer ]] && zstd -q -19 "$tokenizer" -o .gpu/gpt2-tokenizer.json.zst
if [[ -n ${NANOGPT_DIR:-} ]]; then
  data=$NANOGPT_DIR/data/shakespeare_char
  cp "$corpus" "$data/input.txt" # prepare.py downloads it otherwise
  (cd "$data" && python3 prepare.py > /dev/null)
  mkdir -p .gpu/nanogpt/config .gpu/nanogpt/data/shakespeare_char
  cp "$NANOGPT_DIR"/{train.py,model.py,configurator.py} .gpu/nanogpt/
  cp "$NANOGPT_DIR"/config/train_shakespeare_char.py .gpu/nanogpt/config/
  cp "$data"/{train.bin,val.bin,meta.pkl} .gpu/nanogpt/data/shakespeare_char/
fi
# The MPI libraries the NCCL build links (GPU images may have no MPI; the one-rank check starts
# no MPI job, so the libraries alone do).
mkdir -p .gpu/mpi
for lib in $(ldd "$nccl_tests" | awk '/libmpi|libopen-|libhwloc|libevent|libpmix|libfabric|libudev|libltdl|libz\./ {print $3}'); do
  cp -L "$lib" .gpu/mpi/
done
# zstd itself, for GPU machines without it (gpu.sh uses it when there is none there).
mkdir -p .gpu/tools
cp "$(command -v zstd)" .gpu/tools/
for lib in $(ldd "$(command -v zstd)" | awk '/=>/ {print $3}' | grep -v -E '/(libc|libm|ld-linux)[.-]'); do
  cp -L "$lib" .gpu/tools/
done
git rev-parse HEAD > .gpu/commit
du -sh .gpu
