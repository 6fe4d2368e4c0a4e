"""One eager decode step under the profiler (for `ncu --profile-from-start off`).

    ncu --clock-control none --profile-from-start off --csv --metrics ... \
        python bench/ncu_step.py --file llama3-8b-q4_k_m.gguf --batch 1
Synthesizes the file if missing, captures and warms the decode step, then runs one eager step
(the same kernels the graph replays) between cudaProfilerStart/Stop.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "daemon"))

import cupy as cp  # noqa: E402

from ntransformerd.engine.backends import cuda  # noqa: E402
from ntransformerd.engine.backends.cuda import StepGraphs  # noqa: E402
from ntransformerd.engine.gguf_file import GGUFModel  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from resident import synthetic_8b  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/ntx")
    ap.add_argument("--type", default="q4_k_m")
    ap.add_argument("--batch", type=int, default=1)
    a = ap.parse_args()
    path = synthetic_8b(a.dir, a.type)
    model = GGUFModel(path)
    ops, weights = cuda.load(model)
    kv = cuda.kv_cache(model.config, n_slots=32, max_ctx=1024)
    dec = StepGraphs(ops, weights, kv)
    slots = [kv.alloc() for _ in range(a.batch)]
    toks = np.arange(a.batch, dtype=np.int32) + 100
    for _ in range(24):
        toks = dec.step(slots, toks, advance=True)
    cp.cuda.Device().synchronize()
    cp.cuda.profiler.start()
    dec.launch(slots, toks, eager=True)  # the bucket's pass kernel by kernel, for the profiler
    dec.stream.synchronize()
    cp.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
