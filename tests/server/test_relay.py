"""The user socket's relay: bytes pass unchanged both ways (8 MiB each way at once, EOF passed
on), a gRPC servicer behind it learns the client's uid from context.peer() (as root: another
user's), a peer it did not connect is nobody, one uid cannot hold every connection (its refused
gRPC call is told why; the log counts refusals instead of a line each), a relay that cannot start
leaves no socket, and stop() closes everything."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ntransformerd.config import DaemonConfig
from ntransformerd.server import relay as relay_mod
from ntransformerd.server import sockets
from ntransformerd.server.daemon import Daemon
from ntransformerd.server.relay import Relay
from ntx_client import Client, NtxError

LIMIT = 3  # connections per uid in grpc_behind_relay


@pytest.fixture
def sock_dir():
    """0755 outside pytest's 0700 directories, so that another user can reach the socket."""
    d = tempfile.mkdtemp(prefix="ntx-relay-")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


class Echo:
    """A unix server that sends back what it reads and closes after the client's EOF."""

    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(path)
        self.sock.listen()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn):
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)


def _relay(sock_dir: str, target: str) -> tuple[Relay, str]:
    path = os.path.join(sock_dir, "user.sock")
    r = Relay()
    r.start(sockets.listen(path, mode=sockets.USER_MODE), target)
    return r, path


def _wait(cond, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_bytes_pass_unchanged_both_ways_and_eof_is_passed_on(sock_dir):
    Echo(os.path.join(sock_dir, "echo.sock"))
    r, path = _relay(sock_dir, os.path.join(sock_dir, "echo.sock"))
    try:
        payload = os.urandom(8 << 20)  # far more than the socket buffers: the relay must wait for each side
        with socket.socket(socket.AF_UNIX) as c:
            c.connect(path)
            got = bytearray()

            def read():
                while data := c.recv(1 << 20):
                    got.extend(data)
            reader = threading.Thread(target=read)
            reader.start()
            c.sendall(payload)
            c.shutdown(socket.SHUT_WR)  # the echo server sees EOF, closes, and the client its EOF
            reader.join(30)
            assert not reader.is_alive() and bytes(got) == payload
        _wait(lambda: r.connections == 0)
    finally:
        r.stop()
    assert not os.path.exists(path) or not _connects(path)


def _echoes(path: str) -> bool:
    with socket.socket(socket.AF_UNIX) as c:
        c.settimeout(5)
        c.connect(path)
        c.sendall(b"ping")
        return c.recv(4) == b"ping"


def test_the_relay_process_outlives_signals_and_is_started_again_after_a_crash(sock_dir, caplog):
    """SIGINT and SIGTERM (a terminal's Ctrl-C reaches the process group; the daemon drains
    first) leave it relaying; a relay killed outright is started again on the same socket."""
    Echo(os.path.join(sock_dir, "echo.sock"))
    r, path = _relay(sock_dir, os.path.join(sock_dir, "echo.sock"))
    try:
        first = r.pid
        assert first is not None and first != os.getpid()
        assert _echoes(path)  # serving: its handlers are set
        for sig in (signal.SIGINT, signal.SIGTERM):
            os.kill(first, sig)
            time.sleep(0.2)
            assert _echoes(path) and r.pid == first
        os.kill(first, signal.SIGKILL)
        _wait(lambda: r.pid != first)
        assert _echoes(path)  # a new process on the same listener
        assert "started it again" in caplog.text
    finally:
        r.stop()
    assert not _connects(path)


def test_its_pipes_past_fd_1024_are_watched_too(sock_dir):
    """A daemon with many connections open hands the relay pipes numbered past FD_SETSIZE: the
    reports are still drained and a crashed relay still comes back."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"the fd limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        Echo(os.path.join(sock_dir, "echo.sock"))
        r, path = _relay(sock_dir, os.path.join(sock_dir, "echo.sock"))
        try:
            assert r._reports >= 1024
            pid = r.pid
            assert _echoes(path)
            os.kill(pid, signal.SIGKILL)
            _wait(lambda: r.pid != pid)
            assert _echoes(path)
        finally:
            r.stop()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_relay_that_keeps_dying_closes_the_user_socket(sock_dir, monkeypatch, caplog):
    """Past RESTARTS ends in a window the socket is closed: clients are refused, not left waiting."""
    monkeypatch.setattr(relay_mod, "RESTARTS", 1)
    Echo(os.path.join(sock_dir, "echo.sock"))
    r, path = _relay(sock_dir, os.path.join(sock_dir, "echo.sock"))
    try:
        for _ in range(2):
            pid = r.pid
            assert _echoes(path)
            os.kill(pid, signal.SIGKILL)
            _wait(lambda: r.pid != pid or not _connects(path))
        _wait(lambda: not _connects(path))
        assert "closing the user socket" in caplog.text
    finally:
        r.stop()


def test_the_relay_process_ends_when_the_daemon_dies(sock_dir):
    """A daemon killed outright (no stop()) leaves no relay behind: its control pipe closes."""
    Echo(os.path.join(sock_dir, "echo.sock"))
    path = os.path.join(sock_dir, "user.sock")
    code = ("import sys, time\n"
            "from ntransformerd.server import sockets\n"
            "from ntransformerd.server.relay import Relay\n"
            "r = Relay(); r.start(sockets.listen(sys.argv[1], mode=sockets.USER_MODE), sys.argv[2])\n"
            "print(r.pid, flush=True); time.sleep(600)\n")
    daemon = subprocess.Popen([sys.executable, "-c", code, path, os.path.join(sock_dir, "echo.sock")],
                              stdout=subprocess.PIPE, text=True, env=os.environ)
    try:
        pid = int(daemon.stdout.readline())
        _wait(lambda: _echoes(path))
        daemon.kill()
        daemon.wait()
        _wait(lambda: not os.path.exists(f"/proc/{pid}") or _zombie(pid), relay_mod.EXIT_WAIT_S)
        assert not _connects(path)
    finally:
        daemon.kill()


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _connects(path: str) -> bool:
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(path)
            return True
        except OSError:
            return False


def test_one_uid_cannot_hold_every_connection(sock_dir, monkeypatch):
    monkeypatch.setattr(relay_mod, "MAX_PER_UID", 3)
    Echo(os.path.join(sock_dir, "echo.sock"))
    r, path = _relay(sock_dir, os.path.join(sock_dir, "echo.sock"))
    conns = []
    try:
        for _ in range(5):
            c = socket.socket(socket.AF_UNIX)
            c.settimeout(30)
            c.connect(path)
            conns.append(c)
        for c in conns[:3]:
            c.sendall(b"ping")
            assert c.recv(4) == b"ping"
        conns[3].sendall(b"ping")  # not HTTP/2: closed with nothing said
        assert conns[3].recv(4) == b""
        assert conns[4].recv(4) == b""  # silent: closed once its REFUSAL_WAIT_S are over
        assert r.connections == 3
    finally:
        for c in conns:
            c.close()
        r.stop()


def test_a_refused_grpc_client_is_told_it_has_too_many_connections(grpc_behind_relay, monkeypatch):
    """Past its limit a uid's new channel gets RESOURCE_EXHAUSTED naming the limit and what to do,
    not "Connection reset by peer"; once it closes some, it is served again."""
    servicer, path, _ = grpc_behind_relay
    held = []
    try:
        for _ in range(LIMIT):
            c = socket.socket(socket.AF_UNIX)
            c.connect(path)
            held.append(c)
        for _ in range(2):  # a second call on the channel opens another connection: told the same
            with grpc.insecure_channel(f"unix:{path}") as ch:
                with pytest.raises(grpc.RpcError) as e:
                    health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
            assert e.value.details() == (f"ntransformerd: uid {os.geteuid()} already has {LIMIT} connections open, "
                                         "the most one user may have: close some (one Client, one gRPC channel, "
                                         "carries many calls at once)")
        with Client(path, timeout=30) as c, pytest.raises(NtxError, match=f"already has {LIMIT} connections open"):
            c.status()
    finally:
        for c in held:
            c.close()
    end = time.monotonic() + 30  # a hang guard: the relay sees the closes
    while True:
        with grpc.insecure_channel(f"unix:{path}") as ch:
            try:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30)
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < end, e
        time.sleep(0.05)


class _InProcessLoop:
    """The relay's loop on a thread of this process (its constants patchable, its log in caplog)."""

    def __init__(self, sock_dir: str, target: str, max_per_uid: int):
        self.path = os.path.join(sock_dir, "loop.sock")
        listener = sockets.listen(self.path, mode=0o666)
        self._rep_r, rep_w = os.pipe()
        ctl_r, self._ctl_w = os.pipe()
        self._fds = [rep_w, ctl_r]
        os.set_blocking(self._rep_r, False)
        self.loop = relay_mod._Loop(listener, target, rep_w, ctl_r, max_per_uid)
        self.thread = threading.Thread(target=self.loop.run, daemon=True)
        self.thread.start()

    def connect(self) -> socket.socket:
        c = socket.socket(socket.AF_UNIX)
        c.settimeout(30)
        c.connect(self.path)
        return c

    def stop(self) -> None:
        os.close(self._ctl_w)
        self.thread.join(30)
        assert not self.thread.is_alive()
        for fd in (self._rep_r, *self._fds):
            os.close(fd)


def test_refused_connections_are_logged_once_per_uid_with_a_count(sock_dir, caplog):
    Echo(os.path.join(sock_dir, "echo.sock"))
    loop = _InProcessLoop(sock_dir, os.path.join(sock_dir, "echo.sock"), max_per_uid=1)
    caplog.set_level("INFO", logger="ntransformerd")
    held = loop.connect()
    try:
        held.sendall(b"ping")
        assert held.recv(4) == b"ping"
        for _ in range(50):
            with loop.connect() as c:
                with contextlib.suppress(OSError):  # a relay that closed it at once: the same for the log
                    c.sendall(b"ping")  # not HTTP/2: closed at once
                with contextlib.suppress(ConnectionResetError):
                    assert c.recv(4) == b""
    finally:
        held.close()
        loop.stop()  # the count not yet said is said as it ends
    lines = [r.getMessage() for r in caplog.records if "refus" in r.getMessage()]
    uid = os.geteuid()
    assert lines == [f"uid {uid} has 1 connection open, the most one user may have: refusing its new ones "
                     f"(how many, every {relay_mod.REFUSAL_LOG_S:.0f} s while it goes on)",
                     f"uid {uid}: 49 more connections refused within the last {relay_mod.REFUSAL_LOG_S:.0f} s"], lines


def test_the_refusal_log_says_a_uid_once_per_interval_with_its_count():
    log = relay_mod.RefusalLog(interval=60)
    assert "uid 7 has 4 connections open" in log.refused(7, 0.0, 4)
    assert [log.refused(7, t, 4) for t in (1.0, 2.0, 3.0)] == [None] * 3
    assert "uid 8 has 4 connections open" in log.refused(8, 30.0, 4)  # each uid its own
    assert log.next_due() == 60.0 and log.due(59.0) == []
    assert log.due(60.0) == ["uid 7: 3 more connections refused within the last 60 s"]
    assert log.due(90.0) == []  # uid 8 had no more: nothing to say, and it is forgotten
    assert log.refused(7, 100.0, 4) is None  # uid 7 is still counted until its next line
    assert log.due(120.0) == ["uid 7: 1 more connection refused within the last 60 s"]
    assert log.due(180.0) == [] and log.next_due() is None  # a quiet interval: forgotten
    assert log.refused(8, 200.0, 4) is not None and log.refused(7, 200.0, 4) is not None  # said at once again


def test_past_refusing_refused_connections_are_closed_unanswered(sock_dir, monkeypatch):
    """A flood costs the relay a bounded number of connections being told why."""
    monkeypatch.setattr(relay_mod, "REFUSING", 1)
    monkeypatch.setattr(relay_mod, "REFUSAL_WAIT_S", 600.0)
    loop = _InProcessLoop(sock_dir, os.path.join(sock_dir, "none.sock"), max_per_uid=0)
    first = loop.connect()
    try:
        with loop.connect() as second:
            assert second.recv(9) == b""  # the one place taken: closed at once, with nothing read
        first.sendall(relay_mod.PREFACE + relay_mod.h2_frame(relay_mod.SETTINGS, 0, 0))
        assert first.recv(9) == relay_mod.h2_frame(relay_mod.SETTINGS, 0, 0)  # still being answered
    finally:
        first.close()
        loop.stop()


class PeerHealth(health.HealthServicer):
    """Health that records who the relay says each caller is."""

    def __init__(self, relay: Relay):
        super().__init__()
        self.relay, self.seen = relay, []

    def Check(self, request, context):
        self.seen.append((context.peer(), self.relay.uid_of(context.peer())))
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


@pytest.fixture
def grpc_behind_relay(sock_dir, monkeypatch):
    monkeypatch.setattr(relay_mod, "MAX_PER_UID", LIMIT)
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(4))
    r = Relay()
    servicer = PeerHealth(r)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    inner = sockets.bind_private(server, os.path.join(sock_dir, "user.sock"))
    assert (os.stat(os.path.dirname(inner)).st_mode & 0o777) == 0o700  # nobody else reaches the server
    server.start()
    path = os.path.join(sock_dir, "user.sock")
    r.start(sockets.listen(path, mode=0o666), inner)
    try:
        yield servicer, path, inner
    finally:
        server.stop(0).wait()
        r.stop()
        sockets.remove_private(inner)
    assert not os.path.exists(os.path.dirname(inner))


def test_a_grpc_servicer_learns_the_clients_uid_from_its_peer(grpc_behind_relay):
    servicer, path, inner = grpc_behind_relay
    with grpc.insecure_channel(f"unix:{path}") as ch:
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    with grpc.insecure_channel(f"unix:{inner}") as ch:  # past the relay (only this user can)
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    (peer, uid), (peer2, uid2) = servicer.seen
    # a name of the relay's own (never reused, unlike the kernel's 2^20 autobind names)
    assert re.fullmatch(r"unix-abstract:ntx-[0-9a-f]{24}", peer) and uid == os.geteuid(), peer
    assert uid2 is None  # a peer the relay did not connect is nobody


@pytest.mark.root
def test_as_root_the_uid_is_the_connecting_users(grpc_behind_relay):
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv")
    servicer, path, _ = grpc_behind_relay
    code = ("import sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g\n"
            "g.HealthStub(grpc.insecure_channel('unix:' + sys.argv[1])).Check(h.HealthCheckRequest(), timeout=10)")
    for uid in (65534, 1):
        r = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", sys.executable,
                            "-c", code, path], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
    assert [uid for _, uid in servicer.seen] == [65534, 1]


def test_a_killed_daemons_private_listener_is_removed_a_live_ones_kept(sock_dir):
    dead = os.path.join(sock_dir, sockets.PRIVATE_PREFIX + "dead")
    os.mkdir(dead, 0o700)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(os.path.join(dead, "s"))  # bound, never served: what a SIGKILL leaves
    live = socket.socket(socket.AF_UNIX)
    os.mkdir(os.path.join(sock_dir, sockets.PRIVATE_PREFIX + "live"), 0o700)
    live.bind(os.path.join(sock_dir, sockets.PRIVATE_PREFIX + "live", "s"))
    live.listen()
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(1))
    try:
        inner = sockets.bind_private(server, os.path.join(sock_dir, "user.sock"))
        left = sorted(n for n in os.listdir(sock_dir) if n.startswith(sockets.PRIVATE_PREFIX))
        assert left == sorted([sockets.PRIVATE_PREFIX + "live", os.path.basename(os.path.dirname(inner))])
    finally:
        live.close()
        server.stop(0)


def test_a_relay_that_cannot_start_stops_the_daemon_with_the_reason_and_no_socket_left(sock_dir, monkeypatch):
    def refused(*args, **kw):
        raise PermissionError(13, "Permission denied")
    d = Daemon(config=DaemonConfig(socket=os.path.join(sock_dir, "d.sock"), socket_group="",
                                   admin_socket=os.path.join(sock_dir, "a.sock")))
    monkeypatch.setattr(relay_mod.subprocess, "Popen", refused)
    with pytest.raises(sockets.SocketError, match=r"cannot start the user socket's relay process \(.*\): "
                                                  r"Permission denied"):
        d.start()
    assert os.listdir(sock_dir) == []
