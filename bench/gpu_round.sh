#!/usr/bin/env bash
# One device call for the one-forward-pass change: wheels, kernels, the GPU tests, then the
# same-run A/B of the decode step against the previous engine (a checkout in .ab/old).
#   (device tool) carry: .whl .ab .gpu-data ; command: bash bench/gpu_round.sh
#   TESTS=0 skips the tests; AB=0 the A/B; SLICE=0 the real-slice greedy checks; SPEC=1 adds
#   bench/speculative_gpu.py; PYTEST_PATHS narrows the tests.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$(dirname "$0")/out}; L=$OUT/logs; mkdir -p "$L"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/daemon:$PWD/client:$PWD/system:$PWD/proto
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
if [ "${SLICE:-1}" = 1 ] && [ -f .gpu-data/smollm2-4l.gguf ]; then
  # Greedy ids on the real-weights slice: ntx-model run before (.ab/old) and after, and the daemon after.
  args=(run .gpu-data/smollm2-4l.gguf --backend cuda --prompt "The capital of France is" --temperature 0 --max-tokens 24 --ignore-eos --json)
  python3 -c "import sys; sys.path[:0] = ['.ab/old/' + d for d in ('daemon', 'client', 'system', 'proto')]; from ntransformerd.tools.ntx_model import main; sys.exit(main(sys.argv[1:]))"     "${args[@]}" 2>"$L/slice.err" | tail -1 > "$L/slice_old.json"
  python3 -m ntransformerd.tools.ntx_model "${args[@]}" 2>>"$L/slice.err" | tail -1 > "$L/slice_new.json"
  python3 - "$L" <<'PY' 2>&1 | tee "$L/slice.log"
import json, sys
d = sys.argv[1]
old, new = (json.load(open(f"{d}/slice_{w}.json")).get("ids") for w in ("old", "new"))
print("slice greedy ids (ntx-model run, cuda): old == new:", old == new, len(new or []), "ids")
PY
  sock=$(mktemp -d /tmp/ntx-gpu.XXXXXX)/ntx.sock  # a private directory: the daemon refuses /tmp itself
  python3 -m ntransformerd.main --socket $sock --socket-group '' --config /dev/null --backend cuda \
    --model .gpu-data/smollm2-4l.gguf --log-level warning > "$L/daemon.log" 2>&1 &
  dpid=$!
  python3 -c "from ntx_client import Client; Client('$sock').wait_ready(timeout=120)" 2>>"$L/daemon.log" \
    && python3 -m ntx_client.cli --socket $sock generate --raw "The capital of France is" \
       --temperature 0 --max-tokens 24 --ignore-eos --json 2>>"$L/daemon.log" | tail -1 > "$L/slice_daemon.json"
  kill -TERM $dpid; wait $dpid
  python3 - "$L" <<'PY' 2>&1 | tee -a "$L/slice.log"
import json, sys
d = sys.argv[1]
try:
    new, dae = json.load(open(f"{d}/slice_new.json"))["ids"], json.load(open(f"{d}/slice_daemon.json"))["ids"]
    print("slice greedy ids: daemon (cuda) == ntx-model run:", dae == new)
except Exception as e:
    print("slice daemon check failed:", e)
PY
fi
if [ "${SPEC:-0}" = 1 ]; then
  timeout ${SPEC_TIMEOUT:-300} python3 bench/speculative_gpu.py --dir /tmp/ntx ${SPEC_ARGS:-} --json "$L/speculative_gpu.json" 2>&1 \
    | tee "$L/speculative_gpu.log" | tail -30
  echo "speculative done at $(( $(date +%s) - t0 )) s"
fi
tar czf "$OUT/logs.tgz" -C "$OUT" logs
