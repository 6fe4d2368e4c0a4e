"""Where a captured decode step spends its time, kernel by kernel, in the real sequence.

    python bench/profile_decode.py --dir /tmp/ntx [--json bench/out/profile.json] [--types q8_0 q4_k_m] [--batch 1 16]
    python bench/profile_decode.py --model MODEL.gguf --batch 1 16 64 --no-prefill   # a real file
    python bench/profile_decode.py --smoke --dir /tmp/ntx-smoke     # tiny files: does it run?

The step's kernels are queued eagerly behind a spin kernel (so the GPU runs them back to back,
never waiting for Python), with a timing event after each launch; the gap between two events
is that kernel's time inside the step, L2 state included (weights stream through once, as in
real decode; a matrix timed alone in a loop would partly hit the 50 MB L2). Kernels are then
grouped by (name, grid, weight bytes) and compared with their byte floors (bytes / the
device-to-device bandwidth measured in the same run). The event gaps add ~1 µs per kernel;
the captured graph's own step time is printed beside the sum for scale.
"""

from __future__ import annotations

import collections
import functools
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "daemon"))

import common  # noqa: E402
from ntransformerd.engine.backends import cuda  # noqa: E402
from ntransformerd.engine.backends.cuda import launch  # noqa: E402
from ntransformerd.engine.backends.cuda import StepGraphs, cp  # noqa: E402 (cp is None without CuPy)
from ntransformerd.engine.gguf_file import GGUFModel  # noqa: E402
from resident import copy_bandwidth, device_step_s  # noqa: E402


@functools.cache
def spin():
    """A kernel that holds the GPU for `cycles` clocks (compiled on first use)."""
    return cp.RawKernel(r"""
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}""", "spin")


class Recorder:
    """Wraps cuda.kernel so every launch is followed by an event (when on)."""

    def __init__(self):
        self.on = False
        self.launches: list[tuple[str, tuple, int, object]] = []
        self._orig = launch.kernel

    def install(self):
        rec = self
        orig_matmul = launch.matmul

        def matmul(x, w, s=None):  # prefill's cuBLAS path (dequantize + GEMM + casts) as one entry
            out = orig_matmul(x, w) if s is None else orig_matmul(x, w, s)
            if rec.on:
                ev = cp.cuda.Event()
                ev.record()
                rec.launches.append((f"matmul {w.qtype.name} {x.shape[0]}x{w.shape[1]}->{w.shape[0]}", (), 0, ev))
            return out

        launch.matmul = matmul

        def kernel(family, name):
            fn = rec._orig(family, name)

            def launch(grid, block, args):
                fn(grid, block, args)
                if rec.on:
                    ptrs, nbytes = set(), 0
                    if name.startswith(("mvq_", "mma_", "mmh_", "matvec_", "dequant_rows")):
                        for a in args[:4]:  # the weight planes
                            if isinstance(a, cp.ndarray) and a.data.ptr not in ptrs:
                                ptrs.add(a.data.ptr)
                                nbytes += a.nbytes
                    ev = cp.cuda.Event()
                    ev.record()
                    rec.launches.append((name, tuple(grid), nbytes, ev))
            launch.blocks_per_sm = fn.blocks_per_sm
            return launch

        launch.kernel = kernel


def profile(dec: StepGraphs, kv, batch: int, bw: float, rec: Recorder) -> dict:
    slots = [kv.alloc() for _ in range(batch)]
    try:
        toks = np.arange(batch, dtype=np.int32) + 100
        for _ in range(8):  # capture, warm-up, and some context
            toks = dec.step(slots, toks, advance=True)
        graph_ms = device_step_s(dec, slots, toks) * 1e3
        # The same step, eagerly, behind a spin kernel, an event after each launch.
        runs = []
        for _ in range(3):
            with dec.stream:
                spin()((1,), (1,), (np.int64(60_000_000),))  # ~30 ms: more than queuing the step takes
                start = cp.cuda.Event()
                start.record()
                rec.launches.clear()
                rec.on = True
                dec.launch(slots, toks, eager=True)  # the bucket's pass, kernel by kernel
                rec.on = False
            dec.stream.synchronize()
            t, prev = [], start
            for name, grid, nbytes, ev in rec.launches:
                t.append(cp.cuda.get_elapsed_time(prev, ev) * 1e3)
                prev = ev
            runs.append((list(rec.launches), t))
        launches = runs[0][0]
        times = np.median(np.array([r[1] for r in runs]), axis=0)
    finally:
        for s in slots:
            kv.free(s)
    groups: dict = collections.OrderedDict()
    for (name, grid, nbytes, _), us in zip(launches, times):
        g = groups.setdefault((name, grid, nbytes), {"kernel": name, "grid": list(grid), "bytes": nbytes,
                                                     "count": 0, "us": 0.0})
        g["count"] += 1
        g["us"] += float(us)
    rows = list(groups.values())
    for g in rows:
        g["us_each"] = g["us"] / g["count"]
        g["floor_us_each"] = g["bytes"] / bw * 1e6 if g["bytes"] else None
    total = float(times.sum())
    floor = sum(g["bytes"] * g["count"] for g in rows) / bw * 1e3
    return {"batch": batch, "graph_step_ms": graph_ms, "eager_sum_ms": total / 1e3, "kernels": len(times),
            "weight_floor_ms": floor, "groups": rows}


def profile_prefill(ops, cfg, weights, kv, rec: Recorder, n: int = 512) -> dict:
    """One n-token prefill chunk through model.forward, timed op by op the same way."""
    from ntransformerd.engine.runtime import model as llama
    from ntransformerd.engine.runtime.model import Batch, Segment
    rng = np.random.default_rng(0)
    runs = []
    for r in range(3):
        slot = kv.alloc()
        batch = Batch.of([Segment(slot, 0, rng.integers(0, cfg.vocab_size, n))])
        cp.cuda.Device().synchronize()
        spin()((1,), (1,), (np.int64(200_000_000),))  # ~100 ms
        start = cp.cuda.Event()
        start.record()
        rec.launches.clear()
        rec.on = r > 0  # the first run compiles and warms up
        llama.forward(ops, cfg, weights, kv, batch)
        rec.on = False
        end = cp.cuda.Event()
        end.record()
        end.synchronize()
        kv.free(slot)
        if r:
            t, prev = [], start
            for name, grid, nbytes, ev in rec.launches:
                t.append(cp.cuda.get_elapsed_time(prev, ev) * 1e3)
                prev = ev
            runs.append(([x[0] for x in rec.launches], t, cp.cuda.get_elapsed_time(start, end)))
    names, _, total = runs[0]
    times = np.median(np.array([r[1] for r in runs]), axis=0)
    groups: dict = collections.OrderedDict()
    for name, us in zip(names, times):
        g = groups.setdefault(name, {"op": name, "count": 0, "us": 0.0})
        g["count"] += 1
        g["us"] += float(us)
    return {"tokens": n, "total_ms": float(np.median([r[2] for r in runs])), "groups": list(groups.values())}


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__file__, __doc__)
    ap.add_argument("--dir", default="/tmp/ntx", help="the synthetic files (made here if missing)")
    ap.add_argument("--types", nargs="+", default=["q8_0", "q4_k_m"])
    ap.add_argument("--model", metavar="GGUF", help="profile this file instead of the synthetic --types "
                    "(the default model, say: where a small model's step goes)")
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--max-ctx", type=int, default=1024)
    ap.add_argument("--no-prefill", action="store_true", help="decode steps only")
    a = ap.parse_args(argv)
    common.require_gpu(__file__)
    shape, prefill_tokens = ("tiny", 32) if a.smoke else ("llama3-8b", 512)
    bw = copy_bandwidth(64 << 20 if a.smoke else 4 << 30)
    print(f"device-to-device copy {bw / 1e9:.0f} GB/s", flush=True)
    rec = Recorder()
    rec.install()
    out = {"copy_bw_Bps": bw, "shape": shape, "smoke": a.smoke, "files": []}
    for ftype in ([a.model] if a.model else a.types):
        model = GGUFModel(ftype if a.model else common.synthetic(a.dir, shape, ftype))
        ops, weights = cuda.load(model)
        kv = cuda.kv_cache(model.config, n_slots=max(32, *a.batch), max_ctx=a.max_ctx)
        dec = StepGraphs(ops, weights, kv)
        label = os.path.basename(ftype) if a.model else ftype
        f = {"type": label, "profiles": []}
        for b in a.batch:
            p = profile(dec, kv, b, bw, rec)
            f["profiles"].append(p)
            print(f"\n{label} B={b}: graph step {p['graph_step_ms']:.3f} ms, eager kernels summed "
                  f"{p['eager_sum_ms']:.3f} ms over {p['kernels']} kernels, weight floor {p['weight_floor_ms']:.3f} ms")
            print(f"{'kernel':28s} {'grid':>14s} {'n':>3s} {'total us':>9s} {'each':>7s} {'floor':>7s} {'%bw':>5s}")
            for g in sorted(p["groups"], key=lambda g: -g["us"]):
                fl = g["floor_us_each"]
                print(f"{g['kernel'][:28]:28s} {str(tuple(g['grid'])):>14s} {g['count']:3d} {g['us']:9.1f} "
                      f"{g['us_each']:7.2f} {fl or 0:7.2f} {100 * fl / g['us_each'] if fl else 0:5.0f}")
        if not a.no_prefill:
            p = f["prefill"] = profile_prefill(ops, model.config, weights, kv, rec, n=prefill_tokens)
            print(f"\n{label} prefill {p['tokens']}: {p['total_ms']:.1f} ms")
            for g in sorted(p["groups"], key=lambda g: -g["us"])[:14]:
                print(f"  {g['op'][:44]:44s} {g['count']:4d} {g['us'] / 1e3:8.2f} ms")
        out["files"].append(f)
        del dec, ops, weights, kv, model
        cp.get_default_memory_pool().free_all_blocks()
    common.write_json(a.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
