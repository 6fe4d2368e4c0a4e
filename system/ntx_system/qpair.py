"""One NVMe submission/completion queue pair, transport-free.

The queue pair knows ring memory (two `DmaRegion`s) and a doorbell writer callable; it does not
know whether the controller is a PCIe device behind VFIO or the tests' in-process fake.  It keeps:

- the SQ tail we write and the SQ head the controller reports in every CQE (`sqhd`), so a slot is
  reused only after the controller has fetched it;
- the CQ head and the expected phase tag, which flips every time the CQ wraps: a CQE is new when
  its phase bit equals the expected phase (the CQ is never read by any other rule);
- command ids: a free list, so completions may arrive in any order;
- a deadline per command: `poll` raises `CommandTimeout` once any outstanding command is past
  it, so a lost command is an error with a name, never a hang.

Ordering: x86 keeps stores in program order and loads in program order, so writing the SQE and
then the doorbell, and reading the phase bit before the rest of the CQE, needs no explicit
barrier from Python on the machines we support (x86-64 only).

Thread rule: one queue pair belongs to one thread.  Nothing here takes a lock; callers that share
a queue pair (the admin queue) serialise with their own lock.
"""
from __future__ import annotations

import struct
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from . import spec
from .dma import DmaRegion
from .spec import CQE_DTYPE, SQE_DTYPE, Status

DoorbellWriter = Callable[[int, int], None]   # (register offset, value)

_SQE = struct.Struct("<BBHIIIQQQIIIIII")     # SQE_DTYPE, packed in one call
_CQE = struct.Struct("<IIHHHH")              # CQE_DTYPE
_U16 = struct.Struct("<H")
assert _SQE.size == SQE_DTYPE.itemsize and _CQE.size == CQE_DTYPE.itemsize


class QpairError(RuntimeError):
    """Base class of queue pair errors."""


class QueueFull(QpairError):
    pass


class QpairClosed(QpairError):
    pass


class CommandTimeout(QpairError):
    """A command did not complete in time.  The controller may still DMA into its buffer: the
    owner must reset the controller (CC.EN=0) before reusing or freeing that memory."""

    def __init__(self, qid: int, cid: int, opcode: int, waited_s: float, outstanding: int):
        self.qid, self.cid, self.opcode, self.waited_s = qid, cid, opcode, waited_s
        super().__init__(
            f"NVMe command cid={cid} opcode={opcode:#04x} on queue {qid} did not complete in "
            f"{waited_s:.3f} s ({outstanding} commands outstanding); the controller is hung or "
            f"lost the command: reset the controller (ntx-admin unbind, then bind again)")


class CommandError(QpairError):
    """A command completed with an error status."""

    def __init__(self, status: Status, opcode: int, cid: int, qid: int, what: str = ""):
        self.status, self.opcode, self.cid, self.qid = status, opcode, cid, qid
        super().__init__(f"NVMe command {what or f'opcode {opcode:#04x}'} (cid={cid}, queue {qid}) "
                         f"failed: {status}")


class CommandAborted(QpairError):
    pass


@dataclass
class Completion:
    cid: int
    status: Status
    dw0: int
    opcode: int
    context: Any = None

    def check(self, qid: int, what: str = "") -> "Completion":
        if not self.status.ok:
            raise CommandError(self.status, self.opcode, self.cid, qid, what)
        return self


@dataclass
class _Outstanding:
    opcode: int
    deadline: float
    submitted: float
    context: Any = None


@dataclass
class QpairStats:
    submitted: int = 0
    completed: int = 0
    errors: int = 0
    doorbells: int = 0
    max_outstanding: int = 0
    extra: dict = field(default_factory=dict)


class QueuePair:
    """Submission + completion ring of `entries` slots each; at most `entries - 1` commands are
    outstanding (a full ring must be told apart from an empty one)."""

    def __init__(self, qid: int, entries: int, sq: DmaRegion, cq: DmaRegion,
                 doorbell_write: DoorbellWriter, dstrd: int, *,
                 timeout_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        if entries < 2:
            raise ValueError("a queue needs at least 2 entries")
        if sq.size < entries * SQE_DTYPE.itemsize or cq.size < entries * CQE_DTYPE.itemsize:
            raise ValueError("ring memory smaller than the queue")
        self.qid = qid
        self.entries = entries
        self.sq_region, self.cq_region = sq, cq
        self.sq = sq.view[: entries * 64].view(SQE_DTYPE)
        self.cq = cq.view[: entries * 16].view(CQE_DTYPE)
        # struct over memoryviews: one call per SQE/CQE instead of a numpy call per field,
        # which is what makes Python keep up with a drive (hot path).
        self._sq_mem = memoryview(sq.view[: entries * 64])
        self._cq_mem = memoryview(cq.view[: entries * 16])
        self._doorbell = doorbell_write
        self._sq_doorbell = spec.doorbell_sq_tail(qid, dstrd)
        self._cq_doorbell = spec.doorbell_cq_head(qid, dstrd)
        self.timeout_s = timeout_s
        self._clock = clock
        self.sq_tail = 0
        self.sq_head = 0
        self._sq_tail_rung = 0
        self.cq_head = 0
        self.phase = 1
        self._free_cids = list(range(entries - 2, -1, -1))   # pop() gives 0 first
        self._outstanding: dict[int, _Outstanding] = {}
        self.closed: str | None = None
        self._earliest_deadline = float("inf")     # lower bound; scanning is only needed past it
        self.unclaimed: dict[int, Completion] = {}   # completed, not yet asked for by wait()
        self.stats = QpairStats()

    # ------------------------------------------------------------------ submission

    @property
    def outstanding(self) -> int:
        return len(self._outstanding)

    @property
    def capacity(self) -> int:
        return self.entries - 1

    def sq_free_slots(self) -> int:
        used = (self.sq_tail - self.sq_head) % self.entries
        return self.entries - 1 - used

    def can_submit(self) -> bool:
        return self.closed is None and bool(self._free_cids) and self.sq_free_slots() > 0

    def peek_cid(self) -> int:
        """The command id the next `submit` will use (to fill its PRP list page first)."""
        if not self._free_cids:
            raise QueueFull(f"queue {self.qid}: no free command id")
        return self._free_cids[-1]

    def submit(self, opcode: int, *, nsid: int = 0, prp1: int = 0, prp2: int = 0,
               cdw10: int = 0, cdw11: int = 0, cdw12: int = 0, cdw13: int = 0,
               cdw14: int = 0, cdw15: int = 0, context: Any = None, ring: bool = True,
               timeout_s: float | None = None) -> int:
        """Write one SQE and return its command id.  With `ring=False` the doorbell is left for
        `ring()`, so a batch costs one MMIO write."""
        if self.closed is not None:
            raise QpairClosed(f"queue {self.qid} is closed: {self.closed}")
        if not self._free_cids or self.sq_free_slots() == 0:
            raise QueueFull(f"queue {self.qid} has {self.outstanding} commands outstanding "
                            f"(capacity {self.capacity}); poll for completions first")
        cid = self._free_cids.pop()
        _SQE.pack_into(self._sq_mem, self.sq_tail * 64, opcode, 0, cid, nsid, 0, 0, 0,
                       prp1, prp2, cdw10, cdw11, cdw12, cdw13, cdw14, cdw15)
        now = self._clock()
        deadline = now + (timeout_s or self.timeout_s)
        self._outstanding[cid] = _Outstanding(opcode, deadline, now, context)
        if deadline < self._earliest_deadline:
            self._earliest_deadline = deadline
        self.sq_tail = (self.sq_tail + 1) % self.entries
        self.stats.submitted += 1
        self.stats.max_outstanding = max(self.stats.max_outstanding, self.outstanding)
        if ring:
            self.ring()
        return cid

    def ring(self) -> None:
        """Tell the controller about every SQE written since the last ring."""
        if self.sq_tail != self._sq_tail_rung:
            self._doorbell(self._sq_doorbell, self.sq_tail)
            self._sq_tail_rung = self.sq_tail
            self.stats.doorbells += 1

    # ------------------------------------------------------------------ completion

    def poll(self, max_completions: int | None = None) -> list[Completion]:
        """Consume every new CQE (those whose phase bit matches), free their command ids, ring
        the CQ head doorbell once, then raise `CommandTimeout` if an outstanding command is
        past its deadline."""
        done: list[Completion] = []
        cq_mem = self._cq_mem
        while max_completions is None or len(done) < max_completions:
            off = self.cq_head * 16
            raw_status = _U16.unpack_from(cq_mem, off + 14)[0]
            if (raw_status & spec.CQE_PHASE) != self.phase:
                break
            dw0, _, sqhd, _, cid, _ = _CQE.unpack_from(cq_mem, off)
            self.sq_head = sqhd % self.entries
            info = self._outstanding.pop(cid, None)
            self.cq_head += 1
            if self.cq_head == self.entries:
                self.cq_head = 0
                self.phase ^= 1
            if info is None:
                self.closed = f"controller completed unknown command id {cid}"
                raise QpairError(f"queue {self.qid}: completion for command id {cid} that is not "
                                 f"outstanding; the controller and driver disagree, reset it")
            self._free_cids.append(cid)
            status = Status.from_cqe_status(raw_status)
            if not status.ok:
                self.stats.errors += 1
            done.append(Completion(cid, status, dw0, info.opcode, info.context))
        if done:
            self._doorbell(self._cq_doorbell, self.cq_head)
            self.stats.completed += len(done)
        elif self._outstanding:
            self._check_deadlines()
        return done

    def _check_deadlines(self) -> None:
        now = self._clock()
        if now <= self._earliest_deadline:
            return
        self._earliest_deadline = min((o.deadline for o in self._outstanding.values()),
                                      default=float("inf"))
        for cid, info in self._outstanding.items():
            if now > info.deadline:
                self.closed = f"command {cid} timed out"
                raise CommandTimeout(self.qid, cid, info.opcode, now - info.submitted,
                                     self.outstanding)

    def wait(self, cids: Iterable[int], *, spin: int = 200,
             sleep_s: float = 20e-6) -> dict[int, Completion]:
        """Poll until every command in `cids` has completed; other completions that arrive are
        kept in `self.unclaimed`.  Raises `CommandTimeout` instead of waiting forever."""
        want = set(cids)
        got: dict[int, Completion] = {}
        for cid in list(want):
            if cid in self.unclaimed:
                got[cid] = self.unclaimed.pop(cid)
                want.discard(cid)
        idle = 0
        while want:
            batch = self.poll()
            if not batch:
                idle += 1
                if idle > spin:
                    time.sleep(sleep_s)
                continue
            idle = 0
            for c in batch:
                if c.cid in want:
                    want.discard(c.cid)
                    got[c.cid] = c
                else:
                    self.unclaimed[c.cid] = c
        return got

    def execute(self, opcode: int, what: str = "", **fields) -> Completion:
        """Submit one command, wait for it and raise `CommandError` on an error status."""
        cid = self.submit(opcode, **fields)
        return self.wait([cid])[cid].check(self.qid, what)

    # ------------------------------------------------------------------ shutdown

    def abort_all(self, reason: str) -> list[int]:
        """Close the queue pair: forget every outstanding command and refuse new ones.  Used on
        shutdown after the controller has been disabled, when no completion can come any more.
        Returns the command ids that were abandoned."""
        abandoned = sorted(self._outstanding)
        self._outstanding.clear()
        self.closed = reason
        return abandoned
