"""`NvmeStagedSource`: the engine's storage source over a model staged on a dedicated NVMe.

    src = NvmeStagedSource.open("0000:03:00.0")          # bound to vfio-pci by ntx-admin bind
    off, length = src.extents()["blk.7"]                  # a layer, in GGUF byte coordinates
    src.register_buffer(pinned)                           # optional: DMA straight into it
    src.read_into(off, length, pinned)                    # blocks until the bytes are there
    src.close()

Offsets are positions in the GGUF file, so every tier speaks the same coordinates; the source
maps them onto the aligned extents on the device.  A read that starts an extent and lands in a
registered, page-aligned buffer goes straight from the drive into that buffer (MDTS-sized
commands, `queue_depth` in flight); anything else goes through a bounce buffer and one memcpy.

Register only buffers that stay allocated until `unregister_buffer` or `close`: the IOMMU keeps
the pages it pinned at registration, so a buffer freed and reallocated at the same address would
silently receive data into the old pages.  Unregistered buffers are always safe (bounce path).

Thread rule: a source owns one controller and one I/O queue pair.  `read_into` may be called by
one thread at a time (an internal lock serialises callers; the engine's reader thread is the
intended one); `open` and `close` belong to the owning thread, and `close` must not race a read.
"""
from __future__ import annotations

import bisect
import threading

import numpy as np

from .ctrlr import Controller
from .dma import DmaRegion, align_down, align_up
from .spec import PAGE_SIZE
from .staging import StageLayout, decode_header, header_size_from_preamble

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
    def __init__(self, ctrl: Controller, transport, *, queue_depth: int, owns_transport: bool):
        self.ctrl = ctrl
        self.t = transport
        self._owns_transport = owns_transport
        self.queue_depth = queue_depth
        self.io = ctrl.io_qpair_create(depth=queue_depth)
        self._bounce = transport.dma_alloc(BOUNCE_BYTES)
        self._lock = threading.Lock()
        self._registered: dict[tuple[int, int], DmaRegion] = {}
        self.lba_size = ctrl.namespace.lba_size
        self.layout = self._read_layout()
        self._starts = [e.offset for e in self.layout.extents]
        self.bytes_direct = 0
        self.bytes_bounced = 0

    @classmethod
    def open(cls, pci_address: str | None = None, *, transport=None, noiommu: bool = False,
             queue_depth: int = 32, nsid: int = 1, io_timeout_s: float = 10.0
             ) -> "NvmeStagedSource":
        """Bring the controller up through VFIO (or the given transport) and read the header."""
        owns = transport is None
        if transport is None:
            from .vfio import VfioTransport
            if pci_address is None:
                raise ValueError("open() needs a PCI address or a transport")
            transport = VfioTransport(pci_address, noiommu=noiommu)
        try:
            ctrl = Controller(transport, nsid=nsid, io_timeout_s=io_timeout_s).start()
            try:
                return cls(ctrl, transport, queue_depth=queue_depth, owns_transport=owns)
            except BaseException:
                ctrl.shutdown()
                raise
        except BaseException:
            if owns:
                transport.close()
            raise

    # ------------------------------------------------------------------ metadata

    def _read_device(self, device_offset: int, length: int) -> bytes:
        out = bytearray()
        pos = 0
        while pos < length:
            lo = align_down(device_offset + pos, self.lba_size)
            skip = device_offset + pos - lo
            n = min(BOUNCE_BYTES, align_up(skip + length - pos, self.lba_size))
            self.ctrl.read_into(self.io, lo, n, self._bounce, depth=self.queue_depth)
            take = min(n - skip, length - pos)
            out += self._bounce.view[skip: skip + take].tobytes()
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
        if key in self._registered:
            return True
        if arr.ctypes.data % PAGE_SIZE or not self.t.contiguous_dma:
            return False
        with self._lock:
            self._registered[key] = self.t.dma_map(arr)
        return True

    def unregister_buffer(self, dest) -> None:
        arr = _as_u8(dest)
        with self._lock:
            region = self._registered.pop((arr.ctypes.data, arr.nbytes), None)
            if region is not None:
                self.t.dma_free(region)

    def _region_for(self, arr: np.ndarray) -> tuple[DmaRegion, int] | None:
        addr = arr.ctypes.data
        for (base, size), region in self._registered.items():
            if base <= addr and addr + arr.nbytes <= base + size:
                return region, addr - base
        return None

    # ------------------------------------------------------------------ reads

    def read_into(self, offset: int, length: int, dest) -> None:
        """Copy GGUF bytes [offset, offset+length) into `dest[:length]`; blocks until done.
        Raises `qpair.CommandError` / `CommandTimeout` on device errors, ValueError on a range
        outside the model."""
        arr = _as_u8(dest)
        if length > arr.nbytes:
            raise ValueError(f"dest holds {arr.nbytes} bytes, {length} requested")
        if offset < 0 or offset + length > self.layout.model_size:
            raise ValueError(f"range [{offset}, {offset + length}) is outside the model "
                             f"({self.layout.model_size} bytes)")
        with self._lock:
            pos = 0
            while pos < length:
                i = bisect.bisect_right(self._starts, offset + pos) - 1
                e = self.layout.extents[i]
                within = offset + pos - e.offset
                n = min(e.length - within, length - pos)
                self._read_piece(e.device_offset + within, n, arr[pos: pos + n])
                pos += n

    def _read_piece(self, device_offset: int, n: int, out: np.ndarray) -> None:
        hit = self._region_for(out)
        direct = 0
        if hit is not None and device_offset % self.lba_size == 0 and hit[1] % 4 == 0:
            region, region_off = hit
            direct = align_down(n, self.lba_size)
            if direct:
                self.ctrl.read_into(self.io, device_offset, direct, region, region_off,
                                    depth=self.queue_depth)
                self.bytes_direct += direct
        if direct < n:
            out[direct:] = np.frombuffer(
                self._read_device(device_offset + direct, n - direct), np.uint8)
            self.bytes_bounced += n - direct

    def close(self) -> None:
        """Delete the queue, shut the controller down, unmap everything, release VFIO."""
        with self._lock:
            self.ctrl.shutdown()            # first: no DMA can target our buffers after this
            for region in self._registered.values():
                self.t.dma_free(region)
            self._registered.clear()
            if self._bounce is not None:
                self.t.dma_free(self._bounce)
                self._bounce = None
            if self._owns_transport:
                self.t.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
