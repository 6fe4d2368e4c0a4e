#!/usr/bin/env bash
# One device call for the one-forward-pass change: wheels, kernels, the GPU tests, then the
# same-run A/B of the decode step against the previous engine (a checkout in .ab/old).
#   (device tool) carry: .whl .ab .gpu-data ; command: bash bench/gpu_round.sh
#   TESTS=0 skips the tests; AB=0 the A/B; PYTEST_PATHS narrows the tests.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$(dirname "$0")/out}; L=$OUT/logs; mkdir -p "$L"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/daemon
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.total --format=csv > "$L/gpu.txt" 2>&1
t0=$(date +%s)
python3 -c "from ntransformerd.engine.backends import cuda; print('precompiled', cuda.precompile(12))" 2>&1 | tail -3 | tee "$L/precompile.log"
echo "precompile $(( $(date +%s) - t0 )) s"
if [ "${TESTS:-1}" = 1 ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -o addopts="" --timeout 200 ${PYTEST_PATHS:-tests/gpu} 2>&1 \
    | tee "$L/gpu_tests.log" | grep -v "^\.*$" | tail -40
  echo "tests done at $(( $(date +%s) - t0 )) s"
fi
if [ "${AB:-1}" = 1 ]; then
  timeout ${AB_TIMEOUT:-330} python3 bench/ab_decode.py --code .ab/old . --dir /tmp/ntx --rounds ${ROUNDS:-2} \
    --json "$L/ab.json" 2>&1 | tee "$L/ab.log" | tail -30
  echo "ab done at $(( $(date +%s) - t0 )) s"
fi
tar czf "$OUT/logs.tgz" -C "$OUT" logs
