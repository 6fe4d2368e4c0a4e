"""The record of one NVMe namespace (or of a controller with none visible): facts only.

`discovery` fills these records and `policy` judges them; both import this module and neither
imports the other's records, so the facts and the rule about them stay apart.

Thread rule: plain data; a record is filled by one thread (discovery) and then only read.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class NvmeDevice:
    controller: str | None          # nvme0; None when the controller is not bound to `nvme`
    pci_address: str
    driver: str | None              # nvme, vfio-pci, or None
    iommu_group: int | None
    group_peers: dict[str, str | None] = field(default_factory=dict)   # other PCI devs: driver
    serial: str | None = None
    model: str | None = None
    firmware: str | None = None
    namespace: str | None = None    # nvme0n1
    devnode: str | None = None      # /dev/nvme0n1
    size_bytes: int | None = None
    lba_size: int | None = None
    partitions: list[str] = field(default_factory=list)
    mounts: list[str] = field(default_factory=list)        # mount points on it or its parts
    holders: list[str] = field(default_factory=list)       # dm-0, md127, ...
    swap: bool = False
    signature: str | None = None    # ext4, LVM2_member, gpt, ntx-staged, ...
    backs: list[str] = field(default_factory=list)         # which SYSTEM_MOUNTS it backs
    sibling_namespaces_in_use: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)
