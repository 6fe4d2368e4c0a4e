"""The KV cache on the GPU: F16 keys and values per layer, slot bookkeeping on the host."""

from __future__ import annotations

import math

import numpy as np

from ntransformerd.engine.backends.cuda.nvrtc import cp, device_alloc
from ntransformerd.engine.gguf_file import LlamaConfig
from ntransformerd.engine.kv_cache import SlotTable


class CudaKVLayer:
    """One layer's F16 cache, k and v of shape (slots, max_ctx, Hkv, hd)."""

    def __init__(self, shape):
        self.k = device_alloc(shape, cp.float16, "KV cache")
        self.v = device_alloc(shape, cp.float16, "KV cache")
        self.k.fill(0)
        self.v.fill(0)

    def read(self, slot: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        return (cp.asnumpy(self.k[slot, :end]).astype(np.float32), cp.asnumpy(self.v[slot, :end]).astype(np.float32))

    def write(self, slot: int, start: int, k, v) -> None:
        """Positions start … start + n of `slot` from device arrays (n, Hkv, hd), rounded to F16."""
        self.k[slot, start:start + len(k)] = k
        self.v[slot, start:start + len(v)] = v

    def rows(self, slot: int, p0: int, p1: int):
        """Positions [p0, p1) of `slot`: views of the device arrays (n, Hkv, hd)."""
        return self.k[slot, p0:p1], self.v[slot, p0:p1]


class CudaKVCache(SlotTable):
    """Slot bookkeeping on the host (as the CPU cache), keys and values on the device. One more
    slot than asked for is kept as scratch: padded rows of a captured decode step write there."""

    def __init__(self, cfg: LlamaConfig, *, n_slots: int, max_ctx: int, dtype: str = "f16"):
        if dtype not in ("f16", "f32"):
            raise ValueError(f"KV cache dtype {dtype!r} is not one of f32, f16")
        if n_slots < 1 or max_ctx < 1:
            raise ValueError("the KV cache needs at least one slot and one position")
        super().__init__(n_slots)
        self.max_ctx, self.dtype = max_ctx, "f16"  # always F16 on the GPU
        self.scratch_slot = n_slots
        shape = (n_slots + 1, max_ctx, cfg.n_kv_heads, cfg.head_dim)
        need = 2 * cfg.n_layers * math.prod(shape) * 2
        free = cp.cuda.runtime.memGetInfo()[0]
        if need > free:
            raise MemoryError(f"KV cache of {n_slots} slots × {max_ctx} positions needs {need / 2**30:.2f} GiB, "
                              f"{free / 2**30:.2f} GiB free on the GPU; lower max_seqs or max_ctx")
        self.layers = [CudaKVLayer(shape) for _ in range(cfg.n_layers)]

    def layer(self, i: int) -> CudaKVLayer:
        return self.layers[i]

    def copy_prefix(self, src: int, dst: int, n: int, start: int = 0) -> None:
        """Positions [start, n) of slot `src` into slot `dst`, every layer (the prefix cache).
        Called between steps; the synchronize orders it before the next step whatever stream
        that runs on."""
        for layer in self.layers:
            layer.k[dst, start:n] = layer.k[src, start:n]
            layer.v[dst, start:n] = layer.v[src, start:n]
        cp.cuda.Device().synchronize()


