"""Where the sockets are: the one place the socket path and its environment are resolved.

Order: an explicit path (`--socket`), then $NTX_SOCKET, then the system default. The daemon
and the client both ask here, so they cannot disagree.
"""

from __future__ import annotations

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
    """The admin socket: `explicit`, else $NTX_ADMIN_SOCKET, else admin.sock next to the user socket."""
    if explicit or os.environ.get(ADMIN_SOCKET_ENV):
        return os.path.abspath(explicit or os.environ[ADMIN_SOCKET_ENV])
    return os.path.join(os.path.dirname(socket_path(user_socket)), "admin.sock")


def grpc_target(path: str) -> str:
    return f"unix:{os.path.abspath(path)}"
