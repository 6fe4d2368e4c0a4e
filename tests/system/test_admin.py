"""ntx-admin commands that are safe on any machine (read-only, or confined to --root)."""
import json
import os

from ntx_system import admin, check


def test_devices_json_runs_read_only(capsys):
    assert admin.main(["devices", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert isinstance(rows, list)
    for r in rows:
        assert "allowed" in r and "reasons" in r


def test_check_prints_status_lines(capsys):
    rc = admin.main(["check"])
    out = capsys.readouterr().out
    assert rc in (0, 1)
    for name in ("iommu", "vfio modules", "memlock", "hugepages", "gpu", "secure boot"):
        assert f" {name}:" in out
    assert all(line.split()[0] in ("OK", "WARN", "FAIL", "fix:")
               for line in out.splitlines() if line.strip())


def test_check_fake_tree_without_iommu(tmp_path):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/cmdline").write_text("quiet\n")
    lines = {c.name: c for c in check.run_checks(str(tmp_path))}
    assert lines["iommu"].status == "FAIL" and "intel_iommu=on" in lines["iommu"].fix
    assert lines["vfio modules"].status == "WARN"


def test_setup_dry_run_and_round_trip_via_cli(tmp_path, capsys):
    (tmp_path / "etc/default").mkdir(parents=True)
    (tmp_path / "etc/default/grub").write_text('GRUB_CMDLINE_LINUX_DEFAULT="quiet"\n')
    assert admin.main(["setup", "--dry-run", "--root", str(tmp_path)]) == 0
    assert "iommu=pt" in capsys.readouterr().out
    assert not (tmp_path / "etc/modprobe.d").exists()
    assert admin.main(["setup", "--root", str(tmp_path)]) == 0
    assert (tmp_path / "etc/modprobe.d/ntransformer.conf").exists()
    assert admin.main(["restore", "--root", str(tmp_path)]) == 0
    assert sorted(os.listdir(tmp_path)) == ["etc"]
    assert (tmp_path / "etc/default/grub").read_text() == 'GRUB_CMDLINE_LINUX_DEFAULT="quiet"\n'


def test_stage_refuses_unknown_device(tmp_path, capsys):
    assert admin.main(["stage", str(tmp_path / "m.gguf"), "--device", "/dev/nvme99n1",
                       "--yes-i-mean-X"]) == 2
    assert "not an NVMe namespace" in capsys.readouterr().err
