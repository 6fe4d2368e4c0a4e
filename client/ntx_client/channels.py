"""Where a client connects: one unix socket, or one or more daemons on TCP with TLS.

A target is a unix socket path (`/run/ntransformer/ntransformerd.sock`, `unix:/path`) or
`host:port`. Several targets make one gRPC channel over all their addresses, balanced by gRPC's
own `round_robin` policy with its client-side health checking (a daemon that is loading,
draining or gone answers NOT_SERVING or nothing, and gets no new calls) and its retry policy
(a call the chosen daemon refuses as UNAVAILABLE before answering is tried on another one).
There is no balancer of our own here: only the service config that asks gRPC for these.

TCP needs TLS with a client certificate (the daemon requires one): TLS(ca=, cert=, key=).
Every daemon's certificate must carry the name the client checks: `server_name`, by default
the host of the first target (with several hosts, give them all one shared name, e.g.
`ntransformerd`, in their certificates' subjectAltName and pass it as server_name).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import socket
from collections.abc import Sequence

import grpc
import grpc.experimental

from ntx_proto import paths

INFERENCE_SERVICE = "ntransformer.v1.Inference"
OPTIONS = [("grpc.max_receive_message_length", 64 << 20)]
# A blocking client reads a stream on the caller's own thread: otherwise each message wakes the
# channel's thread, which then wakes the caller, and on a host whose cores all compute beside
# the GPU every wake takes a core from the step (bench/cli_gap.py measures it)
BLOCKING_OPTIONS = [(grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)]
SERVICE_CONFIG = {
    "loadBalancingConfig": [{"round_robin": {}}],
    "healthCheckConfig": {"serviceName": INFERENCE_SERVICE},
    "methodConfig": [{
        "name": [{"service": INFERENCE_SERVICE}],
        "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.05s", "maxBackoff": "0.5s",
                        "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]},
    }],
}


class TargetError(ValueError):
    """A target list that cannot be connected to; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class TLS:
    """Files of a TLS client: the CA that signed the daemons, this client's certificate and key."""

    ca: str
    cert: str
    key: str
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        data = []
        for what, path in (("CA certificate", self.ca), ("client certificate", self.cert),
                           ("client key", self.key)):
            try:
                with open(path, "rb") as f:
                    data.append(f.read())
            except OSError as e:
                raise TargetError(f"cannot read the TLS {what} {path}: {e.strerror}: check --tls-ca, "
                                  "--tls-cert and --tls-key") from None
        return grpc.ssl_channel_credentials(root_certificates=data[0], private_key=data[2], certificate_chain=data[1])


def is_unix(target: str) -> bool:
    return target.startswith(("unix:", "/", "./", "../", "~")) or target.endswith(".sock")


def unix_path(target: str) -> str:
    return paths.socket_path(os.path.expanduser(target[5:] if target.startswith("unix:") else target))


def split_host_port(target: str) -> tuple[str, int]:
    host, sep, port = target.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise TargetError(f"target {target!r} is neither a socket path nor host:port (e.g. gpu1.lan:7443)")
    return host, int(port)


def _addresses(target: str) -> list[str]:
    """ipv4 / ipv6 address:port strings of a host:port, resolved now."""
    host, port = split_host_port(target)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise TargetError(f"cannot resolve {host!r} of target {target}: {e.strerror}") from None
    out = []
    for family, _, _, _, addr in infos:
        a = f"[{addr[0]}]:{addr[1]}" if family == socket.AF_INET6 else f"{addr[0]}:{addr[1]}"
        if a not in out:
            out.append(a)
    return out


def describe(targets: Sequence[str]) -> str:
    """The targets as an error message names them."""
    return ", ".join(unix_path(t) if is_unix(t) else t for t in targets)


def grpc_target(targets: Sequence[str]) -> str:
    """One gRPC target URI for all `targets` (a socket path, a DNS name, or a list of addresses)."""
    if not targets:
        raise TargetError("no target: give a socket path or host:port")
    if len(targets) == 1:
        t = targets[0]
        if is_unix(t):
            return paths.grpc_target(unix_path(t))
        host, port = split_host_port(t)
        return f"dns:///{t}" if not _is_ip(host) else f"{'ipv6' if ':' in host else 'ipv4'}:{t}"
    if any(is_unix(t) for t in targets):
        raise TargetError("several targets must all be host:port (TCP with TLS); a unix socket serves one host")
    addrs = [a for t in targets for a in _addresses(t)]
    v4 = [a for a in addrs if not a.startswith("[")]
    # one URI holds one address family; IPv4 where every target has it
    if len(v4) >= len(targets):
        return "ipv4:" + ",".join(v4)
    return "ipv6:" + ",".join(a for a in addrs if a.startswith("["))


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def channel_options(targets: Sequence[str], tls: TLS | None) -> list[tuple[str, object]]:
    """A unix socket keeps gRPC's defaults, so the daemon's own answer (e.g. "the model is still
    loading") reaches the caller; TCP targets get the balancing service config and TLS's name."""
    if all(is_unix(t) for t in targets):
        return list(OPTIONS)
    options = [*OPTIONS, ("grpc.service_config", json.dumps(SERVICE_CONFIG))]
    if tls is not None:
        name = tls.server_name or split_host_port(targets[0])[0]
        options += [("grpc.ssl_target_name_override", name), ("grpc.default_authority", name)]
    return options


def open_channel(targets: Sequence[str], tls: TLS | None = None, *, aio: bool = False):
    """A grpc (or grpc.aio) channel to `targets`: insecure on a unix socket, TLS on TCP."""
    uri = grpc_target(targets)
    options = channel_options(targets, tls) + ([] if aio else BLOCKING_OPTIONS)
    mod = grpc.aio if aio else grpc
    if uri.startswith("unix:"):
        return mod.insecure_channel(uri, options=options)
    if tls is None:
        raise TargetError(f"TCP target {describe(targets)} needs TLS: pass the CA, a client certificate and its key "
                          "(--tls-ca, --tls-cert, --tls-key); the daemon refuses clients without a certificate")
    return mod.secure_channel(uri, tls.credentials(), options=options)
