"""`ntx-admin check`: is this host ready for the NVMe path?  Each line OK / WARN / FAIL + fix.

Reads only (procfs, sysfs, rlimits); `root` lets tests point it at a fake tree.

Thread rule: stateless; call from any thread.
"""
from __future__ import annotations

import glob
import os
import resource
import shutil
from dataclasses import dataclass

from .discovery import NVME_PCI_CLASS

SECURE_BOOT_VAR = "sys/firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-e9eb5e4b4b2c"


@dataclass
class CheckLine:
    status: str          # OK, WARN, FAIL
    name: str
    detail: str
    fix: str = ""

    def __str__(self) -> str:
        s = f"{self.status:<4} {self.name}: {self.detail}"
        return s + (f"\n     fix: {self.fix}" if self.fix and self.status != "OK" else "")


def _read(root: str, rel: str) -> str | None:
    try:
        with open(os.path.join(root, rel), "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return None


def check_iommu(root: str) -> list[CheckLine]:
    cmdline = (_read(root, "proc/cmdline") or "").split()
    units = glob.glob(os.path.join(root, "sys/class/iommu/*"))
    groups = glob.glob(os.path.join(root, "sys/kernel/iommu_groups/*"))
    args = [a for a in cmdline if a.startswith(("intel_iommu=", "amd_iommu=", "iommu="))]
    out = []
    if units and groups:
        out.append(CheckLine("OK", "iommu", f"{len(units)} IOMMU unit(s), {len(groups)} groups; "
                                            f"kernel args: {' '.join(args) or '(defaults)'}"))
    else:
        out.append(CheckLine("FAIL", "iommu", "no active IOMMU (/sys/class/iommu is empty)",
                             "enable VT-d/AMD-Vi in firmware, then `ntx-admin setup` "
                             "(adds intel_iommu=on iommu=pt), update-grub, reboot; or use "
                             "no-IOMMU mode explicitly (unsafe)"))
    for dev in sorted(glob.glob(os.path.join(root, "sys/bus/pci/devices/*"))):
        try:
            cls = int((_read(dev, "class") or "0").strip(), 16)
        except ValueError:
            continue
        if cls != NVME_PCI_CLASS:
            continue
        addr = os.path.basename(dev)
        link = os.path.join(dev, "iommu_group")
        if not os.path.islink(link):
            continue
        group = os.path.basename(os.readlink(link))
        peers = [os.path.basename(p) for p in glob.glob(os.path.join(
            root, f"sys/kernel/iommu_groups/{group}/devices/*")) if os.path.basename(p) != addr]
        if peers:
            out.append(CheckLine("WARN", f"iommu group of {addr}",
                                 f"group {group} is shared with {', '.join(sorted(peers))}",
                                 "every device of the group must go to vfio-pci together; move "
                                 "the drive to a slot with its own group or enable ACS"))
        else:
            out.append(CheckLine("OK", f"iommu group of {addr}", f"group {group}, alone"))
    return out


def check_vfio(root: str) -> list[CheckLine]:
    loaded = [m for m in ("vfio", "vfio_iommu_type1", "vfio_pci")
              if os.path.isdir(os.path.join(root, "sys/module", m))]
    missing = [m for m in ("vfio", "vfio_iommu_type1", "vfio_pci") if m not in loaded]
    out = []
    if not missing:
        out.append(CheckLine("OK", "vfio modules", "vfio, vfio_iommu_type1, vfio_pci loaded"))
    else:
        out.append(CheckLine("WARN", "vfio modules", f"not loaded: {', '.join(missing)}",
                             "modprobe vfio-pci (ntx-admin setup loads them at boot)"))
    noiommu = _read(root, "sys/module/vfio/parameters/enable_unsafe_noiommu_mode")
    if noiommu and noiommu.strip() in ("Y", "1"):
        out.append(CheckLine("WARN", "vfio no-IOMMU", "enable_unsafe_noiommu_mode=Y: devices "
                             "can DMA anywhere in memory", "only for machines without IOMMU"))
    return out


def check_memlock() -> CheckLine:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return CheckLine("OK", "memlock", "unlimited")
    if os.geteuid() == 0:
        return CheckLine("OK", "memlock", f"{soft >> 20} MiB, but root has CAP_IPC_LOCK")
    return CheckLine("WARN" if soft < (1 << 30) else "OK", "memlock",
                     f"{soft >> 20} MiB: VFIO pins every DMA buffer against this limit",
                     "LimitMEMLOCK=infinity in the unit, or `ulimit -l unlimited`")


def check_hugepages(root: str) -> CheckLine:
    meminfo = _read(root, "proc/meminfo") or ""
    total = next((int(line.split()[1]) for line in meminfo.splitlines()
                  if line.startswith("HugePages_Total:")), 0)
    if total:
        return CheckLine("OK", "hugepages", f"{total} reserved")
    return CheckLine("OK", "hugepages", "none reserved (not needed with an IOMMU; no-IOMMU mode "
                     "keeps queues to one page)")


def check_gpu(root: str) -> CheckLine:
    nodes = glob.glob(os.path.join(root, "dev/nvidia[0-9]*"))
    if nodes:
        return CheckLine("OK", "gpu", f"{len(nodes)} NVIDIA device node(s)")
    if shutil.which("nvidia-smi") and root == "/":
        return CheckLine("WARN", "gpu", "nvidia-smi present but no /dev/nvidia*",
                         "load the NVIDIA driver (nvidia-smi to see why it failed)")
    return CheckLine("WARN", "gpu", "no NVIDIA GPU visible; the daemon will use the CPU backend",
                     "install the NVIDIA driver if this machine has a GPU")


def check_secure_boot(root: str) -> CheckLine:
    try:
        with open(os.path.join(root, SECURE_BOOT_VAR), "rb") as f:
            data = f.read()
    except OSError:
        return CheckLine("OK", "secure boot", "not readable (no EFI variables): not enforced "
                         "or legacy boot")
    if data and data[-1] == 1:
        return CheckLine("WARN", "secure boot", "enabled: a rebuilt vfio.ko for no-IOMMU mode "
                         "will not load unsigned", "use the IOMMU (type1) path, or sign the module")
    return CheckLine("OK", "secure boot", "disabled")


def run_checks(root: str = "/") -> list[CheckLine]:
    lines = check_iommu(root) + check_vfio(root)
    lines += [check_memlock(), check_hugepages(root), check_gpu(root), check_secure_boot(root)]
    return lines
