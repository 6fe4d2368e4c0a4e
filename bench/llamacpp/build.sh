#!/usr/bin/env bash
# Build llama-bench, llama-batched-bench and llama-perplexity (CUDA, sm_90) from the slim llama.cpp tarball carried in .llama/.
# Make the tarball here with bench/llamacpp/make_tarball.sh; on the GPU machine:
#   bench/llamacpp/build.sh /tmp/llama   → /tmp/llama/llama.cpp/build/bin/llama-bench, llama-batched-bench
set -xeo pipefail
dst=${1:-/tmp/llama}
mkdir -p "$dst"
tar xzf "$(dirname "$0")/../../.llama/llama.cpp-slim.tar.gz" -C "$dst"
cd "$dst/llama.cpp"
cmake -S . -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF \
  -DLLAMA_OPENSSL=OFF 2>&1 | tail -30
cmake --build build --target llama-bench llama-batched-bench llama-perplexity -j${JOBS:-16} 2>&1 | tail -30
ls -la build/bin/llama-bench
