"""Find NVMe controllers and namespaces and everything that says whether they are in use.

One `NvmeDevice` record (nvme_device.py) per namespace (or one per controller that has no visible namespace, e.g.
one already bound to vfio-pci).  The record carries facts only; `policy.device_verdict` judges
them.  Facts come from pyudev (enumeration, properties from the udev database when udev runs)
and sysfs/procfs (partitions, holders, mounts, swap, IOMMU group), plus a read-only sniff of the
first 64 KiB for signatures when udev has not probed the device (e.g. in a minimal guest).

Discovery never writes anything.

Thread rule: functions here are stateless; call from any thread.
"""
from __future__ import annotations

import glob
import os

from .nvme_device import NvmeDevice
from .policy import namespace_in_use
from .staging import HEADER_MAGIC

NVME_PCI_CLASS = 0x010802
SYSTEM_MOUNTS = ("/", "/boot", "/boot/efi", "/efi", "/usr", "/var")


# --------------------------------------------------------------------------- small readers

def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _driver(sys_path: str) -> str | None:
    link = os.path.join(sys_path, "driver")
    return os.path.basename(os.readlink(link)) if os.path.islink(link) else None


def _unescape_mount(s: str) -> str:
    return s.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n") \
        .replace("\\134", "\\")


def block_base_disks(name: str, sysfs: str = "/sys") -> set[str]:
    """The whole disks underneath block device `name`: a partition's parent, a dm/md device's
    slaves, recursively (LVM on a partition of nvme0n1 gives {nvme0n1})."""
    out: set[str] = set()
    path = os.path.join(sysfs, "class/block", name)
    if not os.path.exists(path):
        return out
    real = os.path.realpath(path)
    if os.path.exists(os.path.join(real, "partition")):
        return block_base_disks(os.path.basename(os.path.dirname(real)), sysfs)
    slaves = glob.glob(os.path.join(real, "slaves", "*"))
    if not slaves:
        return {name}
    for s in slaves:
        out |= block_base_disks(os.path.basename(s), sysfs)
    return out


def _devnum_to_name(devnum: str, sysfs: str) -> str | None:
    link = os.path.join(sysfs, "dev/block", devnum)
    return os.path.basename(os.path.realpath(link)) if os.path.exists(link) else None


def mounts_by_disk(sysfs: str = "/sys", mountinfo: str = "/proc/self/mountinfo"
                   ) -> dict[str, list[str]]:
    """Base disk name -> mount points of filesystems that live on it (via partitions/LVM)."""
    out: dict[str, list[str]] = {}
    try:
        lines = open(mountinfo).read().splitlines()
    except OSError:
        return out
    for line in lines:
        fields = line.split()
        if len(fields) < 5:
            continue
        name = _devnum_to_name(fields[2], sysfs)
        if name is None:
            continue
        for disk in block_base_disks(name, sysfs):
            out.setdefault(disk, []).append(_unescape_mount(fields[4]))
    return out


def swap_disks(sysfs: str = "/sys", swaps: str = "/proc/swaps") -> set[str]:
    out: set[str] = set()
    try:
        lines = open(swaps).read().splitlines()[1:]
    except OSError:
        return out
    for line in lines:
        dev = line.split()[0]
        if dev.startswith("/dev/"):
            out |= block_base_disks(os.path.basename(os.path.realpath(dev)), sysfs)
    return out


def sniff_signature(devnode: str) -> str | None:
    """Name the first known on-disk signature, reading (never writing) the first 64 KiB."""
    try:
        with open(devnode, "rb", buffering=0) as f:
            head = f.read(65536)
    except OSError:
        return None
    return signature_of(head)


def signature_of(head: bytes) -> str | None:
    if head[:len(HEADER_MAGIC)] == HEADER_MAGIC:
        return "ntx-staged"
    if head[512:520] == b"EFI PART":
        return "gpt"
    if head[0x218:0x220] == b"LVM2 001" or head[512:520] == b"LABELONE":
        return "LVM2_member"
    if len(head) > 4096 and head[4086:4096] in (b"SWAPSPACE2", b"SWAP-SPACE"):
        return "swap"
    if len(head) > 1082 and head[1080:1082] == b"\x53\xef":
        return "ext4"
    if head[0:4] == b"XFSB":
        return "xfs"
    if head[3:11] in (b"NTFS    ", b"EXFAT   ") or head[82:87] == b"FAT32":
        return "fat/ntfs"
    if head[4096:4100] == b"\xfc\x4e\x2b\xa9":
        return "linux_raid_member"
    if head[510:512] == b"\x55\xaa" and any(head[446:510]):
        return "dos"
    return None


# --------------------------------------------------------------------------- discovery

def _pci_class(sys_path: str) -> int:
    try:
        return int(_read(os.path.join(sys_path, "class")) or "0", 16)
    except ValueError:
        return 0


def _nvme_pci_devices(sysfs: str) -> list[str]:
    """PCI addresses of every NVMe controller (class 01:08:02), whatever its driver."""
    if sysfs == "/sys":
        try:
            import pyudev  # lazy: optional (the [daemon] extra); sysfs is read without it
            return sorted(d.sys_name for d in pyudev.Context().list_devices(subsystem="pci")
                          if _pci_class(d.sys_path) == NVME_PCI_CLASS)
        except ImportError:
            pass
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(sysfs, "bus/pci/devices/*"))
                  if _pci_class(p) == NVME_PCI_CLASS)


def discover(sysfs: str = "/sys", dev: str = "/dev", sniff: bool = True) -> list[NvmeDevice]:
    """Every NVMe namespace on this machine, with the facts the policy needs."""
    mounts = mounts_by_disk(sysfs)
    swaps = swap_disks(sysfs)
    out: list[NvmeDevice] = []
    for addr in _nvme_pci_devices(sysfs):
        pci = os.path.join(sysfs, "bus/pci/devices", addr)
        group_link = os.path.join(pci, "iommu_group")
        group = int(os.path.basename(os.readlink(group_link))) if os.path.islink(group_link) \
            else None
        peers = {}
        if group is not None:
            for p in glob.glob(os.path.join(sysfs, f"kernel/iommu_groups/{group}/devices/*")):
                if os.path.basename(p) != addr:
                    peers[os.path.basename(p)] = _driver(p)
        base = dict(pci_address=addr, driver=_driver(pci), iommu_group=group, group_peers=peers)
        ctrls = sorted(os.path.basename(c) for c in glob.glob(os.path.join(pci, "nvme", "nvme*")))
        if not ctrls:
            out.append(NvmeDevice(controller=None, **base))
            continue
        for ctrl in ctrls:
            cdir = os.path.join(pci, "nvme", ctrl)
            info = dict(base, controller=ctrl, serial=_read(f"{cdir}/serial"),
                        model=_read(f"{cdir}/model"), firmware=_read(f"{cdir}/firmware_rev"))
            namespaces = sorted(os.path.basename(n) for n in glob.glob(f"{cdir}/nvme*n*")
                                if os.path.exists(os.path.join(n, "size")))
            # Multipath kernels expose namespaces as nvmeXnY under the subsystem, not the ctrl.
            if not namespaces:
                namespaces = sorted(os.path.basename(n) for n in glob.glob(
                    os.path.join(sysfs, "class/block", f"{ctrl}n*")) if "p" not in
                    os.path.basename(n)[len(ctrl):])
            if not namespaces:
                out.append(NvmeDevice(**info))
                continue
            recs = []
            for ns in namespaces:
                bdir = os.path.join(sysfs, "class/block", ns)
                parts = sorted(os.path.basename(p) for p in glob.glob(f"{bdir}/{ns}p*"))
                holders = set(os.path.basename(h) for h in glob.glob(f"{bdir}/holders/*"))
                for p in parts:
                    holders |= set(os.path.basename(h) for h in glob.glob(f"{bdir}/{p}/holders/*"))
                sectors = int(_read(f"{bdir}/size") or 0)
                devnode = os.path.join(dev, ns)
                ns_mounts = sorted(set(mounts.get(ns, [])))
                rec = NvmeDevice(**info, namespace=ns, devnode=devnode,
                                 size_bytes=sectors * 512,
                                 lba_size=int(_read(f"{bdir}/queue/logical_block_size") or 512),
                                 partitions=parts, mounts=ns_mounts, holders=sorted(holders),
                                 swap=ns in swaps,
                                 signature=sniff_signature(devnode) if sniff else None,
                                 backs=[m for m in SYSTEM_MOUNTS if m in ns_mounts])
                recs.append(rec)
            for rec in recs:
                rec.sibling_namespaces_in_use = [o.namespace for o in recs
                                                 if o is not rec and namespace_in_use(o)]
            out.extend(recs)
    return out


def find_device(devices: list[NvmeDevice], ident: str) -> NvmeDevice | None:
    """Look a device up by /dev node, namespace name, controller name or PCI address."""
    key = os.path.basename(ident) if ident.startswith("/dev/") else ident
    for d in devices:
        if key in (d.namespace, d.controller, d.pci_address) or ident == d.devnode:
            return d
    return None
