import os, signal, sys
import numpy as np
tables = np.full((64, 32), -1, np.int32); tables[3, :4] = [5, 6, 7, 8]
p0, p1, bs = 20, 32, 16
ops = {
 "arange": lambda: np.arange(p0, p1),
 "fromiter": lambda: np.fromiter(range(p0, p1), np.int64, p1 - p0),
 "mixed": lambda: tables[3, np.arange(p0, p1) // bs],
 "rowthen": lambda: tables[3][np.fromiter(range(p0, p1), np.int64, p1 - p0) // bs],
 "mod": lambda: np.fromiter(range(p0, p1), np.int64, p1 - p0) % bs,
}
f = ops[sys.argv[1]]
os.kill(os.getpid(), signal.SIGUSR1)
for _ in range(50):
    f()
os.kill(os.getpid(), signal.SIGUSR2)
