import sys, os, timeit
root = sys.argv[1]
sys.path.insert(0, os.path.join(root, "daemon"))
import numpy as np
from ntransformerd.engine.runtime.engine import Engine, EngineConfig
from ntransformerd.engine.generation.sampler import Sampler, SampleRows, SamplingParams
eng = Engine.load(config=EngineConfig(backend="cpu", max_batch=64, max_ctx=2048))
slots = [eng.open() for _ in range(64)]
for s in slots: eng.kv.lengths[s] = 5; eng.kv.reserve(s, 5)
for B in (1, 8, 64):
    items = [(s, [7]) for s in slots[:B]]
    t = min(timeit.repeat(lambda: eng._segments(items), number=300, repeat=5)) / 300 * 1e6
    ss = [Sampler(SamplingParams(seed=1), 49152) for _ in range(B)]; hs = [[1, 2]] * B
    u = min(timeit.repeat(lambda: SampleRows.of(ss, hs), number=300, repeat=5)) / 300 * 1e6
    print(f"{root} B={B}: _segments {t:.1f} us, SampleRows.of {u:.1f} us")
