"""The KV cache: per layer, per sequence slot, keys and values of every past position.

Stored as float32 or float16 (`--kv-dtype`); F16 rounds keys and values exactly as a
half-precision cache does, and reads convert back to float32 for the math. Memory comes from
np.zeros, so slots and positions that are never written cost no RAM.
"""

from __future__ import annotations

import numpy as np

from ntransformerd.engine.gguf_file import LlamaConfig

KV_DTYPES = {"f32": np.float32, "f16": np.float16}


class KVLayer:
    """One layer's cache: k and v of shape (slots, max_ctx, Hkv, hd)."""

    def __init__(self, shape: tuple[int, int, int, int], dtype):
        self.k = np.zeros(shape, dtype)
        self.v = np.zeros(shape, dtype)

    def write(self, slot: int, start: int, k: np.ndarray, v: np.ndarray) -> None:
        self.k[slot, start:start + len(k)] = k
        self.v[slot, start:start + len(v)] = v

    def write_rows(self, slots: np.ndarray, positions: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """One position for each of several slots: k, v (B, Hkv, hd)."""
        self.k[slots, positions] = k
        self.v[slots, positions] = v

    def gather(self, slots: np.ndarray, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Positions [0, end) of several slots as float32 (B, end, Hkv, hd); callers mask each
        slot's positions past its own length."""
        return (self.k[slots, :end].astype(np.float32, copy=False),
                self.v[slots, :end].astype(np.float32, copy=False))

    def read(self, slot: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        return (self.k[slot, :end].astype(np.float32, copy=False),
                self.v[slot, :end].astype(np.float32, copy=False))  # (end, Hkv, hd) each


class SlotTable:
    """Which sequence slots of a cache are live and how many positions each holds.

    Shared by every backend's KV cache; one owner (the engine's scheduler thread) calls it.
    """

    def __init__(self, n_slots: int):
        self.n_slots = n_slots
        self.lengths = np.zeros(n_slots, np.int64)
        self._free = list(range(n_slots - 1, -1, -1))

    def alloc(self, slot: int | None = None) -> int:
        """A free slot (`slot` itself when given), empty. Its keys and values are not cleared:
        the prefix cache reopens a slot and keeps the positions it still holds."""
        if not self._free:
            raise RuntimeError(f"all {self.n_slots} KV cache slots are in use")
        if slot is None:
            slot = self._free.pop()
        elif slot in self._free:
            self._free.remove(slot)
        else:
            raise ValueError(f"KV slot {slot} is not free")
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.n_slots:
            raise ValueError(f"KV slot {slot} is not in use")
        self.lengths[slot] = 0
        self._free.append(slot)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def free_ids(self) -> tuple[int, ...]:
        return tuple(self._free)


class KVCache(SlotTable):
    """All layers' caches (host memory) plus the slot bookkeeping."""

    def __init__(self, cfg: LlamaConfig, *, n_slots: int, max_ctx: int, dtype: str = "f32"):
        if dtype not in KV_DTYPES:
            raise ValueError(f"KV cache dtype {dtype!r} is not one of {', '.join(KV_DTYPES)}")
        if n_slots < 1 or max_ctx < 1:
            raise ValueError("the KV cache needs at least one slot and one position")
        super().__init__(n_slots)
        self.max_ctx, self.dtype = max_ctx, dtype
        shape = (n_slots, max_ctx, cfg.n_kv_heads, cfg.head_dim)
        self.layers = [KVLayer(shape, KV_DTYPES[dtype]) for _ in range(cfg.n_layers)]

    def layer(self, i: int) -> KVLayer:
        return self.layers[i]

    def copy_prefix(self, src: int, dst: int, n: int, start: int = 0) -> None:
        """Positions [start, n) of slot `src` into slot `dst`, every layer (a shared prompt prefix)."""
        for layer in self.layers:
            layer.k[dst, start:n] = layer.k[src, start:n]
            layer.v[dst, start:n] = layer.v[src, start:n]
