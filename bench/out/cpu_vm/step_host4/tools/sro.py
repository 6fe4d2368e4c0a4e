import sys, os, timeit
root = sys.argv[1]; sys.path.insert(0, os.path.join(root, "daemon"))
import numpy as np
from ntransformerd.engine.generation.sampler import Sampler, SampleRows, SamplingParams
B = int(sys.argv[2])
ss = [Sampler(SamplingParams(seed=i), 49152) for i in range(2 * B)]; hs = [[1, 2]] * B
A, Bs = ss[:B], ss[B:]
t = min(timeit.repeat(lambda: SampleRows.of(A, hs), number=500, repeat=5)) / 500 * 1e6
def alt():
    SampleRows.of(A, hs); SampleRows.of(Bs, hs)
u = min(timeit.repeat(alt, number=250, repeat=5)) / 500 * 1e6
print(f"{root} B={B}: SampleRows.of same rows {t:.1f} us, two sets taking turns {u:.1f} us")
