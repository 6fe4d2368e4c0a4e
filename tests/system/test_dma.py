"""IOVA allocation and per-page device addresses."""
import numpy as np
import pytest

from ntx_system.dma import ContiguousDmaRegion, IovaAllocator, IovaExhausted, PagedDmaRegion


def test_iova_alloc_free_coalesces():
    a = IovaAllocator(base=0x10000, limit=0x10000 + 16 * 4096)
    x = a.alloc(4096)
    y = a.alloc(5000)          # rounds up to 2 pages
    z = a.alloc(4096)
    assert (x, y, z) == (0x10000, 0x11000, 0x13000)
    a.free(y)
    assert a.alloc(8192) == 0x11000        # first fit reuses the hole
    a.free(x), a.free(z), a.free(0x11000)
    assert a.free_ranges == [(0x10000, 0x10000 + 16 * 4096)] and a.live == 0


def test_iova_exhaustion_and_double_free():
    a = IovaAllocator(base=0, limit=2 * 4096)
    a.alloc(8192)
    with pytest.raises(IovaExhausted):
        a.alloc(1)
    with pytest.raises(ValueError):
        a.free(4096)


def test_page_iovas_contiguous_and_paged():
    view = np.zeros(3 * 4096, np.uint8)
    c = ContiguousDmaRegion(view, 0x100000, owned=True)
    assert c.page_iovas(100, 4096) == [0x100064, 0x101000]
    p = PagedDmaRegion(view, [0x9000, 0x3000, 0x7000], owned=True)
    assert p.page_iovas(4000, 5000) == [0x9000 + 4000, 0x3000, 0x7000]
    with pytest.raises(ValueError):
        c.iova(3 * 4096)
