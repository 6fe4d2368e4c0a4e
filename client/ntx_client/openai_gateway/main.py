"""ntx-openai: serve the OpenAI HTTP API in front of ntransformerd.

    ntx-openai                                   # the local daemon, http://127.0.0.1:8000/v1
    ntx-openai --port 8080 --api-keys-file ~/.config/ntx/keys
    ntx-openai --target gpu1:7443 --target gpu2:7443 --tls-ca ca.pem --tls-cert me.pem --tls-key me.key
    ntx-openai --host 0.0.0.0 --allowed-host gpu-box.lan --api-keys-file keys --open-monitoring
"""

from __future__ import annotations

import argparse
import logging
import sys

from ntx_client.channels import TLS, TargetError, grpc_target

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_MAX_CONNECTIONS = 256


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ntx-openai", description="Serve the OpenAI HTTP API in front of ntransformerd.")
    p.add_argument("--host", default=DEFAULT_HOST,
                   help=f"address to listen on (default {DEFAULT_HOST}: this machine only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"HTTP port (default {DEFAULT_PORT})")
    p.add_argument("--socket", help="the daemon's socket (default $NTX_SOCKET or /run/ntransformer/ntransformerd.sock)")
    p.add_argument("--target", action="append", metavar="HOST:PORT",
                   help="a daemon on TCP with TLS (repeat for several; requests are spread round-robin)")
    p.add_argument("--tls-ca", help="CA certificate that signed the daemons' certificates (PEM)")
    p.add_argument("--tls-cert", help="this gateway's client certificate (PEM)")
    p.add_argument("--tls-key", help="the key of --tls-cert (PEM)")
    p.add_argument("--tls-server-name", help="name the daemons' certificates carry (default: the first target's host)")
    p.add_argument("--api-keys-file", help="require 'Authorization: Bearer KEY' with a KEY from this file "
                   "(one per line), on every route: /health and /metrics too, unless --open-monitoring")
    p.add_argument("--open-monitoring", action="store_true",
                   help="serve /health and /metrics without a key even with --api-keys-file (e.g. for a local "
                        "Prometheus; they show the daemons' sockets, model and queues)")
    p.add_argument("--allowed-host", action="append", metavar="NAME",
                   help="also answer requests whose Host header is NAME (repeat for several; * for any). By "
                        "default only localhost, 127.0.0.1, ::1 and the --host address are answered: a web page "
                        "cannot reach the gateway through a browser under a name of its own (DNS rebinding)")
    p.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S, metavar="S",
                   help="close a connection whose request line and headers have not all arrived S seconds after "
                        f"it opened, or after the request's first byte (default {DEFAULT_HEADER_TIMEOUT_S:g})")
    p.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S, metavar="S",
                   help="close a connection whose request body has not all arrived S seconds after its headers "
                        f"(default {DEFAULT_BODY_TIMEOUT_S:g})")
    p.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS, metavar="N",
                   help="connections and requests served at once; past them a request gets 503 "
                        f"(default {DEFAULT_MAX_CONNECTIONS})")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


def config_from_args(args):
    from ntx_client.openai_gateway.app import (  # lazy: starlette, the [openai] extra
        LOOPBACK_HOSTS, GatewayConfig, read_api_keys)

    if args.socket and args.target:
        raise SystemExit("ntx-openai: give --socket or --target, not both")
    tls_files = (args.tls_ca, args.tls_cert, args.tls_key)
    if any(tls_files) and not all(tls_files):
        raise SystemExit("ntx-openai: TLS needs all three of --tls-ca, --tls-cert and --tls-key")
    tls = TLS(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key, server_name=args.tls_server_name) \
        if all(tls_files) else None
    if args.target and tls is None:
        raise SystemExit("ntx-openai: TCP targets need TLS: pass --tls-ca, --tls-cert and --tls-key (the daemons "
                         "refuse clients without a certificate)")
    if not 0 < args.port < 65536:
        raise SystemExit(f"ntx-openai: --port {args.port} is not a TCP port (1..65535)")
    for flag, seconds in (("--header-timeout", args.header_timeout), ("--body-timeout", args.body_timeout)):
        if not 0 < seconds < float("inf"):
            raise SystemExit(f"ntx-openai: {flag} {seconds:g} is not a time: give seconds above 0")
    if args.max_connections < 2:
        raise SystemExit(f"ntx-openai: --max-connections {args.max_connections} leaves no room for a request: "
                         "give 2 or more")
    hosts = {*LOOPBACK_HOSTS, *(args.allowed_host or ())}
    if args.host not in ("0.0.0.0", "::", ""):  # a wildcard address is no name a client would send
        hosts.add(args.host)
    if args.target:  # fail here, with the flag's name, rather than on the first request
        grpc_target(args.target)
        tls.credentials()
    keys = read_api_keys(args.api_keys_file) if args.api_keys_file else frozenset()
    return GatewayConfig(socket=args.socket, targets=tuple(args.target or ()), tls=tls, api_keys=keys,
                         open_monitoring=args.open_monitoring, allowed_hosts=frozenset(hosts))


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        from ntx_client.openai_gateway.app import create_app  # lazy: starlette, the [openai] extra
        from ntx_client.openai_gateway.serve import serve  # lazy: uvicorn, the [openai] extra
    except ImportError as e:
        print(f"ntx-openai: {e.name} is missing: install the gateway's extra, pip install 'ntransformer[openai]'",
              file=sys.stderr)
        return 1
    try:
        config = config_from_args(args)
    except TargetError as e:
        print(f"ntx-openai: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(name)s: %(message)s")
    serve(create_app(config), host=args.host, port=args.port, log_level=args.log_level,
          header_timeout=args.header_timeout, body_timeout=args.body_timeout, max_connections=args.max_connections)
    return 0


if __name__ == "__main__":
    sys.exit(main())
