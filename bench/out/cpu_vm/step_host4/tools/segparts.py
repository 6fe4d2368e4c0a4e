import sys, os, timeit, itertools
root = sys.argv[1]; sys.path.insert(0, os.path.join(root, "daemon"))
import numpy as np
from ntransformerd.engine.runtime.engine import Engine, EngineConfig
from ntransformerd.engine.runtime.model import Batch, Segment
eng = Engine.load(config=EngineConfig(backend="cpu", max_batch=64, max_ctx=2048))
slots_l = [eng.open() for _ in range(64)]
for s in slots_l: eng.kv.lengths[s] = 5; eng.kv.reserve(s, 5)
B = int(sys.argv[2])
items = [(s, [7]) for s in slots_l[:B]]
kv = eng.kv
def T(name, f):
    t = min(timeit.repeat(f, number=500, repeat=5)) / 500 * 1e6
    print(f"{name:28s} {t:7.2f} us")
n = B
T("_segments", lambda: eng._segments(items))
T("fromiter slots", lambda: np.fromiter((s for s, _ in items), np.int64, n))
slots = np.fromiter((s for s, _ in items), np.int64, n)
T("seqs+sizes", lambda: (lambda seqs: (list(map(len, seqs))))([t for _, t in items]))
seqs = [t for _, t in items]
T("flat", lambda: np.fromiter(itertools.chain.from_iterable(seqs), np.int64, n))
flat = np.fromiter(itertools.chain.from_iterable(seqs), np.int64, n)
T("toks", lambda: list(flat.reshape(n, 1).copy()))
T("minmax", lambda: flat.size and (flat.min() < 0 or flat.max() >= 49152))
T("at", lambda: np.asarray(kv.lengths)[slots])
at = np.asarray(kv.lengths)[slots]
T("tolist x2", lambda: (slots.tolist(), at.tolist()))
slot_ids, starts = slots.tolist(), at.tolist()
sizes = [1] * n
T("ends+ctx", lambda: [a + b for a, b in zip(starts, sizes)])
ends = [a + b for a, b in zip(starts, sizes)]
T("reserve_rows", lambda: kv.reserve_rows(slot_ids, ends))
T("blocks.reserve_rows", lambda: kv.blocks.reserve_rows(slot_ids, ends, starts))
toks = list(flat.reshape(n, 1).copy())
T("segments", lambda: list(map(Segment, slot_ids, starts, toks)))
segments = list(map(Segment, slot_ids, starts, toks))
T("Batch.of_tokens", lambda: Batch.of_tokens(segments, flat, at))
T("lengths[slots]=ends", lambda: kv.lengths.__setitem__(slots, ends))
