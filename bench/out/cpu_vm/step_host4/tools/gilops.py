import os, signal, sys
import numpy as np
k = np.zeros((1024, 3, 16, 64), np.float32)
src = np.array([5], np.int32); dst = np.array([9], np.int32)
srcp = src.astype(np.intp); dstp = dst.astype(np.intp)
mv = memoryview(k).cast("B"); nb = k[0].nbytes
p0, p1 = 3, 11
o = np.arange(p0, p1)
ops = {
 "fancy_i32": lambda: k.__setitem__(dst, k[src]),
 "fancy_intp": lambda: k.__setitem__(dstp, k[srcp]),
 "scalar": lambda: k.__setitem__(9, k[5]),
 "copyto": lambda: np.copyto(k[9], k[5]),
 "memview": lambda: mv.__setitem__(slice(9 * nb, 10 * nb), mv[5 * nb:6 * nb]),
 "rows_slice": lambda: k[9].__setitem__((slice(None), slice(p0, p1)), k[5][:, p0:p1]),
 "rows_fancy": lambda: k.__setitem__((9, slice(None), o), k[5][:, o]),
}
f = ops[sys.argv[1]]
os.kill(os.getpid(), signal.SIGUSR1)
for _ in range(50):
    f()
os.kill(os.getpid(), signal.SIGUSR2)
