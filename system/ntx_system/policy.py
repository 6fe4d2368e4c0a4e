"""The one safety policy: may ntransformer take this NVMe device, and if not, why not.

Taking a device means overwriting a namespace (stage) and detaching the whole controller from
the kernel (bind), so the rule is strict: everything on the controller must be unused, and the
target namespace must be blank or already ours.  Each refusal reason names what was found and
what would fix it, because the person reading it decides whether the device is really spare.

Thread rule: pure functions over `nvme_device.NvmeDevice` records (discovery fills them); call from any thread.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .nvme_device import NvmeDevice

# Signatures that mean "this is ours or blank enough": a previous staging.
REUSABLE_SIGNATURES = {None, "ntx-staged"}


@dataclass
class Verdict:
    allowed: bool
    reasons: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return "allowed" if self.allowed else "refused: " + "; ".join(self.reasons)


def namespace_in_use(d: NvmeDevice) -> bool:
    return bool(d.mounts or d.partitions or d.holders or d.swap or d.backs
                or d.signature not in REUSABLE_SIGNATURES)


def device_verdict(d: NvmeDevice) -> Verdict:
    """Whether `d` may be staged onto and bound to vfio-pci; every reason it may not."""
    reasons: list[str] = []
    if d.backs:
        reasons.append(f"backs {', '.join(d.backs)} of the running system")
    other_mounts = [m for m in d.mounts if m not in d.backs]
    if other_mounts:
        reasons.append(f"mounted at {', '.join(other_mounts)} (unmount it first)")
    if d.swap:
        reasons.append("used as swap (swapoff it and remove it from /etc/fstab)")
    if d.holders:
        kinds = ", ".join(d.holders)
        reasons.append(f"in use by {kinds} (LVM/device-mapper/RAID): remove it from that "
                       f"volume group or array first")
    if d.partitions:
        reasons.append(f"has partitions {', '.join(d.partitions)}: a dedicated device has none "
                       f"(wipefs -a {d.devnode} if its data is really disposable)")
    if d.signature not in REUSABLE_SIGNATURES:
        what = {"LVM2_member": "an LVM physical volume", "swap": "a swap signature",
                "linux_raid_member": "a RAID member", "gpt": "a GPT partition table",
                "dos": "an MBR partition table"}.get(d.signature, f"a {d.signature} filesystem")
        reasons.append(f"contains {what} (wipefs -a {d.devnode} if it is really disposable)")
    if d.sibling_namespaces_in_use:
        reasons.append(f"controller {d.controller} also carries "
                       f"{', '.join(d.sibling_namespaces_in_use)}, which is in use; binding the "
                       f"controller would take it away")
    busy_peers = {a: drv for a, drv in d.group_peers.items()
                  if drv not in (None, "vfio-pci", "pcieport")}
    if busy_peers:
        listed = ", ".join(f"{a} ({drv})" for a, drv in sorted(busy_peers.items()))
        reasons.append(f"IOMMU group {d.iommu_group} also holds {listed}; VFIO needs the whole "
                       f"group (move the drive to another slot or enable ACS)")
    if d.driver not in ("nvme", "vfio-pci", None):
        reasons.append(f"bound to unexpected driver {d.driver}")
    if d.driver == "nvme" and d.namespace is None:
        reasons.append("the kernel shows no namespace on it; nothing to stage onto")
    return Verdict(not reasons, reasons)
