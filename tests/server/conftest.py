"""A real ntransformerd process (CPU backend, the default model) on a temporary socket."""

from __future__ import annotations

import grp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

PY = sys.executable
MAX_BATCH = 32  # all 32 clients of the concurrency test decode together
SOCKET_GROUP = "users"  # an existing group, so the permissions test needs no new users or groups


def _group_or_empty() -> str:
    if os.geteuid() != 0:
        return ""
    try:
        grp.getgrnam(SOCKET_GROUP)
        return SOCKET_GROUP
    except KeyError:
        return ""


class DaemonProcess:
    """`ntransformerd` in a subprocess; .socket, .admin_socket, .proc, .log()."""

    def __init__(self, *flags: str, env: dict | None = None):
        # 0755, outside pytest's 0700 tmp dirs, so an unprivileged test user can reach the socket
        self.dir = tempfile.mkdtemp(prefix="ntxd-")
        os.chmod(self.dir, 0o755)
        self.socket = os.path.join(self.dir, "d.sock")
        self.admin_socket = os.path.join(self.dir, "admin.sock")
        self.log_path = os.path.join(self.dir, "log")
        self.group = _group_or_empty()
        self.max_batch = MAX_BATCH
        cmd = [PY, "-m", "ntransformerd.main", "--socket", self.socket, "--backend", "cpu",
               "--socket-group", self.group, "--config", os.devnull, "--max-batch", str(MAX_BATCH), *flags]
        env = {**{k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "JOURNAL_STREAM")},
               "NTX_STATE_DIR": self.dir, **(env or {})}  # what it measures once (step costs) stays its own
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def wait_ready(self, timeout: float = 120.0) -> "DaemonProcess":
        from ntx_client import Client
        end = time.monotonic() + timeout
        while not os.path.exists(self.socket):
            assert self.proc.poll() is None, f"ntransformerd exited {self.proc.returncode}:\n{self.log()}"
            assert time.monotonic() < end, f"no socket after {timeout} s:\n{self.log()}"
            time.sleep(0.05)
        with Client(self.socket) as c:
            c.wait_ready(max(1.0, end - time.monotonic()))
        return self

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def daemon():
    """One daemon for the session, with a queue deep enough for 32 clients."""
    d = DaemonProcess("--max-queue", "64", "--max-ctx", "1024", "--prefill-chunk", "128")
    try:
        yield d.wait_ready()
    finally:
        d.cleanup()


@pytest.fixture(scope="session")
def engine():
    """The same model in this process, for solo reference runs."""
    from ntransformerd.engine.runtime.engine import Engine, EngineConfig
    return Engine.load(None, config=EngineConfig(backend="cpu", max_batch=2, max_ctx=1024, prefill_chunk=128))


@pytest.fixture(scope="session")
def new_daemon():
    """Start another daemon: new_daemon(*flags) -> DaemonProcess (the caller cleans it up)."""
    return DaemonProcess


@pytest.fixture(scope="session")
def solo():
    """solo(engine, prompt_ids, max_tokens, **params) -> ids of engine.generate, greedy."""
    return solo_ids


def solo_ids(engine, prompt_ids, max_tokens: int, **kw) -> list[int]:
    """What engine.generate gives alone, greedy."""
    from ntransformerd.engine.runtime.engine import generate
    from ntransformerd.engine.generation.sampler import SamplingParams
    params = SamplingParams.greedy(max_tokens=max_tokens, **kw)
    return [ev.token for ev in generate(engine, prompt_ids, params)]
