"""The KV cache on the GPU: engine/runtime/kv_cache.py's paged layout in device memory.

The slot and block bookkeeping is the host cache's own (kv_cache.KVCache: BlockTable, reserve,
trim, kept); the layers (CudaKVLayer) hold k and v as CuPy arrays of the same layout, (n_blocks
+ 1, Hkv, BLOCK_SIZE, row), f16 values or q8_0 rows (GGUF Q8_0 blocks as bytes, written as
gguf.quants.quantize rounds, by kernels/attention.cu). The extra block is scratch: padded rows
of a captured step write there (the scratch slot, one past the last, has every table entry
pointing at it). f32 is not stored on the GPU (kv_dtype f16 or q8_0).

The kernels read the block tables from a device copy (DeviceTables): one fixed buffer, so
captured graphs hold its address, brought up to date before a step from the host tables of
the step's slots (`refresh`: a row is copied when it differs from what was last copied).
"""

from __future__ import annotations

import numpy as np

from ntransformerd.engine.backends.cuda import attention as A
from ntransformerd.engine.backends.cuda.nvrtc import cp, device_alloc
from ntransformerd.engine.gguf_file import LlamaConfig
from ntransformerd.engine.runtime.kv_cache import BLOCK_SIZE, BlockTable, KVCache, default_blocks, row_bytes, row_width

CUDA_KV_DTYPES = ("f16", "q8_0")  # what the kernels read; the first is the default
Q8_HEAD_DIMS = (32, 64, 128, 256)  # q8_0 rows: head_dim / 32 values per lane (attention.ATTN_ND) within one block


def check_dtype(dtype: str) -> None:
    if dtype not in CUDA_KV_DTYPES:
        raise ValueError(f"kv_dtype {dtype!r}: the cuda backend stores its KV cache as "
                         f"{' or '.join(CUDA_KV_DTYPES)}; set kv_dtype to one of them")


class DeviceTables:
    """The block tables on the device, (n_slots + 1, max_blocks) int32: the host table's rows,
    then the scratch slot's (every entry the scratch block). Never reallocated."""

    def __init__(self, table: BlockTable, scratch_block: int):
        self.table = table
        n, m = table.tables.shape
        host = np.full((n + 1, m), scratch_block, np.int32)
        host[:n] = table.tables
        self.dev = cp.asarray(host)
        self._copied = host[:n].copy()  # what the device rows hold
        self.copies = 0  # refreshes that copied (tests, figures)

    def refresh(self, slots=None, *, stream=None) -> None:
        """Bring the device rows of `slots` (default: all) up to the host table, ordered on
        `stream` (default: the current one) before what runs after it there."""
        host = self.table.tables
        n = len(host)
        rows = np.arange(n) if slots is None else np.unique(np.asarray(slots, np.int64))
        rows = rows[(rows >= 0) & (rows < n)]  # the scratch slot's row never changes
        if not len(rows):
            return
        stale = rows[(host[rows] != self._copied[rows]).any(axis=1)]
        if not len(stale):
            return
        lo, hi = int(stale[0]), int(stale[-1]) + 1
        self._copied[lo:hi] = host[lo:hi]
        self.dev[lo:hi].set(self._copied[lo:hi], stream=stream)
        self.copies += 1


class CudaKVLayer:
    """One layer's keys and values on the device, k and v (n_blocks + 1, Hkv, BLOCK_SIZE, row):
    kv_cache.KVLayer's calls over CuPy arrays. Rows come and go as float32 (n, Hkv, hd), host or
    device arrays in, device arrays out (rows) or host arrays (read, gather)."""

    def __init__(self, table: BlockTable, dtype: str, n_kv_heads: int, head_dim: int):
        check_dtype(dtype)
        self.table, self.dtype, self.n_kv, self.head_dim = table, dtype, n_kv_heads, head_dim
        self.q8 = dtype == "q8_0"
        if self.q8 and head_dim not in Q8_HEAD_DIMS:  # a warp lane's values must lie in one Q8_0 block
            raise ValueError(f"kv_dtype q8_0 on the cuda backend takes head_dim {', '.join(map(str, Q8_HEAD_DIMS))}; "
                             f"this model's is {head_dim}: use kv_dtype f16")
        self.row = row_width(dtype, head_dim)
        shape = (table.n_blocks + 1, n_kv_heads, table.block_size, self.row)  # the last block: scratch
        elem = cp.uint8 if self.q8 else cp.float16
        self.k = device_alloc(shape, elem, "KV cache")
        self.v = device_alloc(shape, elem, "KV cache")
        self.k.fill(0)
        self.v.fill(0)
        self.tables: DeviceTables | None = None  # set by the cache (one copy for all its layers)

    # ---- rows in and out ----------------------------------------------------------------------

    def _flat_rows(self, blocks: np.ndarray, offsets: np.ndarray):
        """Row indices (n, Hkv) into k, v viewed as (rows, row) for positions at (block, offset)."""
        bs = self.table.block_size
        idx = (np.asarray(blocks, np.int64)[:, None] * self.n_kv + np.arange(self.n_kv)) * bs + np.asarray(
            offsets, np.int64)[:, None]
        return cp.asarray(idx)

    def _flat(self, x):
        return x.reshape(-1, self.row)

    def _decode(self, raw):
        """Rows in the storage type (..., row) as float32 (..., hd), on the device."""
        if not self.q8:
            return raw.astype(cp.float32)
        blocks = raw.reshape(raw.shape[:-1] + (self.head_dim // 32, 34))
        d = cp.ascontiguousarray(blocks[..., :2]).view(cp.float16).astype(cp.float32)  # (..., nb, 1)
        q = cp.ascontiguousarray(blocks[..., 2:]).view(cp.int8).astype(cp.float32)
        return (q * d).reshape(raw.shape[:-1] + (self.head_dim,))

    def _append(self, k, v, slots, positions) -> None:
        n = len(slots)
        kv_dim = self.n_kv * self.head_dim
        k = cp.ascontiguousarray(cp.asarray(k, cp.float32)).reshape(n, kv_dim)
        v = cp.ascontiguousarray(cp.asarray(v, cp.float32)).reshape(n, kv_dim)
        A.kv_append_(k, v, self, cp.asarray(np.asarray(slots, np.int32)), cp.asarray(np.asarray(positions, np.int32)),
                     n=n, ldk=kv_dim, ldv=kv_dim)

    def write(self, slot: int, start: int, k, v) -> None:
        """Positions start … start + n of `slot` (blocks reserved as needed): k, v (n, Hkv, hd),
        host or device, rounded to the storage type on the device."""
        n = len(k)
        if n == 0:
            return
        self.table.reserve(slot, start + n, start=start)  # a block shared there is copied first
        self.tables.refresh([slot])
        self._append(k, v, np.full(n, slot), np.arange(start, start + n))

    def write_rows(self, slots, positions, k, v) -> None:
        """One position for each of several slots: k, v (B, Hkv, hd)."""
        slots, positions = np.asarray(slots, np.int64), np.asarray(positions, np.int64)
        for slot, p in zip(slots, positions):
            self.table.reserve(int(slot), int(p) + 1, start=int(p))
        self.tables.refresh(slots)
        self._append(k, v, slots, positions)

    def rows(self, slot: int, p0: int, p1: int):
        """Positions [p0, p1) of `slot` as float32 device arrays (p1 - p0, Hkv, hd) each."""
        idx = self._flat_rows(*self.table.locate(slot, p0, p1))
        return self._decode(self._flat(self.k)[idx]), self._decode(self._flat(self.v)[idx])

    def read(self, slot: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Positions [0, end) of `slot` as host float32 (end, Hkv, hd); zeros where it holds no block."""
        k = np.zeros((end, self.n_kv, self.head_dim), np.float32)
        v = np.zeros_like(k)
        n = min(end, int(self.table.held[slot]) * self.table.block_size)  # in its blocks (not spilled ones)
        if n:
            dk, dv = self.rows(slot, 0, n)
            k[:n], v[:n] = cp.asnumpy(dk), cp.asnumpy(dv)
        return k, v

    def gather(self, slots, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Positions [0, end) of several slots, host float32 (B, end, Hkv, hd)."""
        pairs = [self.read(int(s), end) for s in slots]
        return np.stack([k for k, _ in pairs]), np.stack([v for _, v in pairs])

    def copy_rows(self, src_rows, dst_rows) -> None:
        """Rows (block, offset) src → dst, every head (positions of one slot into another)."""
        s, d = self._flat_rows(*src_rows), self._flat_rows(*dst_rows)
        for a in (self.k, self.v):
            f = self._flat(a)
            f[d] = f[s]

    # ---- whole blocks -----------------------------------------------------------------------------

    def copy_blocks(self, src, dst) -> None:
        """Blocks src[i] → dst[i] (whole blocks, every head and position)."""
        s, d = cp.asarray(np.asarray(src, np.int64)), cp.asarray(np.asarray(dst, np.int64))
        self.k[d] = self.k[s]
        self.v[d] = self.v[s]

    def save_blocks(self, ids) -> tuple[np.ndarray, np.ndarray]:
        """Blocks `ids` as host arrays (len(ids), Hkv, BLOCK_SIZE, row) in the storage type, in
        pinned memory (CuPy's pinned pool: a spill reuses what an earlier restore let go), so the
        copies each way run at the link's rate, not a pageable copy's tenth of it."""
        i = cp.asarray(np.asarray(ids, np.int64))
        return _to_pinned(self.k[i]), _to_pinned(self.v[i])

    def load_blocks(self, ids, k, v) -> None:
        """Blocks `ids` from host arrays save_blocks gave."""
        i = cp.asarray(np.asarray(ids, np.int64))
        self.k[i] = cp.asarray(k, self.k.dtype)
        self.v[i] = cp.asarray(v, self.v.dtype)


def _to_pinned(x) -> np.ndarray:
    """A device array's copy in pinned host memory."""
    mem = cp.cuda.alloc_pinned_memory(max(x.nbytes, 1))
    out = np.frombuffer(mem, x.dtype, x.size).reshape(x.shape)
    x.get(out=out)
    return out


class CudaKVCache(KVCache):
    """kv_cache.KVCache with its layers on the GPU (CudaKVLayer), one scratch block and slot
    (`scratch_slot`, `scratch_block`) for the padded rows of captured steps, and the device copy
    of the block tables (`tables`) every attention kernel reads."""

    layer_class = CudaKVLayer

    def __init__(self, cfg: LlamaConfig, *, n_slots: int, max_ctx: int, dtype: str = "f16",
                 n_blocks: int | None = None, block_size: int = BLOCK_SIZE, spill: int = 0):
        check_dtype(dtype)
        if block_size != BLOCK_SIZE:
            raise ValueError(f"the cuda KV cache has blocks of {BLOCK_SIZE} positions (the kernels' KV_BLOCK), "
                             f"not {block_size}")
        if n_slots < 1 or max_ctx < 1:
            raise ValueError("the KV cache needs at least one slot and one position")
        blocks = default_blocks(n_slots, max_ctx, block_size) if n_blocks is None else n_blocks
        need = 2 * cfg.n_layers * (blocks + 1) * block_size * cfg.n_kv_heads * row_bytes(dtype, cfg.head_dim)
        free = cp.cuda.runtime.memGetInfo()[0]
        if need > free:
            raise MemoryError(f"KV cache of {blocks} blocks of {block_size} positions ({dtype}) needs "
                              f"{need / 2**30:.2f} GiB, {free / 2**30:.2f} GiB free on the GPU; lower kv_blocks, "
                              "max_seqs or max_ctx, or use kv_dtype q8_0")
        super().__init__(cfg, n_slots=n_slots, max_ctx=max_ctx, dtype=dtype, n_blocks=n_blocks, block_size=block_size,
                         spill=spill)
        self.scratch_slot, self.scratch_block = n_slots, self.blocks.n_blocks
        self.tables = DeviceTables(self.blocks, self.scratch_block)
        for layer in self.layers:
            layer.tables = self.tables

    def layer(self, i: int) -> CudaKVLayer:
        return self.layers[i]

    def copy_prefix(self, src: int, dst: int, n: int, start: int = 0) -> None:
        """Positions [start, n) of slot `src` into slot `dst`, every layer (the prefix cache): by
        block reference where blocks lie whole in the range (BlockTable.share, as the host cache);
        a block dst already holds part of gets the rest copied row by row. `src` may be closed
        (or spilled) if it still holds them. Called between steps; the synchronize orders the
        copies before the next step whatever stream that runs on."""
        rest = self.blocks.share(src, dst, n, start)
        if rest is not None:
            p0, p1 = rest
            self.blocks.reserve(dst, p1, keep=(src,), start=p0)
            s, d = self.blocks.locate(src, p0, p1), self.blocks.locate(dst, p0, p1)
            for layer in self.layers:
                layer.copy_rows(s, d)
        cp.cuda.get_current_stream().synchronize()

    # ---- what the block table asks of the layers (BlockTable.owner): between steps, so each
    # ends with a synchronize (a captured step runs on its own stream, unordered with this one) --

    def copy_blocks(self, src, dst) -> None:
        super().copy_blocks(src, dst)
        cp.cuda.get_current_stream().synchronize()

    def load_blocks(self, ids, saved) -> None:
        super().load_blocks(ids, saved)
        cp.cuda.get_current_stream().synchronize()
