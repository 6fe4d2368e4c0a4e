"""A test double: an in-process NVMe controller over fake BAR0 registers and fake DMA memory.

It exists so the queue logic and bring-up can be tested without hardware: the driver talks to
`FakeNvmeTransport` exactly as it talks to `vfio.VfioTransport` (32/64-bit register accesses, DMA
regions with device addresses), and `FakeNvmeController` behaves like a controller that processes
commands when the SQ tail doorbell is written:

- fetches SQEs between its head and the new tail, executes them against a numpy "namespace",
  moving data through PRP1/PRP2/PRP lists it resolves in the fake DMA space;
- posts CQEs with the phase tag, `sqhd`, and never more than the CQ can hold (it waits for the
  CQ head doorbell), so ring wrap-around and phase flips happen as on hardware;
- can complete a batch out of order (`completion_order="reverse"` or `"shuffle"`), return
  injected error statuses (`error_for`), or swallow a command for ever (`hang_for`);
- records DMA to unmapped addresses in `faults` and otherwise carries on with success status,
  which is what QEMU behind intel-iommu does (the fault only shows in the kernel log).

Thread rule: every register access and DMA (un)mapping through `FakeNvmeTransport` takes one
lock, and the model does all its work inside those calls (a doorbell write runs the commands),
so several driver threads may share it as they share a real controller, one queue pair each.
(Real controllers are concurrent; the driver's correctness does not depend on when
completions appear, only on the phase bit, which is what the out-of-order modes exercise.)
"""
from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ntx_system import spec
from ntx_system.dma import ContiguousDmaRegion, DmaRegion, IovaAllocator, PagedDmaRegion, align_up
from ntx_system.spec import PAGE_SIZE, AdminOpcode, IoOpcode, Status

BAR0_SIZE = 0x4000


@dataclass
class SimCommand:
    qid: int
    opc: int
    cid: int
    nsid: int
    prp1: int
    prp2: int
    cdw10: int
    cdw11: int
    cdw12: int

    @property
    def slba(self) -> int:
        return self.cdw10 | (self.cdw11 << 32)

    @property
    def nlb(self) -> int:
        return (self.cdw12 & 0xFFFF) + 1


@dataclass
class _SimSq:
    base: int
    entries: int
    cqid: int
    head: int = 0
    tail: int = 0


@dataclass
class _SimCq:
    base: int
    entries: int
    head: int = 0
    tail: int = 0
    phase: int = 1
    pending: list = field(default_factory=list)    # (sqid, sqhd, cid, Status, dw0)


class FakeNvmeTransport:
    """Fake BAR0 + fake DMA space in front of a `FakeNvmeController`.

    `paged=True` gives every allocation scattered "physical" pages, as no-IOMMU mode does, so
    the driver's per-page PRP handling is exercised."""

    pci_ids = (0x1B36, 0x0010)

    def __init__(self, controller: "FakeNvmeController", *, paged: bool = False, seed: int = 1):
        self.ctrl = controller
        self.paged = paged
        self.contiguous_dma = not paged
        self._iova = IovaAllocator(base=0x10_0000_0000)
        self._pages: dict[int, tuple[np.ndarray, int]] = {}     # page addr -> (view, start)
        self._region_pages: dict[int, list[int]] = {}          # id(region) -> its page addrs
        self._rng = random.Random(seed)
        self._next_phys = 0x1000_0000
        self.regions: list[DmaRegion] = []
        self.lock = threading.RLock()
        controller.attach(self)

    # registers
    def read32(self, offset: int) -> int:
        with self.lock:
            return self.ctrl.reg_read(offset, 4)

    def write32(self, offset: int, value: int) -> None:
        with self.lock:
            self.ctrl.reg_write(offset, value & 0xFFFFFFFF, 4)

    def read64(self, offset: int) -> int:
        with self.lock:
            return self.ctrl.reg_read(offset, 8)

    def write64(self, offset: int, value: int) -> None:
        with self.lock:
            self.ctrl.reg_write(offset, value, 8)

    # DMA
    def _map(self, view: np.ndarray, owned: bool) -> DmaRegion:
        npages = align_up(max(view.nbytes, 1), PAGE_SIZE) // PAGE_SIZE
        if self.paged:
            addrs = []
            for _ in range(npages):
                self._next_phys += PAGE_SIZE * self._rng.randint(1, 7)
                addrs.append(self._next_phys)
            region: DmaRegion = PagedDmaRegion(view, addrs, owned=owned)
        else:
            base = self._iova.alloc(npages * PAGE_SIZE)
            addrs = [base + i * PAGE_SIZE for i in range(npages)]
            region = ContiguousDmaRegion(view, base, owned=owned)
        for i, a in enumerate(addrs):
            self._pages[a] = (view, i * PAGE_SIZE)
        self._region_pages[id(region)] = addrs
        self.regions.append(region)
        return region

    def dma_alloc(self, size: int) -> DmaRegion:
        with self.lock:
            return self._map(np.zeros(align_up(size, PAGE_SIZE), np.uint8), owned=True)

    def dma_map(self, array: np.ndarray) -> DmaRegion:
        if array.dtype != np.uint8 or array.ndim != 1 or not array.flags.c_contiguous:
            raise ValueError("DMA buffers are 1-D contiguous uint8 arrays")
        if array.ctypes.data % PAGE_SIZE:
            raise ValueError("DMA buffers must start on a page boundary")
        with self.lock:
            return self._map(array, owned=False)

    def dma_free(self, region: DmaRegion) -> None:
        with self.lock:
            self._free(region)

    def _free(self, region: DmaRegion) -> None:
        if not region.mapped:
            raise ValueError("DMA region freed twice")
        region.mapped = False
        for a in self._region_pages.pop(id(region)):
            del self._pages[a]
        if isinstance(region, ContiguousDmaRegion):
            self._iova.free(region.iova_base)
        self.regions.remove(region)

    def close(self) -> None:
        for region in list(self.regions):
            self.dma_free(region)

    # device side of DMA: one page at a time, like the PRP entries themselves
    def _resolve(self, addr: int, length: int) -> np.ndarray | None:
        page = addr - addr % PAGE_SIZE
        hit = self._pages.get(page)
        if hit is None or addr % PAGE_SIZE + length > PAGE_SIZE:
            return None
        view, start = hit
        lo = start + addr % PAGE_SIZE
        if lo + length > view.nbytes:
            return None
        return view[lo: lo + length]

    def device_read(self, addr: int, length: int, what: str) -> np.ndarray:
        out = np.zeros(length, np.uint8)
        pos = 0
        while pos < length:
            n = min(length - pos, PAGE_SIZE - (addr + pos) % PAGE_SIZE)
            src = self._resolve(addr + pos, n)
            if src is None:
                self.ctrl.faults.append(f"DMA Read {what} at {addr + pos:#x}: not mapped")
            else:
                out[pos: pos + n] = src
            pos += n
        return out

    def device_write(self, addr: int, data: np.ndarray, what: str) -> None:
        pos = 0
        length = data.nbytes
        while pos < length:
            n = min(length - pos, PAGE_SIZE - (addr + pos) % PAGE_SIZE)
            dst = self._resolve(addr + pos, n)
            if dst is None:
                self.ctrl.faults.append(f"DMA Write {what} at {addr + pos:#x}: not mapped")
            else:
                dst[:] = data[pos: pos + n]
            pos += n


class FakeNvmeController:
    """The controller model.  `storage` is the namespace's bytes (a uint8 array you may fill)."""

    def __init__(self, storage: np.ndarray | int, *, lba_size: int = 512, mqes: int = 256,
                 dstrd: int = 0, mdts: int = 5, max_io_queues: int = 4, to_ms: int = 1000,
                 serial: str = "SIM0001", model: str = "NTX Simulated NVMe",
                 completion_order: str = "fifo", seed: int = 0, ready_after_reads: int = 2):
        if isinstance(storage, int):
            storage = np.zeros(storage, np.uint8)
        assert storage.nbytes % lba_size == 0
        self.storage = storage
        self.lba_size = lba_size
        self.mqes, self.dstrd, self.mdts = mqes, dstrd, mdts
        self.max_io_queues = max_io_queues
        self.cap = spec.Cap.encode(mqes=mqes, dstrd=dstrd, to_ms=to_ms)
        self.serial, self.model = serial, model
        self.completion_order = completion_order
        self._rng = random.Random(seed)
        self.ready_after_reads = ready_after_reads    # CSTS.RDY flips after N reads, not at once
        self.error_for: Callable[[SimCommand], Status | None] = lambda cmd: None
        self.hang_for: Callable[[SimCommand], bool] = lambda cmd: False
        self.never_ready = False
        self.faults: list[str] = []
        self.lost: list[SimCommand] = []
        self.executed: list[SimCommand] = []
        self.max_transfer_seen = 0
        self.cc = 0
        self.csts = 0
        self.aqa = self.asq = self.acq = 0
        self.sqs: dict[int, _SimSq] = {}
        self.cqs: dict[int, _SimCq] = {}
        self._rdy_countdown = 0
        self._rdy_target = 0
        self.t: FakeNvmeTransport | None = None

    def attach(self, transport: FakeNvmeTransport) -> None:
        self.t = transport

    # ------------------------------------------------------------------ registers

    def reg_read(self, offset: int, width: int) -> int:
        if offset == spec.REG_CAP:
            return self.cap if width == 8 else self.cap & 0xFFFFFFFF
        if offset == spec.REG_CAP + 4:
            return self.cap >> 32
        if offset == spec.REG_VS:
            return 0x10400
        if offset == spec.REG_CC:
            return self.cc
        if offset == spec.REG_CSTS:
            if self._rdy_countdown > 0:
                self._rdy_countdown -= 1
                if self._rdy_countdown == 0:
                    self.csts = (self.csts & ~spec.CSTS_RDY) | self._rdy_target
            return self.csts
        if offset == spec.REG_AQA:
            return self.aqa
        if offset == spec.REG_ASQ:
            return self.asq
        if offset == spec.REG_ACQ:
            return self.acq
        return 0

    def reg_write(self, offset: int, value: int, width: int) -> None:
        if offset == spec.REG_CC:
            self._write_cc(value)
        elif offset == spec.REG_AQA:
            self.aqa = value
        elif offset == spec.REG_ASQ:
            self.asq = value if width == 8 else (self.asq & ~0xFFFFFFFF) | value
        elif offset == spec.REG_ASQ + 4:
            self.asq = (self.asq & 0xFFFFFFFF) | (value << 32)
        elif offset == spec.REG_ACQ:
            self.acq = value if width == 8 else (self.acq & ~0xFFFFFFFF) | value
        elif offset == spec.REG_ACQ + 4:
            self.acq = (self.acq & 0xFFFFFFFF) | (value << 32)
        elif offset >= spec.REG_DOORBELL_BASE:
            stride = 4 << self.dstrd
            index = (offset - spec.REG_DOORBELL_BASE) // stride
            if not self.cc & spec.CC_EN:
                self.faults.append(f"doorbell write {offset:#x} while disabled")
                return
            if index % 2 == 0:
                self._sq_doorbell(index // 2, value)
            else:
                self._cq_doorbell(index // 2, value)

    def _schedule_rdy(self, target: int) -> None:
        if self.ready_after_reads <= 0:
            self.csts = (self.csts & ~spec.CSTS_RDY) | target
        else:
            self._rdy_countdown = self.ready_after_reads
            self._rdy_target = target

    def _write_cc(self, value: int) -> None:
        was_enabled = bool(self.cc & spec.CC_EN)
        self.cc = value
        if value & spec.CC_SHN_MASK:
            self.csts = (self.csts & ~spec.CSTS_SHST_MASK) | spec.CSTS_SHST_COMPLETE
        if value & spec.CC_EN and not was_enabled:
            asqs = (self.aqa & 0xFFF) + 1
            acqs = ((self.aqa >> 16) & 0xFFF) + 1
            self.sqs = {0: _SimSq(self.asq, asqs, 0)}
            self.cqs = {0: _SimCq(self.acq, acqs)}
            self.csts &= ~spec.CSTS_SHST_MASK
            if not self.never_ready:
                self._schedule_rdy(spec.CSTS_RDY)
        elif not value & spec.CC_EN and was_enabled:
            self.sqs, self.cqs = {}, {}
            self._schedule_rdy(0)

    # ------------------------------------------------------------------ queues

    def _sq_doorbell(self, qid: int, tail: int) -> None:
        sq = self.sqs.get(qid)
        if sq is None or tail >= sq.entries:
            self.faults.append(f"SQ doorbell for invalid queue {qid} / tail {tail}")
            return
        sq.tail = tail
        batch = []
        while sq.head != sq.tail:
            raw = self.t.device_read(sq.base + sq.head * 64, 64, f"SQE q{qid}")
            sqe = raw.view(spec.SQE_DTYPE)[0]
            sq.head = (sq.head + 1) % sq.entries
            cmd = SimCommand(qid, int(sqe["opc"]), int(sqe["cid"]), int(sqe["nsid"]),
                             int(sqe["prp1"]), int(sqe["prp2"]), int(sqe["cdw10"]),
                             int(sqe["cdw11"]), int(sqe["cdw12"]))
            self.executed.append(cmd)
            if self.hang_for(cmd):
                self.lost.append(cmd)
                continue
            status = self.error_for(cmd)
            dw0 = 0
            if status is None:
                status, dw0 = self._execute(cmd)
            batch.append((qid, sq.head, cmd.cid, status, dw0, sq.cqid))
        if self.completion_order == "reverse":
            batch.reverse()
        elif self.completion_order == "shuffle":
            self._rng.shuffle(batch)
        for qid_, head, cid, status, dw0, cqid in batch:
            cq = self.cqs.get(cqid)
            if cq is not None:
                cq.pending.append((qid_, head, cid, status, dw0))
        self._post_all()

    def _cq_doorbell(self, qid: int, head: int) -> None:
        cq = self.cqs.get(qid)
        if cq is None or head >= cq.entries:
            self.faults.append(f"CQ doorbell for invalid queue {qid} / head {head}")
            return
        cq.head = head
        self._post_all()

    def _post_all(self) -> None:
        for cq in self.cqs.values():
            while cq.pending and (cq.tail + 1) % cq.entries != cq.head:
                sqid, sqhd, cid, status, dw0 = cq.pending.pop(0)
                entry = np.zeros(1, spec.CQE_DTYPE)
                entry["dw0"], entry["sqhd"], entry["sqid"], entry["cid"] = dw0, sqhd, sqid, cid
                entry["status"] = status.to_cqe_status(cq.phase)
                self.t.device_write(cq.base + cq.tail * 16, entry.view(np.uint8), "CQE")
                cq.tail += 1
                if cq.tail == cq.entries:
                    cq.tail = 0
                    cq.phase ^= 1

    # ------------------------------------------------------------------ commands

    def _execute(self, cmd: SimCommand) -> tuple[Status, int]:
        if cmd.qid == 0:
            return self._admin(cmd)
        if cmd.nsid != 1:
            return spec.STATUS_INVALID_NAMESPACE, 0
        if cmd.opc == IoOpcode.FLUSH:
            return spec.STATUS_SUCCESS, 0
        if cmd.opc not in (IoOpcode.READ, IoOpcode.WRITE):
            return spec.STATUS_INVALID_OPCODE, 0
        nbytes = cmd.nlb * self.lba_size
        if (cmd.slba + cmd.nlb) * self.lba_size > self.storage.nbytes:
            return spec.STATUS_LBA_OUT_OF_RANGE, 0
        if self.mdts and nbytes > (1 << self.mdts) * PAGE_SIZE:
            return spec.STATUS_INVALID_FIELD, 0
        self.max_transfer_seen = max(self.max_transfer_seen, nbytes)
        pages = self._prp_walk(cmd.prp1, cmd.prp2, nbytes)
        if pages is None:
            return Status(0, 0x13), 0          # PRP offset invalid
        lo = cmd.slba * self.lba_size
        pos = 0
        for addr, n in pages:
            if cmd.opc == IoOpcode.READ:
                self.t.device_write(addr, self.storage[lo + pos: lo + pos + n], "read data")
            else:
                self.storage[lo + pos: lo + pos + n] = self.t.device_read(addr, n, "write data")
            pos += n
        return spec.STATUS_SUCCESS, 0

    def _prp_walk(self, prp1: int, prp2: int, nbytes: int) -> list[tuple[int, int]] | None:
        if prp1 % 4:
            return None
        first = min(nbytes, PAGE_SIZE - prp1 % PAGE_SIZE)
        out = [(prp1, first)]
        left = nbytes - first
        if left == 0:
            return out
        if left <= PAGE_SIZE:
            if prp2 % PAGE_SIZE:
                return None
            return out + [(prp2, left)]
        list_addr = prp2
        if list_addr % 8:
            return None
        while left > 0:
            per_list = (PAGE_SIZE - list_addr % PAGE_SIZE) // 8
            entries = self.t.device_read(list_addr, per_list * 8, "PRP list").view("<u8")
            for i, entry in enumerate(entries):
                entry = int(entry)
                if i == per_list - 1 and left > PAGE_SIZE:
                    list_addr = entry       # chain to the next list page
                    break
                if entry % PAGE_SIZE:
                    return None
                n = min(left, PAGE_SIZE)
                out.append((entry, n))
                left -= n
                if left == 0:
                    break
        return out

    def _identify_ctrlr(self) -> np.ndarray:
        rec = np.zeros(1, spec.IDENTIFY_CTRLR_DTYPE)
        rec["vid"], rec["ssvid"] = 0x1B36, 0x1AF4
        rec["sn"] = self.serial.ljust(20).encode()
        rec["mn"] = self.model.ljust(40).encode()
        rec["fr"] = b"1.0     "
        rec["mdts"], rec["cntlid"], rec["ver"] = self.mdts, 1, 0x10400
        rec["sqes"], rec["cqes"], rec["nn"], rec["maxcmd"] = 0x66, 0x44, 1, self.mqes
        return rec.view(np.uint8)

    def _identify_ns(self) -> np.ndarray:
        rec = np.zeros(1, spec.IDENTIFY_NS_DTYPE)
        n = self.storage.nbytes // self.lba_size
        rec["nsze"] = rec["ncap"] = rec["nuse"] = n
        lbaf = np.zeros(16, np.uint32)
        lbaf[0] = (self.lba_size.bit_length() - 1) << 16
        rec["lbaf"] = lbaf
        return rec.view(np.uint8)

    def _admin(self, cmd: SimCommand) -> tuple[Status, int]:
        opc = cmd.opc
        qid = cmd.cdw10 & 0xFFFF
        qsize = (cmd.cdw10 >> 16) + 1
        if opc == AdminOpcode.IDENTIFY:
            cns = cmd.cdw10 & 0xFF
            if cns == spec.IdentifyCns.CONTROLLER:
                data = self._identify_ctrlr()
            elif cns == spec.IdentifyCns.NAMESPACE:
                if cmd.nsid != 1:
                    return spec.STATUS_INVALID_NAMESPACE, 0
                data = self._identify_ns()
            elif cns == spec.IdentifyCns.ACTIVE_NS_LIST:
                data = np.zeros(4096, np.uint8)
                data[:4] = np.frombuffer((1).to_bytes(4, "little"), np.uint8)
            else:
                return spec.STATUS_INVALID_FIELD, 0
            for addr, n in self._prp_walk(cmd.prp1, cmd.prp2, 4096) or []:
                self.t.device_write(addr, data[:n], "identify")
                data = data[n:]
            return spec.STATUS_SUCCESS, 0
        if opc == AdminOpcode.SET_FEATURES:
            if cmd.cdw10 & 0xFF != spec.FEATURE_NUMBER_OF_QUEUES:
                return spec.STATUS_INVALID_FIELD, 0
            nsq = min((cmd.cdw11 & 0xFFFF) + 1, self.max_io_queues)
            ncq = min((cmd.cdw11 >> 16) + 1, self.max_io_queues)
            return spec.STATUS_SUCCESS, ((ncq - 1) << 16) | (nsq - 1)
        if opc == AdminOpcode.CREATE_IO_CQ:
            if not 1 <= qid <= self.max_io_queues or qid in self.cqs:
                return spec.STATUS_INVALID_QUEUE_ID, 0
            if not 2 <= qsize <= self.mqes:
                return spec.STATUS_INVALID_QUEUE_SIZE, 0
            self.cqs[qid] = _SimCq(cmd.prp1, qsize)
            return spec.STATUS_SUCCESS, 0
        if opc == AdminOpcode.CREATE_IO_SQ:
            cqid = cmd.cdw11 >> 16
            if not 1 <= qid <= self.max_io_queues or qid in self.sqs:
                return spec.STATUS_INVALID_QUEUE_ID, 0
            if cqid not in self.cqs or cqid == 0:
                return Status(1, 0x00), 0           # completion queue invalid
            if not 2 <= qsize <= self.mqes:
                return spec.STATUS_INVALID_QUEUE_SIZE, 0
            self.sqs[qid] = _SimSq(cmd.prp1, qsize, cqid)
            return spec.STATUS_SUCCESS, 0
        if opc == AdminOpcode.DELETE_IO_SQ:
            if qid == 0 or qid not in self.sqs:
                return spec.STATUS_INVALID_QUEUE_ID, 0
            del self.sqs[qid]
            return spec.STATUS_SUCCESS, 0
        if opc == AdminOpcode.DELETE_IO_CQ:
            if qid == 0 or qid not in self.cqs:
                return spec.STATUS_INVALID_QUEUE_ID, 0
            if any(sq.cqid == qid for q, sq in self.sqs.items() if q):
                return Status(1, 0x0C), 0           # invalid queue deletion
            del self.cqs[qid]
            return spec.STATUS_SUCCESS, 0
        return spec.STATUS_INVALID_OPCODE, 0
