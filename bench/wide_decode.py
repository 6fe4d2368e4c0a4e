"""Decode steps of many rows on the CUDA backend: tok/s of a captured step at 16, 32 and 64 rows
(33..128-row matmuls as fused matvecs of 32 rows, 64-row buckets captured), against the 64-row
step as it ran before (eager, its matmuls dequantized to f16 and multiplied by cuBLAS), with
f16 and q8_0 KV, on a Llama-3-8B-shaped synthetic file cut to a few layers (the per-layer work
of the 8B; tok/s scale by the layer count).

    python bench/wide_decode.py --dir /tmp/ntx [--layers 8] [--ftype q4_k_m] [--json out.json] [--smoke]
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "daemon"))

import common  # noqa: E402
from ntransformerd.engine.backends import cuda  # noqa: E402
from ntransformerd.engine.backends.cuda import launch as K  # noqa: E402
from ntransformerd.engine.gguf_file import GGUFModel  # noqa: E402


def tok_s(dec, rows: int, steps: int, *, eager: bool = False) -> float:
    """Tokens per second of `steps` decode steps of `rows` sequences, each step waiting for its ids."""
    slots = list(range(rows))
    toks = np.arange(rows) % 1000 + 100

    def one():
        b, m = dec.launch(slots, toks, eager=eager, advance=True)
        return b.ids[:m].get(stream=dec.stream)

    for _ in range(3):
        one()
    t = time.perf_counter()
    for _ in range(steps):
        one()
    return rows * steps / (time.perf_counter() - t)


def main() -> int:
    ap = common.parser("wide_decode.py", __doc__)
    ap.add_argument("--dir", default="/tmp/ntx")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ftype", default="q4_k_m")
    ap.add_argument("--steps", type=int, default=48)
    a = ap.parse_args()
    common.require_gpu(__file__)
    if a.smoke:
        a.steps = 4
    model = GGUFModel(common.synthetic(a.dir, "tiny" if a.smoke else "llama3-8b", a.ftype,
                                       n_layers=None if a.smoke else a.layers))
    ops, w = cuda.load(model)
    out = {"smoke": a.smoke, "layers": a.layers, "ftype": a.ftype, "tok_s": {}}
    for dtype in ("f16", "q8_0"):
        kv = cuda.kv_cache(model.config, n_slots=64, max_ctx=1024, dtype=dtype)
        for _ in range(64):
            kv.alloc()
        dec = cuda.StepGraphs(ops, w, kv)
        for rows in (16, 32, 64):
            out["tok_s"][f"{dtype} captured {rows} rows"] = tok_s(dec, rows, a.steps)
        kv.lengths[:] = 0
        saved = K.CHUNKED_MAX_ROWS
        K.CHUNKED_MAX_ROWS = K.MATVEC_MAX_ROWS  # the earlier path: > 32 rows through cuBLAS, eager
        try:
            out["tok_s"][f"{dtype} eager cuBLAS 64 rows"] = tok_s(dec, 64, a.steps // 2, eager=True)
        finally:
            K.CHUNKED_MAX_ROWS = saved
        del dec, kv
    for k, v in out["tok_s"].items():
        print(f"{k:28s} {v:8.0f} tok/s  ({a.layers} layers of llama3-8b, {a.ftype})")
    common.write_json(a.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
