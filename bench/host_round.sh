#!/usr/bin/env bash
# One device call for the CPU backend on the GPU machine's host CPU: the 8B-shaped Q4_K_M decode
# with 16 threads beside `llama-bench -ngl 0 -t 16` built from the same llama.cpp sources in the
# same call (a CPU build: -ngl 0 computes every layer on the host), as a fraction of the host's
# read bandwidth (bench/cpu.py); then the GPU tests and the CPU backend's tests.
#   (device tool) carry: .whl .llama .gpu-data ; command: bash bench/host_round.sh
#   TESTS=0 skips the tests; BENCH=0 the benchmark; PYTEST_PATHS narrows the tests.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$(dirname "$0")/out}; L=$OUT/logs; mkdir -p "$L" /tmp/ntx
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/daemon:$PWD/client:$PWD/system:$PWD/proto
t0=$(date +%s)
{ lscpu; free -g; nproc; gcc --version | head -1; } > "$L/host.txt" 2>&1
if [ "${BENCH:-1}" = 1 ]; then
  ( mkdir -p /tmp/llcpu && tar xzf .llama/llama.cpp-slim.tar.gz -C /tmp/llcpu && cd /tmp/llcpu/llama.cpp \
    && cmake -S . -B build -G Ninja -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF \
       -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    && cmake --build build --target llama-bench -j16; echo "rc=$?" ) > "$L/llama_cpu_build.log" 2>&1 &
  [ -f /tmp/ntx/8b-q4_k_m.gguf ] || python3 -m ntransformerd.tools.ntx_model synth --shape llama3-8b --type q4_k_m \
    --quiet /tmp/ntx/8b-q4_k_m.gguf 2>&1 | tail -1
  python3 -c "from ntransformerd.engine.backends.host import native; l = native.load(); print('kernels', l.variant.name, l.isa())"
  echo "synth + kernels at $(( $(date +%s) - t0 )) s"
  for i in $(seq 1 200); do grep -q rc= "$L/llama_cpu_build.log" 2>/dev/null && break; sleep 2; done
  tail -3 "$L/llama_cpu_build.log"
  bin=/tmp/llcpu/llama.cpp/build/bin/llama-bench
  cat /tmp/ntx/8b-q4_k_m.gguf > /dev/null  # both engines start from a warm page cache
  timeout ${BENCH_TIMEOUT:-300} python3 bench/cpu.py --model /tmp/ntx/8b-q4_k_m.gguf --threads 16 --engines cpu \
    $( [ -x $bin ] && echo --llama-bench $bin ) --batch 1 --prompt-tokens 32 --decode-tokens 32 --repeat 3 \
    --json "$L/cpu_h200.json" 2>&1 | tee "$L/cpu_h200.log"
  echo "bench done at $(( $(date +%s) - t0 )) s"
fi
if [ "${TESTS:-1}" = 1 ]; then
  timeout ${TEST_TIMEOUT:-330} python3 -m pytest -q -p no:cacheprovider -o addopts="" --timeout 300 \
    ${PYTEST_PATHS:-tests/gpu tests/engine/test_host_backend.py tests/engine/test_cpu_kernels.py} 2>&1 \
    | tee "$L/tests.log" | grep -v "^\.*$" | tail -40
  echo "tests done at $(( $(date +%s) - t0 )) s"
fi
tar czf "$OUT/logs.tgz" -C "$OUT" logs
