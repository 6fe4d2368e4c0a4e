"""The user socket's relay: how the daemon learns each client's uid, which gRPC does not tell it.

gRPC Python gives a servicer the peer's address (context.peer()), never its credentials, and an
unbound unix client's address is empty. So the daemon accepts on the user socket itself, asks
the kernel who connected (SO_PEERCRED: the uid at connect time, which the client cannot choose),
and passes the connection's bytes both ways to the gRPC server's own listener from a socket of
its own, bound to an abstract address of 96 random bits that is never used twice. The relay
remembers which uid each such address carries; the servicer looks its context.peer() up
(`uid_of`). The gRPC listener sits in a directory only the daemon can enter, so every unix peer
the server sees is one the relay connected and vouched for. The addresses name no uid: the
abstract names of a process show in /proc/net/unix (in the daemon's network namespace, which
the unit makes private), and who uses the daemon is nobody else's business.

The relay runs in a process of its own (this file run as a program, started by Relay.start with
the user socket's listener): every message of every stream passes through one recv and one send
here, and in the daemon's process that work would hold the interpreter the scheduler needs
between device steps (bench/relay.py, bench/host_ceiling.py measure it). It reports each
connection it opens to the daemon on a pipe, `+ADDRESS UID` before the connection to the gRPC
listener exists and `-ADDRESS` once it is closed, so the daemon knows a peer's uid before the
peer's first byte reaches its server. It outlives SIGINT and SIGTERM (the daemon drains first,
and its last words to the clients pass here), and ends when the daemon closes its control pipe:
on stop(), or when the daemon dies. Should it end otherwise (a crash, a kill), the daemon starts
it again on the same listening socket, which it keeps open for that (RESTARTS in
RESTART_WINDOW_S at most).

One uid holds at most MAX_PER_UID connections. The one past that is refused, and told why: the
relay answers its first call itself, in HTTP/2 as a gRPC server would (`refusal`: a status
RESOURCE_EXHAUSTED whose message names the limit), where closing it would leave the client with
"Connection reset by peer". At most REFUSING connections are answered at once, each for at most
REFUSAL_WAIT_S; past that they are closed unanswered, so a flood costs the relay no more. The log
says a uid's first refusal at once, then how many more it had once per REFUSAL_LOG_S
(RefusalLog), not one line per connection.

Thread rule: in the daemon, start() and stop() are called from the daemon's thread, uid_of() and
`connections` from any; the reports are read under one lock, by whichever thread asks first.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import secrets
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

log = logging.getLogger("ntransformerd")

CHUNK = 256 << 10  # bytes read per recv: a whole gRPC frame of a long prompt in one piece
MAX_PER_UID = 256  # open connections per uid; past it a new one is closed (one user cannot take them all)
ACCEPT_PAUSE_S = 0.1  # out of file descriptors: stop accepting this long, not spin
STOP_FLUSH_S = 1.0  # on stop, how long what the server said last may take to reach its clients
EXIT_WAIT_S = STOP_FLUSH_S + 5.0  # stop(): how long the relay process may take to end before it is killed
RESTARTS = 5  # an unexpected end of the relay process starts it again, at most this often…
RESTART_WINDOW_S = 60.0  # …within this long; past that the user socket stays deaf (and says so)
REFUSING = 64  # refused connections being told why at once; past this they are closed unanswered
REFUSAL_WAIT_S = 2.0  # how long a refused client has to send its first call before it is closed
REFUSAL_LOG_S = 60.0  # a uid's refused connections are logged once per this long, with a count
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process that connected `conn` (SO_PEERCRED)."""
    _, uid, _ = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return uid


def peer_address(name: bytes) -> str:
    """How gRPC writes the peer of a connection from abstract address `name` (context.peer())."""
    return "unix-abstract:" + name[1:].decode("ascii", "backslashreplace")


class Relay:
    """The daemon's side: starts the relay process on the user socket, knows from its reports the
    uid behind each peer it connected, and starts it again after an unexpected end."""

    def __init__(self):
        self._uids: dict[str, int] = {}  # peer address → uid (under _lock)
        self._lock = threading.Lock()
        self._partial = b""  # a report line read in part
        self._listener: socket.socket | None = None
        self._target = ""
        self._proc: subprocess.Popen | None = None
        self._reports = -1  # the reports pipe's read end (non-blocking)
        self._control = -1  # the control pipe's write end: closing it ends the relay
        self._watcher: threading.Thread | None = None
        self._stopping = False
        self._restarts: list[float] = []  # when the relay process was started again

    def uid_of(self, peer: str) -> int | None:
        """The uid of the client behind gRPC peer `peer`; None for a peer the relay did not connect.
        The relay reported the peer before connecting it, so its line is read by now or here."""
        with self._lock:
            self._read_reports()
            return self._uids.get(peer)

    @property
    def pid(self) -> int | None:
        """The relay process's pid (None before start)."""
        return None if self._proc is None else self._proc.pid

    @property
    def connections(self) -> int:
        with self._lock:
            self._read_reports()
            return len(self._uids)

    def start(self, listener: socket.socket, target: str) -> None:
        """Serve `listener` (bound and listening: sockets.listen) in the relay process, relaying to
        the unix socket at `target` (sockets.bind_private). The listener stays open here too: a
        relay process started again after an unexpected end takes the same socket over (clients
        that connect meanwhile wait in its backlog). stop() closes it."""
        self._listener, self._target = listener, target
        with self._lock:
            self._spawn()
        self._watcher = threading.Thread(target=self._watch, name="relay-reports", daemon=True)
        self._watcher.start()

    def stop(self) -> None:
        """Close the user socket, then every connection once what the gRPC server sent on it has
        been passed on (call it after the server has stopped), STOP_FLUSH_S at most."""
        with self._lock:  # the watcher starts no relay process after this
            self._stopping = True
            proc, control, self._control = self._proc, self._control, -1
        if proc is None:
            return
        if control >= 0:
            os.close(control)  # the relay stops accepting, flushes, ends
        self._listener.close()
        try:
            proc.wait(EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            log.warning("the relay process did not end in %.0f s: killing it", EXIT_WAIT_S)
            proc.kill()
            proc.wait()
        if self._watcher is not None:
            self._watcher.join(5.0)
        with self._lock:
            if self._reports >= 0:
                os.close(self._reports)
                self._reports = -1

    def _spawn(self) -> None:
        """Start the relay process on the listener, with fresh pipes (_lock held)."""
        fds: list[int] = []
        try:
            rep_r, rep_w = os.pipe()
            fds += (rep_r, rep_w)
            ctl_r, ctl_w = os.pipe()
            fds += (ctl_r, ctl_w)
            fd = self._listener.fileno()
            # -I: the relay imports the standard library only, from no path a caller could set
            proc = subprocess.Popen(
                [sys.executable, "-I", os.path.abspath(__file__), "--listener", str(fd), "--target", self._target,
                 "--reports", str(rep_w), "--control", str(ctl_r), "--max-per-uid", str(MAX_PER_UID)],
                pass_fds=(fd, rep_w, ctl_r), stdin=subprocess.DEVNULL,
                start_new_session=True)  # a terminal's Ctrl-C is the daemon's to act on, not the relay's
        except BaseException:
            for x in fds:
                os.close(x)
            raise
        for x in (rep_w, ctl_r):  # the child's ends
            os.close(x)
        os.set_blocking(rep_r, False)
        for x in (self._reports, self._control):  # an earlier process's (it has ended)
            if x >= 0:
                os.close(x)
        self._uids.clear()  # its connections ended with it
        self._partial = b""
        self._proc, self._reports, self._control = proc, rep_r, ctl_w

    def _watch(self) -> None:
        """Read the reports as they come (thread `relay-reports`), so that the pipe never fills;
        start the relay again when it ends unasked (RESTARTS times in RESTART_WINDOW_S at most,
        then the user socket is closed: clients are refused rather than left waiting)."""
        try:
            while self._watch_one():
                pass
        except Exception:  # noqa: BLE001 - a bug here must be seen: nothing else drains the reports
            log.exception("the relay's watcher stopped")
            self._give_up()

    def _watch_one(self) -> bool:
        """One relay process, to its end; True where another was started in its place."""
        fd = self._reports
        poller = select.poll()  # not select(): the pipe's fd may be past FD_SETSIZE
        poller.register(fd, select.POLLIN)
        while True:
            poller.poll()
            with self._lock:
                if self._reports != fd:  # stop() closed it
                    return False
                if not self._read_reports():
                    break
        code = self._proc.wait()
        delay = 0.0
        while True:
            if delay:
                time.sleep(delay)
            with self._lock:
                if self._stopping:
                    return False
                now = time.monotonic()
                self._restarts = [t for t in self._restarts if now - t < RESTART_WINDOW_S]
                if len(self._restarts) >= RESTARTS:
                    log.error("the user socket's relay ended (exit status %s) %d times in %.0f s: closing the user "
                              "socket (restart ntransformerd)", code, len(self._restarts) + 1, RESTART_WINDOW_S)
                    break
                self._restarts.append(now)
                try:
                    self._spawn()
                except OSError as e:  # out of file descriptors, say: again, a while later
                    log.error("cannot start the user socket's relay again: %s", e)
                    delay = min(2 * delay or 0.5, 8.0)
                    continue
                log.error("the user socket's relay ended (exit status %s): started it again (the connections "
                          "it held are lost; their clients see UNAVAILABLE)", code)
                return True
        self._give_up()
        return False

    def _give_up(self) -> None:
        """No relay will serve the user socket: close it, so that clients are refused at once."""
        with self._lock:
            if not self._stopping and self._listener is not None:
                self._listener.close()

    def _read_reports(self) -> bool:
        """Apply the reports waiting in the pipe (_lock held); False once the relay has closed it."""
        if self._reports < 0:
            return False
        while True:
            try:
                data = os.read(self._reports, 65536)
            except BlockingIOError:
                return True
            if not data:
                return False
            *lines, self._partial = (self._partial + data).split(b"\n")
            for line in lines:
                text = line.decode("ascii", "backslashreplace")
                if text.startswith("+"):
                    address, _, uid = text[1:].rpartition(" ")
                    self._uids[address] = int(uid)
                elif text.startswith("-"):
                    self._uids.pop(text[1:], None)


# ---- telling a refused client why ---------------------------------------------------------------
# The least of HTTP/2 (RFC 9113) a gRPC client needs to read a status from its first call: the
# server's SETTINGS, acks of the client's SETTINGS and PINGs, and for a call (a HEADERS frame) a
# response of headers only, ending the stream, with grpc-status and grpc-message (gRPC over
# HTTP/2's "Trailers-Only"); then GOAWAY, so the client opens no further call on this connection.

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEADERS, SETTINGS, PING, GOAWAY = 0x1, 0x4, 0x6, 0x7
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
MAX_FRAME = 16384  # SETTINGS_MAX_FRAME_SIZE's initial value, which the relay never raises
RESOURCE_EXHAUSTED = 8  # grpc-status


def h2_frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame: 24-bit length, type, flags, 31-bit stream id, payload."""
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big") + payload


def _hpack_int(n: int, bits: int) -> bytes:
    """An HPACK integer with a `bits`-bit prefix (RFC 7541 5.1)."""
    top = (1 << bits) - 1
    if n < top:
        return bytes((n,))
    out, n = [top], n - top
    while n >= 128:
        out.append(n & 127 | 128)
        n >>= 7
    return bytes(out + [n])


def _hpack_literal(name: bytes, value: bytes) -> bytes:
    """A header field as a literal without indexing, new name, no Huffman (RFC 7541 6.2.2): the
    peer's HPACK table is left as it was."""
    return b"\0" + _hpack_int(len(name), 7) + name + _hpack_int(len(value), 7) + value


def _grpc_message(text: str) -> bytes:
    """grpc-message's encoding: UTF-8, bytes outside printable ASCII and '%' percent-encoded."""
    return b"".join(bytes((c,)) if 0x20 <= c <= 0x7E and c != 0x25 else b"%%%02X" % c for c in text.encode())


def refusal(stream: int, status: int, message: str) -> bytes:
    """The answer to call `stream`: its status as headers only (":status 200" is HPACK's static
    entry 8), then GOAWAY naming it the last stream this connection serves."""
    block = (b"\x88" + _hpack_literal(b"content-type", b"application/grpc")
             + _hpack_literal(b"grpc-status", str(status).encode())
             + _hpack_literal(b"grpc-message", _grpc_message(message)))
    return (h2_frame(HEADERS, END_HEADERS | END_STREAM, stream, block)
            + h2_frame(GOAWAY, 0, 0, stream.to_bytes(4, "big") + (0).to_bytes(4, "big")))


class _Refused:
    """A refused connection being told why: its client's frames are read until its first call,
    which gets `message`; closed on anything that is not HTTP/2, or at `deadline`."""

    def __init__(self, sock: socket.socket, message: str, deadline: float):
        self.sock, self.message, self.deadline = sock, message, deadline
        self.buf = b""
        self.seen_preface = self.answered = False

    def readable(self) -> bool:
        """Read what the client sent and answer it; False once the connection is to be closed."""
        data = self.sock.recv(65536)
        if not data:
            return False
        if self.answered:  # what the client sends after its answer does not matter
            return True
        self.buf += data
        out = b""
        if not self.seen_preface:
            if len(self.buf) < len(PREFACE):
                return PREFACE.startswith(self.buf)
            if not self.buf.startswith(PREFACE):
                return False  # not an HTTP/2 client: nothing to tell it in a form it would read
            self.buf, self.seen_preface = self.buf[len(PREFACE):], True
            out += h2_frame(SETTINGS, 0, 0)
        while len(self.buf) >= 9 and not self.answered:
            size, kind, flags = int.from_bytes(self.buf[:3], "big"), self.buf[3], self.buf[4]
            stream = int.from_bytes(self.buf[5:9], "big") & 0x7FFFFFFF
            if size > MAX_FRAME:
                return False
            if len(self.buf) < 9 + size:
                break
            payload, self.buf = self.buf[9:9 + size], self.buf[9 + size:]
            if kind == SETTINGS and not flags & ACK:
                out += h2_frame(SETTINGS, ACK, 0)
            elif kind == PING and not flags & ACK:
                out += h2_frame(PING, ACK, 0, payload)
            elif kind == HEADERS and stream % 2:
                out += refusal(stream, RESOURCE_EXHAUSTED, self.message)
                self.answered = True
        if out:
            self.sock.send(out)  # a few hundred bytes into an empty buffer: whole, or the client is gone
        if self.answered:
            self.sock.shutdown(socket.SHUT_WR)  # the client reads its answer, then EOF; it closes
        return True


class RefusalLog:
    """What the relay says of refused connections: a uid's first refusal at once, then how many
    more it had once per `interval`, so that a flood of connections is a line a minute, not a
    line a connection. A uid quiet for a whole interval is said at once again."""

    def __init__(self, interval: float = REFUSAL_LOG_S):
        self.interval = interval
        self._uids: dict[int, list] = {}  # uid -> [when its count is said, connections refused since]

    def refused(self, uid: int, now: float, limit: int) -> str | None:
        """A connection of `uid` was refused at `now`: the line to log now, if any."""
        if uid in self._uids:
            self._uids[uid][1] += 1
            return None
        self._uids[uid] = [now + self.interval, 0]
        return (f"uid {uid} has {_connections(limit)} open, the most one user may have: refusing its new ones "
                f"(how many, every {self.interval:.0f} s while it goes on)")

    def due(self, now: float, *, all_of_them: bool = False) -> list[str]:
        """The counts to log at `now` (all_of_them: every count pending, as when the relay ends)."""
        lines = []
        for uid, (at, n) in list(self._uids.items()):
            if now < at and not all_of_them:
                continue
            if n:
                lines.append(f"uid {uid}: {n} more {'connection' if n == 1 else 'connections'} refused within "
                             f"the last {self.interval:.0f} s")
                self._uids[uid] = [now + self.interval, 0]
            else:
                del self._uids[uid]
        return lines

    def next_due(self) -> float | None:
        return min((at for at, _ in self._uids.values()), default=None)


def _connections(n: int) -> str:
    return f"{n} connection" + ("" if n == 1 else "s")


def _bind_unique(sock: socket.socket) -> bytes:
    """Bind `sock` to an abstract address of its own: 96 random bits, so that no address is ever
    used twice (the kernel's autobind reuses its 2^20 names: a request queued in the gRPC server
    while its connection closed and another took the same name would pass for the other's
    caller). The name says nothing of whose connection it is."""
    while True:
        name = b"\0ntx-" + secrets.token_hex(12).encode()
        try:
            sock.bind(name)
            return name
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise


class _Link:
    """One client connection (`outer`) and the relay's own connection to the gRPC listener
    (`inner`): bytes read from one wait in `pending` for the other until it can take them."""

    def __init__(self, outer: socket.socket, inner: socket.socket, uid: int, address: str):
        self.outer, self.inner, self.uid, self.address = outer, inner, uid, address
        self.pending: dict[socket.socket, bytes] = {outer: b"", inner: b""}  # to be written to the key
        self.ended: set[socket.socket] = set()  # sockets that have sent EOF
        self.shut: set[socket.socket] = set()  # sockets whose write side is shut (EOF passed on)

    def other(self, s: socket.socket) -> socket.socket:
        return self.inner if s is self.outer else self.outer

    def events(self, s: socket.socket) -> int:
        """What to wait for on `s`: reading while the other end has nothing queued, writing
        while `s` has."""
        ev = selectors.EVENT_READ if s not in self.ended and not self.pending[self.other(s)] else 0
        return ev | (selectors.EVENT_WRITE if self.pending[s] else 0)

    def done(self) -> bool:
        return len(self.shut) == 2


class _Loop:
    """The relay process: accepts on the user socket and relays each connection to the gRPC
    server's listener, in one selector loop."""

    def __init__(self, listener: socket.socket, target: str, reports: int, control: int, max_per_uid: int):
        self.listener, self.target = listener, target
        self.reports, self.control, self.max_per_uid = reports, control, max_per_uid
        self._per_uid: dict[int, int] = {}
        self._links: dict[socket.socket, _Link] = {}
        self._registered: dict[socket.socket, int] = {}
        self._sel = selectors.DefaultSelector()
        self._stop_at: float | None = None  # the daemon closed the control pipe: flush until every link is closed, or this
        self._paused_until = 0.0
        self._refusing: dict[socket.socket, _Refused] = {}  # refused connections being told why
        self._refusals = RefusalLog()

    def _report(self, line: str) -> None:
        """One line to the daemon (a pipe write of under PIPE_BUF bytes: whole or not at all)."""
        os.write(self.reports, (line + "\n").encode("ascii", "backslashreplace"))

    def run(self) -> None:
        self.listener.setblocking(False)
        self._sel.register(self.listener, selectors.EVENT_READ)
        self._sel.register(self.control, selectors.EVENT_READ)
        try:
            while True:
                timeout = None
                if self._stop_at is not None:
                    if not self._links or time.monotonic() >= self._stop_at:
                        return
                    timeout = self._stop_at - time.monotonic()
                elif self._paused_until:
                    timeout = max(0.0, self._paused_until - time.monotonic())
                    if timeout == 0.0:
                        self._paused_until = 0.0
                        self._sel.register(self.listener, selectors.EVENT_READ)
                        timeout = None
                due = self._next_due()
                if due is not None:
                    wait = max(0.0, due - time.monotonic())
                    timeout = wait if timeout is None else min(timeout, wait)
                for key, ev in self._sel.select(timeout):
                    s = key.fileobj
                    if s is self.listener:
                        self._accept()
                    elif s == self.control:  # closed (stop(), or the daemon is gone): no new connections
                        self._sel.unregister(self.control)
                        if not self._paused_until:
                            self._sel.unregister(self.listener)
                        self._paused_until = 0.0
                        self.listener.close()
                        self._stop_at = time.monotonic() + STOP_FLUSH_S
                        for r in list(self._refusing.values()):
                            self._drop(r)
                    elif s in self._links:
                        self._serve(self._links[s], s, ev)
                    elif s in self._refusing:
                        self._tell(self._refusing[s])
                self._on_time(time.monotonic())
        except BrokenPipeError:  # the daemon is gone: nobody to vouch for the clients to
            return
        finally:
            for link in list({id(x): x for x in self._links.values()}.values()):
                self._close(link, report=False)
            for r in list(self._refusing.values()):
                self._drop(r)
            for line in self._refusals.due(time.monotonic(), all_of_them=True):
                log.warning("%s", line)
            self._sel.close()
            self.listener.close()

    def _next_due(self) -> float | None:
        """When a refused connection's time is up or a count of refusals is to be said."""
        times = [r.deadline for r in self._refusing.values()]
        if (at := self._refusals.next_due()) is not None:
            times.append(at)
        return min(times, default=None)

    def _on_time(self, now: float) -> None:
        for r in [r for r in self._refusing.values() if now >= r.deadline]:
            self._drop(r)
        for line in self._refusals.due(now):
            log.warning("%s", line)

    def _accept(self) -> None:
        while True:
            try:
                outer, _ = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("cannot accept a client: %s; pausing new connections for %.1f s "
                                "(raise LimitNOFILE)", e.strerror, ACCEPT_PAUSE_S)
                    self._sel.unregister(self.listener)
                    self._paused_until = time.monotonic() + ACCEPT_PAUSE_S
                    return
                continue  # ECONNABORTED and the like: that client is gone
            self._open(outer)

    def _open(self, outer: socket.socket) -> None:
        inner, address = None, None
        try:
            uid = peer_uid(outer)
            if self._per_uid.get(uid, 0) >= self.max_per_uid:
                self._refuse(outer, uid)
                return
            inner = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            name = _bind_unique(inner)  # the abstract address the servicer sees as the peer
            inner.setblocking(False)
            address = peer_address(name)
            self._report(f"+{address} {uid}")  # before the first byte can reach the server
            inner.connect(self.target)  # a unix connect completes at once, or fails (backlog full: EAGAIN)
            outer.setblocking(False)
        except OSError as e:
            if isinstance(e, BrokenPipeError):
                raise
            log.warning("cannot relay a client connection to the gRPC server: %s", e)
            outer.close()
            if address is not None:  # reported, never connected
                self._report(f"-{address}")
            if inner is not None:
                inner.close()
            return
        link = _Link(outer, inner, uid, address)
        self._per_uid[uid] = self._per_uid.get(uid, 0) + 1
        self._links[outer] = self._links[inner] = link
        for s in (outer, inner):
            self._update(link, s)

    def _refuse(self, outer: socket.socket, uid: int) -> None:
        """`uid` has max_per_uid connections open: its new one `outer` is told so (REFUSING at
        once at most; past that it is closed unanswered), and counted for the log."""
        now = time.monotonic()
        line = self._refusals.refused(uid, now, self.max_per_uid)
        if line:
            log.warning("%s", line)
        if len(self._refusing) >= REFUSING:
            outer.close()
            return
        message = (f"ntransformerd: uid {uid} already has {_connections(self.max_per_uid)} open, the most one "
                   "user may have: close some (one Client, one gRPC channel, carries many calls at once)")
        outer.setblocking(False)
        self._sel.register(outer, selectors.EVENT_READ)
        self._refusing[outer] = _Refused(outer, message, now + REFUSAL_WAIT_S)

    def _tell(self, r: _Refused) -> None:
        try:
            if r.readable():
                return
        except OSError:  # reset, or its buffer full: it hears nothing more
            pass
        self._drop(r)

    def _drop(self, r: _Refused) -> None:
        if self._refusing.pop(r.sock, None) is not None:
            self._sel.unregister(r.sock)
            r.sock.close()

    def _serve(self, link: _Link, s: socket.socket, ev: int) -> None:
        other = link.other(s)
        try:
            if ev & selectors.EVENT_WRITE:
                self._flush(link, s)
            if ev & selectors.EVENT_READ and s not in link.ended and not link.pending[other]:
                data = s.recv(CHUNK)
                if data:
                    link.pending[other] = data
                    self._flush(link, other)
                else:
                    link.ended.add(s)
                    self._flush(link, other)
        except OSError:  # reset, broken pipe: the connection is over both ways
            self._close(link)
            return
        if link.done():
            self._close(link)
            return
        self._update(link, s)
        self._update(link, other)

    def _flush(self, link: _Link, s: socket.socket) -> None:
        """Write what waits for `s`; once it is all written and the other end has ended, pass
        the EOF on."""
        data = link.pending[s]
        if data:
            try:
                n = s.send(data)
            except BlockingIOError:
                n = 0
            link.pending[s] = data[n:]
        if not link.pending[s] and link.other(s) in link.ended and s not in link.shut:
            link.shut.add(s)
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_WR)

    def _update(self, link: _Link, s: socket.socket) -> None:
        ev = link.events(s)
        old = self._registered.get(s, 0)
        if ev == old:
            return
        if not old:
            self._sel.register(s, ev)
        elif not ev:
            self._sel.unregister(s)
        else:
            self._sel.modify(s, ev)
        self._registered[s] = ev

    def _close(self, link: _Link, *, report: bool = True) -> None:
        """Close both of the link's sockets (once: a closed link has left _links); report: tell
        the daemon its address is gone (not when the relay itself ends)."""
        if link.outer not in self._links:
            return
        for s in (link.outer, link.inner):
            if self._registered.pop(s, 0):
                self._sel.unregister(s)
            self._links.pop(s, None)
            s.close()
        self._per_uid[link.uid] -= 1
        if not self._per_uid[link.uid]:
            del self._per_uid[link.uid]
        if report:
            self._report(f"-{link.address}")


def main(argv: list[str] | None = None) -> int:
    """The relay process (Relay.start runs this file with the listener and the pipes passed)."""
    ap = argparse.ArgumentParser(prog="relay", description="ntransformerd's user-socket relay (started by the daemon)")
    ap.add_argument("--listener", type=int, required=True, help="the user socket's listening fd")
    ap.add_argument("--target", required=True, help="the gRPC server's own unix socket")
    ap.add_argument("--reports", type=int, required=True, help="the pipe fd the connections are reported on")
    ap.add_argument("--control", type=int, required=True, help="the pipe fd whose end stops the relay")
    ap.add_argument("--max-per-uid", type=int, default=MAX_PER_UID)
    a = ap.parse_args(argv)
    # the daemon drains first on SIGTERM (its last words to the clients pass here), and a terminal's
    # Ctrl-C reaches the whole process group: the daemon ends the relay by closing the control pipe
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="ntransformerd relay: %(levelname)s %(message)s")
    listener = socket.socket(fileno=a.listener)
    try:
        _Loop(listener, a.target, a.reports, a.control, a.max_per_uid).run()
    except Exception:  # noqa: BLE001 - a bug here must be seen; the user socket is deaf after it
        log.exception("the user socket's relay stopped: no new connections are served")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
