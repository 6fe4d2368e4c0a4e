"""What sampling costs a decode step on the GPU: the top_rows kernel (a row's n most likely ids,
kernels/sample.cu) against argmax_rows, the host's part of a draw from n ids against one from a
whole row, and a batch-1 step of an 8B file as greedy / device top ids / whole rows to the host.

    python bench/sample_top.py --dir /tmp/ntx [--json bench/out/sample.json] [--code DIR]
    python bench/sample_top.py --smoke --dir /tmp/ntx-smoke      # the tiny file, few reps: does it run?

Kernel times: CUDA events around 200 launches, per launch. Step rates: 64 steps after 4 of
warm-up, each with its sampling (SamplingParams defaults: top-k 40, top-p 0.95, min-p 0.05).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import common


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__file__, __doc__)
    ap.add_argument("--dir", default="/tmp/ntx", help="synthetic 8B files (made here if missing)")
    ap.add_argument("--type", default="q4_k_m")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--code", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir),
                    help="the checkout whose daemon/ is imported (default: this one)")
    a = ap.parse_args(argv)
    common.require_gpu(__file__)
    # Imported here: --code says which checkout's engine this measures.
    sys.path.insert(0, os.path.join(os.path.abspath(a.code), "daemon"))
    from ntransformerd.engine.backends import cuda
    from ntransformerd.engine.backends.cuda import StepGraphs, cp
    from ntransformerd.engine.gguf_file import GGUFModel
    try:
        from ntransformerd.engine.generation.sampler import Sampler, SamplingParams, TopLogits
    except ImportError:  # a checkout from before engine/ was grouped
        from ntransformerd.engine.sampler import Sampler, SamplingParams, TopLogits
    from resident import sampled_rates
    steps, reps = (4, 5) if a.smoke else (a.steps, 200)

    out = {"code": os.path.abspath(a.code), "smoke": a.smoke, "kernels": [], "host": {}, "steps": {}}
    rng = np.random.default_rng(0)

    def gpu_us(fn):
        fn()
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        for _ in range(reps):
            fn()
        e1.record()
        e1.synchronize()
        return cp.cuda.get_elapsed_time(e0, e1) * 1e3 / reps

    for v in (49152, 128256):
        for b in (1, 16):
            x = cp.asarray((rng.standard_normal((b, v)) * 3).astype(np.float32))
            ids = cp.empty((b,), cp.int32)
            k = {"V": v, "B": b, "argmax_us": gpu_us(lambda: cuda.argmax(x, out=ids))}
            fn = cuda.kernel("sample", "top_rows")
            res = cp.empty((b, 81), cp.int32)  # per row: 40 ids, 40 logits, the NaN count
            k["top40_us"] = gpu_us(lambda: fn((b,), (1024,), (x, np.int32(v), np.int32(40), res)))
            t0 = time.perf_counter()
            for _ in range(reps // 4):
                cuda.top_rows(x, 40)
            k["top_rows_call_us"] = (time.perf_counter() - t0) / (reps // 4) * 1e6  # launch + copy to the host
            out["kernels"].append(k)
            print(f"V={v} B={b}: argmax {k['argmax_us']:.1f} us, top_rows(40) {k['top40_us']:.1f} us on the device, "
                  f"{k['top_rows_call_us']:.1f} us a call with its copy", flush=True)

    v = 49152
    xh = (rng.standard_normal((1, v)) * 3).astype(np.float32)
    s = Sampler(SamplingParams(seed=0), v)
    top = TopLogits.of(xh, 40)
    t0 = time.perf_counter()
    for _ in range(500):
        s.sample(TopLogits(top.ids, top.vals, top.nan)[0])
    t1 = time.perf_counter()
    for _ in range(50):
        s.sample(xh[0])
    t2 = time.perf_counter()
    out["host"] = {"top40_draw_us": (t1 - t0) / 500 * 1e6, "whole_row_draw_us": (t2 - t1) / 50 * 1e6}
    print(f"host: a draw from 40 ids {out['host']['top40_draw_us']:.1f} us, from a whole row of {v} "
          f"{out['host']['whole_row_draw_us']:.1f} us", flush=True)

    model = GGUFModel(common.synthetic(a.dir, "tiny" if a.smoke else "llama3-8b", a.type))
    ops, weights = cuda.load(model)
    kv = cuda.kv_cache(model.config, n_slots=4, max_ctx=1024)
    dec = StepGraphs(ops, weights, kv)
    out["steps"] = sampled_rates(dec, kv, model.config, steps, modes=("greedy", "device_top", "host_rows"))
    print(f"{a.type} B=1: greedy {out['steps']['greedy']:.1f} tok/s, sampled with the device's top ids "
          f"{out['steps']['device_top']:.1f}, with whole rows to the host {out['steps']['host_rows']:.1f}", flush=True)
    common.write_json(a.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
