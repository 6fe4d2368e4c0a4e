"""Single-thread speed of the CPU backend's quantized matmul (kernels/cpu/quant*.c), per type and
build variant, beside a plain memory read of the same bytes.

    .venv/bin/python bench/cpu_kernels.py [--smoke] [--types Q4_1,Q4_K] [--variants avx512]
                                          [--nr 1,8,512] [--repeat 10] [--huge]

Decode (nr = 1, and batched decode nr = 8) reads each weight byte once: GB/s of weights is the
figure, against `read`, numpy's max over as many bytes (the memory read bound of one core).
Weights are sized past the last-level cache (--decode-mb, default 96 MB). Prefill (nr = 512)
reuses each weight row from cache against many activation rows: GOP/s (2 · rows · n · nr per
second) is the figure. Activation quantization is outside the timing (it is done once per op,
not per weight row). Times are CPU time of the calling thread; the table shows the best of
--repeat runs (the figure least disturbed by other work on a shared machine) with the median
beside it, and the JSON (bench/out/cpu_kernels.json) keeps every run. --huge puts weights and
the read on 2 MiB pages. Kernels are built by the host backend's build module into a
temporary directory.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import tempfile
import time

import numpy as np
from gguf import GGMLQuantizationType as Q

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "daemon")]  # this tree's kernels, not an installed copy's
from ntransformerd.engine.backends.host import native  # noqa: E402
from ntransformerd.engine.quants import BLOCK_DTYPES, QUANT_BLOCKS, SUPPORTED_TYPES  # noqa: E402


def weights(qtype: Q, rows: int, n: int, rng: np.random.Generator, huge: bool) -> np.ndarray:
    block_elems, block_bytes = QUANT_BLOCKS[qtype]
    raw = buffer(rows * n // block_elems * block_bytes, huge)
    raw[:] = rng.integers(0, 256, raw.size, dtype=np.uint8)
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
    """CPU seconds of this thread per call: time the scheduler gives to other work on a shared
    machine does not count (their use of the memory bus still does)."""
    fn()  # warm: page faults, code
    ts = []
    for _ in range(repeat):
        t = time.thread_time()
        fn()
        ts.append(time.thread_time() - t)
    return ts


def buffer(nbytes: int, huge: bool) -> np.ndarray:
    """nbytes of anonymous memory, 2 MiB aligned; on 2 MiB pages where `huge` (madvise)."""
    mm = mmap.mmap(-1, nbytes + (2 << 20))
    if huge:
        mm.madvise(mmap.MADV_HUGEPAGE)
    a = np.frombuffer(mm, np.uint8)
    off = (-a.ctypes.data) % (2 << 20)
    return a[off:off + nbytes]


def read_bound(nbytes: int, repeat: int, huge: bool) -> list[float]:
    """GB/s of numpy's max over nbytes (one core; ~70 GB/s from cache, so memory is what it
    measures; a float sum would be limited by its own adds near 24 GB/s)."""
    a = buffer(nbytes, huge)
    a[:] = 1
    return [nbytes / t / 1e9 for t in timed(lambda: a.max(), repeat)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat: checks the script runs")
    p.add_argument("--types", default=",".join(q.name for q in SUPPORTED_TYPES))
    p.add_argument("--variants", default=",".join(v.name for v in native.VARIANTS))
    p.add_argument("--nr", default="1,8,512", help="activation rows per call (1 = decode)")
    p.add_argument("--n", type=int, default=4096, help="row length (elements)")
    p.add_argument("--decode-mb", type=float, default=96.0, help="weight bytes of a decode call")
    p.add_argument("--prefill-rows", type=int, default=512, help="weight rows of an nr > 1 call")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--huge", action="store_true", help="weights on 2 MiB pages (fewer TLB misses)")
    p.add_argument("--json", default=os.path.join(ROOT, "bench", "out", "cpu_kernels.json"))
    args = p.parse_args()
    if args.smoke:
        args.n, args.decode_mb, args.prefill_rows, args.repeat, args.nr = 512, 1.0, 16, 1, "1,8"
    types = [Q[t] for t in args.types.split(",")]
    nrs = [int(v) for v in args.nr.split(",")]
    rng = np.random.default_rng(0)

    results = []
    print(f"{'type':6} {'variant':8} {'nr':>4} {'ms':>9} {'GB/s':>7} {'GOP/s':>8}  spread")
    flags = native.cpu_flags()
    with tempfile.TemporaryDirectory() as tmp:
        for v in (x for x in native.VARIANTS if x.name in args.variants.split(",")):
            variant = v.name
            if not all(f in flags for f in v.needs):
                print(f"-- {variant}: this CPU cannot run it")
                continue
            lib = native.Library(native.build(v, out_dir=tmp, quiet=True), v)
            for qtype in types:
                block_elems, block_bytes = QUANT_BLOCKS[qtype]
                n = args.n
                row_bytes = n // block_elems * block_bytes
                for nr in nrs:
                    rows = (max(2, int(args.decode_mb * 1e6 / row_bytes)) if nr <= 8 else args.prefill_rows)
                    w = weights(qtype, rows, n, rng, args.huge)
                    x = rng.standard_normal((nr, n), dtype=np.float32)
                    act = np.empty((nr, lib.act_row_bytes(int(qtype), n)), np.uint8)
                    lib.quantize_act(int(qtype), x.ctypes.data, nr, n, n, act.ctypes.data)
                    out = np.empty((nr, rows), np.float32)
                    call = lambda: lib.gemm(int(qtype), w.ctypes.data, row_bytes, n, 0, rows, act.ctypes.data,  # noqa: E731
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
    rb = read_bound(nbytes, args.repeat, args.huge)
    print(f"read   numpy    {'':>4} {'':>9} {max(rb):7.2f} {'':>8}  "
          f"median {statistics.median(rb):.2f} GB/s (numpy max over {nbytes / 1e6:.0f} MB)")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(dict(cpu=os.uname().machine, results=results, read_gb_s=rb), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
