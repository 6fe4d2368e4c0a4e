"""The daemon's storage: the NVMe drive it streams from, and the handle each engine reads through.

    drive = Drive(config, status=notifier.status)
    drive.open()                         # the record of the unit's start step (or, as root
                                         # without the unit, that step run here), VFIO, the
                                         # controller reset and brought up, queue pairs, the
                                         # staged header checked against `model`
    model, fill = drive.staged_model()   # `model` unset: metadata, tokenizer and tensors read
                                         # from the drive alone
    source = drive.handle()              # EngineConfig(storage=source): the tiers read through it,
                                         # its `kind` the storage setting it serves
    drive.close(); drive.release()       # queues deleted, controller disabled, unmapped; handed
                                         # back to nvme when this process bound it

The drive is opened once and shared by every engine the daemon loads, so a new model is read
from it while the old one still serves.  Each engine gets its own `StorageHandle`: it counts the
bytes, seconds and errors of its reads for the per-tier Status counters, unmaps the buffers it
registered when its engine closes, and turns a device error into `StorageUnavailable` (gRPC
UNAVAILABLE) after telling the daemon, which then brings the drive up again.

Thread rule: `Drive.open/close/release/staged_model` belong to the daemon's loader thread;
`StorageHandle.read_into` runs on the engine's reader threads (the staged source hands each its
own queue pair); `stats` from any thread.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Callable

import numpy as np

from ntransformerd.engine.gguf_file import GGUFModel
from ntransformerd.engine.tiers.sources import PAGE, Source, open_source
from ntransformerd.server.errors import StorageUnavailable
from ntx_system import service, staging
from ntx_system.ctrlr import CtrlrError
from ntx_system.qpair import QpairError
from ntx_system.source import NvmeStagedSource
from ntx_system.vfio import VfioError

log = logging.getLogger("ntransformerd")
READ_CHUNK = 16 << 20


def drive_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean "the drive or its transport failed" (worth a new bring-up)."""
    return (CtrlrError, QpairError, VfioError, StorageUnavailable)


class Drive:
    """The configured NVMe drive, brought up by this process."""

    def __init__(self, config, *, status: Callable[[str], None] = lambda text: None,
                 transport_factory=None, run_dir: str | None = None, state_dir: str | None = None):
        self.config = config
        self.ident = service.storage_drive(config.storage)
        self._status = status
        self._transport_factory = transport_factory  # tests: a fake controller instead of VFIO
        self.run_dir = run_dir or service.RUN_DIR
        self.state_dir = state_dir or service.STATE_DIR
        self.record = None
        self.staged = None
        self.on_failure: Callable[[BaseException], None] = lambda exc: None
        self._failed = threading.Event()

    def say(self, text: str) -> None:
        log.info("%s", text)
        self._status(text)

    @property
    def describe(self) -> str:
        r = self.record
        return f"nvme {r.serial or self.ident} at {r.pci_address}" if r else f"nvme {self.ident}"

    # ---- bring-up -------------------------------------------------------------------------

    def _find(self):
        """The drive's record: the unit's start step wrote it; without the unit, as root, that
        step runs here. Raises service.Refused."""
        if self._transport_factory is not None:
            return service.DriveRecord(serial=self.ident, pci_address="fake", iommu_group=None,
                                       previous_driver=None, bound_by="test",
                                       model=self.config.model)
        record = service.DriveRecord.load(self.run_dir)
        if record is not None:
            wanted = self.ident.lower() if service.PCI_ADDRESS_RE.match(self.ident) else None
            if (wanted and record.pci_address != wanted) or (not wanted and record.serial != self.ident):
                raise service.Refused(f"{self.run_dir}/nvme.json records drive {record.serial} at "
                                      f"{record.pci_address}, but storage names {self.ident}: "
                                      "restart the unit (systemctl restart ntransformerd)")
            self.say(f"nvme: drive {record.serial} at {record.pci_address}, bound by {record.bound_by}")
            return record
        if os.geteuid() != 0:
            raise service.Refused(f"not root: storage = \"nvme:{self.ident}\" needs ntransformerd "
                                  "to run as root, as the systemd unit runs it (sudo systemctl start "
                                  "ntransformerd); or use storage = \"file\"")
        cfg = service.ServiceConfig(storage=self.config.storage, model=self.config.model,
                                    noiommu=self.config.noiommu, nvme_release=self.config.nvme_release)
        return service.prepare(cfg, status=self.say, bound_by="ntransformerd", run_dir=self.run_dir,
                               state_dir=self.state_dir)

    def open(self) -> None:
        """Bring the drive up: VFIO, controller reset and start, queue pairs, header checks.
        Raises service.Refused (not worth a retry) or one of drive_errors()."""
        if self.staged is not None:
            return
        c = self.config
        if self.record is None:
            self.record = self._find()
        r = self.record
        self.say(f"nvme: bringing up {r.pci_address} ({c.nvme_queues} queue(s) of depth "
                 f"{c.nvme_queue_depth}{', no-IOMMU' if c.noiommu else ''})")
        transport = self._transport_factory() if self._transport_factory else None
        try:
            staged = NvmeStagedSource.open(r.pci_address, transport=transport, noiommu=c.noiommu,
                                           queue_depth=c.nvme_queue_depth, queues=c.nvme_queues,
                                           io_timeout_s=c.nvme_io_timeout)
        except staging.StagingError as e:
            raise service.Refused(f"the staged copy on {self.describe} is unusable: {e}") from None
        try:
            serial = staged.ctrl.identity.serial
            if r.serial and serial != r.serial:
                raise service.Refused(f"the controller at {r.pci_address} reports serial {serial}, not "
                                      f"{r.serial}: the PCI address moved; restart the unit")
            layout = staged.layout
            if c.model:
                sha = r.model_sha256 if r.model == c.model and r.model_sha256 else \
                    service.file_sha256(c.model, self.state_dir)
                service.check_staged_model(layout, self.describe, c.model, sha)
        except BaseException:
            staged.close()
            raise
        self.staged = staged
        self._failed.clear()
        self.say(f"nvme: {staged.ctrl.identity.model} serial {serial} ready: staged "
                 f"{layout.model_name} ({layout.model_size >> 20} MiB, {len(layout.extents)} extents), "
                 f"{staged.queues} queue pair(s), max transfer {staged.ctrl.max_transfer >> 10} KiB")

    def close(self) -> None:
        """Delete the queues, disable the controller, unmap, release the VFIO group."""
        if self.staged is None:
            return
        staged, self.staged = self.staged, None
        try:
            staged.close()
            self.say(f"nvme: {self.describe}: queues deleted, controller disabled, VFIO released")
        except Exception as e:  # noqa: BLE001 - closing the fd resets the function anyway
            log.warning("nvme: closing %s: %s", self.describe, e)

    def release(self) -> None:
        """Hand the drive back when this process bound it (the unit's stop step does otherwise)."""
        if self.record is not None and self.record.bound_by == "ntransformerd":
            service.release(self.record, status=self.say, run_dir=self.run_dir)
            self.record = None

    # ---- failure --------------------------------------------------------------------------

    def failed(self, exc: BaseException) -> None:
        """A read failed: tell the daemon once per bring-up."""
        if not self._failed.is_set():
            self._failed.set()
            log.error("nvme: %s failed: %s", self.describe, exc)
            self.on_failure(exc)

    # ---- the model ------------------------------------------------------------------------

    def handle(self) -> "StorageHandle":
        if self.staged is None:
            raise StorageUnavailable(f"{self.describe} is not up: retry once ntransformerd is serving "
                                     "again (systemctl status ntransformerd)")
        return StorageHandle.for_drive(self.staged, kind=self.config.storage, name=self.describe, on_error=self.failed)

    def staged_model(self):
        """(GGUFModel, fill) of the model on the drive alone: a sparse in-memory image (memfd)
        holding its metadata and non-layer tensors; fill(layers) reads those layers into it too
        (every layer the tier plan keeps in memory). The layers left out are holes that read
        as zeros, so the daemon checks the plan streams each of them from the drive."""
        staged = self.staged
        layout = staged.layout
        fd = os.memfd_create(f"ntx-staged-{layout.model_name}", os.MFD_CLOEXEC)
        os.ftruncate(fd, layout.model_size)
        by_layer: dict[int, list] = {}
        for e in layout.extents:
            base = e.name.split("#")[0]
            if base.startswith("blk."):
                by_layer.setdefault(int(base[4:]), []).append(e)
            else:
                self._copy(fd, e.offset, e.length)
        model = GGUFModel(f"/proc/self/fd/{fd}")
        model.staged_fd = fd
        filled: set[int] = set()

        def fill(layers) -> set[int]:
            for i in sorted(set(layers) - filled):
                for e in by_layer.get(i, []):
                    self._copy(fd, e.offset, e.length)
                filled.add(i)
            return filled
        return model, fill

    def _copy(self, fd: int, offset: int, length: int) -> None:
        mem = mmap.mmap(-1, min(READ_CHUNK, max(length, PAGE)))
        buf = np.frombuffer(mem, np.uint8)
        try:
            pos = 0
            while pos < length:
                n = min(len(buf), length - pos)
                self.staged.read_into(offset + pos, n, buf)
                os.pwrite(fd, memoryview(buf)[:n], offset + pos)
                pos += n
        finally:
            del buf
            mem.close()


class StorageHandle(Source):
    """One engine's view of a storage source: counts its reads, unmaps what it registered when
    the engine closes, and reports a failed read (UNAVAILABLE for the requests it served).
    `kind` is the storage setting it serves (file | odirect | mmap | nvme:…): the backend is
    checked against it (backends.settle) as against the setting itself."""

    alignment = PAGE

    def __init__(self, inner, *, kind: str, name: str, drive: bool,
                 on_error: Callable[[BaseException], None] | None = None, owns: bool = False):
        """inner: a file Source (engine/tiers/sources.py), or with `drive` the staged NVMe drive
        (ntx_system.source.NvmeStagedSource), which DMAs into the buffers registered with it."""
        self.inner, self.kind, self.name, self._on_error, self._owns = inner, kind, name, on_error, owns
        self._nvme = drive
        self.alignment = PAGE if drive else inner.alignment
        self._registered: list[np.ndarray] = []
        self._lock = threading.Lock()
        self.bytes = self.reads = self.errors = 0
        self.seconds = 0.0
        self.last_error = ""

    @classmethod
    def for_file(cls, kind: str, path: str) -> "StorageHandle":
        """A handle that owns a file source (file | odirect | mmap) of `path`."""
        return cls(open_source(kind, path), kind=kind, name=f"{kind} {path}", drive=False, owns=True)

    @classmethod
    def for_drive(cls, staged: NvmeStagedSource, *, kind: str, name: str,
                  on_error: Callable[[BaseException], None] | None = None) -> "StorageHandle":
        """A handle on the staged drive (the Drive keeps it open: closing the handle unmaps only
        the buffers this engine registered)."""
        return cls(staged, kind=kind, name=name, drive=True, on_error=on_error)

    def register(self, dest: np.ndarray) -> None:
        if self._nvme and self.inner.register_buffer(dest):
            with self._lock:
                self._registered.append(dest)

    def unregister(self, dest: np.ndarray) -> None:
        if self._nvme:
            with self._lock:
                self._registered = [b for b in self._registered if b is not dest]
            self.inner.unregister_buffer(dest)

    def read_into(self, offset: int, length: int, dest: np.ndarray) -> None:
        t0 = time.perf_counter()
        try:
            self.inner.read_into(offset, length, dest[:length] if self._nvme else dest)
        except Exception as e:
            with self._lock:
                self.errors += 1
                self.last_error = str(e)
            if self._on_error is not None:
                self._on_error(e)
                raise StorageUnavailable(f"the model's storage ({self.name}) failed: {e}; ntransformerd "
                                         "is bringing it up again: retry in a few seconds") from e
            raise
        with self._lock:
            self.bytes += length
            self.reads += 1
            self.seconds += time.perf_counter() - t0

    def stats(self) -> dict:
        """This engine's reads (bytes, seconds, reads, errors) plus, for the drive, its commands."""
        with self._lock:
            out = dict(source=self.name, bytes=self.bytes, seconds=self.seconds, reads=self.reads,
                       errors=self.errors, last_error=self.last_error, commands=0, in_flight=0,
                       max_in_flight=0)
        if self._nvme:
            d = self.inner.stats()
            out.update(commands=d["commands"], in_flight=d["in_flight"], max_in_flight=d["max_in_flight"])
        return out

    def close(self) -> None:
        with self._lock:
            bufs, self._registered = self._registered, []
        for b in bufs:
            try:
                self.inner.unregister_buffer(b)
            except Exception as e:  # noqa: BLE001 - the drive is being reset anyway
                log.warning("nvme: unmapping a staging buffer: %s", e)
        if self._owns:
            self.inner.close()
