"""ntransformerd's configuration: one keyword-only object from the TOML file and the flags.

Precedence: flag > file > default. The file is `--config PATH`, else
/etc/ntransformer/ntransformerd.toml when it exists. Keys are the flag names with underscores
(packaging/ntransformerd.toml lists them all).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import tomllib

from ntx_client import paths

DEFAULT_CONFIG_FILE = "/etc/ntransformer/ntransformerd.toml"
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 1 << 10, "m": 1e6, "mb": 1e6, "mib": 1 << 20,
          "g": 1e9, "gb": 1e9, "gib": 1 << 30, "t": 1e12, "tb": 1e12, "tib": 1 << 40}


class ConfigError(ValueError):
    """A bad setting; the message names the key and what it accepts."""


def parse_bytes(value: str | int | None) -> int | None:
    """'24GiB' → 25769803776; None, '' and 'auto' → None (the tier plan decides)."""
    if value is None or isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if str(value).strip().lower() in ("", "auto"):
        return None
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"{value!r} is not a size: write e.g. 24GiB, 512MiB, 8G or auto")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclasses.dataclass(frozen=True, kw_only=True)
class DaemonConfig:
    """Everything ntransformerd is configured with, passed down as one object."""

    socket: str = paths.SYSTEM_SOCKET
    admin_socket: str = ""  # empty: admin.sock next to `socket`
    socket_group: str = paths.SOCKET_GROUP  # group owning the user socket when run as root; "" = none
    # ---- TCP with TLS, for clients on other hosts (off unless tcp_listen is set) ---------------
    tcp_listen: str = ""  # host:port, e.g. "0.0.0.0:7443" (port 0: any free one, logged); empty: off
    tls_cert: str = ""  # this daemon's certificate (PEM)
    tls_key: str = ""  # its private key (PEM)
    tls_client_ca: str = ""  # clients must present a certificate signed by this CA (PEM)
    # ---- end of TCP keys -----------------------------------------------------------------------
    model: str = ""  # GGUF path; empty: the embedded default model
    backend: str = "auto"  # cpu | cuda | auto
    vram_budget: int | None = None  # bytes of VRAM the tier plan may use (None: what is free)
    pinned_budget: int | None = None  # bytes of pinned host RAM for the tier plan
    max_batch: int = 8  # sequences decoded together (KV-cache slots)
    max_queue: int = 64  # requests waiting for a slot before RESOURCE_EXHAUSTED
    max_ctx: int = 4096  # positions per sequence (capped by the model)
    kv_dtype: str = "f32"
    prefill_chunk: int = 256  # prompt tokens per step across all prefilling requests
    default_max_tokens: int = 512  # when a request does not say
    drain_timeout: float = 5.0  # seconds in-flight requests get to finish on SIGTERM / Drain
    log_level: str = "info"
    # BLAS threads of the CPU backend. 1 by default: with 2 OpenBLAS threads on 2 cores a batch of
    # 8 ran 25x slower than one sequence (each small GEMM waited ~16 ms for its worker thread),
    # which erased what batching gains; 0 leaves OpenBLAS's own default.
    cpu_threads: int = 1

    def __post_init__(self):
        if not self.admin_socket:
            object.__setattr__(self, "admin_socket",
                               os.path.join(os.path.dirname(os.path.abspath(self.socket)), "admin.sock"))
        self.validate()

    def validate(self) -> None:
        self.validate_tcp()
        if self.backend not in ("cpu", "cuda", "auto"):
            raise ConfigError(f"backend {self.backend!r}: use cpu, cuda or auto")
        if self.kv_dtype not in ("f32", "f16"):
            raise ConfigError(f"kv_dtype {self.kv_dtype!r}: use f32 or f16")
        for key, lo, hi in (("max_batch", 1, 4096), ("max_queue", 0, 1 << 20), ("max_ctx", 16, 1 << 24),
                            ("prefill_chunk", 1, 1 << 20), ("default_max_tokens", 1, 1 << 24),
                            ("cpu_threads", 0, 4096)):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise ConfigError(f"{key} = {v!r}: must be an integer in {lo}..{hi}")
        if not (isinstance(self.drain_timeout, (int, float)) and 0 <= self.drain_timeout <= 3600):
            raise ConfigError(f"drain_timeout = {self.drain_timeout!r}: seconds in 0..3600")
        if os.path.abspath(self.socket) == os.path.abspath(self.admin_socket):
            raise ConfigError("socket and admin_socket must be different paths")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"log_level {self.log_level!r}: use debug, info, warning or error")

    def validate_tcp(self) -> None:
        """The TCP keys: all or nothing, and TLS files that exist (a client certificate is required)."""
        tls = {"tls_cert": self.tls_cert, "tls_key": self.tls_key, "tls_client_ca": self.tls_client_ca}
        for key, v in {"tcp_listen": self.tcp_listen, **tls}.items():
            if not isinstance(v, str):
                raise ConfigError(f"{key} = {v!r}: must be a string")
        if not self.tcp_listen:
            if any(tls.values()):
                raise ConfigError("tls_cert, tls_key and tls_client_ca are set but tcp_listen is not: set "
                                  'tcp_listen = "HOST:PORT" to serve on TCP, or remove them')
            return
        host, sep, port = self.tcp_listen.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise ConfigError(f"tcp_listen = {self.tcp_listen!r}: write HOST:PORT, e.g. \"0.0.0.0:7443\" "
                              "(all interfaces) or \"[::]:7443\"")
        missing = [k for k, v in tls.items() if not v]
        if missing:
            raise ConfigError(f"tcp_listen is set, so TLS is required: set {', '.join(missing)} (PEM files; "
                              "the README's 'Several hosts' section makes them)")
        for key, path in tls.items():
            if not os.path.isfile(path):
                raise ConfigError(f"{key} = {path!r}: no such file")


FIELDS = {f.name: f for f in dataclasses.fields(DaemonConfig)}
_BYTES = ("vram_budget", "pinned_budget")


def argument_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ntransformerd", description="Serve a GGUF model over gRPC on a unix socket.")
    p.add_argument("--config", help=f"TOML file (default {DEFAULT_CONFIG_FILE} if it exists)")
    p.add_argument("--socket", help=f"user socket (default $NTX_SOCKET or {paths.SYSTEM_SOCKET})")
    p.add_argument("--admin-socket", help="root-only admin socket (default admin.sock next to --socket)")
    p.add_argument("--socket-group", help="group that owns the user socket when run as root ('' for none)")
    p.add_argument("--tcp-listen", metavar="HOST:PORT", help="also serve on TCP with TLS (needs the --tls-* files)")
    p.add_argument("--tls-cert", help="this daemon's TLS certificate (PEM)")
    p.add_argument("--tls-key", help="the key of --tls-cert (PEM)")
    p.add_argument("--tls-client-ca", help="CA that signed the clients' certificates (PEM); clients must have one")
    p.add_argument("--model", help="GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--backend", choices=("cpu", "cuda", "auto"))
    p.add_argument("--vram-budget", help="VRAM the tier plan may use, e.g. 24GiB (default: what is free)")
    p.add_argument("--pinned-budget", help="pinned host RAM for the tier plan, e.g. 64GiB")
    p.add_argument("--max-batch", type=int, help="sequences decoded together")
    p.add_argument("--max-queue", type=int, help="requests waiting for a slot before RESOURCE_EXHAUSTED")
    p.add_argument("--max-ctx", type=int, help="positions per sequence")
    p.add_argument("--kv-dtype", choices=("f32", "f16"))
    p.add_argument("--prefill-chunk", type=int, help="prompt tokens per scheduler step")
    p.add_argument("--default-max-tokens", type=int)
    p.add_argument("--drain-timeout", type=float, help="seconds in-flight requests get on SIGTERM")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    p.add_argument("--cpu-threads", type=int, help="BLAS threads for the CPU backend (default 1; 0 = BLAS default)")
    return p


def from_file(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config {path} is not valid TOML: {e}") from None
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise ConfigError(f"config {path}: unknown key(s) {', '.join(unknown)}; known: {', '.join(FIELDS)}")
    return data


def load(argv: list[str] | None = None, *, environ=os.environ) -> DaemonConfig:
    """Flags over the file over the defaults. Raises ConfigError with a message to show as is."""
    args = argument_parser().parse_args(argv)
    file = args.config or (DEFAULT_CONFIG_FILE if os.path.exists(DEFAULT_CONFIG_FILE) else None)
    values = from_file(file) if file else {}
    for name in FIELDS:
        v = getattr(args, name, None)
        if v is not None:
            values[name] = v
    if "socket" not in values and environ.get(paths.SOCKET_ENV):
        values["socket"] = environ[paths.SOCKET_ENV]
    for name in _BYTES:
        if name in values:
            values[name] = parse_bytes(values[name])
    for name in ("socket", "admin_socket", "model", "tls_cert", "tls_key", "tls_client_ca"):
        if values.get(name):
            values[name] = os.path.abspath(os.path.expanduser(values[name]))
    try:
        return DaemonConfig(**values)
    except TypeError as e:  # a wrong type in the file
        raise ConfigError(f"config: {e}") from None
