"""ntx-openai: serve the OpenAI HTTP API in front of ntransformerd.

    ntx-openai                                   # the local daemon, http://127.0.0.1:8000/v1
    ntx-openai --port 8080 --api-keys-file ~/.config/ntx/keys
    ntx-openai --target gpu1:7443 --target gpu2:7443 --tls-ca ca.pem --tls-cert me.pem --tls-key me.key
"""

from __future__ import annotations

import argparse
import logging
import sys

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


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
                   "(one per line)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


def config_from_args(args):
    from ntx_client.channels import TLS, grpc_target
    from ntx_client.openai_gateway.app import GatewayConfig, read_api_keys

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
    if args.target:  # fail here, with the flag's name, rather than on the first request
        grpc_target(args.target)
        tls.credentials()
    keys = read_api_keys(args.api_keys_file) if args.api_keys_file else frozenset()
    return GatewayConfig(socket=args.socket, targets=tuple(args.target or ()), tls=tls, api_keys=keys)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        import uvicorn

        from ntx_client.openai_gateway.app import create_app
    except ImportError as e:
        print(f"ntx-openai: {e.name} is missing: install the gateway's extra, pip install 'ntransformer[openai]'",
              file=sys.stderr)
        return 1
    from ntx_client.channels import TargetError
    try:
        config = config_from_args(args)
    except TargetError as e:
        print(f"ntx-openai: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(name)s: %(message)s")
    uvicorn.run(create_app(config), host=args.host, port=args.port, log_level=args.log_level,
                access_log=args.log_level == "debug", timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
