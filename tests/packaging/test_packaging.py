"""packaging/: the unit passes systemd-analyze verify, install.sh stages the files, the example
config is what the daemon reads."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG = ROOT / "packaging"
BINDIR = os.path.dirname(sys.executable)  # the venv's bin, which has ntransformerd


@pytest.fixture
def staged(tmp_path):
    if not os.access(os.path.join(BINDIR, "ntransformerd"), os.X_OK):
        pytest.skip(f"ntransformerd is not installed in {BINDIR}")
    r = subprocess.run([str(PKG / "install.sh"), "--destdir", str(tmp_path), "--bindir", BINDIR],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return tmp_path


def test_install_sh_stages_unit_sysusers_tmpfiles_config(staged):
    unit = (staged / "etc/systemd/system/ntransformerd.service").read_text()
    assert f"ExecStart={BINDIR}/ntransformerd --config /etc/ntransformer/ntransformerd.toml" in unit
    assert "@BINDIR@" not in unit
    assert (staged / "etc/sysusers.d/ntransformer.conf").read_text().splitlines()[-1].split()[:2] == ["g", "ntransformer"]
    assert "/run/ntransformer" in (staged / "etc/tmpfiles.d/ntransformer.conf").read_text()
    assert (staged / "etc/ntransformer/ntransformerd.toml").exists()


def test_unit_is_hardened_as_the_issue_asks():
    unit = (PKG / "systemd/ntransformerd.service").read_text()
    keys = dict(re.findall(r"^(\w+)=(.*)$", unit, re.M))
    # a refusal exits 2 and must not loop; crashes, kills and watchdog timeouts restart
    assert keys["Type"] == "notify" and keys["Restart"] == "on-abnormal"
    assert keys["NotifyAccess"] == "exec"
    assert keys["ExecStartPre"].startswith("+@BINDIR@/ntx-admin bind --service")
    assert keys["ExecStopPost"] == "+@BINDIR@/ntx-admin unbind --service"
    assert keys["CapabilityBoundingSet"] == "CAP_CHOWN" and keys["ProtectKernelTunables"] == "yes"
    assert keys["LimitMEMLOCK"] == "infinity" and keys["RuntimeDirectory"] == "ntransformer"
    assert int(keys["WatchdogSec"]) > 0
    assert keys["ProtectSystem"] == "strict" and keys["ProtectHome"] == "read-only"
    assert keys["DevicePolicy"] == "closed" and keys["NoNewPrivileges"] == "yes"
    allowed = re.findall(r"^DeviceAllow=(\S+)", unit, re.M)
    assert all("nvidia" in d or "vfio" in d for d in allowed), allowed


def test_systemd_analyze_verify_is_clean(staged):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is missing (Debian package: systemd)")
    unit = staged / "etc/systemd/system/ntransformerd.service"
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60)
    mine = [line for line in (r.stdout + r.stderr).splitlines() if "ntransformerd" in line]
    assert r.returncode == 0 and not mine, r.stdout + r.stderr  # warnings count: a strict lint


def test_gateway_unit_is_staged_unprivileged_and_verifies(staged):
    if not os.access(os.path.join(BINDIR, "ntx-openai"), os.X_OK):
        pytest.skip(f"ntx-openai is not installed in {BINDIR}")
    path = staged / "etc/systemd/system/ntx-openai.service"
    unit = path.read_text()
    keys = dict(re.findall(r"^(\w+)=(.*)$", unit, re.M))
    assert keys["ExecStart"].startswith(f"{BINDIR}/ntx-openai --socket /run/ntransformer/ntransformerd.sock")
    assert keys["DynamicUser"] == "yes" and keys["SupplementaryGroups"] == "ntransformer"
    assert keys["CapabilityBoundingSet"] == "" and keys["NoNewPrivileges"] == "yes" and "User" not in keys
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is missing (Debian package: systemd)")
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(path)], capture_output=True, text=True, timeout=60)
    mine = [line for line in (r.stdout + r.stderr).splitlines() if "ntx-openai" in line]
    assert r.returncode == 0 and not mine, r.stdout + r.stderr


def test_tcp_dropin_only_when_the_config_serves_tcp(staged):
    dropin = staged / "etc/systemd/system/ntransformerd.service.d/tcp.conf"
    assert not dropin.exists()  # the example config: unix sockets only, PrivateNetwork=yes stays
    config = staged / "etc/ntransformer/ntransformerd.toml"
    config.write_text(config.read_text() + '\ntcp_listen = "0.0.0.0:7443"\n')
    install = [str(PKG / "install.sh"), "--destdir", str(staged), "--bindir", BINDIR]
    r = subprocess.run(install, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    keys = dict(re.findall(r"^(\w+)=(.*)$", dropin.read_text(), re.M))
    assert keys["PrivateNetwork"] == "no" and "AF_INET" in keys["RestrictAddressFamilies"].split()
    if shutil.which("systemd-analyze"):
        unit = staged / "etc/systemd/system/ntransformerd.service"
        r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
    config.write_text(config.read_text().replace('tcp_listen = "0.0.0.0:7443"', ""))
    r = subprocess.run(install, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not dropin.exists(), r.stderr


def test_example_config_lists_every_key_and_parses(tmp_path):
    from ntransformerd import config
    text = (PKG / "ntransformerd.toml").read_text()
    assert config.load(["--config", str(PKG / "ntransformerd.toml")]) == config.load(["--config", os.devnull])
    keys = re.findall(r"^# (\w+) = ", text, re.M)
    assert set(keys) == set(config.FIELDS)
    uncommented = tmp_path / "all.toml"
    uncommented.write_text(re.sub(r"^# (\w+ = )", r"\1", text, flags=re.M))
    cfg = config.load(["--config", str(uncommented)])
    assert cfg == config.load(["--config", os.devnull])  # the file shows the defaults


def test_install_sh_refuses_a_missing_daemon(tmp_path):
    r = subprocess.run([str(PKG / "install.sh"), "--destdir", str(tmp_path), "--bindir", str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "--bindir" in r.stderr


def test_security_exposure_with_the_nvme_path_is_at_most_3(staged):
    """`systemd-analyze security --offline=true` of the installed unit with storage = "nvme:…"
    configured: at most 3.0, and every exposure it still lists is justified in the unit."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is missing (Debian package: systemd)")
    (staged / "etc/ntransformer/ntransformerd.toml").write_text('storage = "nvme:ntxdata"\n')
    unit = staged / "etc/systemd/system/ntransformerd.service"
    r = subprocess.run(["systemd-analyze", "security", "--offline=true", "--no-pager", str(unit)],
                       capture_output=True, text=True, timeout=60)
    m = re.search(r"Overall exposure level for ntransformerd.service: ([\d.]+)", r.stdout)
    assert m, r.stdout + r.stderr
    assert float(m.group(1)) <= 3.0, r.stdout
    left = re.findall(r"^✗ (\S+?)=", r.stdout, re.M)
    text = unit.read_text()
    justified = text.split("# Exposure left", 1)[1].split("DevicePolicy=", 1)[0]
    # each remaining exposure's setting is named in the unit's comment block
    names = {"SystemCallFilter": "@resources", "CapabilityBoundingSet": "CAP_CHOWN",
             "RestrictAddressFamilies": "AF_UNIX", "User": "root"}
    assert left, r.stdout
    for key in left:
        assert names.get(key, key) in justified, f"{key} is not justified in the unit's comment"
