"""The daemon's TCP port, for clients on other hosts: TLS with client certificates required.

Off unless `tcp_listen` is configured. gRPC's own TLS (ssl_server_credentials with
require_client_auth) does the work: a client without a certificate signed by `tls_client_ca`
fails the handshake and never reaches a servicer. The same server as the user socket serves it,
so TCP clients see the same verbs (never the admin ones) and the same health status.
"""

from __future__ import annotations

import logging

import grpc

from ntransformerd.server.sockets import SocketError

log = logging.getLogger("ntransformerd")


def _read(key: str, path: str, marker: bytes) -> bytes:
    """The PEM file of config key `key`; gRPC itself only says "failed to bind" for a bad one."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise SocketError(f"cannot read {key} {path}: {e.strerror}") from None
    if b"-----BEGIN " not in data or marker not in data:
        what = "a private key" if marker == b"PRIVATE KEY-----" else "a certificate"
        raise SocketError(f"{key} {path} is not {what} in PEM form (-----BEGIN ...): point {key} at the right file")
    return data


def credentials(config) -> grpc.ServerCredentials:
    cert = _read("tls_cert", config.tls_cert, b"CERTIFICATE-----")
    key = _read("tls_key", config.tls_key, b"PRIVATE KEY-----")
    ca = _read("tls_client_ca", config.tls_client_ca, b"CERTIFICATE-----")
    try:
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
    except (TypeError, ValueError, RuntimeError) as e:
        raise SocketError(f"the TLS files are not usable ({e}): tls_cert and tls_key must be one PEM "
                          "certificate and its key, tls_client_ca a PEM CA certificate") from None


def bind(server, config) -> int:
    """Add the TLS port `config.tcp_listen` to `server` (not yet started); returns the port."""
    try:
        port = server.add_secure_port(config.tcp_listen, credentials(config))
    except RuntimeError as e:
        port, err = 0, e
    else:
        err = None
    if not port:
        raise SocketError(f"cannot listen on {config.tcp_listen}: {err or 'gRPC refused the address'}. Is the "
                          "port in use (ss -ltnp), the address not on this host, or tls_key not the key of tls_cert? "
                          "Change tcp_listen or the TLS files")
    log.info("listening on TCP %s with TLS (client certificates required)",
             config.tcp_listen.rpartition(":")[0] + f":{port}")
    return port
