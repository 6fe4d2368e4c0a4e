#!/usr/bin/env bash
# Two device calls for the hybrid plan (the host computes beside the GPU, issue 23), the first
# immediately followed by the second (files in /tmp last while the machine stays warm):
#   PHASE=build: llama-bench (CUDA build, from .llama) in the background while the GPU tests and
#                the GPU benchmarks' smoke runs use the GPU; waits for the build.
#   PHASE=bench: bench/streaming.py's hybrid and capped-link rows beside llama-bench -ngl N -t 16.
#   PHASE=quality: bench/hybrid_quality.py on the real-weights slice, the 8B's batch-16 hybrid rows;
#                starts making the 70B file in the background for
#   PHASE=big: the 70B's hybrid rows (streaming.py --hybrid-70b) and speculation on it.
#   (device tool) carry: .whl .llama .gpu-data ; command: PHASE=build bash bench/hybrid_round.sh
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$(dirname "$0")/out}; L=$OUT/logs; mkdir -p "$L" /tmp/ntx
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/daemon:$PWD/client:$PWD/system:$PWD/proto
t0=$(date +%s)
bin=/tmp/llama/llama.cpp/build/bin/llama-bench
if [ "${PHASE:-build}" = build ]; then
  [ -x $bin ] || ( setsid nohup bash bench/llamacpp/build.sh /tmp/llama > /tmp/llama_build.log 2>&1; echo "rc=$?" >> /tmp/llama_build.log ) &
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -o addopts="" --timeout 250 \
    ${PYTEST_PATHS:-tests/gpu tests/bench} 2>&1 | tee "$L/tests.log" | grep -v "^\.*$" | tail -30
  echo "tests done at $(( $(date +%s) - t0 )) s"
  [ -f /tmp/ntx/llama3-8b-q4_k_m.gguf ] || python3 -c "
import sys; sys.path.insert(0, 'bench'); import common; print(common.synthetic('/tmp/ntx', 'llama3-8b', 'q4_k_m'))" 2>&1 | tail -1
  for i in $(seq 1 ${LLAMA_WAIT:-120}); do grep -q rc= /tmp/llama_build.log 2>/dev/null && break; sleep 2; done
  tail -3 /tmp/llama_build.log | tee "$L/llama_build.log"
  echo "build phase done at $(( $(date +%s) - t0 )) s"
elif [ "$PHASE" = quality ]; then
  # the 70B file made in the background for PHASE=big (it outlives this call while the machine stays warm)
  [ -f /tmp/ntx/llama3-70b-q4_k_m.gguf ] || ( setsid nohup python3 -c "
import sys; sys.path.insert(0, 'bench'); import common; print(common.synthetic('/tmp/ntx', 'llama3-70b', 'q4_k_m'))" \
    > /tmp/synth70.log 2>&1 & )
  text=/usr/share/common-licenses/GPL-3; [ -f $text ] || text=.gpu-data/GPL-3
  timeout 240 python3 bench/hybrid_quality.py --model .gpu-data/smollm2-4l.gguf --text $text \
    --json "$L/hybrid_quality.json" 2>&1 | tee "$L/hybrid_quality.log" | tail -25
  timeout ${BENCH_TIMEOUT:-300} python3 bench/streaming.py --dir /tmp/ntx --no-odirect --no-70b --splits \
    --hybrid-splits ${SPLITS:-24} --batches 1 16 --link-cap off --json "$L/streaming_b16.json" 2>&1 \
    | tee "$L/streaming_b16.log" | grep -v "^ *[0-9]* rows" | tail -12
  echo "quality phase done at $(( $(date +%s) - t0 )) s"
elif [ "$PHASE" = big ]; then
  for i in $(seq 1 200); do [ -f /tmp/ntx/llama3-70b-q4_k_m.gguf ] && ! pgrep -f "llama3-70b" >/dev/null && break; sleep 3; done
  tail -2 /tmp/synth70.log
  timeout 330 python3 bench/streaming.py --dir /tmp/ntx --no-odirect --splits --hybrid-splits --hybrid-70b \
    --batches 1 16 --link-cap off --json "$L/streaming70.json" 2>&1 | tee "$L/streaming70.log" | grep -v "^ *[0-9]* rows" | tail -20
  timeout 240 python3 bench/speculative_gpu.py --dir /tmp/ntx --no-8b --no-verify --host-compute auto \
    --json "$L/speculative_gpu_hybrid.json" 2>&1 | tee "$L/speculative_gpu_hybrid.log" | tail -20
  echo "big phase done at $(( $(date +%s) - t0 )) s"
else
  timeout ${BENCH_TIMEOUT:-560} python3 bench/streaming.py --dir /tmp/ntx --no-odirect ${NO70B:---no-70b} \
    --splits ${SPLITS:-} --batches 1 16 $( [ -x $bin ] && echo --llama-bench $bin ) \
    --json "$L/streaming.json" 2>&1 | tee "$L/streaming.log" | tail -60
  echo "bench done at $(( $(date +%s) - t0 )) s"
fi
tar czf "$OUT/logs.tgz" -C "$OUT" logs
