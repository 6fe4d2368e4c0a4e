"""One layer's decode attention on the host outside a step: the kernels' `ntx_attention` over a
paged cache of random rows, as a step's attention op runs it.

    probe = AttentionProbe(cfg, dtype="f16", positions=4096, rows=1)
    seconds = probe.seconds(threads=16)          # one layer, every KV head, `rows` sequences
    out = probe.run(threads=2, kernel="ref")     # the reference kernel's output, (rows, H * hd)

What the figures at load time (engine/figures.py: the host's attention cost per position), the
kernel tests (against the reference and the kernel before splits, bit for bit) and
bench/host_attention.py use. Each probe owns its cache (nothing is borrowed from a serving
pool). Thread rule: one caller at a time per probe.
"""

from __future__ import annotations

import ctypes
import dataclasses
import statistics
import time
from collections.abc import Sequence

import numpy as np

from ntransformerd.engine.backends.host import native
from ntransformerd.engine.backends.host.record import header, model_consts
from ntransformerd.engine.gguf_file import LlamaConfig
from ntransformerd.engine.runtime.kv_cache import KVCache

# ntx_attention's kernels (kernels/cpu/attention.h NTX_ATTN_*): "step" as a step runs it (positions
# past NTX_ATTN_SPLIT in splits, merged in order), "ref" the first kernel, "whole" the steps' kernel
# before splits (every group in one pass), "serial" the steps' with no room for partials (each
# head's splits in turn in one item: a step's fallback, the same bits as "step")
KERNELS = {"step": 0, "ref": 1, "whole": 2, "serial": 3}


class AttentionProbe:
    """`rows` sequences of `positions` keys each (random, stored as `dtype`; or one length per
    sequence, their count then the rows), each with its last `chunk` positions as query rows
    (1: a decode step; more: a prefill chunk or a verify step): q (rows × chunk, H * hd) random.
    A sequence's keys depend on the seed and the lengths of the sequences before it alone."""

    def __init__(self, cfg: LlamaConfig, *, dtype: str, positions: int | Sequence[int], rows: int = 1,
                 chunk: int = 1, seed: int = 0, lib: native.Library | None = None):
        lengths = [positions] * rows if isinstance(positions, int) else list(positions)
        if not lengths or min(lengths) < 1 or not 1 <= chunk <= min(lengths):
            raise ValueError(f"attention probe: positions {positions} and rows {rows} must be at least 1, "
                             f"chunk {chunk} from 1 to positions")
        rows = len(lengths)
        self.lib = lib or native.load()
        self.cfg = dataclasses.replace(cfg, n_layers=1)
        c, rng = self.cfg, np.random.default_rng(seed)
        self.cache = KVCache(c, n_slots=rows, max_ctx=max(lengths), dtype=dtype)
        layer = self.cache.layer(0)
        for s, length in enumerate(lengths):
            self.cache.alloc(s)
            for p0 in range(0, length, 4096):  # a bounded float32 staging at a time
                n = min(4096, length - p0)
                k, v = (rng.standard_normal((n, c.n_kv_heads, c.head_dim), dtype=np.float32) for _ in range(2))
                layer.write(s, p0, k, v)
        self._rope = np.zeros((1, max(c.rope_dim // 2, 1)), np.float32)  # attention reads no rope table
        self.consts = model_consts(c, self._rope, self._rope, self.cache)
        n = rows * chunk
        # each query row's position and its sequence's slot (the header points into them)
        self.positions = np.concatenate([np.arange(length - chunk, length, dtype=np.int64) for length in lengths])
        self.slots = np.repeat(np.arange(rows, dtype=np.int64), chunk)
        self._arrays = (np.zeros(n, np.int64), self.positions, self.slots, np.arange(n, dtype=np.int64))
        self.header = header(*self._arrays)
        self.q = rng.standard_normal((n, c.n_heads * c.head_dim), dtype=np.float32)
        self.out = np.full_like(self.q, np.nan)

    def run(self, *, threads: int = 1, kernel: str = "step") -> np.ndarray:
        """The attention's output (rows × chunk, H * hd) by one of KERNELS."""
        layer = self.cache.layer(0)
        rc = self.lib.attention(ctypes.addressof(self.consts), ctypes.addressof(self.header), self.q.ctypes.data,
                                self.out.ctypes.data, layer.k.ctypes.data, layer.v.ctypes.data, threads,
                                KERNELS[kernel])
        if rc != 0:
            raise MemoryError(f"ntx_attention returned {rc}: its scratch could not be allocated")
        return self.out.copy()

    def seconds(self, *, threads: int = 1, kernel: str = "step", repeats: int = 5) -> float:
        """The median wall time of one run after a warm-up."""
        self.run(threads=threads, kernel=kernel)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            self.run(threads=threads, kernel=kernel)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
