"""Move a PCI function between the kernel's `nvme` driver and `vfio-pci`.

The kernel's own mechanism, nothing else: write the driver name to `driver_override`, unbind
from the current driver, ask `drivers_probe` to probe again; for the way back clear the override
and probe, so `nvme` takes it.  `sysfs` is a parameter so tests run against a fake tree.

`unbind` refuses while a live process holds the device's VFIO group open (vfio-pci would block
the unbind until it exits); a process killed mid-read releases the group when it dies, and the
kernel resets the function on release, so unbinding after SIGKILL is safe.

Thread rule: one bind/unbind at a time per device; the caller serialises (ntx-admin is one shot).
"""
from __future__ import annotations

import glob
import os
import subprocess
import time


class BindError(RuntimeError):
    pass


def _dev(sysfs: str, addr: str) -> str:
    path = os.path.join(sysfs, "bus/pci/devices", addr)
    if not os.path.isdir(path):
        raise BindError(f"no PCI device {addr} (see `ntx-admin devices`)")
    return path


def current_driver(addr: str, sysfs: str = "/sys") -> str | None:
    link = os.path.join(_dev(sysfs, addr), "driver")
    return os.path.basename(os.readlink(link)) if os.path.islink(link) else None


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _wait_driver(addr: str, want: str | None, sysfs: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while current_driver(addr, sysfs) != want:
        if time.monotonic() > deadline:
            raise BindError(f"{addr} is bound to {current_driver(addr, sysfs)} after "
                            f"{timeout_s:.0f} s, expected {want}; see the kernel log (dmesg)")
        time.sleep(0.05)


def vfio_group_holders(group: int | None, proc: str = "/proc") -> list[int]:
    """PIDs that have /dev/vfio/<group> (or noiommu-<group>) open."""
    if group is None:
        return []
    targets = {f"/dev/vfio/{group}", f"/dev/vfio/noiommu-{group}"}
    pids = []
    for fd_dir in glob.glob(os.path.join(proc, "[0-9]*", "fd")):
        try:
            for fd in os.listdir(fd_dir):
                if os.readlink(os.path.join(fd_dir, fd)) in targets:
                    pids.append(int(fd_dir.split(os.sep)[-2]))
                    break
        except OSError:
            continue
    return sorted(set(pids))


def bind_vfio(addr: str, *, sysfs: str = "/sys", modprobe: bool = True,
              timeout_s: float = 10.0) -> str | None:
    """Give `addr` to vfio-pci.  Returns the driver it had before."""
    dev = _dev(sysfs, addr)
    before = current_driver(addr, sysfs)
    if before == "vfio-pci":
        return before
    if modprobe and sysfs == "/sys":
        r = subprocess.run(["modprobe", "-a", "vfio-pci", "vfio_iommu_type1"],
                           capture_output=True, text=True)
        if r.returncode:
            raise BindError(f"modprobe vfio-pci failed: {r.stderr.strip()} "
                            f"(ntx-admin setup loads it at boot)")
    _write(os.path.join(dev, "driver_override"), "vfio-pci")
    if before is not None:
        _write(os.path.join(dev, "driver", "unbind"), addr)
    _write(os.path.join(sysfs, "bus/pci/drivers_probe"), addr)
    _wait_driver(addr, "vfio-pci", sysfs, timeout_s)
    return before


def unbind_vfio(addr: str, *, sysfs: str = "/sys", proc: str = "/proc", to: str = "nvme",
                timeout_s: float = 15.0) -> None:
    """Hand `addr` back to `to` (nvme): clear the override, unbind from vfio-pci, probe."""
    dev = _dev(sysfs, addr)
    group_link = os.path.join(dev, "iommu_group")
    group = int(os.path.basename(os.readlink(group_link))) if os.path.islink(group_link) \
        else None
    holders = [p for p in vfio_group_holders(group, proc) if p != os.getpid()]
    if holders:
        raise BindError(f"{addr} is still in use by PID {', '.join(map(str, holders))} "
                        f"(ntransformerd?): stop it first (systemctl stop ntransformerd)")
    _write(os.path.join(dev, "driver_override"), "\n")
    if current_driver(addr, sysfs) is not None:
        _write(os.path.join(dev, "driver", "unbind"), addr)
    _write(os.path.join(sysfs, "bus/pci/drivers_probe"), addr)
    _wait_driver(addr, to, sysfs, timeout_s)
