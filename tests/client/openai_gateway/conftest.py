"""Real processes for the gateway's tests: tests/server's DaemonProcess (a CPU ntransformerd on
the default model) and GatewayProcess (`ntx-openai`). Each test module starts its own, once."""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

import pytest

pytest.importorskip("starlette", reason="the gateway's extra is not installed: pip install '.[openai]'")
pytest.importorskip("openai", reason="the openai package (test extra) is not installed")

# tests/ is not a package; load the server tests' conftest by path to share its fixtures
_spec = importlib.util.spec_from_file_location("ntx_tests_server_conftest",
                                               pathlib.Path(__file__).parents[2] / "server" / "conftest.py")
server_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(server_conftest)
DaemonProcess = server_conftest.DaemonProcess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GatewayProcess:
    """`ntx-openai` in a subprocess on a free port; .url (…/v1), .port, .log(), .stop()."""

    def __init__(self, *flags: str, api_key: str | None = None, more_keys: tuple[str, ...] = ()):
        self.api_key = api_key  # the one wait_ready uses; more_keys are valid too
        self.dir = tempfile.mkdtemp(prefix="ntx-openai-")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.log_path = os.path.join(self.dir, "log")
        cmd = [sys.executable, "-m", "ntx_client.openai_gateway.main", "--port", str(self.port), *flags]
        if api_key:
            keys = os.path.join(self.dir, "keys")
            with open(keys, "w") as f:
                f.write(f"# test key\n{api_key}\n" + "".join(f"{k}\n" for k in more_keys))
            cmd += ["--api-keys-file", keys]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        """(status, headers, parsed JSON body or text) of one plain HTTP request."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            r = conn.getresponse()
            data = r.read().decode()
            try:
                parsed = json.loads(data)
            except ValueError:
                parsed = data
            return r.status, {k.lower(): v for k, v in r.getheaders()}, parsed
        finally:
            conn.close()

    def wait_ready(self, timeout: float = 30.0, status: int = 200) -> "GatewayProcess":
        """Wait until GET /health (with the key) answers `status`: 200 once its daemons serve;
        503 for a gateway with no daemon behind it, for the tests that never reach one."""
        end = time.monotonic() + timeout
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        while True:
            assert self.proc.poll() is None, f"ntx-openai exited {self.proc.returncode}:\n{self.log()}"
            try:
                if self.request("GET", "/health", headers=auth)[0] == status:
                    return self
            except OSError:
                pass
            assert time.monotonic() < end, f"ntx-openai not healthy after {timeout} s:\n{self.log()}"
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()



@pytest.fixture(scope="session")
def processes():
    """(DaemonProcess, GatewayProcess): start them with flags; the caller stops them."""
    return DaemonProcess, GatewayProcess


@contextlib.contextmanager
def _stack(api_key: str, *daemon_flags: str):
    d = DaemonProcess(*daemon_flags)
    g = None
    try:
        d.wait_ready()
        g = GatewayProcess("--socket", d.socket, api_key=api_key).wait_ready()
        yield d, g
    finally:
        if g is not None:
            g.stop()
        d.cleanup()


@pytest.fixture(scope="session")
def stack_with():
    """stack_with(api_key, *daemon_flags): a context giving (daemon, gateway) that takes api_key, both
    stopped at its end; a module's `stack` fixture holds one for the module."""
    return _stack

