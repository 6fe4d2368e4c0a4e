"""setup/restore under --root: byte-identical round trip, idempotence, dry run, GRUB editing."""
import hashlib
import os

import pytest

from ntx_system import hostsetup

GRUB = b'''# If you change this file, run 'update-grub' afterwards
GRUB_DEFAULT=0
GRUB_TIMEOUT=5
GRUB_CMDLINE_LINUX_DEFAULT="quiet"
GRUB_CMDLINE_LINUX=""
'''
INTEL = "vendor_id\t: GenuineIntel\n"


def snapshot(root):
    """Every path under root with its type, mode and content hash."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            p = os.path.join(dirpath, d)
            out[os.path.relpath(p, root)] = ("dir", os.stat(p).st_mode)
        for f in filenames:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = ("file", os.stat(p).st_mode,
                                             hashlib.sha256(open(p, "rb").read()).hexdigest())
    return out


@pytest.fixture
def root(tmp_path):
    (tmp_path / "etc/default").mkdir(parents=True)
    (tmp_path / "etc/modprobe.d").mkdir()
    (tmp_path / "etc/default/grub").write_bytes(GRUB)
    os.chmod(tmp_path / "etc/default/grub", 0o640)
    (tmp_path / "etc/modprobe.d/other.conf").write_text("options foo bar=1\n")
    return str(tmp_path)


def test_round_trip_is_byte_identical(root):
    before = snapshot(root)
    changes = hostsetup.setup(root, cpuinfo=INTEL, log=lambda *_: None)
    assert {c.path for c in changes} == {hostsetup.GRUB_PATH, hostsetup.MODPROBE_PATH,
                                         hostsetup.MODULES_LOAD_PATH}
    grub = open(os.path.join(root, hostsetup.GRUB_PATH)).read()
    assert 'GRUB_CMDLINE_LINUX_DEFAULT="quiet intel_iommu=on iommu=pt"' in grub
    assert os.stat(os.path.join(root, hostsetup.GRUB_PATH)).st_mode & 0o777 == 0o640
    assert snapshot(root) != before
    assert hostsetup.restore(root, log=lambda *_: None) == 3
    assert snapshot(root) == before


def test_setup_is_idempotent_and_keeps_first_backup(root):
    hostsetup.setup(root, cpuinfo=INTEL, log=lambda *_: None)
    after_first = snapshot(root)
    assert hostsetup.setup(root, cpuinfo=INTEL, log=lambda *_: None) == []
    assert snapshot(root) == after_first


def test_dry_run_prints_diff_and_changes_nothing(root):
    before = snapshot(root)
    lines = []
    changes = hostsetup.setup(root, dry_run=True, cpuinfo=INTEL, log=lines.append)
    assert len(changes) == 3 and snapshot(root) == before
    text = "\n".join(lines)
    assert "+GRUB_CMDLINE_LINUX_DEFAULT=\"quiet intel_iommu=on iommu=pt\"" in text
    assert "+vfio-pci" in text


def test_restore_without_setup_is_a_no_op(root):
    before = snapshot(root)
    assert hostsetup.restore(root, log=lambda *_: None) == 0
    assert snapshot(root) == before


@pytest.mark.parametrize("line,cpu,expected", [
    ('GRUB_CMDLINE_LINUX_DEFAULT="quiet"', INTEL, '"quiet intel_iommu=on iommu=pt"'),
    ("GRUB_CMDLINE_LINUX_DEFAULT='quiet splash'", "AuthenticAMD",
     "'quiet splash amd_iommu=on iommu=pt'"),
    ('GRUB_CMDLINE_LINUX_DEFAULT="intel_iommu=off"', INTEL, '"intel_iommu=on iommu=pt"'),
    ('GRUB_CMDLINE_LINUX_DEFAULT=""', INTEL, '"intel_iommu=on iommu=pt"'),
])
def test_grub_edit(line, cpu, expected):
    out = hostsetup.edit_grub(line + "\n", hostsetup.iommu_kernel_args(cpu))
    assert out == f"GRUB_CMDLINE_LINUX_DEFAULT={expected}\n"


def test_packaging_files_match_what_setup_installs():
    here = os.path.dirname(__file__)
    pk = os.path.join(here, "..", "..", "packaging")
    assert open(os.path.join(pk, "modprobe.d/ntransformer.conf")).read() == \
        hostsetup.MODPROBE_TEXT
    assert open(os.path.join(pk, "modules-load.d/ntransformer.conf")).read() == \
        hostsetup.MODULES_LOAD_TEXT
