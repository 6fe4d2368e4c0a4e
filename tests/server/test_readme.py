"""Every command block and Python example of README.md runs as written, as a user who is not
root (where the tests run as root: as nobody, through setpriv): the line that starts a daemon on
./ntx.sock (no warning; its admin socket in $XDG_RUNTIME_DIR, none in the working directory), the
commands against it, the gateway's command line, the Python client and the OpenAI example
against them (the gateway on a free port instead of 8000); shell blocks in bash (placeholders
such as MODEL.gguf stand for small real files), the TLS config through the daemon's config
loader. The imports of the Python examples come with `packaging/dev/bootstrap openai`. A block
that needs a GPU skips without one; one that needs what CI cannot give (a host to install the
service on, several hosts) skips and says which test covers it. A new block the table below does
not know fails: say how it runs. As root, the same daemon line warns that the socket's group is
missing (where it is)."""

from __future__ import annotations

import ast
import dataclasses
import grp
import importlib.metadata
import os
import pathlib
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.request

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from ntx_client import Client
from ntx_proto import paths

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
VENV_BIN = ROOT / ".venv" / "bin"
NOBODY = 65534


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
    ("inference_pb2_grpc.InferenceStub(channel)", "python-stub", ""),
    (".venv/bin/ntransformerd --socket ./ntx.sock", "readme-daemon", ""),
    ("ntx-client --socket ./ntx.sock generate --wait", "shell-daemon", ""),
    ("ntx-model run --prompt \"What is gravity?\" --chat", "shell", ""),
    ("ntx-openai --socket ./ntx.sock", "gateway", ""),
    ("from openai import OpenAI", "python-openai", ""),
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


def block_of(kind: str) -> Block:
    (block,) = [b for b in BLOCKS if how(b)[0] == kind]
    return block


def test_every_block_is_known():
    assert len(BLOCKS) >= 10
    kinds = [how(b)[0] for b in BLOCKS]
    assert kinds.count("skip") <= 5  # each names the test that covers it
    assert all(kinds.count(k) == 1 for k in ("readme-daemon", "gateway", "python-client", "python-stub",
                                             "python-openai"))


def _imports(code: str) -> set[str]:
    """The top-level modules `code` imports."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_the_python_examples_need_only_what_bootstrap_openai_installs():
    """What `packaging/dev/bootstrap openai` installs (the project's requirements and its openai
    extra) provides every module the README's Python examples import."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    given = {canonicalize_name(Requirement(r).name) for r in
             project["dependencies"] + project["optional-dependencies"]["openai"]}
    given.add(canonicalize_name(project["name"]))
    owners = importlib.metadata.packages_distributions()
    python = [b for b in BLOCKS if b.lang == "python"]
    assert len(python) >= 2
    for b in python:
        for module in _imports(b.text):
            if module in sys.stdlib_module_names:
                continue
            dists = {canonicalize_name(d) for d in owners.get(module, [])}
            if module in ("ntx_client", "ntransformerd", "ntx_system", "ntx_proto"):  # this checkout (editable)
                dists.add(canonicalize_name(project["name"]))
            assert dists & given, (f"README.md line {b.line} imports {module} (from {sorted(dists) or '?'}), which "
                                   "packaging/dev/bootstrap openai does not install")


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


# ---- a user who is not root, and the README's daemon and gateway as that user -------------------

def _private_dir(prefix: str, uid: int, mode: int) -> pathlib.Path:
    """A new directory owned by `uid`, outside pytest's root-only temporary directories."""
    d = pathlib.Path(tempfile.mkdtemp(prefix=prefix))
    os.chown(d, uid, -1)
    os.chmod(d, mode)
    return d


@dataclasses.dataclass
class User:
    """A user who is not root: `prefix` runs a command as it (setpriv where the tests run as root),
    in `work` (its project directory), with its own HOME and runtime directory."""

    uid: int
    prefix: list[str]
    work: pathlib.Path
    home: pathlib.Path
    runtime: pathlib.Path

    @property
    def env(self) -> dict:
        keep = {k: v for k, v in os.environ.items() if k in ("LANG", "LC_ALL", "TERM")}
        return {**keep, "PATH": f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin", "HOME": str(self.home),
                "XDG_RUNTIME_DIR": str(self.runtime), "XDG_CACHE_HOME": str(self.home / ".cache")}

    def popen(self, argv: list[str], log) -> subprocess.Popen:
        return subprocess.Popen([*self.prefix, *argv], cwd=self.work, env=self.env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def run(self, argv: list[str], *, stdin: str = "", timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([*self.prefix, *argv], cwd=self.work, env=self.env, input=stdin,
                              capture_output=True, text=True, timeout=timeout)

    def shell(self, text: str, **kw) -> subprocess.CompletedProcess:
        return self.run(["bash", "-euo", "pipefail", "-c", text.replace(".venv/bin/", f"{VENV_BIN}/")], **kw)


@pytest.fixture(scope="module")
def user():
    if not (VENV_BIN / "python").exists():
        pytest.skip("the README's commands use ./.venv (packaging/dev/bootstrap makes it)")
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("needs setpriv (util-linux) to run the README as a user who is not root")
        uid, prefix = NOBODY, ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"]
    else:
        uid, prefix = os.geteuid(), []
    dirs = [_private_dir("ntx-readme-work-", uid, 0o755), _private_dir("ntx-readme-home-", uid, 0o700),
            _private_dir("ntx-readme-run-", uid, 0o700)]
    u = User(uid, prefix, *dirs)
    try:
        # the programs start others (the daemon its relay, bash the scripts), whose interpreter
        # this checkout's .venv may reach only through a directory nobody cannot search (a root
        # pyenv in a 0700 home): then nobody keeps the one right to read and search directories
        if prefix and u.shell(".venv/bin/python -c 'import ntx_client'", timeout=120).returncode != 0:
            u.prefix = [*prefix[:-1], "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search", "--"]
        probe = u.shell(".venv/bin/python -c 'import ntx_client'", timeout=120)
        if probe.returncode != 0:
            pytest.skip(f"uid {uid} cannot run this checkout's .venv: {probe.stderr.strip()[-300:]}")
        yield u
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def _wait(cond, what: str, proc: subprocess.Popen, log: pathlib.Path, timeout: float = 300) -> None:
    end = time.monotonic() + timeout  # a hang guard
    while not cond():
        assert proc.poll() is None, f"{what}: exited {proc.returncode}:\n{log.read_text()}"
        assert time.monotonic() < end, f"{what}: not after {timeout} s:\n{log.read_text()}"
        time.sleep(0.1)


@dataclasses.dataclass
class Started:
    proc: subprocess.Popen
    log: pathlib.Path
    socket: str = ""
    port: int = 0


@pytest.fixture(scope="module")
def readme_daemon(user):
    """The README's daemon line, run as `user` in its project directory; Ctrl-C (SIGINT) stops it,
    and it leaves nothing behind and has said no warning."""
    log = user.home / "ntransformerd.log"
    with open(log, "w") as f:
        proc = user.popen(["bash", "-c", "exec " + block_of("readme-daemon").text.strip().replace(
            ".venv/bin/", f"{VENV_BIN}/")], f)
    d = Started(proc, log, socket=str(user.work / "ntx.sock"))
    try:
        _wait(lambda: os.path.exists(d.socket), "ntransformerd", proc, log)
        with Client(d.socket) as c:
            c.wait_ready(300)
        yield d
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    text = log.read_text()
    assert rc == 0, text
    assert "WARNING" not in text and "Traceback" not in text, text
    assert sorted(os.listdir(user.work)) == [], sorted(os.listdir(user.work))  # its sockets went with it
    assert os.listdir(user.runtime / "ntransformer") == []  # and its admin socket


@pytest.fixture(scope="module")
def readme_gateway(user, readme_daemon):
    """The README's ntx-openai line (its optional flags left out), on a free port instead of 8000."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    line = re.sub(r"\s*\[[^]]*\]", "", block_of("gateway").text.strip())
    log = user.home / "ntx-openai.log"
    with open(log, "w") as f:
        proc = user.popen(["bash", "-c", f"exec {line.replace('.venv/bin/', f'{VENV_BIN}/')} --port {port}"], f)
    g = Started(proc, log, port=port)

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
                return r.status == 200
        except OSError:
            return False
    try:
        _wait(healthy, "ntx-openai", proc, log)
        yield g
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _check_readme_daemon(user: User, d: Started) -> None:
    """Run as a user, the daemon line says no warning and keeps its admin socket in the user's
    runtime directory; in the project directory there is the socket the README names and nothing
    else of it that a listing shows."""
    text = d.log.read_text()
    assert "WARNING" not in text, text
    assert [n for n in os.listdir(user.work) if not n.startswith(".")] == ["ntx.sock"], os.listdir(user.work)
    admin = paths.default_admin_socket(d.socket, euid=user.uid, environ={"XDG_RUNTIME_DIR": str(user.runtime)})
    assert os.path.dirname(admin) == str(user.runtime / "ntransformer") and f"(admin socket {admin})" in text, text
    st = os.lstat(admin)
    assert stat.S_ISSOCK(st.st_mode) and st.st_uid == user.uid and stat.S_IMODE(st.st_mode) == 0o600
    # the user's admin client finds it by the same rule, from the user socket alone
    r = user.run([str(VENV_BIN / "python"), "-c", "from ntx_client import AdminClient\n"
                  f"a = AdminClient(user_socket={d.socket!r}); a.resume(); print(a.socket)"], timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == admin, r.stderr


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_readme_block(block, request, tmp_path):
    kind, why = how(block)
    if kind == "skip":
        pytest.skip(why)
    if kind == "gpu" and not _gpu():
        pytest.skip("needs a CUDA GPU")
    if kind in ("shell", "gpu") and not (VENV_BIN / "python").exists():
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
    elif kind == "readme-daemon":
        _check_readme_daemon(request.getfixturevalue("user"), request.getfixturevalue("readme_daemon"))
    elif kind == "shell-daemon":
        user, _ = request.getfixturevalue("user"), request.getfixturevalue("readme_daemon")
        r = user.shell(block.text, stdin="What is 2+2?\n/exit\n")
        assert r.returncode == 0, f"README.md line {block.line}:\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
        assert "serving" in r.stdout and len(r.stdout.strip().splitlines()) >= 4
    elif kind == "python-client":
        user, d = request.getfixturevalue("user"), request.getfixturevalue("readme_daemon")
        code = block.text.replace('"/run/ntransformer/ntransformerd.sock"', repr(d.socket))
        r = user.run([str(VENV_BIN / "python"), "-c", code])
        assert r.returncode == 0, r.stderr
        assert "[19556, 216, 2]" in r.stdout  # what its comment says
    elif kind == "python-stub":
        user, d = request.getfixturevalue("user"), request.getfixturevalue("readme_daemon")
        r = user.run(["env", f"NTX_SOCKET={d.socket}", str(VENV_BIN / "python"), "-c", block.text])
        assert r.returncode == 0, r.stderr
        assert "[19556, 216, 2] ['Hello', ' ', '<|im_end|>']" in r.stdout, r.stdout  # what its comment says
    elif kind == "gateway":
        g = request.getfixturevalue("readme_gateway")
        with urllib.request.urlopen(f"http://127.0.0.1:{g.port}/v1/models", timeout=30) as r:
            assert r.status == 200 and b'"data"' in r.read()
    elif kind == "python-openai":
        user, g = request.getfixturevalue("user"), request.getfixturevalue("readme_gateway")
        assert "127.0.0.1:8000" in block.text
        r = user.run([str(VENV_BIN / "python"), "-c", block.text.replace("127.0.0.1:8000", f"127.0.0.1:{g.port}")])
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip(), "the chat streamed no text"
    elif kind == "toml-config":
        _check_tls_config(block.text, tmp_path)
    elif kind == "nvme-config":
        _check_nvme_config(block.text, tmp_path)
    else:
        raise AssertionError(kind)


@pytest.mark.root
def test_as_root_the_readme_daemon_line_warns_that_the_group_is_missing(tmp_path):
    """Root serves the socket to group ntransformer; where that group is missing it says so (and
    keeps the admin socket next to the user socket, as the service does)."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    try:
        grp.getgrnam(paths.SOCKET_GROUP)
        pytest.skip(f"group {paths.SOCKET_GROUP} exists here")
    except KeyError:
        pass
    if not (VENV_BIN / "python").exists():
        pytest.skip("the README's commands use ./.venv (packaging/dev/bootstrap makes it)")
    log = tmp_path / "log"
    line = block_of("readme-daemon").text.strip().replace(".venv/bin/", f"{VENV_BIN}/")
    with open(log, "w") as f:
        proc = subprocess.Popen(["bash", "-c", "exec " + line], cwd=tmp_path, stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "NTX_STATE_DIR": str(tmp_path)})
    try:
        _wait(lambda: "listening on" in log.read_text(), "ntransformerd", proc, log)
    finally:
        proc.send_signal(signal.SIGINT)  # it stops its load at the next layer
        try:
            rc = proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    text = log.read_text()
    assert rc == 0, text
    assert f"WARNING group {paths.SOCKET_GROUP} does not exist" in text, text
    assert f"(admin socket {tmp_path / 'admin.sock'})" in text, text


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
