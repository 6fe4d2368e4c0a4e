"""Every command block of README.md runs: shell blocks in bash (placeholders such as MODEL.gguf
stand for small real files), the Python client against a daemon, the TLS config through the
daemon's config loader. A block that needs a GPU skips without one; one that needs what CI
cannot give (a host to install the service on, several hosts) skips and says which test covers
it. A new block the table below does not know fails: say how it runs. (It lives in tests/server
for the daemon the server tests share.)"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
VENV_BIN = ROOT / ".venv" / "bin"


@dataclasses.dataclass
class Block:
    line: int  # 1-based line of its first line in README.md
    lang: str  # "" for an indented block
    text: str

    @property
    def id(self) -> str:
        return f"L{self.line}:{self.text.strip().splitlines()[0][:40]}"


def readme_blocks() -> list[Block]:
    blocks, lines = [], README.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            j = i + 1
            while not lines[j].startswith("```"):
                j += 1
            blocks.append(Block(i + 2, line[3:].strip(), "\n".join(lines[i + 1:j]) + "\n"))
            i = j + 1
            continue
        if line.startswith("    ") and (i == 0 or not lines[i - 1].strip()):
            j = i
            while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                j += 1
            body = [ln[4:] for ln in lines[i:j]]
            while body and not body[-1].strip():
                body.pop()
            blocks.append(Block(i + 1, "", "\n".join(body) + "\n"))
            i = j
            continue
        i += 1
    return blocks


def _gpu() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device: all mean no GPU here
        return False


# How each block runs, by a line it contains: (text, how, why for a skip)
HOW = [
    ('packaging/dev/try "', "shell", ""),
    ("tests/run", "skip", "the test command itself (CI runs it through .ci/run)"),
    ("from ntx_client import Client", "python-client", ""),
    ("ntx-client --socket ./ntx.sock generate --wait", "shell-daemon", ""),
    ("ntx-model run --prompt \"What is gravity?\" --chat", "shell", ""),
    ("ntx-openai --socket ./ntx.sock", "skip", "a long-running server: tests/client/openai_gateway runs it"),
    ("from openai import OpenAI", "skip", "needs a running ntx-openai: tests/client/openai_gateway drives "
     "it with the openai package"),
    ("openssl req -x509", "shell", ""),
    ('tcp_listen = "0.0.0.0:7443"', "toml-config", ""),
    ("ntx-openai --target gpu1:7443", "skip", "needs N hosts: tests/server/test_tcp.py puts three TLS daemons "
     "behind one gateway"),
    ("--backend cuda --vram-budget 24GiB", "gpu", ""),
    ("packaging/install.sh --bindir", "skip", "installs a system service on the host: "
     "tests/packaging/test_systemd_vm.py installs and starts it in a guest"),
    ("sudo ntx-admin devices", "skip", "stages onto a real NVMe drive: tests/packaging/test_systemd_vm.py"
     "::test_service_on_its_nvme_drive_in_a_vm stages one in a guest"),
    ('storage = "nvme:', "nvme-config", ""),
    ("sudo systemctl restart ntransformerd", "skip", "restarts the host's service on its drive: "
     "tests/packaging/test_systemd_vm.py::test_service_on_its_nvme_drive_in_a_vm does it in a guest"),
]


def how(block: Block) -> tuple[str, str]:
    for text, kind, why in HOW:
        if text in block.text:
            return kind, why
    raise AssertionError(f"README.md line {block.line}: a command block tests/server/test_readme.py does not "
                         f"know; add it to HOW:\n{block.text}")


BLOCKS = readme_blocks()


def test_every_block_is_known():
    assert len(BLOCKS) >= 10
    kinds = [how(b)[0] for b in BLOCKS]
    assert kinds.count("skip") <= 7  # each names the test that covers it


@pytest.fixture
def placeholders(tmp_path, synth_model):
    """Small real files for the README's placeholder names, in the block's working directory."""
    os.symlink(synth_model("tiny", "q8_0"), tmp_path / "MODEL.gguf")
    os.symlink(synth_model("tiny", "f16"), tmp_path / "F16.gguf")
    return tmp_path


def _shell(text: str, cwd, *, stdin: str = "", timeout: float = 300) -> subprocess.CompletedProcess:
    script = text.replace(".venv/bin/", f"{VENV_BIN}/").replace("packaging/dev/", f"{ROOT}/packaging/dev/")
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}"}
    return subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, input=stdin, capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_readme_block(block, request, tmp_path):
    kind, why = how(block)
    if kind == "skip":
        pytest.skip(why)
    if kind == "gpu" and not _gpu():
        pytest.skip("needs a CUDA GPU")
    if kind in ("shell", "shell-daemon", "gpu") and not (VENV_BIN / "python").exists():
        pytest.skip("the README's commands use ./.venv (packaging/dev/bootstrap makes it)")
    if kind == "shell" and "openssl" in block.text and shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    if kind in ("shell", "gpu"):
        cwd = request.getfixturevalue("placeholders")
        r = _shell(block.text, cwd)
        assert r.returncode == 0, f"README.md line {block.line}:\n{block.text}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
        if "ntx-model" in block.text:
            assert "wrote OUT.gguf (" in r.stdout and "wrote tiny.gguf (" in r.stdout and (cwd / "OUT.gguf").exists()
            assert "Traceback" not in r.stderr
        if "packaging/dev/try" in block.text:
            assert r.stdout.strip() and "serving" in r.stdout
    elif kind == "shell-daemon":
        daemon = request.getfixturevalue("daemon")
        os.symlink(daemon.socket, tmp_path / "ntx.sock")
        r = _shell(block.text, tmp_path, stdin="What is 2+2?\n/exit\n")
        assert r.returncode == 0, f"README.md line {block.line}:\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
        assert "serving" in r.stdout and len(r.stdout.strip().splitlines()) >= 4
    elif kind == "python-client":
        daemon = request.getfixturevalue("daemon")
        code = block.text.replace('"/run/ntransformer/ntransformerd.sock"', repr(daemon.socket))
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert "[19556, 216, 2]" in r.stdout  # what its comment says
    elif kind == "toml-config":
        _check_tls_config(block.text, tmp_path)
    elif kind == "nvme-config":
        _check_nvme_config(block.text, tmp_path)
    else:
        raise AssertionError(kind)


def _check_nvme_config(text: str, tmp_path) -> None:
    """The NVMe block loads as the daemon's config (its model path made to exist)."""
    from ntransformerd import config

    model = tmp_path / "big.gguf"
    model.write_bytes(b"GGUF")
    f = tmp_path / "n.toml"
    f.write_text(text.replace("/srv/models/big.gguf", str(model)))
    cfg = config.load(["--config", str(f)])
    assert cfg.storage.startswith("nvme:") and cfg.model == str(model)


def _check_tls_config(text: str, tmp_path) -> None:
    """The TOML lines load as the daemon's config once the files they name exist."""
    from ntransformerd import config

    for name in re.findall(r'"(/etc/ntransformer/tls/[^"]+)"', text):
        (tmp_path / os.path.basename(name)).write_text("-----BEGIN CERTIFICATE-----\n")
    f = tmp_path / "d.toml"
    f.write_text(text.replace("/etc/ntransformer/tls/", f"{tmp_path}/") + f'socket = "{tmp_path}/d.sock"\n')
    cfg = config.load(["--config", str(f)])
    assert cfg.tcp_listen == "0.0.0.0:7443" and cfg.tls_cert == f"{tmp_path}/server.pem"
