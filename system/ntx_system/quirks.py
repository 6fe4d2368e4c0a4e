"""Per-controller deviations from the specification, looked up by PCI vendor/device id.

Kept as one small table, like SPDK's nvme_quirks.c, so the bring-up code stays the spec's and
every workaround has a name and a reason next to it.

Thread rule: read-only data; safe from any thread.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Quirks:
    # Some controllers report CSTS.RDY=1 before they accept admin commands.
    delay_after_enable_s: float = 0.0
    # Cap the transfer size below MDTS where large transfers are known to be slow or broken.
    max_transfer_bytes: int | None = None
    # Name for logs.
    name: str = "none"


NO_QUIRKS = Quirks()

_TABLE: dict[tuple[int, int], Quirks] = {
    # QEMU's emulated controller ("QEMU NVMe Ctrl"): follows the spec; listed so logs say so.
    (0x1B36, 0x0010): Quirks(name="qemu-nvme (none needed)"),
    # Intel DC P3x00 family: SPDK documents a short delay needed after CC.EN=1.
    (0x8086, 0x0953): Quirks(delay_after_enable_s=0.0025, name="intel-p3x00 delay after enable"),
}


def quirks_lookup(vendor_id: int | None, device_id: int | None) -> Quirks:
    if vendor_id is None or device_id is None:
        return NO_QUIRKS
    return _TABLE.get((vendor_id, device_id), NO_QUIRKS)
