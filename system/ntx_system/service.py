"""The privileged steps around ntransformerd: find the configured drive, check it, bind it to
vfio-pci, and hand it back.  The systemd unit runs them with full privileges, so the serving
process keeps none of the rights they need:

    ExecStartPre=+ntx-admin bind --service     prepare(): the drive named by `storage =
                                                "nvme:SERIAL"` (or a PCI address), the staging
                                                policy, the IOMMU, the staged header against the
                                                configured model, bind; the outcome goes to
                                                /run/ntransformer/nvme.json for ntransformerd
    ExecStopPost=+ntx-admin unbind --service   release(): back to `nvme` (or kept on vfio-pci
                                                with nvme_release = "keep"), record removed

ntransformerd started as root without the unit runs the same two functions itself.  Every
refusal is a `Refused` whose message names what was found and the fix; `ntx-admin` exits 2 on
one, so the unit fails once (Restart=on-abnormal does not retry a refusal) with the reason in
the journal and in STATUS=.

A drive kept on vfio-pci has no serial in sysfs any more (only the `nvme` driver publishes it),
so the last PCI address of each serial is remembered in the state directory; ntransformerd then
confirms the serial by IDENTIFY before it reads anything.

Thread rule: one-shot functions, called by one thread (the unit's start and stop steps).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import socket
from collections.abc import Callable

from . import config_file, staging
from .bind import bind_vfio, current_driver, unbind_vfio
from .discovery import NvmeDevice, discover
from .policy import device_verdict

STORAGE_PREFIX = "nvme:"
PCI_ADDRESS_RE = re.compile(r"^[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")
RUN_DIR = "/run/ntransformer"            # the unit's RuntimeDirectory
STATE_DIR = "/var/lib/ntransformer"      # the unit's StateDirectory
RECORD_FILE = "nvme.json"
KNOWN_FILE = "nvme-drives.json"
SHA_CACHE_FILE = "sha256-cache.json"
RELEASE_MODES = config_file.RELEASE_MODES
DEFAULT_CONFIG = config_file.DEFAULT_PATH

Status = Callable[[str], None]


class Refused(RuntimeError):
    """The drive may not be used as configured; the message says why and what would fix it."""


def storage_drive(storage: str) -> str | None:
    """The drive named by a `storage` setting ("nvme:SERIAL" or "nvme:PCI"), else None."""
    if not storage.startswith(STORAGE_PREFIX):
        return None
    ident = storage[len(STORAGE_PREFIX):].strip()
    if not ident:
        raise ValueError('storage = "nvme:" names no drive: write nvme:SERIAL (the serial '
                         "`ntx-admin devices` shows) or nvme:PCI_ADDRESS")
    return ident


@dataclasses.dataclass(frozen=True)
class ServiceConfig:
    """The keys of ntransformerd.toml the privileged steps need (config_file.DRIVE_KEYS; the
    daemon checks the others)."""

    storage: str = "file"
    model: str = ""
    noiommu: bool = False
    nvme_release: str = "nvme"

    @classmethod
    def from_toml(cls, path: str) -> "ServiceConfig":
        """The drive's keys of ntransformerd's config, read and checked as the daemon reads them
        (config_file); a missing file: the defaults."""
        try:
            return cls(**config_file.drive_settings(path))
        except config_file.ConfigError as exc:
            raise Refused(str(exc)) from None


@dataclasses.dataclass
class DriveRecord:
    """What the start step did, for ntransformerd and for the stop step."""

    serial: str
    pci_address: str
    iommu_group: int | None
    previous_driver: str | None
    bound_by: str                 # "ntx-admin" (the unit's start step) or "ntransformerd"
    release: str = "nvme"
    noiommu: bool = False
    model: str = ""               # the configured model file, "" = the staged one
    model_sha256: str = ""        # of that file, when set
    staged_name: str = ""         # what the header says is on the drive ("" if not read)
    staged_sha256: str = ""

    def save(self, run_dir: str = RUN_DIR) -> str:
        path = os.path.join(run_dir, RECORD_FILE)
        _write_json(path, dataclasses.asdict(self), 0o644)
        return path

    @classmethod
    def load(cls, run_dir: str = RUN_DIR) -> "DriveRecord | None":
        try:
            with open(os.path.join(run_dir, RECORD_FILE)) as f:
                return cls(**json.load(f))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError) as exc:
            raise Refused(f"{os.path.join(run_dir, RECORD_FILE)} is damaged ({exc}): "
                          f"`ntx-admin unbind --service` then start again") from None

    @staticmethod
    def forget(run_dir: str = RUN_DIR) -> None:
        try:
            os.unlink(os.path.join(run_dir, RECORD_FILE))
        except FileNotFoundError:
            pass


def _write_json(path: str, doc, mode: int) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _read_json(path: str, default):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


# --------------------------------------------------------------------------- model hashes

def file_sha256(path: str, state_dir: str = STATE_DIR) -> str:
    """sha256 of a model file, cached by (path, size, mtime, inode) in the state directory:
    a multi-GB model is hashed once, not at every start."""
    st = os.stat(path)
    key = f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"
    cache_path = os.path.join(state_dir, SHA_CACHE_FILE)
    cache = _read_json(cache_path, {})
    if key in cache:
        return cache[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    digest = h.hexdigest()
    cache = {k: v for k, v in cache.items() if not k.startswith(os.path.realpath(path) + ":")}
    cache[key] = digest
    try:
        _write_json(cache_path, cache, 0o644)
    except OSError:
        pass                       # a read-only state directory only costs the next hash
    return digest


def check_staged_model(layout: staging.StageLayout, where: str, model: str,
                       model_sha256: str) -> None:
    """Refuse a staged copy of another model than the configured file."""
    if model and layout.model_sha256 != model_sha256:
        raise Refused(f"{where} holds a staged copy of {layout.model_name} (sha256 "
                      f"{layout.model_sha256[:16]}…), not of {model} (sha256 "
                      f"{model_sha256[:16]}…): stage it with `ntx-admin stage {model} --device "
                      f"/dev/nvmeXnY`, or unset `model` to serve the staged copy")


# --------------------------------------------------------------------------- finding the drive

def find_drive(ident: str, devices: list[NvmeDevice], *, state_dir: str = STATE_DIR,
               sysfs: str = "/sys") -> tuple[str, str | None, list[NvmeDevice]]:
    """(PCI address, serial or None if only known by address, the kernel's records of that
    controller) of the drive `ident` names: a serial, or a PCI address."""
    by_pci = PCI_ADDRESS_RE.match(ident) is not None
    if by_pci:
        mine = [d for d in devices if d.pci_address == ident.lower()]
        if mine:
            return mine[0].pci_address, mine[0].serial, mine
        raise Refused(f"no NVMe controller at PCI address {ident} (`ntx-admin devices` lists "
                      f"them); PCI addresses move between boots and slots, so name the drive "
                      f"by serial: storage = \"nvme:SERIAL\"")
    mine = [d for d in devices if d.serial == ident]
    if mine:
        return mine[0].pci_address, ident, mine
    known = _read_json(os.path.join(state_dir, KNOWN_FILE), {}).get(ident)
    if known:
        kept = [d for d in devices if d.pci_address == known and d.driver == "vfio-pci"]
        if kept:
            return known, ident, kept
    seen = ", ".join(sorted(f"{d.serial} ({d.pci_address})" for d in devices if d.serial)) \
        or "none with the nvme driver"
    raise Refused(f"drive absent: no NVMe drive with serial {ident!r} (found: {seen}); check "
                  f"the serial with `ntx-admin devices` and storage = \"nvme:SERIAL\" in "
                  f"{DEFAULT_CONFIG}")


def iommu_refusal(d: NvmeDevice, noiommu: bool, sysfs: str = "/sys") -> str | None:
    """Why the IOMMU setup forbids VFIO for this drive, or None."""
    if d.iommu_group is not None and not noiommu:
        return None
    if d.iommu_group is None and not noiommu:
        return (f"the IOMMU is off ({d.pci_address} has no IOMMU group): enable VT-d/AMD-Vi "
                f"and `ntx-admin setup` (then reboot), or set noiommu = true in {DEFAULT_CONFIG} "
                f"to accept a drive that can DMA anywhere in memory (unsafe)")
    param = os.path.join(sysfs, "module/vfio/parameters/enable_unsafe_noiommu_mode")
    try:
        on = open(param).read().strip() in ("Y", "1")
    except OSError:
        on = False
    if not on:
        return ("noiommu = true, but the kernel's vfio is not in no-IOMMU mode: load it with "
                "enable_unsafe_noiommu_mode=1 (a kernel built with CONFIG_VFIO_NOIOMMU)")
    return None


# --------------------------------------------------------------------------- start / stop

def prepare(cfg: ServiceConfig, *, status: Status = lambda text: None, bound_by: str,
            sysfs: str = "/sys", dev: str = "/dev", run_dir: str = RUN_DIR,
            state_dir: str = STATE_DIR, require_root: bool = True,
            devices: list[NvmeDevice] | None = None,
            bind: Callable[..., str | None] = bind_vfio) -> DriveRecord | None:
    """The start step: find, check, bind and record the drive `cfg.storage` names.  None when
    the storage is not an NVMe drive.  Raises Refused; BindError/OSError when binding fails."""
    ident = storage_drive(cfg.storage)
    if ident is None:
        return None
    if require_root and os.geteuid() != 0:
        raise Refused(f"not root: binding the NVMe drive {ident} to vfio-pci needs root; run "
                      f"it as the service does (sudo systemctl start ntransformerd)")
    status(f"nvme: looking for drive {ident}")
    if devices is None:
        devices = discover(sysfs=sysfs, dev=dev)
    pci, serial, mine = find_drive(ident, devices, state_dir=state_dir, sysfs=sysfs)
    first = mine[0]
    status(f"nvme: drive {serial or ident} is {pci} ({first.model or 'model unknown'}, "
           f"driver {first.driver or 'none'}, IOMMU group "
           f"{first.iommu_group if first.iommu_group is not None else 'none'})")
    reasons = [r for d in mine for r in device_verdict(d).reasons]
    if reasons:
        raise Refused(f"refused by policy: {pci} ({first.devnode or first.controller or pci}): "
                      + "; ".join(dict.fromkeys(reasons)))
    why = iommu_refusal(first, cfg.noiommu, sysfs)
    if why:
        raise Refused(why)
    model_sha = ""
    if cfg.model:
        if not os.path.isfile(cfg.model):
            raise Refused(f"model = {cfg.model}: no such file; fix `model` in {DEFAULT_CONFIG} "
                          f"or unset it to serve the staged copy")
        status(f"nvme: hashing {os.path.basename(cfg.model)} to compare with the staged copy")
        model_sha = file_sha256(cfg.model, state_dir)
    record = DriveRecord(serial=serial or "", pci_address=pci, iommu_group=first.iommu_group,
                         previous_driver=first.driver, bound_by=bound_by,
                         release=cfg.nvme_release, noiommu=cfg.noiommu, model=cfg.model,
                         model_sha256=model_sha)
    if first.driver == "nvme" and first.devnode:
        # While the kernel still owns it: a blank, corrupt or foreign header refuses here,
        # before the drive leaves the kernel.  A drive already on vfio-pci is checked by
        # ntransformerd through its own driver.
        # Under the unit the device cgroup (DevicePolicy=closed) covers this step too, so the
        # node cannot be opened there: ntransformerd then checks the header through its driver.
        try:
            layout = staging.read_layout(first.devnode)
        except PermissionError:
            layout = None
            status(f"nvme: {first.devnode} is not readable here; ntransformerd checks the staged "
                   f"header through its own driver")
        except (staging.StagingError, ValueError, KeyError) as exc:
            raise Refused(f"the staged copy on {first.devnode} (serial {serial}) is unusable: "
                          f"{exc}") from None
        if layout is not None:
            check_staged_model(layout, f"{first.devnode} (serial {serial})", cfg.model, model_sha)
            record.staged_name, record.staged_sha256 = layout.model_name, layout.model_sha256
            status(f"nvme: staged copy of {layout.model_name} ({len(layout.extents)} extents) "
                   f"checked")
    before = bind(pci, sysfs=sysfs)
    record.previous_driver = before
    group = _group_of(pci, sysfs)
    record.iommu_group = group if group is not None else record.iommu_group
    record.save(run_dir)
    if serial:
        known = _read_json(os.path.join(state_dir, KNOWN_FILE), {})
        known[serial] = pci
        try:
            _write_json(os.path.join(state_dir, KNOWN_FILE), known, 0o644)
        except OSError:
            pass
    status(f"nvme: {pci} bound to vfio-pci (was {before or 'no driver'}), IOMMU group "
           f"{record.iommu_group}")
    return record


def _group_of(pci: str, sysfs: str) -> int | None:
    link = os.path.join(sysfs, "bus/pci/devices", pci, "iommu_group")
    return int(os.path.basename(os.readlink(link))) if os.path.islink(link) else None


def release(record: DriveRecord | None, *, status: Status = lambda text: None,
            sysfs: str = "/sys", run_dir: str = RUN_DIR,
            unbind: Callable[..., None] = unbind_vfio) -> str:
    """The stop step: hand the drive back to `nvme` unless it is to be kept; forget the record.
    Returns what happened, for the log."""
    if record is None:
        return "no NVMe drive was bound for the service"
    if record.release == "keep":
        DriveRecord.forget(run_dir)
        what = f"nvme: {record.pci_address} stays on vfio-pci (nvme_release = \"keep\")"
    elif current_driver(record.pci_address, sysfs) != "vfio-pci":
        DriveRecord.forget(run_dir)
        what = (f"nvme: {record.pci_address} is on "
                f"{current_driver(record.pci_address, sysfs) or 'no driver'} already")
    else:
        unbind(record.pci_address, sysfs=sysfs)
        DriveRecord.forget(run_dir)
        what = f"nvme: {record.pci_address} handed back to nvme"
    status(what)
    return what


def notify_status(text: str, environ=os.environ) -> bool:
    """STATUS= to $NOTIFY_SOCKET (the unit's NotifyAccess=exec lets its start step speak)."""
    addr = environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.sendto(f"STATUS={text}".encode(), addr)
        return True
    except OSError:
        return False
