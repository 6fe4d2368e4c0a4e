"""Time of one layer's decode attention on the host (kernels/cpu/attention.c) at several context
lengths, on 8B shapes (32 query heads, 8 KV heads, head_dim 128) by default: the kernel the steps
run ("step": past NTX_ATTN_SPLIT = 1024 positions a row's keys in splits, spread over the threads
and merged in order), the same kernel before splits ("whole": a (row, KV head) item each), and
the reference both replaced ("ref").

    .venv/bin/python bench/host_attention.py [--smoke] [--threads 16] [--contexts 512,1024,4096,16384]
                                             [--dtype f16] [--rows 1] [--heads 32,8,128] [--repeat 5]
                                             [--json out.json]

Each context is `rows` sequences of that many random keys in a paged cache of `--dtype`, one
decode row each (backends/host/attention.py: AttentionProbe). The kernels are timed in turn,
one call each per round, `--repeat` rounds after a warm-up (a loaded host's drift falls on all of
them alike); the figure is each kernel's median wall time of one call over every KV head, with the
fastest and slowest call. `same_bits`: whole == ref, which must hold at every context (the same
chains in the same order); `step_same_bits`: step == whole, which must hold up to 1024 positions
(one split: the same path) and does not past it (the splits round differently; step_max_diff is
the largest difference). Kernels are those of this tree, built for the best variant this CPU runs
(or --variant).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "daemon")]  # this tree's kernels, not an installed copy's
from ntransformerd.engine.backends.host import native  # noqa: E402
from ntransformerd.engine.backends.host.attention import AttentionProbe  # noqa: E402
from ntransformerd.engine.gguf_file import LlamaConfig  # noqa: E402

SPLIT = 1024  # kernels/cpu/attention.h NTX_ATTN_SPLIT
KERNELS = ("ref", "whole", "step")


def shapes(n_heads: int, n_kv_heads: int, head_dim: int) -> LlamaConfig:
    return LlamaConfig(n_layers=1, d_model=n_heads * head_dim, d_ff=4 * n_heads * head_dim, n_heads=n_heads,
                       n_kv_heads=n_kv_heads, head_dim=head_dim, vocab_size=32000, context_length=1 << 20,
                       rms_eps=1e-5, rope_base=5e5, rope_dim=head_dim, rope_neox=False, rope_scale=1.0,
                       tied_output=False)


def rounds(probe: AttentionProbe, threads: int, repeats: int) -> dict[str, list[float]]:
    """Each kernel's wall times of one call, the kernels alternating within each round."""
    times: dict[str, list[float]] = {k: [] for k in KERNELS}
    for k in KERNELS:
        probe.run(threads=threads, kernel=k)
    for _ in range(repeats):
        for k in KERNELS:
            t0 = time.perf_counter()
            probe.run(threads=threads, kernel=k)
            times[k].append(time.perf_counter() - t0)
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="a context of one split and one of two, one repeat: "
                                                        "checks the script runs")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--contexts", default="512,1024,4096,16384", help="positions per sequence")
    p.add_argument("--dtype", default="f16", help="KV cache storage: f16, q8_0, f32")
    p.add_argument("--rows", type=int, default=1, help="sequences, one decode row each")
    p.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head_dim (8B: 32,8,128; "
                                                       "SmolLM2-135M: 9,3,64)")
    p.add_argument("--variant", default=None, help="kernel build: " + ", ".join(v.name for v in native.VARIANTS))
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", default=os.path.join(ROOT, "bench", "out", "host_attention.json"))
    args = p.parse_args()
    if args.smoke:
        args.contexts, args.repeat = "64,1500", 1
    cfg = shapes(*(int(x) for x in args.heads.split(",")))
    lib = native.load(args.variant)
    print(f"{lib.variant.name} build, {args.threads} threads, {args.rows} rows, KV {args.dtype}, heads {args.heads}; "
          f"ms: median (fastest-slowest) of {args.repeat}")
    print(f"{'context':>8} {'ref ms':>9} {'whole ms':>22} {'step ms':>22} {'speedup':>8} {'step ns/pos':>12}  "
          f"whole=ref step=whole")
    results, ok = [], True
    for ctx in (int(x) for x in args.contexts.split(",")):
        probe = AttentionProbe(cfg, dtype=args.dtype, positions=ctx, rows=args.rows, lib=lib)
        out = {k: probe.run(threads=args.threads, kernel=k) for k in KERNELS}
        same = bool(np.array_equal(out["whole"].view(np.uint32), out["ref"].view(np.uint32)))
        step_same = bool(np.array_equal(out["step"].view(np.uint32), out["whole"].view(np.uint32)))
        diff = float(np.abs(out["step"] - out["whole"]).max())
        ok &= same and np.isfinite(out["step"]).all() and (step_same or ctx > SPLIT)
        times = rounds(probe, args.threads, args.repeat)
        med = {k: statistics.median(v) for k, v in times.items()}
        per_pos = med["step"] / (ctx * args.rows)

        def cell(k: str) -> str:
            return f"{med[k] * 1e3:.3f} ({min(times[k]) * 1e3:.3f}-{max(times[k]) * 1e3:.3f})"
        print(f"{ctx:8d} {med['ref'] * 1e3:9.3f} {cell('whole'):>22} {cell('step'):>22} "
              f"{med['whole'] / med['step']:7.2f}x {per_pos * 1e9:12.1f}  {str(same):>9} {str(step_same):>10}"
              + ("" if step_same else f" (max diff {diff:.2g})"), flush=True)
        results.append(dict(context=ctx, ref_seconds=med["ref"], whole_seconds=med["whole"], step_seconds=med["step"],
                            speedup=med["whole"] / med["step"], step_seconds_per_position=per_pos, same_bits=same,
                            step_same_bits=step_same, step_max_diff=diff,
                            times={k: v for k, v in times.items()}))
        del probe
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(dict(variant=lib.variant.name, threads=args.threads, rows=args.rows, dtype=args.dtype,
                       heads=args.heads, split=SPLIT, results=results, smoke=args.smoke), f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
