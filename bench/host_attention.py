"""Time of one layer's decode attention on the host (kernels/cpu/attention.c), the kernel the
steps run against the reference it replaced, at several context lengths, on 8B shapes (32 query
heads, 8 KV heads, head_dim 128) by default.

    .venv/bin/python bench/host_attention.py [--smoke] [--threads 16] [--contexts 512,1024,4096,16384]
                                             [--dtype f16] [--rows 1] [--repeat 5] [--json out.json]

Each context is `rows` sequences of that many random keys in a paged cache of `--dtype`, one
decode row each (backends/host/attention.py: AttentionProbe). The figure is the median wall time
of one call over every KV head; `same_bits` says whether the two kernels' outputs are identical
(they must be: the same chains in the same order). Kernels are those of this tree, built for the
best variant this CPU runs (or --variant).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "daemon")]  # this tree's kernels, not an installed copy's
from ntransformerd.engine.backends.host import native  # noqa: E402
from ntransformerd.engine.backends.host.attention import AttentionProbe  # noqa: E402
from ntransformerd.engine.gguf_file import LlamaConfig  # noqa: E402


def shapes(n_heads: int, n_kv_heads: int, head_dim: int) -> LlamaConfig:
    return LlamaConfig(n_layers=1, d_model=n_heads * head_dim, d_ff=4 * n_heads * head_dim, n_heads=n_heads,
                       n_kv_heads=n_kv_heads, head_dim=head_dim, vocab_size=32000, context_length=1 << 20,
                       rms_eps=1e-5, rope_base=5e5, rope_dim=head_dim, rope_neox=False, rope_scale=1.0,
                       tied_output=False)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="small contexts, one repeat: checks the script runs")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--contexts", default="512,1024,4096,16384", help="positions per sequence")
    p.add_argument("--dtype", default="f16", help="KV cache storage: f16, q8_0, f32")
    p.add_argument("--rows", type=int, default=1, help="sequences, one decode row each")
    p.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head_dim (8B: 32,8,128)")
    p.add_argument("--variant", default=None, help="kernel build: " + ", ".join(v.name for v in native.VARIANTS))
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", default=os.path.join(ROOT, "bench", "out", "host_attention.json"))
    args = p.parse_args()
    if args.smoke:
        args.contexts, args.repeat = "64,300", 1
    cfg = shapes(*(int(x) for x in args.heads.split(",")))
    lib = native.load(args.variant)
    print(f"{lib.variant.name} build, {args.threads} threads, {args.rows} rows, KV {args.dtype}, heads {args.heads}")
    print(f"{'context':>8} {'ref ms':>9} {'new ms':>9} {'speedup':>8} {'new ns/pos':>11}  same bits")
    results = []
    for ctx in (int(x) for x in args.contexts.split(",")):
        probe = AttentionProbe(cfg, dtype=args.dtype, positions=ctx, rows=args.rows, lib=lib)
        same = bool(np.array_equal(probe.run(threads=args.threads, ref=True).view(np.uint32),
                                   probe.run(threads=args.threads).view(np.uint32)))
        ref = probe.seconds(threads=args.threads, ref=True, repeats=args.repeat)
        new = probe.seconds(threads=args.threads, repeats=args.repeat)
        per_pos = new / (ctx * args.rows)
        print(f"{ctx:8d} {ref * 1e3:9.3f} {new * 1e3:9.3f} {ref / new:7.2f}x {per_pos * 1e9:11.1f}  {same}", flush=True)
        results.append(dict(context=ctx, ref_seconds=ref, new_seconds=new, speedup=ref / new,
                            new_seconds_per_position=per_pos, same_bits=same))
        del probe
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(dict(variant=lib.variant.name, threads=args.threads, rows=args.rows, dtype=args.dtype,
                       heads=args.heads, results=results, smoke=args.smoke), f, indent=1)
    return 0 if all(r["same_bits"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
