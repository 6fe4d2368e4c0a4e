"""The daemon's unix sockets: where they go, who may open them, and cleaning them up.

As root the user socket is group `ntransformer` mode 0660 and the admin socket root 0600; as any
other user both are files owned by that user wherever it can write. A socket's directory must be
one that nobody else can change: not a symlink, owned by root or the daemon's user, not writable
by group or others, and every directory above it the same (or sticky, as /tmp is); otherwise
another user could move or swap the sockets, and the daemon refuses to start.

A socket is bound inside a private directory (mode 0700) made next to its final path, given its
mode and group there, where nobody else can reach or replace it, and then renamed into place:
it never appears at its path with another mode or group, and nothing is changed through a path
someone else could redirect.

The user socket is the relay's (relay.py), which learns each client's uid and passes its bytes
on to the gRPC server's own listener: a socket left in such a private directory (bind_private),
so that nobody but the daemon can connect to the server past the relay.
"""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import pwd
import socket
import stat
import tempfile

log = logging.getLogger("ntransformerd")

USER_MODE = 0o660
ADMIN_MODE = 0o600
DIR_MODE = 0o755  # clients need to traverse it; the socket modes do the access control
MAX_PATH = 107  # sun_path holds 108 bytes with the terminating NUL


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


def _owner(uid: int) -> str:
    try:
        return f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _writers(mode: int) -> str:
    return " and ".join(w for w, bit in (("its group", stat.S_IWGRP), ("all users", stat.S_IWOTH)) if mode & bit)


def _ancestors(d: str) -> list[str]:
    out, cur = [], os.path.dirname(d)
    while True:
        out.append(cur)
        if cur == os.path.dirname(cur):
            return out
        cur = os.path.dirname(cur)


def check_directory(d: str) -> None:
    """Refuse a socket directory that a user other than root and this one could change."""
    trusted = {0, os.geteuid()}
    st = os.lstat(d)
    if stat.S_ISLNK(st.st_mode):
        raise SocketError(f"the socket directory {d} is a symlink (to {os.readlink(d)}): whoever can change "
                          "the link can redirect the sockets. Give --socket a path in a real directory")
    if not stat.S_ISDIR(st.st_mode):
        raise SocketError(f"{d} is not a directory: pick another --socket")
    fix = f"Use a directory owned by root or by you that only its owner can write (e.g. mkdir -m 0755 DIR)"
    if st.st_uid not in trusted:
        raise SocketError(f"the socket directory {d} is owned by {_owner(st.st_uid)}, who could move or "
                          f"replace the sockets. {fix}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise SocketError(f"the socket directory {d} is writable by {_writers(st.st_mode)} (mode "
                          f"{stat.S_IMODE(st.st_mode):04o}), who could move or replace the sockets: "
                          f"chmod go-w {d}, or pick another --socket. {fix}")
    # the directories above, as named and as resolved: a writer there could swap `d` itself
    for a in dict.fromkeys(_ancestors(d) + _ancestors(os.path.realpath(d))):
        st = os.stat(a)
        if st.st_uid not in trusted:
            raise SocketError(f"{a}, above the socket directory {d}, is owned by {_owner(st.st_uid)}, who could "
                              f"replace {d}. {fix}")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
            raise SocketError(f"{a}, above the socket directory {d}, is writable by {_writers(st.st_mode)} "
                              f"without the sticky bit, so {d} could be replaced. {fix}")


def prepare(path: str) -> None:
    """Make the directory (or check the one there); refuse a path a live daemon serves; remove a
    stale socket."""
    d = os.path.dirname(path)
    if not os.path.lexists(d):
        try:
            os.makedirs(d, mode=DIR_MODE)
        except OSError as e:
            raise SocketError(f"cannot create {d} for the socket: {e.strerror}. Run as root, or pass "
                              f"--socket with a path you can write (e.g. --socket ./ntx.sock)") from None
    check_directory(d)
    if len(path.encode()) > MAX_PATH:
        raise SocketError(f"socket path is {len(path.encode())} bytes; unix sockets allow {MAX_PATH}: "
                          "pick a shorter path")
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise SocketError(f"{path} exists and is not a socket: remove it or pick another --socket")
        if _in_use(path):
            raise SocketError(f"another ntransformerd is already serving {path}: stop it "
                              "(systemctl stop ntransformerd) or pick another --socket")
        os.unlink(path)


def _group_id(group: str, path: str) -> int | None:
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        log.warning("group %s does not exist, so %s stays root-only: create it with "
                    "systemd-sysusers (packaging/sysusers.d/ntransformer.conf) or "
                    "groupadd --system %s, or pass --socket-group ''", group, path, group)
        return None


def _staged(path: str, *, mode: int, group: str, bind_at) -> None:
    """Bind at `path` through `bind_at(staged path)` (which raises SocketError), with `mode` and,
    when root, `group`: made in a private directory next to it, then renamed into place."""
    prepare(path)
    gid = _group_id(group, path) if group and is_root() else None
    private = tempfile.mkdtemp(prefix=".ntx-", dir=os.path.dirname(path))  # 0700, ours
    staged = os.path.join(private, "s")
    try:
        if len(staged.encode()) > MAX_PATH:
            raise SocketError(f"socket directory {os.path.dirname(path)} is too long a path to bind in "
                              f"(unix sockets allow {MAX_PATH} bytes): pick a shorter --socket")
        bind_at(staged)
        os.chmod(staged, mode)
        if gid is not None:
            os.chown(staged, -1, gid, follow_symlinks=False)
        os.rename(staged, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(staged)
        with contextlib.suppress(OSError):
            os.rmdir(private)


def _add_port(server, path: str, shown: str) -> None:
    try:
        port = server.add_insecure_port(f"unix:{path}")
    except RuntimeError as e:
        port, err = 0, e
    else:
        err = None
    if not port:
        raise SocketError(f"cannot bind {shown}: {err or 'gRPC refused the address'}. Is the directory "
                          "writable? Pick another --socket")


def bind(server, path: str, *, mode: int, group: str = "") -> None:
    """Bind `server` (a grpc.Server, not yet started) to `path` with `mode`, group-owned when root."""
    _staged(path, mode=mode, group=group, bind_at=lambda staged: _add_port(server, staged, path))


def listen(path: str, *, mode: int, group: str = "") -> socket.socket:
    """A listening unix socket at `path` with `mode`, group-owned when root (relay.py accepts on it)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

    def bind_at(staged: str) -> None:
        try:
            sock.bind(staged)
            sock.listen(socket.SOMAXCONN)
        except OSError as e:
            raise SocketError(f"cannot bind {path}: {e.strerror}. Is the directory writable? Pick another "
                              "--socket") from None
    try:
        _staged(path, mode=mode, group=group, bind_at=bind_at)
    except BaseException:
        sock.close()
        raise
    return sock


PRIVATE_PREFIX = ".ntx-grpc-"


def _remove_stale_private(d: str) -> None:
    """Remove what a daemon killed in `d` left of bind_private: our directories whose listener
    nobody serves."""
    for name in os.listdir(d):
        path = os.path.join(d, name)
        if not name.startswith(PRIVATE_PREFIX) or os.lstat(path).st_uid != os.geteuid() \
                or not stat.S_ISDIR(os.lstat(path).st_mode):
            continue
        inner = os.path.join(path, "s")
        if not _in_use(inner):
            with contextlib.suppress(OSError):
                os.unlink(inner)
            with contextlib.suppress(OSError):
                os.rmdir(path)


def bind_private(server, near: str) -> str:
    """Bind `server` in a new directory only this user can enter, next to socket `near`: a
    listener nobody else can connect to (the relay's target). Returns its path."""
    prepare(near)  # the directory is checked before anything is made in it
    _remove_stale_private(os.path.dirname(near))
    private = tempfile.mkdtemp(prefix=PRIVATE_PREFIX, dir=os.path.dirname(near))  # 0700, ours
    path = os.path.join(private, "s")
    try:
        if len(path.encode()) > MAX_PATH:
            raise SocketError(f"socket directory {os.path.dirname(near)} is too long a path to bind in "
                              f"(unix sockets allow {MAX_PATH} bytes): pick a shorter --socket")
        _add_port(server, path, near)
    except BaseException:
        os.rmdir(private)
        raise
    return path


def remove_private(path: str) -> None:
    """Remove bind_private's socket and its directory."""
    remove(path)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(path))


def remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
