#!/usr/bin/env bash
# The slim llama.cpp tree (from the PyPI sdist of llama-cpp-python 0.3.36) carried as .llama/.
set -euo pipefail
root=$(git rev-parse --show-toplevel); mkdir -p "$root/.llama"; work=$(mktemp -d)
python3 -m pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d "$work"
tar xzf "$work"/llama_cpp_python-0.3.36.tar.gz -C "$work"
cd "$work"/llama_cpp_python-0.3.36/vendor/llama.cpp
rm -rf models docs .git tests examples media benches pocs conversion skills tools/ui tools/server tools/cli \
  ggml/src/{ggml-sycl,ggml-vulkan,ggml-metal,ggml-opencl,ggml-cann,ggml-hexagon,ggml-webgpu,ggml-zdnn,ggml-zendnn,ggml-openvino,ggml-virtgpu,ggml-et}
cd ..

tar czf "$root/.llama/llama.cpp-slim.tar.gz" llama.cpp
