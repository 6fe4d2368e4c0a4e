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

Slots share blocks: a prompt prefix one slot computed is given to another by reference (its
whole blocks counted once in the pool; the last, partial block copied), and a slot about to
write into a block it shares gets its own copy first (copy on write, in `reserve`, which the
engine calls before every step with the slot's length at the segment's start).

Every slot has one owner at a time (SlotState): FREE slots hold nothing and are the only ones
`alloc` hands out; a LIVE slot is its sequence's (or an internal job's, such as a measurement)
and is the only kind a step writes; a PARKED slot is a finished sequence whose owner (the prefix
cache) keeps it to reopen. Freeing a slot gives its blocks back at once. A parked slot keeps its
blocks, and so its keys and values, until the pool runs short: then the least recently parked
slots give theirs back, first saving them to a host pool where one is configured (`spill`
bytes; a device's cache, where host RAM is the larger memory), and `kept` says how many
positions a slot still holds, in blocks or in the host pool; reopening or sharing from a
spilled slot restores its blocks instead of prefilling them. Memory comes from np.zeros, so
blocks that are never written cost no RAM.

Thread rule: one owner (the engine's scheduler thread) calls a cache; a step reads the tables
the owner set before it started.
"""

from __future__ import annotations

import collections
import enum
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


class SlotState(enum.Enum):
    """Who a sequence slot belongs to. A slot has one owner at a time: nothing is written into
    a slot, or read back as someone's keys and values, except by the owner that holds it."""

    FREE = "free"      # nobody's: holds nothing; `alloc` hands out these alone
    LIVE = "live"      # a running sequence's (or an internal job's): the only state a step writes
    PARKED = "parked"  # the sequence ended and whoever ran it keeps its keys and values (the
    #                    prefix cache); its blocks may go back to the pool (`kept` says what is left)


class SlotTable:
    """Which sequence slots of a cache are free, live or parked, and how many positions each holds.

    Shared by every backend's KV cache; one owner (the engine's scheduler thread) calls it. The
    paged calls (reserve, trim, kept) are answered here as a cache of whole slots answers them
    (every slot holds max_ctx positions from the start); KVCache pages.

    Ownership is by construction: `alloc` takes a FREE slot only, so a job that asks for "a slot"
    can never receive one whose keys and values another part still counts on; a PARKED slot goes
    back to LIVE only through `reopen`, by the part that parked it, and to FREE through `free`,
    which forgets its contents.
    """

    max_ctx: int  # set by each cache

    def __init__(self, n_slots: int):
        self.n_slots = n_slots
        self.lengths = np.zeros(n_slots, np.int64)
        self.state = [SlotState.FREE] * n_slots
        self._free = list(range(n_slots - 1, -1, -1))

    def _expect(self, slot: int, *states: SlotState) -> None:
        if not 0 <= slot < self.n_slots:
            raise ValueError(f"KV slot {slot} is out of range 0..{self.n_slots - 1}")
        if self.state[slot] not in states:
            raise ValueError(f"KV slot {slot} is {self.state[slot].value}, not "
                             f"{' or '.join(s.value for s in states)}")

    def alloc(self, slot: int | None = None) -> int:
        """A FREE slot (`slot` itself when given: it must be FREE), now LIVE and empty."""
        if slot is None:
            if not self._free:
                raise RuntimeError(f"all {self.n_slots} KV cache slots are live or kept by the prefix cache")
            slot = self._free.pop()
        else:
            self._expect(slot, SlotState.FREE)
            self._free.remove(slot)
        self.state[slot] = SlotState.LIVE
        self.lengths[slot] = 0
        return slot

    def park(self, slot: int) -> None:
        """A LIVE slot's sequence ended; its keys and values stay for the caller, who alone may
        `reopen` or `free` it."""
        self._expect(slot, SlotState.LIVE)
        self.state[slot] = SlotState.PARKED

    def reopen(self, slot: int) -> None:
        """A PARKED slot LIVE again, its positions as they were (the caller trims them)."""
        self._expect(slot, SlotState.PARKED)
        self.state[slot] = SlotState.LIVE

    def free(self, slot: int) -> None:
        """A LIVE or PARKED slot FREE: its contents are forgotten."""
        self._expect(slot, SlotState.LIVE, SlotState.PARKED)
        self.state[slot] = SlotState.FREE
        self.lengths[slot] = 0
        self._free.append(slot)

    def reserve(self, slot: int, n: int) -> None:
        """Room for positions [0, n) of `slot` (a whole slot has it)."""

    def reserve_rows(self, slots: list[int], ends: list[int]) -> None:
        """reserve(slots[i], ends[i]) for each segment of a step, in order."""
        for slot, n in zip(slots, ends):
            self.reserve(slot, n)

    def trim(self, slot: int, n: int) -> None:
        """Positions ≥ n of `slot` are no longer needed (a whole slot keeps its room)."""

    def kept(self, slot: int) -> int:
        """Positions whose keys and values `slot` may still hold (a whole slot: all of them;
        a FREE slot: none)."""
        return 0 if self.state[slot] is SlotState.FREE else self.max_ctx

    def blocks_for(self, n: int) -> int:
        """Blocks a sequence of n positions needs (a whole slot has its room: none to count)."""
        return 0

    def available(self) -> int:
        """Blocks a sequence could get now; admission takes a prompt of n positions while
        blocks_for(n) ≤ available()."""
        return 0

    @property
    def free_slots(self) -> int:
        """FREE slots: what `alloc` can hand out now."""
        return len(self._free)


class BlockTable:
    """The blocks of one pool and which slot holds which, in position order. Shared by every
    layer of a cache (one block id covers all layers).

    A block may be held by several slots at once (a shared prompt prefix: `share`); `refs`
    counts its holders and it goes back to the pool when the last lets go, so the pool counts a
    shared block once. A slot about to write positions in a block it shares first gets its own
    copy (`reserve(..., start=)`: copy on write), so a sharer never sees another's writes.

    When the pool runs short, closed slots (least recently closed first) give their blocks
    back; with a host pool (`spill_limit` bytes, 0: none) their contents are saved there first
    (`spilled`), and the slot still counts as holding its positions (`kept`): reopening it, or
    sharing from it, restores them into fresh blocks instead of having them prefilled again.

    The table moves no data itself: its `owner` (KVCache) copies, saves and restores blocks
    over every layer (copy_blocks, save_blocks, load_blocks)."""

    def __init__(self, n_slots: int, max_ctx: int, n_blocks: int, block_size: int = BLOCK_SIZE):
        if n_blocks < 1 or block_size < 1:
            raise ValueError("the KV pool needs at least one block of at least one position")
        self.block_size, self.n_blocks, self.max_ctx = block_size, n_blocks, max_ctx
        self.max_blocks = -(-max_ctx // block_size)
        self.tables = np.full((n_slots, self.max_blocks), -1, np.int32)  # never reallocated: kernels hold it
        self.held = np.zeros(n_slots, np.int64)  # blocks each slot holds
        self.refs = np.zeros(n_blocks, np.int32)  # slots holding each block (0: in the pool)
        self._pool = list(range(n_blocks))  # a heap: the lowest free id first keeps the touched memory compact
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # closed slots, oldest first
        self._closed = np.zeros(n_slots, bool)
        self.owner = None  # copies, saves and restores blocks (KVCache); None: a table without data
        self.spill_limit = 0  # bytes of the host pool for closed slots' blocks (0: they are dropped)
        self.block_bytes = 0  # host bytes one spilled block takes (the owner sets it)
        # slot → (blocks, what owner.save_blocks gave), least recently spilled first
        self.spilled: collections.OrderedDict[int, tuple[int, object]] = collections.OrderedDict()
        self._spilled_n = 0  # blocks in the host pool (a counter: status reads it from another thread)
        self.stats = {"shared": 0, "cow": 0, "spilled": 0, "restored": 0, "dropped": 0}  # blocks, in all

    # Before every write, check that the slot is live and holds its blocks alone (reserve with
    # start): a few numpy calls per segment, so on in tests (tests/conftest.py), off in service.
    check_owners = False

    @property
    def free_blocks(self) -> int:
        return len(self._pool)

    @property
    def used_blocks(self) -> int:
        """Blocks some slot holds (a shared block once)."""
        return self.n_blocks - len(self._pool)

    @property
    def shared_blocks(self) -> int:
        """Blocks more than one slot holds."""
        return int((self.refs > 1).sum())

    @property
    def spill_bytes(self) -> int:
        """Host bytes the spilled blocks take."""
        return self._spilled_n * self.block_bytes

    def available(self, keep: tuple[int, ...] = ()) -> int:
        """Blocks a growing sequence could get now: the free ones, and those closed slots (not
        in `keep`) hold alone."""
        mine = collections.Counter(int(b) for s in self._idle if s not in keep
                                   for b in self.tables[s, :self.held[s]])
        return len(self._pool) + sum(1 for b, n in mine.items() if self.refs[b] == n)

    def _check(self, slot: int) -> None:
        if not 0 <= slot < len(self.held):
            raise ValueError(f"KV slot {slot} is out of range 0..{len(self.held) - 1}")

    def _take(self) -> int:
        b = heapq.heappop(self._pool)
        self.refs[b] = 1
        return b

    def _drop(self, b: int) -> None:
        self.refs[b] -= 1
        if self.refs[b] == 0:
            heapq.heappush(self._pool, b)

    def _grab(self, need: int, keep: tuple[int, ...]) -> None:
        """At least `need` free blocks if closed slots (least recently closed first, never those
        in `keep`) can give them; fewer otherwise (the caller raises)."""
        for other in list(self._idle):
            if len(self._pool) >= need:
                return
            if other not in keep:
                del self._idle[other]
                self._evict(other)

    def spill(self, slot: int) -> bool:
        """A closed slot's blocks back to the pool now, as the pool takes them when it runs short:
        saved to the host pool first where it has room (True), else dropped (False)."""
        self._check(slot)
        if slot not in self._idle:
            raise ValueError(f"KV slot {slot} is live or holds no blocks: only a closed slot's blocks spill")
        del self._idle[slot]
        self._evict(slot)
        return slot in self.spilled

    def _evict(self, slot: int) -> None:
        """A closed slot's blocks back to the pool: saved to the host pool first where it has room."""
        h = int(self.held[slot])
        size = h * self.block_bytes
        saved = None
        if self.owner is not None and h and 0 < size <= self.spill_limit:
            while self.spilled and self.spill_bytes + size > self.spill_limit:
                _, (n, _) = self.spilled.popitem(last=False)  # the least recently spilled goes
                self._spilled_n -= n
                self.stats["dropped"] += n
            saved = self.owner.save_blocks(self.tables[slot, :h].copy())
        self._let_go(slot, 0)
        if saved is not None:
            self.spilled[slot] = (h, saved)
            self._spilled_n += h
            self.stats["spilled"] += h
        else:
            self.stats["dropped"] += h

    def _let_go(self, slot: int, keep: int) -> None:
        """Blocks `keep` onwards of `slot` back (a shared one only once its last holder lets go)."""
        for j in range(keep, int(self.held[slot])):
            self._drop(int(self.tables[slot, j]))
            self.tables[slot, j] = -1
        self.held[slot] = min(int(self.held[slot]), keep)

    def _restore(self, slot: int, blocks: int, keep: tuple[int, ...] = ()) -> None:
        """The first `blocks` of `slot`'s spilled blocks into fresh ones (the rest forgotten)."""
        n, saved = self.spilled.pop(slot)
        self._spilled_n -= n
        blocks = min(blocks, n)
        if blocks:
            self._grab(blocks, keep + (slot,))
            if len(self._pool) < blocks:
                self.spilled[slot] = (n, saved)
                self._spilled_n += n
                self.spilled.move_to_end(slot, last=False)
                raise self._full(slot, blocks, blocks * self.block_size)
            ids = np.array([self._take() for _ in range(blocks)], np.int32)
            self.tables[slot, :blocks] = ids
            self.held[slot] = blocks
            self.owner.load_blocks(ids, saved)
            self.stats["restored"] += blocks
            if self._closed[slot]:
                self._idle[slot] = None
        self.stats["dropped"] += n - blocks

    def _full(self, slot: int, need: int, n: int) -> KVPoolFull:
        live = {int(b) for s in np.nonzero(~self._closed)[0] for b in self.tables[s, :self.held[s]]}
        return KVPoolFull(f"KV pool full: slot {slot} needs {need} more blocks of {self.block_size} positions "
                          f"for {n} positions, {len(self._pool)} of {self.n_blocks} are free ({len(live)} held by "
                          f"live sequences); give the pool more blocks (kv_blocks) or run fewer sequences at once")

    def reserve(self, slot: int, n: int, *, keep: tuple[int, ...] = (), start: int | None = None) -> None:
        """Blocks for positions [0, n) of `slot`, taken from the pool as needed; when it runs
        short, closed slots (least recently closed first, never those in `keep`) give theirs back.
        With `start`, positions [start, n) are about to be written: a block among them that
        `slot` shares with another is replaced by a copy of its own first (copy on write)."""
        self._check(slot)
        if n > self.max_ctx:
            raise ValueError(f"KV slot {slot}: {n} positions exceed the context of {self.max_ctx}")
        if slot in self.spilled:
            self._restore(slot, self.max_blocks, keep)
        want = -(-n // self.block_size)

        def shared():
            if start is None:
                return []
            return [j for j in range(start // self.block_size, min(int(self.held[slot]), want))
                    if self.refs[self.tables[slot, j]] > 1]

        need = max(0, want - int(self.held[slot])) + len(shared())
        if need <= 0:
            if self.check_owners and start is not None and start < n:
                self._check_write(slot, start, n)
            return
        self._grab(need, keep + (slot,))
        cow = shared()  # closed sharers may have let go meanwhile
        need = max(0, want - int(self.held[slot])) + len(cow)
        if len(self._pool) < need:
            raise self._full(slot, need, n)
        if cow:
            src = self.tables[slot, cow].copy()
            dst = np.array([self._take() for _ in cow], np.int32)
            self.owner.copy_blocks(src, dst)
            self.tables[slot, cow] = dst
            for b in src:
                self._drop(int(b))
            self.stats["cow"] += len(cow)
        h = int(self.held[slot])
        for j in range(h, want):
            self.tables[slot, j] = self._take()
        self.held[slot] = max(h, want)
        if self.check_owners and start is not None and start < n:
            self._check_write(slot, start, n)

    def reserve_rows(self, slots: list[int], ends: list[int], starts: list[int]) -> None:
        """reserve(slots[i], ends[i], start=starts[i]) for each segment of a step, in order.
        Most decode rows write into a block they already hold alone: for those a few look-ups
        tell that there is nothing to do, and only the others (a block to take or to copy, a
        spilled slot, a segment over several blocks, a bad slot or end: reserve raises) go
        through reserve. A reserve takes blocks from the pool or from closed slots, never from a
        live slot's, so a row found to have nothing to do still has nothing to do after the
        others'. (A step holds a few rows: a numpy pass over them costs more than this loop, whose
        look-ups read Python ints (item), not numpy scalars.)"""
        bs, n_slots, max_ctx = self.block_size, len(self.held), self.max_ctx
        held, table, refs, spilled = self.held.item, self.tables.item, self.refs.item, self.spilled
        for slot, n, start in zip(slots, ends, starts):
            j = start // bs  # the block the segment starts in
            if (0 <= slot < n_slots and start < n <= max_ctx and (n - 1) // bs == j and j < held(slot)
                    and refs(table(slot, j)) == 1 and slot not in spilled):
                if self.check_owners:
                    self._check_write(slot, start, n)
                continue
            self.reserve(slot, n, start=start)

    def release(self, slot: int, n: int) -> None:
        """The blocks of `slot` past position n back to the pool; a spilled slot's first
        positions up to n restored from the host pool (the rest forgotten)."""
        self._check(slot)
        keep = -(-n // self.block_size)
        if slot in self.spilled:
            self._restore(slot, keep)
        self._let_go(slot, keep)

    def share(self, src: int, dst: int, n: int, start: int = 0) -> tuple[int, int] | None:
        """Slot `dst`, which holds positions [0, start) of its own, takes [start, n) of slot
        `src`: src's blocks themselves where a block lies whole in [start, n), a copy of the
        last, partial one (dst writes there next). Returns the positions left to copy one by
        one, (start, end of its block), when start falls inside a block dst holds; else None."""
        self._check(src)
        self._check(dst)
        if self._closed[dst]:
            raise RuntimeError(f"KV slot {dst} is not live: it cannot take positions of slot {src}")
        bs = self.block_size
        if src in self.spilled:
            self._restore(src, -(-n // bs), keep=(dst,))
        if n > self.kept(src):
            raise ValueError(f"KV slot {src} holds {self.kept(src)} positions, not the {n} to share")
        if dst in self.spilled:
            n, _ = self.spilled.pop(dst)
            self._spilled_n -= n
            self.stats["dropped"] += n
        first, (full, part) = -(-start // bs), divmod(n, bs)  # first: the first block wholly past start
        if self.held[dst] < first:
            raise ValueError(f"KV slot {dst} holds {self.kept(dst)} positions, not the {start} it keeps")
        self._let_go(dst, first)  # what dst held from there on is past its length
        for j in range(first, full):
            self.refs[self.tables[src, j]] += 1
            self.tables[dst, j] = self.tables[src, j]
            self.stats["shared"] += 1
        if part and full >= first:
            self._grab(1, (src, dst))
            if not self._pool:
                raise self._full(dst, 1, n)
            d = self._take()
            self.tables[dst, full] = d
            self.owner.copy_blocks(self.tables[src, full:full + 1].copy(), np.array([d], np.int32))
        self.held[dst] = max(int(self.held[dst]), -(-n // bs))
        return (start, min(n, first * bs)) if start % bs and start < n else None

    def closed(self, slot: int) -> None:
        """`slot`'s sequence ended and its owner keeps it (parked): its blocks stay until the
        pool needs them."""
        self._idle.pop(slot, None)
        self._closed[slot] = True
        if self.held[slot]:
            self._idle[slot] = None

    def opened(self, slot: int) -> None:
        self._idle.pop(slot, None)
        self._closed[slot] = False

    def forget(self, slot: int) -> None:
        """`slot` is free: its blocks go back to the pool and its spilled copy is dropped, so
        nothing of it can be read back by whoever holds the slot next."""
        self._check(slot)
        self._idle.pop(slot, None)
        if slot in self.spilled:
            n, _ = self.spilled.pop(slot)
            self._spilled_n -= n
            self.stats["dropped"] += n
        self._let_go(slot, 0)
        self._closed[slot] = True

    def _check_write(self, slot: int, start: int, n: int) -> None:
        """The owner check (`check_owners`): positions [start, n) of `slot` are about to be
        written, so the slot is live and every block they fall in is its alone."""
        if self._closed[slot]:
            raise RuntimeError(f"KV slot {slot} is not live: nothing may write its positions {start}..{n}")
        blocks = self.tables[slot, start // self.block_size:-(-n // self.block_size)]
        if (blocks < 0).any() or (self.refs[blocks] != 1).any():
            raise RuntimeError(f"KV slot {slot}: positions {start}..{n} fall in blocks {blocks.tolist()} that "
                               f"it does not hold alone (holders {self.refs[blocks].tolist()})")

    def kept(self, slot: int) -> int:
        """Positions `slot` holds: in its blocks, or spilled to the host pool."""
        self._check(slot)
        blocks = self.spilled[slot][0] if slot in self.spilled else int(self.held[slot])
        return min(blocks * self.block_size, self.max_ctx)

    def locate(self, slot: int, p0: int, p1: int) -> tuple[np.ndarray, np.ndarray]:
        """(block ids, offsets in the block) of positions [p0, p1) of `slot`, which must hold them."""
        # from range and a row of the tables: np.arange's fill and a 2-d index let the GIL go
        p = np.fromiter(range(p0, p1), np.int64, max(0, p1 - p0))
        blocks = self.tables[slot][p // self.block_size]
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
        # Blocks and rows move between blocks as bytes (memoryview slices: a memcpy that keeps the
        # GIL). numpy lets the GIL go for a copy of a block's thousands of elements, and the
        # scheduler thread, which copies at admission (a shared prompt's last block), would wait
        # behind the daemon's other threads at each of a copy's 2 × layers calls.
        self._bytes = (memoryview(self.k).cast("B"), memoryview(self.v).cast("B"))
        self._row_bytes = shape[3] * self.k.itemsize

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
        self.table.reserve(slot, start + n, start=start)
        b, o = self.table.locate(slot, start, start + n)
        self.k[b, :, o] = self._encode(k)
        self.v[b, :, o] = self._encode(v)

    def write_rows(self, slots: np.ndarray, positions: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """One position for each of several slots: k, v (B, Hkv, hd)."""
        for slot, p in zip(slots, positions):
            self.table.reserve(int(slot), int(p) + 1, start=int(p))
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
        n = min(end, int(self.table.held[slot]) * self.table.block_size)  # in its blocks (not spilled ones)
        k[:n], v[:n] = self.rows(slot, 0, n)
        return k, v

    def copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Blocks src[i] → dst[i] (whole blocks, every head and position: sharing's copy on write)."""
        n = self.k[0].nbytes
        for s, d in zip(np.asarray(src).tolist(), np.asarray(dst).tolist()):
            for m in self._bytes:
                m[d * n:(d + 1) * n] = m[s * n:(s + 1) * n]

    def copy_rows(self, src_rows: tuple[np.ndarray, np.ndarray], dst_rows: tuple[np.ndarray, np.ndarray]) -> None:
        """Rows (block ids, offsets in the block: BlockTable.locate's) src → dst, every head
        (positions of one slot into another): each head's run of consecutive rows in one block
        is one copy."""
        sb, so, db, do = (np.asarray(a).tolist() for a in (*src_rows, *dst_rows))
        heads, size, row = self.k.shape[1], self.k.shape[2], self._row_bytes
        i = 0
        while i < len(sb):
            j = i + 1
            while j < len(sb) and (sb[j], db[j], so[j], do[j]) == (sb[i], db[i], so[j - 1] + 1, do[j - 1] + 1):
                j += 1
            n = (j - i) * row
            for h in range(heads):
                a, b = ((sb[i] * heads + h) * size + so[i]) * row, ((db[i] * heads + h) * size + do[i]) * row
                for m in self._bytes:
                    m[b:b + n] = m[a:a + n]
            i = j

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
    save_blocks, load_blocks) over its own arrays of the same layout.

    spill: bytes of host memory for closed slots' blocks when the pool needs them (BlockTable;
    0: dropped). Where the pool itself is host memory (the cpu backends) spilling only copies
    RAM to RAM, so they leave it 0; `spill_limit` may be set after construction."""

    layer_class: type = KVLayer

    def __init__(self, cfg: LlamaConfig, *, n_slots: int, max_ctx: int, dtype: str = "f32",
                 n_blocks: int | None = None, block_size: int = BLOCK_SIZE, spill: int = 0):
        if dtype not in KV_TYPES:
            raise ValueError(f"KV cache dtype {dtype!r} is not one of {', '.join(KV_DTYPES)}")
        if n_slots < 1 or max_ctx < 1:
            raise ValueError("the KV cache needs at least one slot and one position")
        if spill < 0:
            raise ValueError(f"kv_spill {spill} is negative: give bytes of host RAM, or 0 for none")
        super().__init__(n_slots)
        self.max_ctx, self.dtype = max_ctx, dtype
        n_blocks = default_blocks(n_slots, max_ctx, block_size) if n_blocks is None else n_blocks
        self.blocks = BlockTable(n_slots, max_ctx, n_blocks, block_size)
        self.blocks.owner = self
        self.blocks.block_bytes = bytes_per_token(cfg, dtype) * block_size
        self.blocks.spill_limit = spill
        self.layers = [self.layer_class(self.blocks, dtype, cfg.n_kv_heads, cfg.head_dim) for _ in range(cfg.n_layers)]

    @property
    def spill_limit(self) -> int:
        return self.blocks.spill_limit

    @spill_limit.setter
    def spill_limit(self, n: int) -> None:
        self.blocks.spill_limit = int(n)

    def layer(self, i: int) -> KVLayer:
        return self.layers[i]

    def alloc(self, slot: int | None = None) -> int:
        slot = super().alloc(slot)
        self.blocks.opened(slot)
        return slot

    def park(self, slot: int) -> None:
        super().park(slot)
        self.blocks.closed(slot)

    def reopen(self, slot: int) -> None:
        super().reopen(slot)
        self.blocks.opened(slot)

    def free(self, slot: int) -> None:
        super().free(slot)
        self.blocks.forget(slot)

    def spill(self, slot: int) -> bool:
        """A PARKED slot's blocks to the host pool now (spill_limit permitting; False: dropped),
        what the pool does when it runs short; reopening the slot restores them."""
        self._expect(slot, SlotState.PARKED)
        return self.blocks.spill(slot)

    def reserve(self, slot: int, n: int) -> None:
        """Room for positions [0, n) of `slot`, whose positions from its length on are written
        next: a block it shares there is copied first (the engine reserves a step's positions
        with lengths[slot] at the segment's start)."""
        self.blocks.reserve(slot, n, start=min(int(self.lengths[slot]), n))

    def reserve_rows(self, slots: list[int], ends: list[int]) -> None:
        """reserve(slots[i], ends[i]) for each segment of a step, in order (BlockTable.reserve_rows)."""
        length, n_slots = self.lengths.item, self.n_slots
        self.blocks.reserve_rows(slots, ends, [min(length(s), n) if 0 <= s < n_slots else 0
                                               for s, n in zip(slots, ends)])

    def trim(self, slot: int, n: int) -> None:
        self.blocks.release(slot, n)

    def kept(self, slot: int) -> int:
        return self.blocks.kept(slot)

    def available(self) -> int:
        """Blocks a sequence could get now (free, or held by closed slots alone): admission
        admits a prompt of n positions when blocks_for(n) ≤ available()."""
        return self.blocks.available()

    def blocks_for(self, n: int) -> int:
        return -(-n // self.blocks.block_size)

    def copy_prefix(self, src: int, dst: int, n: int, start: int = 0) -> None:
        """Positions [start, n) of slot `src` into slot `dst`, every layer (a shared prompt
        prefix): by block reference where blocks lie whole in the range (BlockTable.share); a
        block dst already holds part of gets the rest copied row by row. `src` may be closed
        (or spilled) if it still holds them."""
        rest = self.blocks.share(src, dst, n, start)
        if rest is None:
            return
        p0, p1 = rest
        self.blocks.reserve(dst, p1, keep=(src,), start=p0)
        s, d = self.blocks.locate(src, p0, p1), self.blocks.locate(dst, p0, p1)
        for layer in self.layers:
            layer.copy_rows(s, d)

    # ---- what the block table asks of the layers (BlockTable.owner) ----------------------------

    def copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None:
        for layer in self.layers:
            layer.copy_blocks(src, dst)

    def save_blocks(self, ids: np.ndarray) -> list:
        return [layer.save_blocks(ids) for layer in self.layers]

    def load_blocks(self, ids: np.ndarray, saved: list) -> None:
        """The first len(ids) blocks of what save_blocks gave into blocks `ids`."""
        n = len(ids)
        for layer, (k, v) in zip(self.layers, saved):
            layer.load_blocks(ids, k[:n], v[:n])
