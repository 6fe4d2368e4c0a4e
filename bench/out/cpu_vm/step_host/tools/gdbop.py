import os, signal, sys, itertools
import numpy as np
tables = np.full((64, 32), -1, np.int32)
refs = np.zeros(2048, np.int32)
lengths = np.zeros(64, np.int64)
s = np.arange(64); c = np.full(64, 2); blk = tables[s, c]
seqs = [[5]] * 64
t = np.ones((64, 11))
chains = [np.ones(11) for _ in range(64)]
ops = {
 "pure": lambda: sum(range(64)),
 "arange2": lambda: np.arange(2),
 "arange65": lambda: np.arange(65),
 "fromiter_range": lambda: np.fromiter(range(65), np.int64, 65),
 "fromiter_chain": lambda: np.fromiter(itertools.chain.from_iterable(seqs), np.int64, 64),
 "zeros65": lambda: np.zeros(65, np.int64),
 "full_nan": lambda: np.full(64, np.nan),
 "fancy2d": lambda: tables[s, c],
 "fancy_i32": lambda: refs[blk],
 "fancy_intp": lambda: lengths[s],
 "setitem_list": lambda: lengths.__setitem__(s, [1] * 64),
 "reshape_copy": lambda: s.reshape(64, 1).copy(),
 "list2d": lambda: list(tables),
 "minmax": lambda: (s.min(), s.max()),
 "tolist": lambda: s.tolist(),
 "concat64": lambda: np.concatenate(chains),
 "astype": lambda: t[:, 3].astype(np.int64),
 "colcopy": lambda: t[:, 3].copy(),
 "Tcopy": lambda: t.T.copy(),
 "compare": lambda: t != 0,
 "flatnonzero": lambda: np.flatnonzero(s > 3),
 "cumsum": lambda: np.cumsum(s),
 "repeat": lambda: np.repeat(s, s),
 "asarray_list": lambda: np.asarray([5], np.int64),
 "array_flat": lambda: np.array([1] * 64, np.int64),
 "where": lambda: np.where(s > 3, s, 0),
 "bool_index": lambda: s[s > 3],
 "argmax_axis": lambda: t.argmax(1),
 "take": lambda: s.take(s),
 "sort": lambda: np.sort(s),
 "broadcast_copy": lambda: np.broadcast_to(s[:8], (64, 8)).copy(),
 "add": lambda: s + 1,
}
f = ops[sys.argv[1]]
os.kill(os.getpid(), signal.SIGUSR1)
for _ in range(50):
    f()
os.kill(os.getpid(), signal.SIGUSR2)
