"""The on-device format of a staged model, and writing it with the kernel driver.

Layout of the namespace (byte offsets, every boundary aligned to `align` = max(LBA, page)):

    0                 header: 128-byte preamble + JSON body (extents, tensors), padded
    header_bytes      extent 0 ("gguf.meta": GGUF header, metadata, tensor infos)
    ...               extent k: one run of tensors of one layer ("blk.N") or of non-layer
                      tensors ("nonlayer"), each starting on an aligned device offset
    data_end

An extent is a contiguous byte range of the GGUF file; together the extents cover the file
exactly once, in file order, so the model's sha256 is the hash of the extents in order.  Each
extent starts aligned on the device so a reader can DMA a layer straight into a page-aligned
pinned buffer.  The header is written last, after every extent is on the device, so a half
staged device never looks valid.

Thread rule: functions are stateless; a staging run owns its device fd.
"""
from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import gguf
import numpy as np

from .dma import align_up
from .spec import PAGE_SIZE

HEADER_MAGIC = b"NTXSTAGE"
HEADER_VERSION = 1

PREAMBLE_DTYPE = np.dtype([
    ("magic", "S8"),
    ("version", "<u4"),
    ("align", "<u4"),              # alignment of every extent on the device
    ("header_bytes", "<u8"),       # preamble + body + padding
    ("body_bytes", "<u8"),         # JSON body length
    ("model_size", "<u8"),
    ("data_end", "<u8"),           # device bytes used
    ("extent_count", "<u4"),
    ("tensor_count", "<u4"),
    ("model_sha256", "V32"),
    ("body_sha256", "V32"),
    ("reserved", "V8"),
])
assert PREAMBLE_DTYPE.itemsize == 128

_LAYER_RE = re.compile(r"^(blk\.\d+)\.")


class StagingError(RuntimeError):
    pass


@dataclass
class Extent:
    name: str
    offset: int            # in the GGUF file
    length: int
    device_offset: int     # on the namespace, aligned
    sha256: str = ""


@dataclass
class Tensor:
    name: str
    offset: int            # absolute offset in the GGUF file
    nbytes: int
    extent: str


@dataclass
class StageLayout:
    model_name: str
    model_size: int
    align: int
    header_bytes: int
    extents: list[Extent]
    tensors: list[Tensor]
    model_sha256: str = ""
    version: int = HEADER_VERSION

    @property
    def data_end(self) -> int:
        last = self.extents[-1]
        return align_up(last.device_offset + last.length, self.align)

    def extent_map(self) -> dict[str, tuple[int, int]]:
        return {e.name: (e.offset, e.length) for e in self.extents}


# --------------------------------------------------------------------------- planning

def gguf_tensors(path: str) -> list[tuple[str, int, int]]:
    """(name, absolute data offset, byte size) of every tensor, via gguf.GGUFReader."""
    reader = gguf.GGUFReader(path)
    return [(t.name, int(t.data_offset), int(t.n_bytes)) for t in reader.tensors]


def extent_key(tensor_name: str) -> str:
    m = _LAYER_RE.match(tensor_name)
    return m.group(1) if m else "nonlayer"


def plan_layout(path: str, *, lba_size: int = 512,
                tensors: list[tuple[str, int, int]] | None = None) -> StageLayout:
    """Cut the GGUF into extents (one per run of same-layer tensors) and place them aligned."""
    size = os.path.getsize(path)
    tensors = sorted(tensors if tensors is not None else gguf_tensors(path), key=lambda t: t[1])
    if not tensors:
        raise StagingError(f"{path} has no tensors")
    align = max(lba_size, PAGE_SIZE)
    runs: list[tuple[str, int]] = [("gguf.meta", 0)]
    tensor_recs: list[Tensor] = []
    seen: dict[str, int] = {}
    for name, off, nbytes in tensors:
        if off + nbytes > size:
            raise StagingError(f"tensor {name} ends past the end of {path} (truncated file?)")
        key = extent_key(name)
        if runs[-1][0].split("#")[0] != key or len(runs) == 1:
            n = seen.get(key, 0)
            seen[key] = n + 1
            runs.append((key if n == 0 else f"{key}#{n}", off))
        tensor_recs.append(Tensor(name, off, nbytes, runs[-1][0]))
    if runs[1][1] == 0:
        runs.pop(0)
    bounds = [off for _, off in runs] + [size]
    extents = [Extent(name, bounds[i], bounds[i + 1] - bounds[i], 0)
               for i, (name, _) in enumerate(runs)]
    layout = StageLayout(os.path.basename(path), size, align, 0, extents, tensor_recs)
    # The header's size depends on the JSON, which holds the device offsets that depend on
    # the header's size: iterate until it stops growing (twice in practice).
    header_bytes = align
    for _ in range(8):
        layout.header_bytes = header_bytes
        pos = header_bytes
        for e in extents:
            e.device_offset = pos
            pos = align_up(pos + e.length, align)
        for e in extents:
            e.sha256 = "0" * 64          # size the body with full-length hashes
        layout.model_sha256 = "0" * 64
        need = align_up(len(encode_header(layout)), align)
        if need <= header_bytes:
            return layout
        header_bytes = need
    raise StagingError("header size did not converge")


# --------------------------------------------------------------------------- header codec

def _body(layout: StageLayout) -> bytes:
    return json.dumps({
        "model_name": layout.model_name,
        "extents": [asdict(e) for e in layout.extents],
        "tensors": [[t.name, t.offset, t.nbytes, t.extent] for t in layout.tensors],
    }, separators=(",", ":")).encode()


def encode_header(layout: StageLayout) -> bytes:
    """The header bytes (padded to `header_bytes`, or unpadded while planning)."""
    body = _body(layout)
    pre = np.zeros(1, PREAMBLE_DTYPE)
    pre["magic"], pre["version"], pre["align"] = HEADER_MAGIC, layout.version, layout.align
    pre["header_bytes"], pre["body_bytes"] = layout.header_bytes, len(body)
    pre["model_size"], pre["data_end"] = layout.model_size, layout.data_end
    pre["extent_count"], pre["tensor_count"] = len(layout.extents), len(layout.tensors)
    pre["model_sha256"] = np.frombuffer(bytes.fromhex(layout.model_sha256), "V32")[0]
    pre["body_sha256"] = np.frombuffer(hashlib.sha256(body).digest(), "V32")[0]
    raw = pre.tobytes() + body
    if layout.header_bytes >= len(raw):
        raw += b"\0" * (layout.header_bytes - len(raw))
    return raw


def decode_preamble(raw: bytes) -> np.void:
    if len(raw) < PREAMBLE_DTYPE.itemsize:
        raise StagingError("header too short")
    pre = np.frombuffer(raw[:PREAMBLE_DTYPE.itemsize], PREAMBLE_DTYPE)[0]
    if bytes(pre["magic"]) != HEADER_MAGIC:
        raise StagingError("no staged model here (magic NTXSTAGE not found): run "
                           "`ntx-admin stage MODEL.gguf --device /dev/nvmeXnY` first")
    if int(pre["version"]) != HEADER_VERSION:
        raise StagingError(f"staged with header version {int(pre['version'])}; this "
                           f"ntransformer reads version {HEADER_VERSION}: stage the model again")
    return pre


def decode_header(raw: bytes) -> StageLayout:
    pre = decode_preamble(raw)
    n = int(pre["body_bytes"])
    body = raw[PREAMBLE_DTYPE.itemsize: PREAMBLE_DTYPE.itemsize + n]
    if len(body) != n or hashlib.sha256(body).digest() != bytes(pre["body_sha256"]):
        raise StagingError("staged header is corrupt (body checksum mismatch): stage again")
    doc = json.loads(body)
    layout = StageLayout(
        model_name=doc["model_name"], model_size=int(pre["model_size"]),
        align=int(pre["align"]), header_bytes=int(pre["header_bytes"]),
        extents=[Extent(**e) for e in doc["extents"]],
        tensors=[Tensor(*t) for t in doc["tensors"]],
        model_sha256=bytes(pre["model_sha256"]).hex())
    if len(layout.extents) != int(pre["extent_count"]) or \
            len(layout.tensors) != int(pre["tensor_count"]):
        raise StagingError("staged header counts disagree with its body: stage again")
    return layout


def header_size_from_preamble(raw: bytes) -> int:
    return int(decode_preamble(raw)["header_bytes"])


# --------------------------------------------------------------------------- writing

def _aligned_buffer(size: int) -> tuple[mmap.mmap, np.ndarray]:
    mem = mmap.mmap(-1, size)
    return mem, np.frombuffer(mem, np.uint8)


Progress = Callable[[int, int], None]     # (bytes done, bytes total)


def stage_write(device_path: str, gguf_path: str, layout: StageLayout, *,
                chunk: int = 8 << 20, progress: Progress | None = None,
                device_size: int | None = None) -> StageLayout:
    """Write every extent (O_DIRECT, hashing as it goes), then the header; fsync.  Works on a
    block device or a plain image file.  Returns the layout with hashes filled in."""
    if device_size is not None and layout.data_end > device_size:
        raise StagingError(f"model needs {layout.data_end} bytes on the device, which has "
                           f"{device_size}")
    fd = _open_direct(device_path, os.O_WRONLY)
    mem, buf = _aligned_buffer(chunk)
    model_hash = hashlib.sha256()
    done = 0
    try:
        with open(gguf_path, "rb") as src:
            for e in layout.extents:
                h = hashlib.sha256()
                src.seek(e.offset)
                pos = 0
                while pos < e.length:
                    n = min(chunk, e.length - pos)
                    got = src.readinto(memoryview(mem)[:n])
                    if got != n:
                        raise StagingError(f"{gguf_path} changed while staging (short read)")
                    h.update(memoryview(mem)[:n])
                    model_hash.update(memoryview(mem)[:n])
                    padded = align_up(n, layout.align)
                    buf[n:padded] = 0
                    _pwrite_all(fd, memoryview(mem)[:padded], e.device_offset + pos)
                    pos += n
                    done += n
                    if progress:
                        progress(done, layout.model_size)
                e.sha256 = h.hexdigest()
        layout.model_sha256 = model_hash.hexdigest()
        header = encode_header(layout)
        hmem, hbuf = _aligned_buffer(len(header))
        hbuf[:] = np.frombuffer(header, np.uint8)
        _pwrite_all(fd, memoryview(hmem), 0)
        os.fsync(fd)
        del hbuf
        hmem.close()
    finally:
        os.close(fd)
        del buf
        mem.close()
    return layout


def _open_direct(path: str, flags: int) -> int:
    """Open with O_DIRECT (bypass the page cache: multi-GB models, honest read-back), falling
    back to buffered I/O on filesystems that refuse it (tmpfs image files in tests)."""
    try:
        return os.open(path, flags | os.O_DIRECT)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return os.open(path, flags)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def read_layout(device_path: str) -> StageLayout:
    """Read and decode the header of a staged device or image (kernel driver path)."""
    with open(device_path, "rb", buffering=0) as f:
        first = f.read(PAGE_SIZE)
        size = header_size_from_preamble(first)
        f.seek(0)
        return decode_header(f.read(size))


def verify_extents(read_at: Callable[[int, int], bytes | memoryview], layout: StageLayout,
                   progress: Progress | None = None) -> list[str]:
    """Hash every extent through `read_at(device_offset, length)`; names of the bad ones."""
    bad = []
    done = 0
    for e in layout.extents:
        if hashlib.sha256(read_at(e.device_offset, e.length)).hexdigest() != e.sha256:
            bad.append(e.name)
        done += e.length
        if progress:
            progress(done, layout.model_size)
    return bad


def direct_reader(device_path: str, chunk: int = 8 << 20):
    """`read_at` over O_DIRECT reads, so read-back verification sees the medium, not the
    page cache."""
    fd = _open_direct(device_path, os.O_RDONLY)
    mem, _ = _aligned_buffer(chunk)

    def read_at(offset: int, length: int) -> bytes:
        h = bytearray()
        pos = 0
        while pos < length:
            n = min(chunk, align_up(length - pos, PAGE_SIZE))
            got = os.preadv(fd, [memoryview(mem)[:n]], offset + pos)
            if got <= 0:
                raise StagingError(f"short read at {offset + pos} on {device_path}")
            take = min(got, length - pos)
            h += mem[:take]
            pos += take
        return bytes(h)

    def close():
        os.close(fd)
        mem.close()
    read_at.close = close
    return read_at


@dataclass
class StageReport:
    layout: StageLayout
    seconds: float
    verified: bool
    bad_extents: list[str] = field(default_factory=list)


def stage(device_path: str, gguf_path: str, *, lba_size: int, device_size: int | None = None,
          progress: Progress | None = None, verify: bool = True) -> StageReport:
    t0 = time.monotonic()
    layout = plan_layout(gguf_path, lba_size=lba_size)
    stage_write(device_path, gguf_path, layout, progress=progress, device_size=device_size)
    bad: list[str] = []
    if verify:
        on_disk = read_layout(device_path)
        if on_disk.model_sha256 != layout.model_sha256:
            bad.append("header")
        reader = direct_reader(device_path)
        try:
            bad += verify_extents(reader, on_disk)
        finally:
            reader.close()
    return StageReport(layout, time.monotonic() - t0, verify and not bad, bad)
