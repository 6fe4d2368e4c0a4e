"""Where layer bytes come from, behind one small interface (STYLE.md rule 8).

Host memory (`HostMemory`: alloc, alignment, is_host) gives the buffers; a storage `Source`
(alignment, read_into, close) fills them from the GGUF file:

    MmapSource      the page cache, one memcpy (the fallback)
    ODirectSource   O_DIRECT preads by a thread pool into aligned buffers (bypasses the cache)

The staged NVMe drive is a Source too, but the engine never opens it: the daemon brings the drive
up (server/storage.py, through ntx_system's driver) and hands its engine the opened source.

Every source speaks GGUF file offsets. `plan_reads` turns a layer's tensors into as few aligned
reads as the file allows (one span when the layer's tensors are contiguous, as llama.cpp and our
writers lay them out) and says where each tensor lands in the destination buffer.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import mmap
import os
import threading
import time

import numpy as np

PAGE = 4096
ODIRECT_ALIGN = 4096  # offset, length and buffer address of an O_DIRECT read
ODIRECT_CHUNK = 8 << 20  # one pread of the thread pool


def align_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def align_down(x: int, a: int) -> int:
    return x // a * a


# ---- host memory ----------------------------------------------------------------------------

class HostMemory:
    """Host buffers (uint8, aligned). Plain numpy here; the CUDA backend pins them."""

    name = "host"
    is_host = True
    alignment = PAGE

    def alloc(self, nbytes: int) -> np.ndarray:
        raw = np.empty(nbytes + self.alignment, np.uint8)
        off = (-raw.ctypes.data) % self.alignment
        return raw[off:off + nbytes]

    def free(self, buf: np.ndarray) -> None:
        pass


# ---- storage sources ------------------------------------------------------------------------

class Source:
    """A storage source: fills caller buffers with file bytes. `read_into` may be called from
    several reader threads at once unless the class says otherwise."""

    name = "source"
    alignment = 1  # what offset, length and dest address must be multiples of

    def read_into(self, offset: int, length: int, dest: np.ndarray) -> None:
        raise NotImplementedError

    def register(self, dest: np.ndarray) -> None:
        """A long-lived destination buffer (staging): a source may map it for DMA."""

    def unregister(self, dest: np.ndarray) -> None:
        """`dest` is about to be freed: a source that mapped it for DMA unmaps it."""

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class MmapSource(Source):
    """Copies out of a read-only memory map: the page cache (fast when cached, slow when not)."""

    name = "mmap"

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            self.size = os.fstat(f.fileno()).st_size
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._view = np.frombuffer(self._mm, np.uint8)

    def read_into(self, offset: int, length: int, dest: np.ndarray) -> None:
        n = max(0, min(length, self.size - offset))
        dest[:n] = self._view[offset:offset + n]

    def close(self) -> None:
        self._view = None
        try:
            self._mm.close()
        except BufferError:  # a view still alive; the map goes with it
            pass


class ODirectSource(Source):
    """O_DIRECT preads, split into `chunk`-sized pieces read by `threads` threads.

    Offsets, lengths and destination addresses must be 4096-aligned (plan_reads makes them
    so); a read past the end of the file stops at the end. Where the filesystem refuses
    O_DIRECT (tmpfs), `direct` becomes False and the same code reads through the page cache.
    """

    name = "odirect"
    alignment = ODIRECT_ALIGN

    def __init__(self, path: str, *, threads: int = 8, chunk: int = ODIRECT_CHUNK, require_direct: bool = False):
        self.path = path
        self.direct = True
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError as e:
            if require_direct:
                raise OSError(e.errno, f"{path}: O_DIRECT refused ({e.strerror}); use the mmap source") from e
            self.fd = os.open(path, os.O_RDONLY)
            self.direct = False
        self.size = os.fstat(self.fd).st_size
        self.chunk = align_up(chunk, ODIRECT_ALIGN)
        self.threads = threads
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="ntx-odirect")

    def _pread(self, offset: int, dest: np.ndarray) -> None:
        view = memoryview(dest)
        done = 0
        while done < len(dest):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n <= 0:
                if offset + done >= self.size:
                    return  # end of file: the tail of an aligned read
                raise OSError(f"{self.path}: short read at {offset + done}")
            done += n
            if self.direct and n % ODIRECT_ALIGN:
                return  # a partial block: the end of the file

    def read_into(self, offset: int, length: int, dest: np.ndarray) -> None:
        if self.direct and (offset % ODIRECT_ALIGN or dest.ctypes.data % ODIRECT_ALIGN):
            raise ValueError(f"O_DIRECT read at {offset} into {dest.ctypes.data:#x}: not {ODIRECT_ALIGN}-aligned")
        length = align_up(length, ODIRECT_ALIGN) if self.direct else length
        if length > len(dest):
            raise ValueError(f"O_DIRECT read of {length} bytes into a {len(dest)}-byte buffer")
        pieces = [(o, min(self.chunk, length - o)) for o in range(0, length, self.chunk)]
        if len(pieces) == 1:
            self._pread(offset, dest[:length])
            return
        futs = [self._pool.submit(self._pread, offset + o, dest[o:o + n]) for o, n in pieces]
        for f in futs:
            f.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


SOURCES = ("file", "odirect", "mmap")


def open_source(kind, path: str, **kw) -> Source:
    """'odirect' (default for storage tiers; 'file' is the same), 'mmap', or a Source already
    opened by the caller (the daemon's handle on its NVMe drive), which is returned as it is:
    whoever opened it closes the device."""
    if isinstance(kind, Source):
        return kind
    if kind in ("odirect", "file"):
        return ODirectSource(path, **kw)
    if kind == "mmap":
        return MmapSource(path)
    if kind.startswith("nvme:"):
        raise ValueError(f"storage = {kind!r} is a staged NVMe drive, which ntransformerd brings up and hands "
                         "to its engine: serve the model through the daemon, or read its file here "
                         "(storage = file, odirect or mmap)")
    raise ValueError(f"storage source {kind!r} is not one of file, odirect, mmap")


# ---- reads of one layer ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LayerReads:
    """Aligned reads (file offset, length, dest offset) and where each tensor lands."""

    reads: tuple[tuple[int, int, int], ...]
    where: dict  # tensor name → offset in the destination buffer
    nbytes: int  # destination buffer size needed

    def fill(self, source: Source, dest: np.ndarray) -> None:
        for off, length, at in self.reads:
            source.read_into(off, length, dest[at:at + length])

    def raw(self, buf: np.ndarray, t) -> np.ndarray:
        """Tensor `t` (a TensorInfo)'s bytes inside a buffer filled by `fill`."""
        at = self.where[t.name]
        return buf[at:at + t.nbytes]


def plan_reads(tensors, alignment: int = ODIRECT_ALIGN, max_gap: int = 1 << 20) -> LayerReads:
    """As few aligned reads as cover `tensors` (TensorInfos): neighbours closer than max_gap merge."""
    ts = sorted(tensors, key=lambda t: t.offset)
    spans: list[list] = []  # [start, end, [tensors]]
    for t in ts:
        a, b = align_down(t.offset, alignment), align_up(t.offset + t.nbytes, alignment)
        if spans and a <= spans[-1][1] + max_gap:
            spans[-1][1] = max(spans[-1][1], b)
            spans[-1][2].append(t)
        else:
            spans.append([a, b, [t]])
    reads, where, at = [], {}, 0
    for a, b, group in spans:
        reads.append((a, b - a, at))
        for t in group:
            where[t.name] = at + t.offset - a
        at += b - a
    return LayerReads(tuple(reads), where, at)


class SlowSource(Source):
    """A source that sleeps before each read (tests: artificially slow readers)."""

    def __init__(self, inner: Source, delay):
        self.inner, self.delay = inner, delay
        self.name, self.alignment = f"slow-{inner.name}", inner.alignment
        self.reads = 0
        self._lock = threading.Lock()

    def read_into(self, offset: int, length: int, dest: np.ndarray) -> None:
        with self._lock:
            self.reads += 1
        d = self.delay() if callable(self.delay) else self.delay
        if d:
            time.sleep(d)
        self.inner.read_into(offset, length, dest)

    def close(self) -> None:
        self.inner.close()
