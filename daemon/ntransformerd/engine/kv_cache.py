"""The KV cache: keys and values of every past position, in fixed-size blocks from one pool.

A device's cache is one pool of blocks; a block holds BLOCK_SIZE consecutive positions of one
sequence, every KV head, in every layer (one block id names the same rows in each layer's
arrays). A sequence slot has a block table, its blocks in position order, and grows a block at
a time as its positions are first written (`reserve`): `max_ctx` limits a sequence, it reserves
nothing. The pool holds `n_blocks` (default: n_slots × max_ctx worth, what a cache of whole
slots held, so it never runs short).

Storage types (`kv_dtype`): f32; f16 (rounded as a half-precision cache rounds); q8_0 and q4_0,
GGUF's own blocks over each head's head_dim values (32 values per block: a float16 scale and
int8 or 4-bit quants), quantized bit-exactly as gguf.quants quantizes. The reference
(backends/cpu.py) reads them back dequantized; the host kernels read the blocks themselves.

The layout every backend's attention reads (kernels/cpu/step.c does; the GPU port follows it):

    layer.k, layer.v   (n_blocks, n_kv_heads, BLOCK_SIZE, row): one row is one position of one
                       head: head_dim float32 / float16 values, or head_dim/32 GGUF blocks (bytes)
    tables             (n_slots, max_blocks) int32, each slot's block ids in position order;
                       -1 past the blocks it holds
    position p of slot s, KV head h  →  layer.k[tables[s, p // BLOCK_SIZE], h, p % BLOCK_SIZE]

A step's blocks are reserved before it runs (the engine reserves every segment's positions, so a
kernel never meets a -1 it must read or write); a device with its own copy of the tables takes
them as they stand then. Writes round as gguf.quants.quantize does, bit for bit; reads decode
each row where it is used (d × q), never into a second cache.

A closed slot keeps its blocks, and so its keys and values (the prefix cache reopens a slot and
keeps the positions it still holds), until the pool runs short: then the least recently closed
slots give theirs back, and `kept` says how many positions a slot still holds. Memory comes from
np.zeros, so blocks that are never written cost no RAM.

Thread rule: one owner (the engine's scheduler thread) calls a cache; a step reads the tables
the owner set before it started.
"""

from __future__ import annotations

import collections
import heapq

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import quants as gguf_quants

from ntransformerd.engine.gguf_file import LlamaConfig
from ntransformerd.engine.quants import QUANT_BLOCKS

BLOCK_SIZE = 16  # positions per block

# kv_dtype → the GGML type of its rows (what the kernels are told) and numpy's element type
# (uint8: rows of GGUF blocks, stored as bytes).
KV_TYPES: dict[str, tuple[Q, type]] = {"f32": (Q.F32, np.float32), "f16": (Q.F16, np.float16),
                                       "q8_0": (Q.Q8_0, np.uint8), "q4_0": (Q.Q4_0, np.uint8)}
KV_DTYPES = tuple(KV_TYPES)


class KVPoolFull(RuntimeError):
    """The pool has no block left for a sequence that grows (preempt one, or give the pool more)."""


def row_width(dtype: str, head_dim: int) -> int:
    """Elements of the storage type in one (position, head) row: head_dim values, or the bytes
    of its GGUF blocks."""
    qtype, _ = KV_TYPES[dtype]
    if qtype in (Q.F32, Q.F16):
        return head_dim
    block_elems, block_bytes = QUANT_BLOCKS[qtype]
    if head_dim % block_elems:
        raise ValueError(f"kv_dtype {dtype} stores blocks of {block_elems} values; this model's head_dim "
                         f"{head_dim} is not a multiple: use kv_dtype f16")
    return head_dim // block_elems * block_bytes


def row_bytes(dtype: str, head_dim: int) -> int:
    """Bytes of one (position, head) row."""
    return row_width(dtype, head_dim) * np.dtype(KV_TYPES[dtype][1]).itemsize


def bytes_per_token(cfg: LlamaConfig, dtype: str) -> int:
    """Bytes of keys and values one position takes over every layer."""
    return 2 * cfg.n_layers * cfg.n_kv_heads * row_bytes(dtype, cfg.head_dim)


def default_blocks(n_slots: int, max_ctx: int, block_size: int = BLOCK_SIZE) -> int:
    """The pool a cache of whole slots amounted to: every slot can reach max_ctx at once."""
    return n_slots * -(-max_ctx // block_size)


class SlotTable:
    """Which sequence slots of a cache are live and how many positions each holds.

    Shared by every backend's KV cache; one owner (the engine's scheduler thread) calls it. The
    paged calls (reserve, trim, kept) are answered here as a cache of whole slots answers them
    (every slot holds max_ctx positions from the start); KVCache pages.
    """

    max_ctx: int  # set by each cache

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

    def reserve(self, slot: int, n: int) -> None:
        """Room for positions [0, n) of `slot` (a whole slot has it)."""

    def trim(self, slot: int, n: int) -> None:
        """Positions ≥ n of `slot` are no longer needed (a whole slot keeps its room)."""

    def kept(self, slot: int) -> int:
        """Positions whose keys and values `slot` may still hold (a whole slot: all of them)."""
        return self.max_ctx

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def free_ids(self) -> tuple[int, ...]:
        return tuple(self._free)


class BlockTable:
    """The blocks of one pool and which slot holds which, in position order. Shared by every
    layer of a cache (one block id covers all layers)."""

    def __init__(self, n_slots: int, max_ctx: int, n_blocks: int, block_size: int = BLOCK_SIZE):
        if n_blocks < 1 or block_size < 1:
            raise ValueError("the KV pool needs at least one block of at least one position")
        self.block_size, self.n_blocks, self.max_ctx = block_size, n_blocks, max_ctx
        self.max_blocks = -(-max_ctx // block_size)
        self.tables = np.full((n_slots, self.max_blocks), -1, np.int32)  # never reallocated: kernels hold it
        self.held = np.zeros(n_slots, np.int64)  # blocks each slot holds
        self._pool = list(range(n_blocks))  # a heap: the lowest free id first keeps the touched memory compact
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # closed slots, oldest first

    @property
    def free_blocks(self) -> int:
        return len(self._pool)

    def _check(self, slot: int) -> None:
        if not 0 <= slot < len(self.held):
            raise ValueError(f"KV slot {slot} is out of range 0..{len(self.held) - 1}")

    def reserve(self, slot: int, n: int, *, keep: tuple[int, ...] = ()) -> None:
        """Blocks for positions [0, n) of `slot`, taken from the pool as needed; when it runs
        short, closed slots (least recently closed first, never those in `keep`) give theirs back."""
        self._check(slot)
        if n > self.max_ctx:
            raise ValueError(f"KV slot {slot}: {n} positions exceed the context of {self.max_ctx}")
        need = -(-n // self.block_size) - int(self.held[slot])
        if need <= 0:
            return
        for other in list(self._idle):
            if len(self._pool) >= need:
                break
            if other != slot and other not in keep:
                self.release(other, 0)
                del self._idle[other]
        if len(self._pool) < need:
            live = self.n_blocks - len(self._pool) - sum(int(self.held[s]) for s in self._idle)
            raise KVPoolFull(f"KV pool full: slot {slot} needs {need} more blocks of {self.block_size} positions "
                             f"for {n} positions, {len(self._pool)} of {self.n_blocks} are free ({live} held by "
                             f"live sequences); give the pool more blocks (kv_blocks) or run fewer sequences at once")
        h = int(self.held[slot])
        for j in range(h, h + need):
            self.tables[slot, j] = heapq.heappop(self._pool)
        self.held[slot] = h + need

    def release(self, slot: int, n: int) -> None:
        """The blocks of `slot` past position n back to the pool."""
        self._check(slot)
        keep = -(-n // self.block_size)
        for j in range(keep, int(self.held[slot])):
            heapq.heappush(self._pool, int(self.tables[slot, j]))
            self.tables[slot, j] = -1
        self.held[slot] = min(int(self.held[slot]), keep)

    def closed(self, slot: int) -> None:
        """`slot`'s sequence ended: its blocks stay until the pool needs them."""
        self._idle.pop(slot, None)
        if self.held[slot]:
            self._idle[slot] = None

    def opened(self, slot: int) -> None:
        self._idle.pop(slot, None)

    def kept(self, slot: int) -> int:
        self._check(slot)
        return min(int(self.held[slot]) * self.block_size, self.max_ctx)

    def locate(self, slot: int, p0: int, p1: int) -> tuple[np.ndarray, np.ndarray]:
        """(block ids, offsets in the block) of positions [p0, p1) of `slot`, which must hold them."""
        p = np.arange(p0, p1)
        blocks = self.tables[slot, p // self.block_size]
        if p1 > p0 and blocks[-1] < 0:
            raise ValueError(f"KV slot {slot} holds {self.kept(slot)} positions, not {p1}")
        return blocks, p % self.block_size


class KVLayer:
    """One layer's keys and values in the pool's blocks, k and v (n_blocks, Hkv, BLOCK_SIZE, row);
    reads and writes take and give float32 (n, Hkv, hd) and convert on the way (module docstring)."""

    def __init__(self, table: BlockTable, dtype: str, n_kv_heads: int, head_dim: int):
        self.table, self.dtype, self.head_dim = table, dtype, head_dim
        self.qtype, elem = KV_TYPES[dtype]
        shape = (table.n_blocks, n_kv_heads, table.block_size, row_width(dtype, head_dim))
        self.k = np.zeros(shape, elem)
        self.v = np.zeros(shape, elem)

    def _encode(self, x: np.ndarray) -> np.ndarray:
        """float rows (..., hd) in the storage type: (..., row)."""
        x = np.asarray(x, np.float32)
        if self.qtype in (Q.F32, Q.F16):
            return x.astype(self.k.dtype)
        return gguf_quants.quantize(np.ascontiguousarray(x), self.qtype)

    def _decode(self, rows: np.ndarray) -> np.ndarray:
        """Rows in the storage type (..., row) as float32 (..., hd)."""
        if self.qtype in (Q.F32, Q.F16):
            return rows.astype(np.float32, copy=False)
        flat = np.ascontiguousarray(rows).reshape(-1)
        return gguf_quants.dequantize(flat, self.qtype).astype(np.float32, copy=False).reshape(
            rows.shape[:-1] + (self.head_dim,))

    def write(self, slot: int, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """Positions start … start + n of `slot` (blocks reserved as needed): k, v (n, Hkv, hd)."""
        n = len(k)
        self.table.reserve(slot, start + n)
        b, o = self.table.locate(slot, start, start + n)
        self.k[b, :, o] = self._encode(k)
        self.v[b, :, o] = self._encode(v)

    def write_rows(self, slots: np.ndarray, positions: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """One position for each of several slots: k, v (B, Hkv, hd)."""
        for slot, p in zip(slots, positions):
            self.table.reserve(int(slot), int(p) + 1)
        bs = self.table.block_size
        b = self.table.tables[slots, positions // bs]
        self.k[b, :, positions % bs] = self._encode(k)
        self.v[b, :, positions % bs] = self._encode(v)

    def rows(self, slot: int, p0: int, p1: int) -> tuple[np.ndarray, np.ndarray]:
        """Positions [p0, p1) of `slot` as float32 (p1 - p0, Hkv, hd) each."""
        b, o = self.table.locate(slot, p0, p1)
        return self._decode(self.k[b, :, o]), self._decode(self.v[b, :, o])

    def read(self, slot: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Positions [0, end) of `slot` as float32 (end, Hkv, hd) each; zeros where it holds no block."""
        k = np.zeros((end,) + self.k.shape[1:2] + (self.head_dim,), np.float32)
        v = np.zeros_like(k)
        n = min(end, self.table.kept(slot))
        k[:n], v[:n] = self.rows(slot, 0, n)
        return k, v

    def copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Blocks src[i] → dst[i] (whole blocks, every head and position: sharing's copy on write)."""
        self.k[dst] = self.k[src]
        self.v[dst] = self.v[src]

    def save_blocks(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Blocks `ids` as host arrays (len(ids), Hkv, BLOCK_SIZE, row) in the storage type (a spill)."""
        return self.k[ids].copy(), self.v[ids].copy()

    def load_blocks(self, ids: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Blocks `ids` from host arrays save_blocks gave (a restore)."""
        self.k[ids] = k
        self.v[ids] = v

    def gather(self, slots: np.ndarray, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Positions [0, end) of several slots as float32 (B, end, Hkv, hd); zeros where a slot
        holds no block (callers mask each slot's positions past its own length)."""
        pairs = [self.read(int(s), end) for s in slots]
        return np.stack([k for k, _ in pairs]), np.stack([v for _, v in pairs])


class KVCache(SlotTable):
    """All layers' caches over one pool of blocks, plus the slot bookkeeping. The layers are
    `layer_class` instances: KVLayer in host memory here; a device's cache subclasses this with
    its own layer class of the same calls (write, write_rows, rows, read, copy_blocks,
    save_blocks, load_blocks) over its own arrays of the same layout."""

    layer_class: type = KVLayer

    def __init__(self, cfg: LlamaConfig, *, n_slots: int, max_ctx: int, dtype: str = "f32",
                 n_blocks: int | None = None, block_size: int = BLOCK_SIZE):
        if dtype not in KV_TYPES:
            raise ValueError(f"KV cache dtype {dtype!r} is not one of {', '.join(KV_DTYPES)}")
        if n_slots < 1 or max_ctx < 1:
            raise ValueError("the KV cache needs at least one slot and one position")
        super().__init__(n_slots)
        self.max_ctx, self.dtype = max_ctx, dtype
        n_blocks = default_blocks(n_slots, max_ctx, block_size) if n_blocks is None else n_blocks
        self.blocks = BlockTable(n_slots, max_ctx, n_blocks, block_size)
        self.layers = [self.layer_class(self.blocks, dtype, cfg.n_kv_heads, cfg.head_dim) for _ in range(cfg.n_layers)]

    def layer(self, i: int) -> KVLayer:
        return self.layers[i]

    def alloc(self, slot: int | None = None) -> int:
        slot = super().alloc(slot)
        self.blocks.opened(slot)
        return slot

    def free(self, slot: int) -> None:
        super().free(slot)
        self.blocks.closed(slot)

    def reserve(self, slot: int, n: int) -> None:
        self.blocks.reserve(slot, n)

    def trim(self, slot: int, n: int) -> None:
        self.blocks.release(slot, n)

    def kept(self, slot: int) -> int:
        return self.blocks.kept(slot)

    def copy_prefix(self, src: int, dst: int, n: int, start: int = 0) -> None:
        """Positions [start, n) of slot `src` into slot `dst`, every layer (a shared prompt
        prefix); `src` may be closed if it still holds them."""
        if n > self.kept(src):
            raise ValueError(f"KV slot {src} holds {self.kept(src)} positions, not the {n} to copy")
        self.blocks.reserve(dst, n, keep=(src,))
        sb, so = self.blocks.locate(src, start, n)
        db, do = self.blocks.locate(dst, start, n)
        for layer in self.layers:
            layer.k[db, :, do] = layer.k[sb, :, so]
            layer.v[db, :, do] = layer.v[sb, :, so]
