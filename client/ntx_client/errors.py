"""Errors the client raises, each naming the cause and the fix."""

from __future__ import annotations

import grp
import os

import grpc

from ntx_proto.paths import ADMIN_SOCKET_ENV, SOCKET_GROUP


class NtxError(Exception):
    """An error from ntransformerd or from reaching it: str() says what happened and what to do,
    `code` is the gRPC status code (said there, not again in the text)."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.code = code


class RequestTooLarge(NtxError, ValueError):
    """A request the daemon would refuse for its size, refused here before it is sent (code
    INVALID_ARGUMENT, as the daemon would answer)."""

    def __init__(self, message: str):
        super().__init__(message, grpc.StatusCode.INVALID_ARGUMENT)


class ConnectionFailed(NtxError):
    """The daemon's socket could not be reached (not running, wrong path)."""


class PermissionDenied(NtxError):
    """The socket exists but this user may not open it."""


def connection_error(path: str, details: str = "", *, admin: bool = False) -> NtxError:
    """Explain why `path` (with `admin`, the daemon's admin socket) cannot be reached, from what
    the filesystem says about it."""
    if os.path.exists(path) and not os.access(path, os.R_OK | os.W_OK) or "ermission denied" in details:
        return permission_denied(path)
    if admin and not os.path.exists(path):
        return ConnectionFailed(
            f"cannot reach ntransformerd's admin socket at {path}: no such socket. Is it running? "
            f"systemctl status ntransformerd. A daemon started by hand keeps it at its --admin-socket, else "
            f"as root admin.sock next to its --socket, as another user in $XDG_RUNTIME_DIR/ntransformer (its "
            f"'listening on' log line names it): pass that path with --admin-socket or set {ADMIN_SOCKET_ENV}",
            grpc.StatusCode.UNAVAILABLE)
    if not os.path.exists(path):
        return ConnectionFailed(
            f"cannot reach ntransformerd at {path}: no such socket. Is it running? "
            f"systemctl status ntransformerd (or start one: ntransformerd --socket {path}; "
            f"or pass --socket / set NTX_SOCKET)", grpc.StatusCode.UNAVAILABLE)
    return ConnectionFailed(
        f"cannot reach ntransformerd at {path}: {details or 'connection refused'}. Is it running? "
        "systemctl status ntransformerd", grpc.StatusCode.UNAVAILABLE)


def tcp_connection_error(where: str, details: str = "") -> NtxError:
    """Explain why daemons on TCP (`where`: their host:port list) cannot be reached."""
    hint = ("is tcp_listen set in each daemon's ntransformerd.toml, and the port open between the hosts? "
            "systemctl status ntransformerd on each")
    low = details.lower()
    if "ssl" in low or "handshake" in low or "certificate" in low or "tls" in low:
        hint = ("the TLS handshake failed: the daemons' certificates must be signed by the CA given with --tls-ca "
                "and name the server name the client checks (--tls-server-name), and the client certificate "
                "(--tls-cert, --tls-key) must be signed by the daemons' tls_client_ca")
    return ConnectionFailed(f"cannot reach ntransformerd at {where}: {details or 'connection refused'}. {hint}",
                            grpc.StatusCode.UNAVAILABLE)


def socket_group(path: str) -> str:
    """The name of the group that owns `path` (its gid when the name is unknown)."""
    try:
        gid = os.stat(path).st_gid
    except OSError:
        return SOCKET_GROUP
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def permission_denied(path: str) -> PermissionDenied:
    """The socket's own group is the one to join: a daemon may run with another socket_group."""
    group = socket_group(path)
    if group in ("root", "0"):
        return PermissionDenied(
            f"permission denied on {path}: the socket belongs to group root, so only root may use it "
            f"(the daemon has no socket_group, or its group is missing): use sudo, or set socket_group "
            f"in /etc/ntransformer/ntransformerd.toml", grpc.StatusCode.PERMISSION_DENIED)
    return PermissionDenied(
        f"permission denied on {path}: add your user to group {group} and log in again "
        f"(sudo usermod -aG {group} $USER)", grpc.StatusCode.PERMISSION_DENIED)


def from_rpc_error(err: grpc.RpcError, path: str, *, admin: bool = False) -> NtxError:
    """`path`: the daemon's socket path (with `admin`, its admin socket), or for TCP targets
    their host:port list."""
    code, details = err.code(), err.details() or ""
    if code == grpc.StatusCode.UNAVAILABLE and ("connect" in details.lower() or "failed to" in details.lower()
                                                or "ermission" in details or "ssl" in details.lower()):
        if not os.path.isabs(path):
            return tcp_connection_error(path, details)
        return connection_error(path, details, admin=admin)
    return NtxError(details or f"the call ended with {code.name}", code)
