#!/usr/bin/env bash
# The end-of-round device calls, back to back (files in /tmp last while the machine stays warm):
#   PHASE=tests:  the GPU tests and every GPU benchmark's smoke run (then attention_gpu.py's table: ATTN_GPU=0 skips); llama.cpp (llama-bench,
#                 llama-batched-bench, llama-perplexity) built in the background (NO_LLAMA=1: not);
#   PHASE=cost:   the model's first half kept (as stash) and bench/ab_decode.py (the redesign's A/A
#                 against .ab/old.tgz, `git archive` of the code before it; the deterministic mode's
#                 cost at B = 1/16/64), then user_path's rows at depth (8b:32, 8b:16, 8b:0);
#   PHASE=stash:  the first half of the default model (.gpu-full-a/part) kept in /tmp for
#   PHASE=checks: the default model whole again (.gpu-full-b/part): the six reference prompts
#                 paged on the GPU (tests/gpu/test_kv_paged.py), the daemon-level invariance
#                 (tests/gpu/test_daemon_invariance.py), kv_spill on the real model (kv_capacity too with CAPACITY_REAL=1), bench/hybrid_quality.py on it
#                 (QUALITY=1), bench/profile_decode.py on it at 1/16/64 rows
#                 under NTX_F16_LEGACY=0 and 1 (PROFILE=1; the default with SERVE_ONLY=1), SPILL=0 skips
#                 kv_spill, SERVE_ONLY=1 runs only the serving rows below, bench/serving_gpu.py (the default
#                 model against llama-batched-bench at 1/16/64, under NTX_F16_LEGACY=0 and 1; then the 8B shape
#                 at 1/16/64 clients unless SERVE8B=0), bench/host_ceiling.py (the serving path alone on
#                 this host's CPU) unless SERVE=0 (CEILING=0: not host_ceiling); KL=1: the KL table's GPU rows, ours and llama.cpp's;
#   PHASE=long:   (SPILL8B=0 / LONG_CONTEXT=0: without kv_spill / long_context, to split it over two calls)
#                 bench/attention_split.py (host layers' attention on the GPU: the round trip against the
#                 host's own; ATTN_SPLIT=0: not), bench/kv_spill.py (8B shape: chats of 4k/8k/16k spilled to host RAM and restored,
#                 against prefilled again, bit for bit) and bench/long_context.py (70B shape, file context 131072, 24 GiB, q8_0 KV,
#                 4 sequences of 32k at once through the daemon: 512 against 32k); CAPACITY=1 adds
#                 bench/kv_capacity.py (8B shape) first. The 8B and 70B files are made in the
#                 background at the end of PHASE=tests (a file of theirs made before 2026-12-05 says
#                 context 8192: long_context.py stops and says so).
#   PHASE=userpath: bench/host_link.py (the host's DRAM shared by the link and the cores: the
#                 hybrid's ceiling; HOST_LINK=0: not), then bench/user_path.py, the benchmark of record (the daemon over its socket and
#                 ntx-model run against llama-bench -d, alternated), on the files PHASE=tests made;
#                 PLANS="70b:24GiB" NOISY= OFF= CLI= TAG=_70b for the 70B row; CLIGAP=1 then bench/cli_gap.py
#                 (the daemon against ntx-model run's loop at 8b:24, in turns, stream intervals 0 / 0.02 / 0.05).
#   (device tool) PHASE=tests:  carry .whl .whl-extra .llama .gpu-data ; bash bench/session_round.sh
#                 PHASE=stash:  carry .whl-extra .gpu-full-a (64 MiB a call: the model goes in halves;
#                               .whl-extra: the llguidance cp312 wheel the daemon imports)
#                 PHASE=checks: carry .whl .gpu-full-b (with a copy of GPL-3)
# Make every carried folder in a fresh checkout with bench/make_carries.sh (the model halves: head -c / tail -c).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$(dirname "$0")/out}; L=$OUT/logs; mkdir -p "$L" /tmp/ntx
if [ "$PHASE" = stash ]; then  # the model's first half and the daemon's llguidance wheel (.whl-extra), nothing else
  cp .gpu-full-a/part /tmp/full.a && ls -la /tmp/full.a
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-extra .whl-extra/*.whl
  exit $?
fi
# the wheels: carried in the first call; later calls on the same warm machine find them in /tmp
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
elif [ ! -d /tmp/site ]; then
  echo "no .whl carried and none installed on this machine: carry .whl" >&2; exit 1
fi
# the daemon imports llguidance: the GPU tests and smokes that start one need it (carry .whl-extra in PHASE=tests too)
[ -d .whl-extra ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site-extra .whl-extra/*.whl
export PYTHONPATH=/tmp/site:/tmp/site-extra:$PWD/daemon:$PWD/client:$PWD/system:$PWD/proto
t0=$(date +%s)
llama=/tmp/llama/llama.cpp/build/bin
if [ "${PHASE:-tests}" = tests ]; then
  # (SIGINT at the limit: pytest still prints its summary and the 30 slowest tests; 2026-12-06 an H100 ran
  # tests/gpu 4-10x slower than the day before, with nothing to say where the time went)
  # the build at the lowest priority: at -j16 beside the tests it slowed them tenfold (H100, 2026-12-05:
  # 12% of the tests in 400 s, against all of tests/gpu in 210 s alone)
  [ -n "$NO_LLAMA" ] || [ -x $llama/llama-batched-bench ] || ( JOBS=${BUILD_JOBS:-12} setsid nohup nice -n 19 \
                                         bash bench/llamacpp/build.sh /tmp/llama > /tmp/llama_build.log 2>&1; \
                                         echo "rc=$?" >> /tmp/llama_build.log ) &
  timeout -s INT -k 20 ${TEST_TIMEOUT:-540} python3 -m pytest -q -p no:cacheprovider -o addopts="" --timeout 250 -rfE --tb=short --durations=30 \
    ${PYTEST_PATHS:-tests/gpu tests/bench/test_smoke.py -k "gpu"} 2>&1 | tee "$L/tests.log" | grep -v "^\.*$" | tail -30
  echo "tests done at $(( $(date +%s) - t0 )) s"
  # the 8B and 70B files for PHASE=long, made after the tests (beside them they slowed the tests by half)
  [ -n "$NO_SYNTH" ] || ( setsid nohup python3 -c "
import sys; sys.path.insert(0, 'bench'); import common
for shape in ('llama3-8b', 'llama3-70b'): print(common.synthetic('/tmp/ntx', shape, 'q4_k_m'))" > /tmp/synth.log 2>&1 & )
  [ "${ATTN_GPU:-1}" = 1 ] && timeout ${ATTN_TIMEOUT:-90} python3 bench/attention_gpu.py \
    --json "$L/attention_gpu.json" 2>&1 | tee "$L/attention_gpu.log" | tail -40
  [ -n "$NO_LLAMA" ] || for i in $(seq 1 ${LLAMA_WAIT:-60}); do grep -q rc= /tmp/llama_build.log 2>/dev/null && break; sleep 2; done
  [ -n "$NO_LLAMA" ] || tail -2 /tmp/llama_build.log | tee "$L/llama_build.log"
elif [ "$PHASE" = cost ]; then  # the model's first half kept; the invariant mode's cost and the redesign's A/A
  # (bench/ab_decode.py: the checkout before the redesign, .ab/old.tgz, against this one, deterministic off and on);
  # then the user-path rows that this round's kernels move (depth: all resident, 16 and 0 resident)
  [ -d .gpu-full-a ] && cp .gpu-full-a/part /tmp/full.a
  for i in $(seq 1 100); do [ -f /tmp/ntx/llama3-8b-q4_k_m.gguf ] && ! pgrep -f "common.synthetic" >/dev/null && break; sleep 2; done
  if [ -f .ab/old.tgz ]; then
    rm -rf /tmp/old /tmp/mid && mkdir -p /tmp/old /tmp/mid && tar xzf .ab/old.tgz -C /tmp/old && tar xzf .ab/mid.tgz -C /tmp/mid
    # 12d0660 (before the redesign) against 3d8e7d8 (after it, no kernel changed): the A/A; then this checkout
    timeout ${AB_TIMEOUT:-300} python3 bench/ab_decode.py --dir /tmp/ntx --code /tmp/old /tmp/mid . . \
      --env '' '' NTX_DETERMINISTIC=0 NTX_DETERMINISTIC=1 \
      --rounds ${AB_ROUNDS:-2} --batches 1 16 64 --json "$L/ab_decode.json" 2>&1 | tee "$L/ab_decode.log" | tail -24
  fi
  timeout ${USERPATH_TIMEOUT:-330} python3 bench/user_path.py --dir /tmp/ntx --llama-bench $llama/llama-bench \
    --plans ${PLANS:-8b:32 8b:16 8b:0} --noisy ${NOISY-} --off ${OFF-} --cli "${CLI-8b:16}" \
    --rounds ${ROUNDS:-3} --tokens ${TOKENS:-32} --deadline ${DEADLINE:-300} \
    --json "$L/user_path${TAG}.json" --png "$L/user_path${TAG}.png" 2>&1 | tee "$L/user_path${TAG}.log" | tail -30
elif [ "$PHASE" = userpath ]; then  # the benchmark of record (8B rows; PLANS/NOISY/CLI to change them)
  for i in $(seq 1 100); do [ -f /tmp/ntx/llama3-8b-q4_k_m.gguf ] && ! pgrep -f "common.synthetic" >/dev/null && break; sleep 2; done
  # the hybrid's byte ceiling: the host's DRAM feeding the link and the cores at once (~15 s)
  [ "${HOST_LINK:-1}" = 1 ] && timeout 60 python3 bench/host_link.py --dir /tmp/ntx --json "$L/host_link.json" 2>&1 \
    | tee "$L/host_link.log" | tail -8
  timeout ${USERPATH_TIMEOUT:-560} python3 bench/user_path.py --dir /tmp/ntx --llama-bench $llama/llama-bench \
    --plans ${PLANS:-8b:32 8b:24 8b:16 8b:8 8b:0} --noisy ${NOISY-8b:24} --off ${OFF-8b:24} --cli "${CLI-8b:24}" \
    --rounds ${ROUNDS:-5} --tokens ${TOKENS:-32} --deadline ${DEADLINE:-520} \
    --json "$L/user_path${TAG}.json" --png "$L/user_path${TAG}.png" 2>&1 | tee "$L/user_path${TAG}.log" | tail -30
  # CLIGAP=1: the daemon against ntx-model run's loop at 8b:24 in turns (issue 34 item 3; bench/cli_gap.py), the
  # daemon's stream interval 0.02 (the default), 0 (a message a step, as before it) and 0.05, the client's old threads
  if [ -n "$CLIGAP" ]; then
    B=$(python3 -c "import sys; sys.path.insert(0,'bench'); import user_path; print(*user_path.budget_for('/tmp/ntx/llama3-8b-q4_k_m.gguf', 24, 4192))")
    timeout ${CLIGAP_TIMEOUT:-300} python3 bench/cli_gap.py --model /tmp/ntx/llama3-8b-q4_k_m.gguf --turns ${CLIGAP_TURNS:-6} \
      --tokens 128 --flags "--backend cuda --host-compute auto --vram-budget ${B% *} --kv-blocks ${B#* } --max-batch 1 --max-ctx 4192" \
      --sides daemon cli daemon:interval=0 daemon:interval=0.05 daemon:client=threads --json "$L/cli_gap.json" 2>&1 \
      | tee "$L/cli_gap.log" | tail -30
  fi
elif [ "$PHASE" = long ]; then
  # host layers' attention on the GPU, by its parts (issue 34 item 4; ~30 s, the host idle otherwise; ATTN_SPLIT=0: not)
  [ "${ATTN_SPLIT:-1}" = 1 ] && timeout 90 python3 bench/attention_split.py --json "$L/attention_split.json" 2>&1 \
    | tee "$L/attention_split.log" | tail -6
  # the 8B file for kv_spill, the 70B (made after it) for long_context
  want=/tmp/ntx/llama3-8b-q4_k_m.gguf; [ "${LONG_CONTEXT:-1}" = 1 ] && want=/tmp/ntx/llama3-70b-q4_k_m.gguf
  for i in $(seq 1 ${SYNTH_WAIT:-150}); do [ -f $want ] && { [ $want != /tmp/ntx/llama3-70b-q4_k_m.gguf ] || \
    ! pgrep -f "common.synthetic" >/dev/null; } && break; sleep 3; done
  tail -3 /tmp/synth.log
  [ -n "$CAPACITY" ] && timeout ${CAPACITY_TIMEOUT:-200} python3 bench/kv_capacity.py --dir /tmp/ntx \
    --json "$L/kv_capacity.json" 2>&1 | tee "$L/kv_capacity.log" | tail -16
  # (PHASE=checks runs it on the default model: its context, 8192, takes the 4k chat)
  [ "${SPILL8B:-1}" = 1 ] && timeout ${SPILL_TIMEOUT:-120} python3 bench/kv_spill.py --dir /tmp/ntx --json "$L/kv_spill_8b.json" 2>&1 \
    | tee "$L/kv_spill_8b.log" | tail -10
  [ "${LONG_CONTEXT:-1}" = 1 ] && timeout ${LONG_TIMEOUT:-420} python3 bench/long_context.py --dir /tmp/ntx ${LONG_ARGS-} --json "$L/long_context.json" \
    2>&1 | tee "$L/long_context.log" | tail -40
else
  model=/tmp/smollm2.gguf
  [ -f $model ] || cat /tmp/full.a .gpu-full-b/part > $model
  ls -la $model
  # SERVE_ONLY=1: the serving rows alone (a later call on the same warm machine)
  if [ -z "$SERVE_ONLY" ]; then
  # two runs: a -k filter applies to every path given, and the invariance tests are not named six_reference
  NTX_FULL_MODEL=$model timeout ${CHECKS_TIMEOUT:-240} bash -c "python3 -m pytest -q -p no:cacheprovider -o addopts='' \
    tests/gpu/test_kv_paged.py -k six_reference; python3 -m pytest -q -p no:cacheprovider -o addopts='' -rfE \
    ${CHECK_TESTS:-tests/gpu/test_daemon_invariance.py}" 2>&1 | tee "$L/six_prompts.log" | tail -12
  [ -n "$CAPACITY_REAL" ] && timeout ${CAPACITY_TIMEOUT:-150} python3 bench/kv_capacity.py --model $model \
    --json "$L/kv_capacity_real.json" 2>&1 | tee "$L/kv_capacity_real.log" | tail -8
  [ "${SPILL:-1}" = 1 ] && timeout ${SPILL_TIMEOUT:-150} python3 bench/kv_spill.py --model $model \
    --json "$L/kv_spill.json" 2>&1 | tee "$L/kv_spill.log" | tail -12
  if [ -n "$KL" ]; then  # issue 35's GPU rows: our cuda and hybrid paths against our exact run, same texts as the CPU table
    timeout ${KL_TIMEOUT:-200} python3 bench/kl_divergence.py --model $model --engines exact,cpu,cuda,hybrid \
      --texts .gpu-full-b/GPL-3 .gpu-full-b/MPL-1.1 --threads 16 --chunks ${KL_CHUNKS:-6} 2>&1 | tee "$L/kl_gpu.log" | tail -14
    # llama.cpp's rows: its GPU (-ngl 99) and CPU (-ngl 0) runs of the same file against its F32 run
    if [ -x $llama/llama-perplexity ]; then
      [ -f /tmp/smollm2-f32.gguf ] || python3 -m ntransformerd.tools.ntx_model quantize $model /tmp/smollm2-f32.gguf \
        --type f32 --quiet
      CHUNKS=${KL_CHUNKS:-6} timeout ${KLD_TIMEOUT:-120} bash bench/llamacpp/kld.sh $llama $model /tmp/smollm2-f32.gguf \
        .gpu-full-b/GPL-3 .gpu-full-b/MPL-1.1 2>&1 | tee "$L/kl_llama.log"
    fi
  fi
  if [ -n "$QUALITY" ]; then
    text=/usr/share/common-licenses/GPL-3; [ -f $text ] || text=.gpu-full-b/GPL-3
    timeout ${QUALITY_TIMEOUT:-150} python3 bench/hybrid_quality.py --model $model --text $text \
      --json "$L/hybrid_quality.json" 2>&1 | tee "$L/hybrid_quality.log" | grep -v "^ *[0-9]* rows" | tail -14
  fi
  fi
  # where the default model's step goes, kernel by kernel, at 1 / 16 / 64 rows (issue 36: small models' serving)
  # (twice: the Q4_1 matvecs on the generic kernel, then on the f16 tensor cores: NTX_F16_LEGACY=1)
  [ "${PROFILE:-${SERVE_ONLY:-0}}" = 1 ] && for lg in ${LEGACY_AB-0 1}; do NTX_F16_LEGACY=$lg timeout ${PROFILE_TIMEOUT:-100} \
    python3 bench/profile_decode.py --model $model --batch 1 16 64 --json "$L/profile_default_f16legacy$lg.json" 2>&1 \
    | tee "$L/profile_default_f16legacy$lg.log" | tail -24; done
  [ "${SERVE:-1}" = 1 ] || { echo "phase checks done at $(( $(date +%s) - t0 )) s (SERVE=0: no serving rows)"; \
    tar czf "$OUT/logs.tgz" -C "$OUT" logs; exit 0; }
  # the default model against llama-batched-bench at 1/16/64, its Q4_1 matvecs generic (0) and f16 (1), then the 8B rows
  [ -x $llama/llama-batched-bench ] && for lg in ${LEGACY_AB-0 1}; do NTX_F16_LEGACY=$lg timeout ${SERVE_DEFAULT_TIMEOUT:-150} \
    python3 bench/serving_gpu.py --default-only --default-model $model --batched-bench $llama/llama-batched-bench \
    --json "$L/serving_default_f16legacy$lg.json" 2>&1 | tee "$L/serving_default_f16legacy$lg.log" | tail -5; done
  [ "${SERVE8B:-1}" = 1 ] && timeout ${SERVE_TIMEOUT:-330} python3 bench/serving_gpu.py --dir /tmp/ntx \
    --clients ${CLIENTS:-1 16 64} --json "$L/serving_gpu.json" 2>&1 | tee "$L/serving_gpu.log" | tail -12
  # the serving path's ceiling on this host's CPU (no GPU work): steps that cost nothing, and a
  # stand-in device of the default model's step, to set beside the daemon's figures above
  [ "${CEILING:-1}" = 1 ] && timeout ${CEILING_TIMEOUT:-120} python3 bench/host_ceiling.py --model $model --clients 1 16 64 --repeats 2 \
    --max-tokens 128 --json "$L/host_ceiling.json" 2>&1 | tee "$L/host_ceiling.log" | tail -8
fi
echo "phase ${PHASE:-tests} done at $(( $(date +%s) - t0 )) s"
tar czf "$OUT/logs.tgz" -C "$OUT" logs
