"""Single-thread speed of the CPU backend's quantized matmul (kernels/cpu/quant*.c), per type and
build variant, beside a plain memory read of the same bytes.

    .venv/bin/python bench/cpu_kernels.py [--smoke] [--types Q4_1,Q4_K] [--variants avx512]
                                          [--nr 1,512] [--repeat 5]

Decode (nr = 1) reads each weight byte once: GB/s of weights is the figure, against `read`, numpy
summing an array of the same size (the memory read bound of one core). Weights are sized past
the last-level cache (--decode-mb, default 96 MB). Prefill (nr = 512) reuses each weight row from
cache against many activation rows: GOP/s (2 · rows · n · nr per second) is the figure. Activation
quantization is outside the timing (it is done once per op, not per weight row). Prints a table
of the best of --repeat runs (the figure least disturbed by other work on a shared machine),
with the median beside it, and writes JSON (bench/out/cpu_kernels.json).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
from gguf import GGMLQuantizationType as Q

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "daemon")]
from ntransformerd.engine.quants import BLOCK_DTYPES, QUANT_BLOCKS, SUPPORTED_TYPES  # noqa: E402

SOURCES = ("quant.c", "quant_legacy.c", "quant_k.c", "quant_float.c")
VARIANTS = {
    "generic": ([], ()),
    "avx2": (["-march=x86-64-v3"], ("avx2", "fma", "f16c")),
    "avx512": (["-march=x86-64-v4", "-mavx512vnni"], ("avx512bw", "avx512vl", "avx512_vnni")),
}


def build(variant: str, out_dir: str) -> ctypes.CDLL:
    so = os.path.join(out_dir, f"libntx_cpu_{variant}.so")
    subprocess.run(["gcc", "-O3", *VARIANTS[variant][0], "-fPIC", "-shared", "-fopenmp", "-std=gnu11",
                    "-o", so, *(os.path.join(ROOT, "kernels", "cpu", s) for s in SOURCES), "-lm"], check=True)
    lib = ctypes.CDLL(so)
    vp, i, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    lib.ntx_act_row_bytes.argtypes, lib.ntx_act_row_bytes.restype = [i, i], sz
    lib.ntx_quantize_act.argtypes, lib.ntx_quantize_act.restype = [i, vp, i, i, i, vp], None
    lib.ntx_gemm.argtypes, lib.ntx_gemm.restype = [i, vp, sz, i, i, i, vp, i, vp, i, vp], None
    return lib


def runnable(variant: str) -> bool:
    with open("/proc/cpuinfo") as f:
        flags = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    return set(VARIANTS[variant][1]) <= flags


def weights(qtype: Q, rows: int, n: int, rng: np.random.Generator) -> np.ndarray:
    block_elems, block_bytes = QUANT_BLOCKS[qtype]
    raw = rng.integers(0, 256, rows * n // block_elems * block_bytes, dtype=np.uint8)
    if qtype in BLOCK_DTYPES:
        blocks = raw.view(BLOCK_DTYPES[qtype])
        for f in ("d", "dmin", "m"):
            if f in blocks.dtype.names:
                blocks[f] = np.float16(0.01)
    elif qtype == Q.F32:
        raw.view(np.float32)[:] = rng.standard_normal(raw.size // 4, dtype=np.float32)
    else:  # F16, BF16: keep exponents finite
        raw.view(np.uint16)[:] &= 0x3fff
    return raw.reshape(rows, -1)


def timed(fn, repeat: int) -> list[float]:
    fn()  # warm: page faults, code
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return ts


def read_bound(nbytes: int, repeat: int) -> list[float]:
    """GB/s of numpy summing nbytes of float32 (one core)."""
    a = np.ones(nbytes // 4, np.float32)
    return [nbytes / t / 1e9 for t in timed(lambda: a.sum(), repeat)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat: checks the script runs")
    p.add_argument("--types", default=",".join(q.name for q in SUPPORTED_TYPES))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--nr", default="1,512", help="activation rows per call (1 = decode)")
    p.add_argument("--n", type=int, default=4096, help="row length (elements)")
    p.add_argument("--decode-mb", type=float, default=96.0, help="weight bytes of a decode call")
    p.add_argument("--prefill-rows", type=int, default=512, help="weight rows of an nr > 1 call")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--json", default=os.path.join(ROOT, "bench", "out", "cpu_kernels.json"))
    args = p.parse_args()
    if args.smoke:
        args.n, args.decode_mb, args.prefill_rows, args.repeat, args.nr = 512, 1.0, 16, 1, "1,8"
    types = [Q[t] for t in args.types.split(",")]
    nrs = [int(v) for v in args.nr.split(",")]
    rng = np.random.default_rng(0)

    results = []
    print(f"{'type':6} {'variant':8} {'nr':>4} {'ms':>9} {'GB/s':>7} {'GOP/s':>8}  spread")
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.variants.split(","):
            if not runnable(variant):
                print(f"-- {variant}: this CPU cannot run it")
                continue
            lib = build(variant, tmp)
            for qtype in types:
                block_elems, block_bytes = QUANT_BLOCKS[qtype]
                n = args.n
                row_bytes = n // block_elems * block_bytes
                for nr in nrs:
                    rows = (max(2, int(args.decode_mb * 1e6 / row_bytes)) if nr == 1 else args.prefill_rows)
                    w = weights(qtype, rows, n, rng)
                    x = rng.standard_normal((nr, n), dtype=np.float32)
                    act = np.empty((nr, lib.ntx_act_row_bytes(int(qtype), n)), np.uint8)
                    lib.ntx_quantize_act(int(qtype), x.ctypes.data, nr, n, n, act.ctypes.data)
                    out = np.empty((nr, rows), np.float32)
                    call = lambda: lib.ntx_gemm(int(qtype), w.ctypes.data, row_bytes, n, 0, rows, act.ctypes.data,  # noqa: E731
                                                nr, out.ctypes.data, rows, None)
                    ts = timed(call, args.repeat)
                    t = min(ts)
                    gbs, gops = w.nbytes / t / 1e9, 2.0 * rows * n * nr / t / 1e9
                    med = statistics.median(ts)
                    spread = f"median {w.nbytes / med / 1e9:.2f} GB/s" if nr == 1 else \
                        f"median {2.0 * rows * n * nr / med / 1e9:.1f} GOP/s"
                    print(f"{qtype.name:6} {variant:8} {nr:4d} {t * 1e3:9.3f} {gbs:7.2f} {gops:8.1f}  {spread}", flush=True)
                    results.append(dict(type=qtype.name, variant=variant, nr=nr, rows=rows, n=n,
                                        weight_bytes=w.nbytes, seconds=ts, gb_s=gbs, gop_s=gops))
    nbytes = int(args.decode_mb * 1e6)
    rb = read_bound(nbytes, args.repeat)
    print(f"read   numpy    {'':>4} {'':>9} {max(rb):7.2f} {'':>8}  "
          f"median {statistics.median(rb):.2f} GB/s (float32 sum of {nbytes / 1e6:.0f} MB)")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(dict(cpu=os.uname().machine, results=results, read_gb_s=rb), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
