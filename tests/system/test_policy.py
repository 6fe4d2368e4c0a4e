"""The safety policy as a table of fake device records (never the host's devices)."""
import pytest

from ntx_system.discovery import NvmeDevice, signature_of
from ntx_system.policy import device_verdict


def dev(**kw):
    base = dict(controller="nvme1", pci_address="0000:03:00.0", driver="nvme", iommu_group=14,
                serial="S1", model="Spare", namespace="nvme1n1", devnode="/dev/nvme1n1",
                size_bytes=1 << 40, lba_size=512)
    base.update(kw)
    return NvmeDevice(**base)


CASES = [
    ("blank dedicated device", dev(), None),
    ("previously staged", dev(signature="ntx-staged"), None),
    ("bound to vfio-pci already", dev(controller=None, namespace=None, devnode=None,
                                      driver="vfio-pci"), None),
    ("root device", dev(mounts=["/"], backs=["/"], partitions=["nvme1n1p2"]), "backs /"),
    ("boot device", dev(mounts=["/boot"], backs=["/boot"]), "backs /boot"),
    ("mounted", dev(mounts=["/data"]), "mounted at /data"),
    ("partitioned", dev(partitions=["nvme1n1p1"]), "has partitions nvme1n1p1"),
    ("LVM member", dev(holders=["dm-0"], signature="LVM2_member"), "in use by dm-0"),
    ("LVM signature only", dev(signature="LVM2_member"), "LVM physical volume"),
    ("swap", dev(swap=True, signature="swap"), "used as swap"),
    ("filesystem", dev(signature="ext4"), "ext4 filesystem"),
    ("sibling namespace", dev(sibling_namespaces_in_use=["nvme1n2"]), "also carries nvme1n2"),
    ("shared IOMMU group", dev(group_peers={"0000:03:00.1": "e1000e"}), "IOMMU group 14"),
]


@pytest.mark.parametrize("name,record,reason", CASES, ids=[c[0] for c in CASES])
def test_policy_table(name, record, reason):
    verdict = device_verdict(record)
    if reason is None:
        assert verdict.allowed, verdict
    else:
        assert not verdict.allowed
        assert any(reason in r for r in verdict.reasons), verdict.reasons
        assert str(verdict).startswith("refused: ")


def test_every_reason_is_listed():
    v = device_verdict(dev(mounts=["/", "/home"], backs=["/"], swap=True,
                           partitions=["nvme1n1p1"]))
    assert len(v.reasons) == 4


@pytest.mark.parametrize("offset,data,expected", [
    (0, b"NTXSTAGE", "ntx-staged"),
    (512, b"EFI PART", "gpt"),
    (512, b"LABELONE", "LVM2_member"),
    (1080, b"\x53\xef", "ext4"),
    (4086, b"SWAPSPACE2", "swap"),
])
def test_signature_sniffing(offset, data, expected):
    head = bytearray(65536)
    head[offset:offset + len(data)] = data
    assert signature_of(bytes(head)) == expected
    assert signature_of(bytes(65536)) is None
