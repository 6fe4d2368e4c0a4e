"""Where the sockets are: the one place the socket path and its environment are resolved.

Order: an explicit path (`--socket`), then $NTX_SOCKET, then the system default. The daemon
and the client both ask here, so they cannot disagree.

The admin socket, unless given: as root (the service) admin.sock next to the user socket; as any
other user (a daemon started by hand) in that user's runtime directory, $XDG_RUNTIME_DIR, where a
user's sockets go, never in the directory the daemon was started from; none where the runtime
directory is not set.
"""

from __future__ import annotations

import hashlib
import os

RUNTIME_DIR = "/run/ntransformer"
SYSTEM_SOCKET = f"{RUNTIME_DIR}/ntransformerd.sock"
SYSTEM_ADMIN_SOCKET = f"{RUNTIME_DIR}/admin.sock"
SOCKET_ENV = "NTX_SOCKET"
ADMIN_SOCKET_ENV = "NTX_ADMIN_SOCKET"
SOCKET_GROUP = "ntransformer"


def socket_path(explicit: str | None = None) -> str:
    """The user socket: `explicit`, else $NTX_SOCKET, else /run/ntransformer/ntransformerd.sock."""
    return os.path.abspath(explicit or os.environ.get(SOCKET_ENV) or SYSTEM_SOCKET)


def admin_socket_path(explicit: str | None = None, *, user_socket: str | None = None) -> str:
    """The admin socket: `explicit`, else $NTX_ADMIN_SOCKET, else default_admin_socket of the user
    socket ("" where there is none)."""
    if explicit or os.environ.get(ADMIN_SOCKET_ENV):
        return os.path.abspath(explicit or os.environ[ADMIN_SOCKET_ENV])
    return default_admin_socket(socket_path(user_socket))


def default_admin_socket(user_socket: str, *, euid: int | None = None, environ=os.environ) -> str:
    """Where a daemon serving `user_socket` keeps its admin socket unless told: as root, admin.sock
    next to the user socket; as another user, $XDG_RUNTIME_DIR/ntransformer/admin-ID.sock, ID
    naming the user socket (two daemons of one user keep apart); "" (no admin socket) where
    $XDG_RUNTIME_DIR is not set."""
    user_socket = os.path.abspath(user_socket)
    if (os.geteuid() if euid is None else euid) == 0:
        return os.path.join(os.path.dirname(user_socket), "admin.sock")
    runtime = environ.get("XDG_RUNTIME_DIR", "")
    if not os.path.isabs(runtime):
        return ""
    tag = hashlib.sha256(user_socket.encode()).hexdigest()[:16]
    return os.path.join(runtime, "ntransformer", f"admin-{tag}.sock")


def grpc_target(path: str) -> str:
    return f"unix:{os.path.abspath(path)}"
