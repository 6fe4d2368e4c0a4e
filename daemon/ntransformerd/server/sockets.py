"""The daemon's unix sockets: where they go, who may open them, and cleaning them up.

As root the user socket is group `ntransformer` mode 0660 and the admin socket root 0600; as any
other user both are 0600-or-0660 files owned by that user wherever it can write. The mode is set
through the umask at bind time, so there is no moment when the socket is more open than asked.
"""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import socket
import stat

log = logging.getLogger("ntransformerd")

USER_MODE = 0o660
ADMIN_MODE = 0o600
DIR_MODE = 0o755  # clients need to traverse it; the socket modes do the access control


class SocketError(RuntimeError):
    """A socket cannot be created; the message names the cause and the fix."""


def is_root() -> bool:
    return os.geteuid() == 0


def _in_use(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
            return True
        except OSError:
            return False


def prepare(path: str) -> None:
    """Make the directory; refuse a path a live daemon serves; remove a stale socket."""
    d = os.path.dirname(path)
    try:
        os.makedirs(d, mode=DIR_MODE, exist_ok=True)
    except OSError as e:
        raise SocketError(f"cannot create {d} for the socket: {e.strerror}. Run as root, or pass "
                          f"--socket with a path you can write (e.g. --socket ./ntx.sock)") from None
    if len(path.encode()) > 107:
        raise SocketError(f"socket path is {len(path.encode())} bytes; unix sockets allow 107: pick a shorter path")
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise SocketError(f"{path} exists and is not a socket: remove it or pick another --socket")
        if _in_use(path):
            raise SocketError(f"another ntransformerd is already serving {path}: stop it "
                              "(systemctl stop ntransformerd) or pick another --socket")
        os.unlink(path)


@contextlib.contextmanager
def _umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def bind(server, path: str, *, mode: int, group: str = "") -> None:
    """Bind `server` (a grpc.Server, not yet started) to `path` with `mode`, group-owned when root."""
    prepare(path)
    with _umask(0o777 & ~mode):
        try:
            port = server.add_insecure_port(f"unix:{path}")
        except RuntimeError as e:
            port, err = 0, e
        else:
            err = None
    if not port:
        raise SocketError(f"cannot bind {path}: {err or 'gRPC refused the address'}. Is the directory "
                          "writable? Pick another --socket")
    os.chmod(path, mode)
    if group and is_root():
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            log.warning("group %s does not exist, so %s stays root-only: create it with "
                        "systemd-sysusers (packaging/sysusers.d/ntransformer.conf) or "
                        "groupadd --system %s, or pass --socket-group ''", group, path, group)
            return
        os.chown(path, 0, gid)


def remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
