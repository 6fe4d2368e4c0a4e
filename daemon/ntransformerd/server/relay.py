"""The user socket's relay: how the daemon learns each client's uid, which gRPC does not tell it.

gRPC Python gives a servicer the peer's address (context.peer()), never its credentials, and an
unbound unix client's address is empty. So the daemon accepts on the user socket itself, asks
the kernel who connected (SO_PEERCRED: the uid at connect time, which the client cannot choose),
and passes the connection's bytes both ways to the gRPC server's own listener from a socket of
its own, bound to an address the kernel picks (Linux autobind: a unique abstract name). The
relay remembers which uid each such address carries; the servicer looks its context.peer() up
(`uid_of`). The gRPC listener sits in a directory only the daemon can enter, so every unix peer
the server sees is one the relay connected and vouched for. The addresses name no uid: the
abstract names of a process show in /proc/net/unix (in the daemon's network namespace, which
the unit makes private), and who uses the daemon is nobody else's business.

Cost: each message passes through one recv and one send here (bench/relay.py measures it).

Thread rule: one thread (`relay`) owns every socket of the relay in one selector loop; start()
and stop() are called from the daemon's thread, uid_of() from any.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import selectors
import socket
import struct
import sys
import threading
import time

log = logging.getLogger("ntransformerd")

CHUNK = 256 << 10  # bytes read per recv: a whole gRPC frame of a long prompt in one piece
MAX_PER_UID = 256  # open connections per uid; past it a new one is closed (one user cannot take them all)
ACCEPT_PAUSE_S = 0.1  # out of file descriptors: stop accepting this long, not spin
STOP_FLUSH_S = 1.0  # on stop, how long what the server said last may take to reach its clients
# The relay's thread needs the interpreter after every recv/select; a thread busy in Python (the
# scheduler between steps) keeps it for the switch interval (5 ms by default) first. The relay
# sets the process's interval to this at start (bench/relay.py measures both).
SWITCH_INTERVAL_S = 0.0005
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process that connected `conn` (SO_PEERCRED)."""
    _, uid, _ = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return uid


def peer_address(name: bytes) -> str:
    """How gRPC writes the peer of a connection from abstract address `name` (context.peer())."""
    return "unix-abstract:" + name[1:].decode("ascii", "backslashreplace")


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


class Relay:
    """Accepts on the user socket and relays each connection to the gRPC server's listener."""

    def __init__(self):
        self.listener: socket.socket | None = None
        self.target = ""
        self._uids: dict[str, int] = {}  # peer address → uid, for the servicer (dict reads are atomic)
        self._per_uid: dict[int, int] = {}
        self._links: dict[socket.socket, _Link] = {}
        self._registered: dict[socket.socket, int] = {}
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._stop_at: float | None = None  # stop() was called: flush until every link is closed, or this
        self._paused_until = 0.0
        self._thread = threading.Thread(target=self._run, name="relay", daemon=True)

    def uid_of(self, peer: str) -> int | None:
        """The uid of the client behind gRPC peer `peer`; None for a peer the relay did not connect."""
        return self._uids.get(peer)

    @property
    def connections(self) -> int:
        return len(self._links) // 2

    def start(self, listener: socket.socket, target: str) -> None:
        """Serve `listener` (bound and listening: sockets.listen), relaying to the unix socket
        at `target` (sockets.bind_private)."""
        self.listener, self.target = listener, target
        if sys.getswitchinterval() > SWITCH_INTERVAL_S:
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        self.listener.setblocking(False)
        self._sel.register(self.listener, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._thread.start()

    def stop(self) -> None:
        """Close the user socket, then every connection once what the gRPC server sent on it has
        been passed on (call it after the server has stopped), STOP_FLUSH_S at most."""
        self._stop_at = time.monotonic() + STOP_FLUSH_S
        if not self._thread.is_alive():
            return
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(STOP_FLUSH_S + 5.0)

    # ---- the loop (thread `relay`) ----------------------------------------------------------

    def _run(self) -> None:
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
                for key, ev in self._sel.select(timeout):
                    s = key.fileobj
                    if s is self.listener:
                        self._accept()
                    elif s is self._wake_r:  # stop(): no new connections
                        self._sel.unregister(self._wake_r)
                        if not self._paused_until:
                            self._sel.unregister(self.listener)
                        self._paused_until = 0.0
                    elif s in self._links:
                        self._serve(self._links[s], s, ev)
        except Exception:  # noqa: BLE001 - a bug here must be seen; the user socket is deaf after it
            log.exception("the user socket's relay stopped: no new connections are served")
        finally:
            for link in list({id(x): x for x in self._links.values()}.values()):
                self._close(link)
            self._sel.close()
            self.listener.close()
            self._wake_r.close()
            self._wake_w.close()

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
        inner = None
        try:
            uid = peer_uid(outer)
            if self._per_uid.get(uid, 0) >= MAX_PER_UID:
                log.warning("uid %d has %d connections open: closing its new one", uid, MAX_PER_UID)
                outer.close()
                return
            inner = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            inner.bind("")  # autobind: a unique abstract address, which the servicer sees as the peer
            inner.setblocking(False)
            inner.connect(self.target)  # a unix connect completes at once, or fails (backlog full: EAGAIN)
            outer.setblocking(False)
        except OSError as e:
            log.warning("cannot relay a client connection to the gRPC server: %s", e)
            outer.close()
            if inner is not None:
                inner.close()
            return
        address = peer_address(inner.getsockname())
        link = _Link(outer, inner, uid, address)
        self._uids[address] = uid  # before the first byte reaches the server
        self._per_uid[uid] = self._per_uid.get(uid, 0) + 1
        self._links[outer] = self._links[inner] = link
        for s in (outer, inner):
            self._update(link, s)

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

    def _close(self, link: _Link) -> None:
        for s in (link.outer, link.inner):
            if self._registered.pop(s, 0):
                self._sel.unregister(s)
            self._links.pop(s, None)
            s.close()
        if self._uids.pop(link.address, None) is not None:
            self._per_uid[link.uid] -= 1
            if not self._per_uid[link.uid]:
                del self._per_uid[link.uid]
