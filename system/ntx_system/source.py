"""`NvmeStagedSource`: the engine's storage source over a model staged on a dedicated NVMe.

    src = NvmeStagedSource.open("0000:03:00.0", queues=2) # bound to vfio-pci by ntx-admin bind
    off, length = src.extents()["blk.7"]                  # a layer, in GGUF byte coordinates
    src.register_buffer(pinned)                           # optional: DMA straight into it
    src.read_into(off, length, pinned)                    # blocks until the bytes are there
    src.stats()                                           # bytes, seconds, commands, errors
    src.close()

Offsets are positions in the GGUF file, so every tier speaks the same coordinates; the source
maps them onto the aligned extents on the device.  A read that starts an extent and lands in a
registered, page-aligned buffer goes straight from the drive into that buffer (MDTS-sized
commands, `queue_depth` in flight); anything else goes through a bounce buffer and one memcpy.

Register only buffers that stay allocated until `unregister_buffer` or `close`: the IOMMU keeps
the pages it pinned at registration, so a buffer freed and reallocated at the same address would
silently receive data into the old pages.  Unregistered buffers are always safe (bounce path).

Thread rule: a source owns one controller and `queues` I/O queue pairs, each with its own bounce
buffer.  `read_into` may be called from several threads at once: each call takes a free queue
pair for its whole duration (one queue pair per thread at a time), so up to `queues` reads run
in parallel and further callers wait.  `register_buffer`, `unregister_buffer` and `close` take
every queue pair first, so they never race a read; `open` and `close` belong to the owner.
"""
from __future__ import annotations

import bisect
import contextlib
import queue
import threading
import time

import numpy as np

from .ctrlr import Controller, IoQpair
from .dma import DmaRegion, align_down, align_up
from .spec import PAGE_SIZE
from .staging import StageLayout, decode_header, header_size_from_preamble
from .vfio import VfioTransport

BOUNCE_BYTES = 4 << 20


def _as_u8(dest) -> np.ndarray:
    if isinstance(dest, np.ndarray):
        arr = dest.reshape(-1).view(np.uint8) if dest.flags.c_contiguous else None
    else:
        arr = np.frombuffer(dest, np.uint8)
    if arr is None or not arr.flags.writeable:
        raise ValueError("dest must be a writable, contiguous buffer (numpy uint8 array or "
                         "memoryview of pinned memory)")
    return arr


class NvmeStagedSource:
    def __init__(self, ctrl: Controller, transport, *, queue_depth: int, owns_transport: bool,
                 queues: int = 1):
        self.ctrl = ctrl
        self.t = transport
        self._owns_transport = owns_transport
        self.queue_depth = queue_depth
        n = max(1, min(queues, ctrl.io_queues_granted or 1))
        self._qpairs: list[tuple[IoQpair, DmaRegion]] = []
        for _ in range(n):
            io = ctrl.io_qpair_create(depth=queue_depth)
            self._qpairs.append((io, transport.dma_alloc(BOUNCE_BYTES)))
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for pair in self._qpairs:
            self._free.put(pair)
        self._registered: dict[tuple[int, int], DmaRegion] = {}
        self._stats_lock = threading.Lock()
        self.lba_size = ctrl.namespace.lba_size
        self.bytes_direct = 0
        self.bytes_bounced = 0
        self.bytes_read = 0            # GGUF bytes delivered by read_into
        self.read_seconds = 0.0        # wall time spent inside read_into
        self.reads = 0
        self.errors = 0
        self.last_error = ""
        self.layout = self._read_layout()
        self._starts = [e.offset for e in self.layout.extents]

    @property
    def io(self) -> IoQpair:
        """The first queue pair (tools that drive the controller directly: ntx-admin verify)."""
        return self._qpairs[0][0]

    @property
    def queues(self) -> int:
        return len(self._qpairs)

    @classmethod
    def open(cls, pci_address: str | None = None, *, transport=None, noiommu: bool = False,
             queue_depth: int = 32, queues: int = 1, nsid: int = 1, io_timeout_s: float = 10.0
             ) -> "NvmeStagedSource":
        """Bring the controller up through VFIO (or the given transport) and read the header.
        Bring-up starts by clearing CC.EN, so a controller left enabled by a killed process is
        reset before it is used again."""
        owns = transport is None
        if transport is None:
            if pci_address is None:
                raise ValueError("open() needs a PCI address or a transport")
            transport = VfioTransport(pci_address, noiommu=noiommu)
        try:
            ctrl = Controller(transport, nsid=nsid, io_timeout_s=io_timeout_s).start(
                io_queues=max(1, queues))
            try:
                return cls(ctrl, transport, queue_depth=queue_depth, owns_transport=owns,
                           queues=queues)
            except BaseException:
                ctrl.shutdown()
                raise
        except BaseException:
            if owns:
                transport.close()
            raise

    @contextlib.contextmanager
    def _qpair(self):
        pair = self._free.get()
        try:
            yield pair
        finally:
            self._free.put(pair)

    @contextlib.contextmanager
    def _every_qpair(self):
        """All queue pairs: no read runs until the block ends."""
        taken = [self._free.get() for _ in self._qpairs]
        try:
            yield
        finally:
            for pair in taken:
                self._free.put(pair)

    # ------------------------------------------------------------------ metadata

    def _read_device(self, device_offset: int, length: int) -> bytes:
        with self._qpair() as (io, bounce):
            return self._read_device_on(io, bounce, device_offset, length)

    def _read_device_on(self, io: IoQpair, bounce: DmaRegion, device_offset: int,
                        length: int) -> bytes:
        out = bytearray()
        pos = 0
        while pos < length:
            lo = align_down(device_offset + pos, self.lba_size)
            skip = device_offset + pos - lo
            n = min(BOUNCE_BYTES, align_up(skip + length - pos, self.lba_size))
            self.ctrl.read_into(io, lo, n, bounce, depth=self.queue_depth)
            take = min(n - skip, length - pos)
            out += bounce.view[skip: skip + take].tobytes()
            pos += take
        return bytes(out)

    def _read_layout(self) -> StageLayout:
        first = self._read_device(0, PAGE_SIZE)
        size = header_size_from_preamble(first)
        return decode_header(self._read_device(0, size))

    def extents(self) -> dict[str, tuple[int, int]]:
        """Extent name ("gguf.meta", "blk.N", "nonlayer") -> (offset, length) in the GGUF."""
        return self.layout.extent_map()

    def tensors(self) -> dict[str, tuple[int, int]]:
        """Tensor name -> (offset, nbytes) in the GGUF."""
        return {t.name: (t.offset, t.nbytes) for t in self.layout.tensors}

    # ------------------------------------------------------------------ buffers

    def register_buffer(self, dest) -> bool:
        """DMA-map `dest` so reads land in it directly.  Returns False (and changes nothing)
        when that is not possible: not page aligned, or no IOMMU (physical pages are only
        stable for memory we allocated ourselves)."""
        arr = _as_u8(dest)
        key = (arr.ctypes.data, arr.nbytes)
        if arr.ctypes.data % PAGE_SIZE or not self.t.contiguous_dma:
            return False
        with self._every_qpair():
            if key not in self._registered:
                self._registered[key] = self.t.dma_map(arr)
        return True

    def unregister_buffer(self, dest) -> None:
        arr = _as_u8(dest)
        with self._every_qpair():
            region = self._registered.pop((arr.ctypes.data, arr.nbytes), None)
            if region is not None:
                self.t.dma_free(region)

    def _region_for(self, arr: np.ndarray) -> tuple[DmaRegion, int] | None:
        addr = arr.ctypes.data
        for (base, size), region in list(self._registered.items()):
            if base <= addr and addr + arr.nbytes <= base + size:
                return region, addr - base
        return None

    # ------------------------------------------------------------------ reads

    def read_into(self, offset: int, length: int, dest) -> None:
        """Copy GGUF bytes [offset, offset+length) into `dest[:length]`; blocks until done.  A
        range running past the end of the model stops there, as a file read does (an aligned
        read of the last layer); the rest of `dest` is left as it was.  Raises
        `qpair.CommandError` / `CommandTimeout` on device errors, ValueError on an offset
        outside the model."""
        arr = _as_u8(dest)
        if length > arr.nbytes:
            raise ValueError(f"dest holds {arr.nbytes} bytes, {length} requested")
        if offset < 0 or offset >= self.layout.model_size or length < 0:
            raise ValueError(f"range [{offset}, {offset + length}) is outside the model "
                             f"({self.layout.model_size} bytes)")
        length = min(length, self.layout.model_size - offset)
        t0 = time.perf_counter()
        with self._qpair() as (io, bounce):
            try:
                pos = 0
                while pos < length:
                    i = bisect.bisect_right(self._starts, offset + pos) - 1
                    e = self.layout.extents[i]
                    within = offset + pos - e.offset
                    n = min(e.length - within, length - pos)
                    self._read_piece(io, bounce, e.device_offset + within, n, arr[pos: pos + n])
                    pos += n
            except Exception as exc:
                with self._stats_lock:
                    self.errors += 1
                    self.last_error = str(exc)
                raise
        with self._stats_lock:
            self.bytes_read += length
            self.read_seconds += time.perf_counter() - t0
            self.reads += 1

    def _read_piece(self, io: IoQpair, bounce: DmaRegion, device_offset: int, n: int,
                    out: np.ndarray) -> None:
        hit = self._region_for(out)
        direct = 0
        if hit is not None and device_offset % self.lba_size == 0 and hit[1] % 4 == 0:
            region, region_off = hit
            direct = align_down(n, self.lba_size)
            if direct:
                self.ctrl.read_into(io, device_offset, direct, region, region_off,
                                    depth=self.queue_depth)
        if direct < n:
            out[direct:] = np.frombuffer(
                self._read_device_on(io, bounce, device_offset + direct, n - direct), np.uint8)
        with self._stats_lock:
            self.bytes_direct += direct
            self.bytes_bounced += n - direct

    def stats(self) -> dict:
        """Counters since open: GGUF bytes read, seconds spent reading, reads, commands
        submitted, commands in flight now (and the most each queue had at once, summed), failed
        reads and commands that completed with an error status, the last error."""
        qps = [io.qpair for io, _ in self._qpairs]
        with self._stats_lock:
            return dict(bytes=self.bytes_read, seconds=self.read_seconds, reads=self.reads,
                        bytes_direct=self.bytes_direct, bytes_bounced=self.bytes_bounced,
                        commands=sum(q.stats.submitted for q in qps),
                        in_flight=sum(q.outstanding for q in qps),
                        max_in_flight=sum(q.stats.max_outstanding for q in qps),
                        errors=self.errors, command_errors=sum(q.stats.errors for q in qps),
                        last_error=self.last_error, queues=len(qps),
                        queue_depth=self.queue_depth)

    def close(self) -> None:
        """Delete the queues, shut the controller down, unmap everything, release VFIO."""
        with self._every_qpair():
            self.ctrl.shutdown()            # first: no DMA can target our buffers after this
            for region in self._registered.values():
                self.t.dma_free(region)
            self._registered.clear()
            for _, bounce in self._qpairs:
                self.t.dma_free(bounce)
            self._qpairs = []
            if self._owns_transport:
                self.t.close()
        self._free = queue.SimpleQueue()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
