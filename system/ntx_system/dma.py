"""DMA memory as the driver sees it: a host view plus the bus address the device uses.

A `DmaRegion` is host memory (a numpy uint8 view) that a transport has made reachable by the
device.  Under an IOMMU (VFIO type1) a region is one contiguous IOVA range; in no-IOMMU mode the
device sees physical addresses, which are contiguous only within a page, so `iova()` is answered
per page.  The driver never assumes more than "contiguous within a page", which is all a PRP
needs.

`IovaAllocator` hands out page-aligned IOVA ranges (first fit over a sorted free list, with
coalescing on free) so mapping and unmapping buffers over a long run does not leak address space.

Thread rule: an `IovaAllocator` is not thread-safe; its owner (the transport) serialises calls.
A `DmaRegion` is plain memory: whoever owns the I/O that targets it owns it.
"""
from __future__ import annotations

import bisect

import numpy as np

from .spec import PAGE_SIZE


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def align_down(value: int, alignment: int) -> int:
    return value // alignment * alignment


class DmaRegion:
    """Host memory the device can reach.  `view` is the host side; `iova(off)` the device side.

    Subclasses answer `iova`.  `owned` says whether the transport allocated the memory (and must
    free it) or mapped a caller's buffer (and must only unmap it).
    """

    def __init__(self, view: np.ndarray, *, owned: bool):
        assert view.dtype == np.uint8 and view.ndim == 1
        self.view = view
        self.size = int(view.nbytes)
        self.owned = owned
        self.mapped = True

    def iova(self, offset: int = 0) -> int:
        raise NotImplementedError

    def page_iovas(self, offset: int, length: int) -> list[int]:
        """The device address of each page the byte range [offset, offset+length) touches:
        the first may carry an in-page offset (PRP1), the rest are page aligned (PRP entries)."""
        first = self.iova(offset)
        out = [first]
        page = align_down(offset, PAGE_SIZE) + PAGE_SIZE
        end = offset + length
        while page < end:
            out.append(self.iova(page))
            page += PAGE_SIZE
        return out


class ContiguousDmaRegion(DmaRegion):
    """One IOVA range: what VFIO type1 gives every mapping."""

    def __init__(self, view: np.ndarray, iova_base: int, *, owned: bool):
        super().__init__(view, owned=owned)
        self.iova_base = iova_base

    def iova(self, offset: int = 0) -> int:
        if not 0 <= offset < max(self.size, 1):
            raise ValueError(f"offset {offset} outside DMA region of {self.size} bytes")
        return self.iova_base + offset


    def page_iovas(self, offset: int, length: int) -> list[int]:
        # Contiguous: arithmetic, no per-page lookups (hot path of every read command).
        first = self.iova(offset)
        start = self.iova_base + align_down(offset, PAGE_SIZE) + PAGE_SIZE
        end = self.iova_base + offset + length
        return [first, *range(start, end, PAGE_SIZE)]


class PagedDmaRegion(DmaRegion):
    """Physical pages that are not contiguous (no-IOMMU mode): one address per page."""

    def __init__(self, view: np.ndarray, page_addresses: list[int], *, owned: bool):
        super().__init__(view, owned=owned)
        assert len(page_addresses) * PAGE_SIZE >= self.size
        self.page_addresses = page_addresses

    def iova(self, offset: int = 0) -> int:
        if not 0 <= offset < max(self.size, 1):
            raise ValueError(f"offset {offset} outside DMA region of {self.size} bytes")
        return self.page_addresses[offset // PAGE_SIZE] + offset % PAGE_SIZE


class IovaExhausted(RuntimeError):
    pass


class IovaAllocator:
    """First-fit allocator of page-aligned IOVA ranges inside [base, limit)."""

    def __init__(self, base: int = 0x1_0000_0000, limit: int = 0x100_0000_0000,
                 alignment: int = PAGE_SIZE):
        assert base % alignment == 0 and limit > base
        self.alignment = alignment
        self._free: list[tuple[int, int]] = [(base, limit)]   # sorted (start, end)
        self._used: dict[int, int] = {}                       # start -> end

    def alloc(self, size: int) -> int:
        size = align_up(max(size, 1), self.alignment)
        for i, (start, end) in enumerate(self._free):
            if end - start >= size:
                if end - start == size:
                    del self._free[i]
                else:
                    self._free[i] = (start + size, end)
                self._used[start] = start + size
                return start
        raise IovaExhausted(f"no free IOVA range of {size} bytes; "
                            f"{len(self._used)} mappings are live (leaked buffers?)")

    def free(self, iova: int) -> None:
        end = self._used.pop(iova, None)
        if end is None:
            raise ValueError(f"IOVA {iova:#x} was not allocated here")
        i = bisect.bisect_left(self._free, (iova, end))
        self._free.insert(i, (iova, end))
        # coalesce with the right, then the left neighbour
        if i + 1 < len(self._free) and self._free[i][1] == self._free[i + 1][0]:
            self._free[i] = (self._free[i][0], self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][1] == self._free[i][0]:
            self._free[i - 1] = (self._free[i - 1][0], self._free[i][1])
            del self._free[i]

    @property
    def live(self) -> int:
        return len(self._used)

    @property
    def free_ranges(self) -> list[tuple[int, int]]:
        return list(self._free)
