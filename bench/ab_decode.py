"""Same-run A/B of the captured decode step: device time per step under variants of the code.

    python bench/ab_decode.py --dir /tmp/ntx --types q8_0 q4_k_m --batch 1 --rounds 3 \
        --variant pdl --variant nopdl 'cuda_decode.PDL_MAX_BUCKET=0' --json ab.json
    python bench/ab_decode.py --code /tmp/old --variant base ...   # another checkout's engine

A variant is a name and `module.ATTR=python-expression` settings (modules: cuda, cuda_decode)
applied while its DecodeGraphs is captured and measured, then undone. Variants take turns,
`rounds` times each; every measurement runs on a fresh sequence slot with the same context
lengths, its device time from steps replayed back to back (resident.device_step_s, median of 3).
Tok/s and the share of the HBM roofline use the device-to-device copy bandwidth measured in the
same process. Compare variants of one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/ntx", help="synthetic 8B files (made here if missing)")
    ap.add_argument("--types", nargs="+", default=["q8_0", "q4_k_m"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variant", nargs="+", action="append", metavar=("NAME", "SETTING"),
                    help="a name, then module.ATTR=expr settings (repeat the option per variant)")
    ap.add_argument("--code", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir),
                    help="the checkout whose daemon/ is imported (default: this one)")
    ap.add_argument("--json", default="ab.json")
    a = ap.parse_args()
    variants = a.variant or [["base"]]
    sys.path.insert(0, os.path.join(os.path.abspath(a.code), "daemon"))
    sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))

    import cupy as cp
    import numpy as np
    from ntransformerd.engine.backends import cuda, cuda_decode
    from ntransformerd.engine.gguf_file import GGUFModel
    from resident import copy_bandwidth, device_step_s, synthetic_8b

    modules = {"cuda": cuda, "cuda_decode": cuda_decode}

    def apply(settings):
        undo = []
        for s in settings:
            target, expr = s.split("=", 1)
            mod, attr = target.split(".", 1)
            m = modules[mod]
            undo.append((m, attr, getattr(m, attr)))
            setattr(m, attr, eval(expr, {"np": np, "cuda": cuda}))  # noqa: S307 (the caller's own settings)
        return undo

    bw = copy_bandwidth()
    print(f"code {os.path.abspath(a.code)}; device-to-device copy {bw / 1e9:.0f} GB/s", flush=True)
    out = {"code": os.path.abspath(a.code), "copy_bw_Bps": bw, "batch": a.batch, "files": []}
    for ftype in a.types:
        path = synthetic_8b(a.dir, ftype)
        model = GGUFModel(path)
        ops, weights = cuda.load(model)
        kv = cuda.kv_cache(model.config, n_slots=a.batch + 2, max_ctx=1024)
        roofline = bw / os.path.getsize(path)
        times = {v[0]: [] for v in variants}
        for _ in range(a.rounds):
            for name, *settings in variants:
                undo = apply(settings)
                try:
                    dec = cuda_decode.DecodeGraphs(ops, weights, kv)
                    slots = [kv.alloc() for _ in range(a.batch)]
                    toks = np.arange(a.batch, dtype=np.int32) + 100
                    for _ in range(4):  # capture + warm-up
                        toks = dec.step(slots, toks)
                    times[name].append(statistics.median(device_step_s(dec, slots, toks) for _ in range(3)))
                    for s in slots:
                        kv.free(s)
                    del dec
                finally:
                    for m, attr, old in reversed(undo):
                        setattr(m, attr, old)
        f = {"type": ftype, "roofline_tok_s": roofline, "variants": []}
        for name, *settings in variants:
            t = times[name]
            med = statistics.median(t)
            v = {"name": name, "settings": settings, "device_step_ms": [x * 1e3 for x in t],
                 "median_ms": med * 1e3, "tok_s": a.batch / med, "frac_of_roofline": 1 / med / roofline}
            f["variants"].append(v)
            print(f"{ftype} B={a.batch} {name:14s} device step {med * 1e3:.3f} ms "
                  f"(runs {' '.join(f'{x * 1e3:.3f}' for x in t)}): {v['tok_s']:.1f} tok/s, "
                  f"{100 * v['frac_of_roofline']:.1f}% of roofline {roofline:.1f}", flush=True)
        out["files"].append(f)
        del ops, weights, kv, model
        cp.get_default_memory_pool().free_all_blocks()
    with open(a.json, "w") as fh:
        json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
