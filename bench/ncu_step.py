"""One eager decode step under the profiler (for `ncu --profile-from-start off`).

    ncu --clock-control none --profile-from-start off --csv --metrics ... \
        python bench/ncu_step.py --dir /tmp/ntx --type q4_k_m --batch 1
Synthesizes the 8B-shaped file if missing (`--smoke`: the tiny shape), captures and warms the
decode step, then runs one eager step (the same kernels the graph replays) between
cudaProfilerStart/Stop. The JSON output says which step ran; the figures are ncu's.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "daemon"))

import common  # noqa: E402
from ntransformerd.engine.backends import cuda  # noqa: E402
from ntransformerd.engine.backends.cuda import StepGraphs, cp  # noqa: E402 (cp is None without CuPy)
from ntransformerd.engine.gguf_file import GGUFModel  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__file__, __doc__)
    ap.add_argument("--dir", default="/tmp/ntx", help="the synthetic files (made here if missing)")
    ap.add_argument("--type", default="q4_k_m")
    ap.add_argument("--batch", type=int, default=1)
    a = ap.parse_args(argv)
    common.require_gpu(__file__)
    path = common.synthetic(a.dir, "tiny" if a.smoke else "llama3-8b", a.type)
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
    t = time.perf_counter()
    dec.launch(slots, toks, eager=True)  # the bucket's pass kernel by kernel, for the profiler
    dec.stream.synchronize()
    wall = time.perf_counter() - t
    cp.cuda.profiler.stop()
    common.write_json(a.json, {"file": path, "type": a.type, "batch": a.batch, "eager_step_wall_s": wall,
                               "smoke": a.smoke})
    return 0


if __name__ == "__main__":
    sys.exit(main())
