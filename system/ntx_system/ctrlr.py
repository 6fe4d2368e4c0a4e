"""NVMe controller bring-up, admin commands, I/O queue pairs and MDTS-sized reads.

Bring-up is a named state machine (SPDK's nvme_ctrlr_process_init does the same), so a log line
or an error always says where it stopped:

    INIT → [DISABLE_WAIT_FOR_READY_1] → DISABLE → DISABLE_WAIT_FOR_READY_0
         → CONFIGURE_ADMIN_QUEUE → ENABLE → ENABLE_WAIT_FOR_READY_1
         → IDENTIFY_CONTROLLER → SET_NUMBER_OF_QUEUES → IDENTIFY_NAMESPACE → READY
    READY → SHUTTING_DOWN → CLOSED;   any state → FAILED on error

Every wait on CSTS.RDY is bounded by CAP.TO (the controller's own worst case), every admin
command by `admin_timeout_s`.

The transport (VFIO, or the tests' fake controller) is anything with: `read32/write32/read64/write64(offset)`
on BAR0, `dma_alloc(size)`, `dma_map(uint8 array)`, `dma_free(region)`, `contiguous_dma` (False
when the device sees physical pages, i.e. no-IOMMU), and `pci_ids` ((vendor, device) or None).

Thread rule: a `Controller` is created, started and shut down by one thread, which also owns the
admin queue.  Each `IoQpair` is owned by exactly one thread (one queue pair per thread);
`read_into` on different queue pairs may run on different threads at the same time.
"""
from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from . import spec
from .dma import ContiguousDmaRegion, DmaRegion, align_down, align_up
from .qpair import CommandError, QueuePair, QpairError
from .quirks import quirks_lookup
from .spec import PAGE_SIZE, AdminOpcode, IoOpcode

log = logging.getLogger("ntx_system.ctrlr")

# Largest transfer we issue even when MDTS allows more: one PRP list page holds 512 entries.
MAX_TRANSFER_CAP = 2 << 20


class Transport(Protocol):
    contiguous_dma: bool
    pci_ids: tuple[int, int] | None

    def read32(self, offset: int) -> int: ...
    def write32(self, offset: int, value: int) -> None: ...
    def read64(self, offset: int) -> int: ...
    def write64(self, offset: int, value: int) -> None: ...
    def dma_alloc(self, size: int) -> DmaRegion: ...
    def dma_map(self, array: np.ndarray) -> DmaRegion: ...
    def dma_free(self, region: DmaRegion) -> None: ...


class CtrlrState(enum.Enum):
    INIT = "init"
    DISABLE_WAIT_FOR_READY_1 = "disable: wait for CSTS.RDY=1 before clearing CC.EN"
    DISABLE = "disable: CC.EN=0"
    DISABLE_WAIT_FOR_READY_0 = "disable: wait for CSTS.RDY=0"
    CONFIGURE_ADMIN_QUEUE = "configure admin queue (AQA/ASQ/ACQ)"
    ENABLE = "enable: CC.EN=1"
    ENABLE_WAIT_FOR_READY_1 = "enable: wait for CSTS.RDY=1"
    IDENTIFY_CONTROLLER = "identify controller"
    SET_NUMBER_OF_QUEUES = "set features: number of queues"
    IDENTIFY_NAMESPACE = "identify namespace"
    READY = "ready"
    SHUTTING_DOWN = "shutting down"
    CLOSED = "closed"
    FAILED = "failed"


class CtrlrError(RuntimeError):
    """Bring-up or shutdown failed; the message names the state and the likely fix."""


@dataclass
class IoQpair:
    """An I/O queue pair plus one PRP list page per command slot (indexed by command id)."""
    qpair: QueuePair
    prp_pages: DmaRegion
    sq_mem: DmaRegion
    cq_mem: DmaRegion

    @property
    def qid(self) -> int:
        return self.qpair.qid


class Controller:
    def __init__(self, transport: Transport, *, nsid: int = 1, admin_entries: int = 32,
                 admin_timeout_s: float = 5.0, io_timeout_s: float = 10.0,
                 max_transfer_cap: int = MAX_TRANSFER_CAP,
                 sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic):
        self.t = transport
        self.nsid = nsid
        self.admin_entries = admin_entries
        self.admin_timeout_s = admin_timeout_s
        self.io_timeout_s = io_timeout_s
        self.max_transfer_cap = max_transfer_cap
        self._sleep, self._clock = sleep, clock
        self.state = CtrlrState.INIT
        self.quirks = quirks_lookup(*(transport.pci_ids or (None, None)))
        self.cap: spec.Cap | None = None
        self.identity: spec.IdentifyController | None = None
        self.namespace: spec.IdentifyNamespace | None = None
        self.max_transfer = 0
        self.io_queues_granted = 0
        self.admin: QueuePair | None = None
        self._admin_mem: list[DmaRegion] = []
        self._identify_buf: DmaRegion | None = None
        self._io: dict[int, IoQpair] = {}
        self._admin_lock = threading.Lock()

    # ------------------------------------------------------------------ registers

    def _set_state(self, state: CtrlrState) -> None:
        log.debug("nvme ctrlr: %s -> %s", self.state.name, state.name)
        self.state = state

    def _wait_csts(self, mask: int, want: int, what: str) -> None:
        timeout_s = max(self.cap.to_ms / 1000.0, 0.5) if self.cap else 5.0
        deadline = self._clock() + timeout_s
        delay = 1e-4
        while True:
            csts = self.t.read32(spec.REG_CSTS)
            if csts == 0xFFFFFFFF:
                raise CtrlrError(f"{self.state.name}: CSTS reads all ones: the device fell off "
                                 f"the bus or BAR0 is not mapped (is memory space enabled?)")
            if csts & spec.CSTS_CFS and want & spec.CSTS_RDY:
                raise CtrlrError(f"{self.state.name}: controller fatal status (CSTS.CFS=1) "
                                 f"while waiting for {what}; it needs a reset (unbind/bind)")
            if csts & mask == want:
                return
            if self._clock() > deadline:
                raise CtrlrError(f"{self.state.name}: {what} did not happen within CAP.TO = "
                                 f"{timeout_s:.1f} s (CSTS={csts:#x}); the controller is not "
                                 f"responding: check `ntx-admin check` and the kernel log")
            self._sleep(delay)
            delay = min(delay * 2, 0.01)

    def _doorbell(self, offset: int, value: int) -> None:
        self.t.write32(offset, value)

    # ------------------------------------------------------------------ bring-up

    def start(self, *, io_queues: int = 1) -> "Controller":
        """Run the bring-up state machine to READY.  Raises `CtrlrError` naming the state."""
        try:
            self._start(io_queues)
        except Exception as exc:
            failed_in = self.state
            self._set_state(CtrlrState.FAILED)
            if isinstance(exc, CtrlrError):
                raise
            raise CtrlrError(f"bring-up failed in state {failed_in.name} "
                             f"({failed_in.value}): {exc}") from exc
        return self

    def _start(self, io_queues: int) -> None:
        self.cap = spec.Cap.decode(self.t.read64(spec.REG_CAP))
        log.info("nvme ctrlr: CAP mqes=%d dstrd=%d to=%d ms mpsmin=%d quirks=%s",
                 self.cap.mqes, self.cap.dstrd, self.cap.to_ms, self.cap.mpsmin, self.quirks.name)
        if self.cap.mpsmin > PAGE_SIZE:
            raise CtrlrError(f"controller's minimum page size {self.cap.mpsmin} exceeds "
                             f"{PAGE_SIZE}; not supported")
        if not self.cap.css & 1:
            raise CtrlrError("controller does not support the NVM command set")
        cc = self.t.read32(spec.REG_CC)
        csts = self.t.read32(spec.REG_CSTS)
        if cc & spec.CC_EN and not csts & spec.CSTS_RDY:
            # Spec: clearing EN while an enable is in progress is undefined; wait it out first.
            self._set_state(CtrlrState.DISABLE_WAIT_FOR_READY_1)
            self._wait_csts(spec.CSTS_RDY, spec.CSTS_RDY, "CSTS.RDY=1")
        self._set_state(CtrlrState.DISABLE)
        self.t.write32(spec.REG_CC, self.t.read32(spec.REG_CC) & ~spec.CC_EN)
        self._set_state(CtrlrState.DISABLE_WAIT_FOR_READY_0)
        self._wait_csts(spec.CSTS_RDY, 0, "CSTS.RDY=0 after CC.EN=0")

        self._set_state(CtrlrState.CONFIGURE_ADMIN_QUEUE)
        entries = min(self.admin_entries, self.cap.mqes, 4096)
        sq = self.t.dma_alloc(align_up(entries * 64, PAGE_SIZE))
        cq = self.t.dma_alloc(align_up(entries * 16, PAGE_SIZE))
        self._identify_buf = self.t.dma_alloc(spec.IDENTIFY_SIZE)
        self._admin_mem = [sq, cq, self._identify_buf]
        self.admin = QueuePair(0, entries, sq, cq, self._doorbell, self.cap.dstrd,
                               timeout_s=self.admin_timeout_s, clock=self._clock)
        self.t.write32(spec.REG_AQA, spec.aqa_value(entries, entries))
        self.t.write64(spec.REG_ASQ, sq.iova(0))
        self.t.write64(spec.REG_ACQ, cq.iova(0))

        self._set_state(CtrlrState.ENABLE)
        self.t.write32(spec.REG_CC, spec.cc_value(enable=True))
        self._set_state(CtrlrState.ENABLE_WAIT_FOR_READY_1)
        self._wait_csts(spec.CSTS_RDY, spec.CSTS_RDY, "CSTS.RDY=1 after CC.EN=1")
        if self.quirks.delay_after_enable_s:
            self._sleep(self.quirks.delay_after_enable_s)

        self._set_state(CtrlrState.IDENTIFY_CONTROLLER)
        self._admin(AdminOpcode.IDENTIFY, "identify controller",
                    prp1=self._identify_buf.iova(0), cdw10=spec.IdentifyCns.CONTROLLER)
        self.identity = spec.IdentifyController.decode(self._identify_buf.view)
        cap_bytes = min(self.max_transfer_cap, self.quirks.max_transfer_bytes or 1 << 62)
        self.max_transfer = spec.max_transfer_bytes(self.identity.mdts, self.cap.mpsmin, cap_bytes)

        self._set_state(CtrlrState.SET_NUMBER_OF_QUEUES)
        n = max(io_queues, 1) - 1
        done = self._admin(AdminOpcode.SET_FEATURES, "set number of queues",
                           cdw10=spec.FEATURE_NUMBER_OF_QUEUES, cdw11=(n << 16) | n)
        self.io_queues_granted = min((done.dw0 & 0xFFFF) + 1, (done.dw0 >> 16) + 1)

        self._set_state(CtrlrState.IDENTIFY_NAMESPACE)
        self._admin(AdminOpcode.IDENTIFY, f"identify namespace {self.nsid}", nsid=self.nsid,
                    prp1=self._identify_buf.iova(0), cdw10=spec.IdentifyCns.NAMESPACE)
        self.namespace = spec.IdentifyNamespace.decode(self._identify_buf.view)
        if self.namespace.nsze == 0:
            raise CtrlrError(f"namespace {self.nsid} is inactive (size 0)")
        self._set_state(CtrlrState.READY)
        log.info("nvme ctrlr ready: %s serial %s, ns %d = %d x %d B, max transfer %d KiB, "
                 "%d I/O queues", self.identity.model, self.identity.serial, self.nsid,
                 self.namespace.nsze, self.namespace.lba_size, self.max_transfer >> 10,
                 self.io_queues_granted)

    def _admin(self, opcode: int, what: str, **fields):
        with self._admin_lock:
            return self.admin.execute(opcode, what, **fields)

    # ------------------------------------------------------------------ I/O queue pairs

    def io_qpair_create(self, depth: int = 64) -> IoQpair:
        """Create an I/O queue pair able to keep `depth` commands in flight (clamped by MQES and,
        without an IOMMU, by one physically contiguous page of SQEs)."""
        self._require_ready()
        qid = next(q for q in range(1, self.io_queues_granted + 2) if q not in self._io)
        if qid > self.io_queues_granted:
            raise CtrlrError(f"all {self.io_queues_granted} I/O queues granted by the controller "
                             f"are in use")
        entries = min(depth + 1, self.cap.mqes, 4096)
        if not self.t.contiguous_dma:
            entries = min(entries, PAGE_SIZE // 64)   # a ring must be physically contiguous
        entries = max(entries, 2)
        sq = self.t.dma_alloc(align_up(entries * 64, PAGE_SIZE))
        cq = self.t.dma_alloc(align_up(entries * 16, PAGE_SIZE))
        prp = self.t.dma_alloc((entries - 1) * PAGE_SIZE)
        try:
            self._admin(AdminOpcode.CREATE_IO_CQ, f"create I/O CQ {qid}", prp1=cq.iova(0),
                        cdw10=((entries - 1) << 16) | qid, cdw11=0x1)     # PC=1, no interrupts
            try:
                self._admin(AdminOpcode.CREATE_IO_SQ, f"create I/O SQ {qid}", prp1=sq.iova(0),
                            cdw10=((entries - 1) << 16) | qid, cdw11=(qid << 16) | 0x1)
            except QpairError:
                self._admin(AdminOpcode.DELETE_IO_CQ, f"delete I/O CQ {qid}", cdw10=qid)
                raise
        except Exception:
            for region in (sq, cq, prp):
                self.t.dma_free(region)
            raise
        qp = QueuePair(qid, entries, sq, cq, self._doorbell, self.cap.dstrd,
                       timeout_s=self.io_timeout_s, clock=self._clock)
        io = IoQpair(qp, prp, sq, cq)
        self._io[qid] = io
        return io

    def io_qpair_delete(self, io: IoQpair) -> None:
        try:
            if io.qpair.closed is None and self.state == CtrlrState.READY:
                self._admin(AdminOpcode.DELETE_IO_SQ, f"delete I/O SQ {io.qid}", cdw10=io.qid)
                self._admin(AdminOpcode.DELETE_IO_CQ, f"delete I/O CQ {io.qid}", cdw10=io.qid)
        finally:
            io.qpair.abort_all("deleted")
            self._io.pop(io.qid, None)
            if self.state != CtrlrState.FAILED:
                for region in (io.sq_mem, io.cq_mem, io.prp_pages):
                    self.t.dma_free(region)

    def _require_ready(self) -> None:
        if self.state != CtrlrState.READY:
            raise CtrlrError(f"controller is {self.state.name}, not READY")

    # ------------------------------------------------------------------ reads

    def _submit_rw(self, io: IoQpair, opcode: int, lba: int, nbytes: int, buf: DmaRegion,
                   buf_offset: int, *, ring: bool) -> int:
        qp = io.qpair
        lba_size = self.namespace.lba_size
        assert nbytes % lba_size == 0 and 0 < nbytes <= self.max_transfer, nbytes
        if buf_offset % 4:
            raise ValueError("NVMe PRP1 must be dword aligned: buffer offset % 4 != 0")
        first = buf.iova(buf_offset)
        npages = (buf_offset % PAGE_SIZE + nbytes + PAGE_SIZE - 1) // PAGE_SIZE
        prp2 = 0
        if npages == 2:
            prp2 = buf.iova(align_up(buf_offset + 1, PAGE_SIZE))
        elif npages > 2:
            if npages - 1 > PAGE_SIZE // 8:
                raise ValueError("transfer needs more than one PRP list page")
            cid = qp.peek_cid()
            lst = io.prp_pages.view[cid * PAGE_SIZE:(cid + 1) * PAGE_SIZE].view("<u8")
            if isinstance(buf, ContiguousDmaRegion):     # hot path: arithmetic, no lists
                start = buf.iova_base + align_down(buf_offset, PAGE_SIZE) + PAGE_SIZE
                lst[: npages - 1] = np.arange(start, start + (npages - 1) * PAGE_SIZE,
                                              PAGE_SIZE, dtype=np.uint64)
            else:
                lst[: npages - 1] = buf.page_iovas(buf_offset, nbytes)[1:]
            prp2 = io.prp_pages.iova(cid * PAGE_SIZE)
        prp1 = first
        nlb = nbytes // lba_size
        return qp.submit(opcode, nsid=self.nsid, prp1=prp1, prp2=prp2,
                         cdw10=lba & 0xFFFFFFFF, cdw11=lba >> 32, cdw12=nlb - 1,
                         context=(lba, nbytes), ring=ring)

    def read_into(self, io: IoQpair, byte_offset: int, length: int, buf: DmaRegion,
                  buf_offset: int = 0, *, depth: int | None = None,
                  opcode: int = IoOpcode.READ) -> None:
        """Read `length` bytes at `byte_offset` of the namespace into `buf[buf_offset:]`, as
        MDTS-sized commands with up to `depth` in flight.  Offset and length must be multiples
        of the LBA size.  On an error status every other in-flight command is drained first (it
        still targets `buf`), then `CommandError` is raised.  `opcode=WRITE` writes instead."""
        self._require_ready()
        lba_size = self.namespace.lba_size
        if byte_offset % lba_size or length % lba_size:
            raise ValueError(f"offset {byte_offset} and length {length} must be multiples of "
                             f"the LBA size {lba_size}")
        if buf_offset + length > buf.size:
            raise ValueError("read past the end of the DMA buffer")
        if byte_offset + length > self.namespace.size_bytes:
            raise ValueError(f"read past the end of the namespace "
                             f"({self.namespace.size_bytes} bytes)")
        qp = io.qpair
        depth = min(depth or qp.capacity, qp.capacity)
        chunk = self.max_transfer - self.max_transfer % lba_size
        pos = 0
        first_error: CommandError | None = None
        idle = 0
        while pos < length or qp.outstanding:
            submitted = False
            while first_error is None and pos < length and qp.outstanding < depth \
                    and qp.can_submit():
                n = min(chunk, length - pos)
                self._submit_rw(io, opcode, (byte_offset + pos) // lba_size, n, buf,
                                buf_offset + pos, ring=False)
                pos += n
                submitted = True
            if submitted:
                qp.ring()
            if first_error is not None and pos < length:
                pos = length               # stop submitting; drain what is in flight
            done = qp.poll()
            for c in done:
                if not c.status.ok and first_error is None:
                    lba, nbytes = c.context
                    first_error = CommandError(c.status, c.opcode, c.cid, qp.qid,
                                               f"read of {nbytes} B at LBA {lba}")
            if done or submitted:
                idle = 0
            else:
                idle += 1
                if idle > 200:
                    time.sleep(20e-6)
        if first_error is not None:
            raise first_error

    def write_from(self, io: IoQpair, byte_offset: int, length: int, buf: DmaRegion,
                   buf_offset: int = 0, *, depth: int | None = None) -> None:
        """Write through our driver (tests and the fake controller; staging uses the kernel driver)."""
        self.read_into(io, byte_offset, length, buf, buf_offset, depth=depth,
                       opcode=IoOpcode.WRITE)

    # ------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        """Delete the I/O queues, ask for a normal shutdown, clear CC.EN and free DMA memory.
        Safe to call in any state; after a timeout it skips the admin commands and just resets
        the controller, which stops all DMA before the memory is released."""
        if self.state in (CtrlrState.CLOSED,):
            return
        failed = self.state != CtrlrState.READY
        if not failed:
            for io in list(self._io.values()):
                try:
                    self.io_qpair_delete(io)
                except (QpairError, CtrlrError) as exc:
                    log.warning("nvme ctrlr: deleting queue %d failed: %s", io.qid, exc)
                    failed = True
        self._set_state(CtrlrState.SHUTTING_DOWN)
        try:
            if not failed:
                cc = self.t.read32(spec.REG_CC)
                self.t.write32(spec.REG_CC, (cc & ~spec.CC_SHN_MASK) | spec.CC_SHN_NORMAL)
                try:
                    self._wait_csts(spec.CSTS_SHST_MASK, spec.CSTS_SHST_COMPLETE,
                                    "shutdown complete (CSTS.SHST=2)")
                except CtrlrError as exc:
                    log.warning("nvme ctrlr: %s", exc)
            self.t.write32(spec.REG_CC, self.t.read32(spec.REG_CC) & ~(spec.CC_EN
                                                                         | spec.CC_SHN_MASK))
            self._wait_csts(spec.CSTS_RDY, 0, "CSTS.RDY=0 after CC.EN=0")
        finally:
            for io in list(self._io.values()):
                io.qpair.abort_all("controller shut down")
                for region in (io.sq_mem, io.cq_mem, io.prp_pages):
                    self.t.dma_free(region)
            self._io.clear()
            if self.admin is not None:
                self.admin.abort_all("controller shut down")
            for region in self._admin_mem:
                self.t.dma_free(region)
            self._admin_mem = []
            self._set_state(CtrlrState.CLOSED)
