"""ntransformerd's configuration: one keyword-only object from the TOML file and the flags.

Precedence: flag > file > default. The file is `--config PATH`, else
/etc/ntransformer/ntransformerd.toml when it exists. Keys are the flag names with underscores
(packaging/ntransformerd.toml lists them all).

Every key goes through one table, KEYS: its check (type and range, the message naming the key)
and its flag's help. A new key is a field of DaemonConfig, a row of KEYS and a line of the
example file; the flag, its shown default and the validation follow from the row.

A value has one meaning everywhere: sizes and rates are read by ntransformerd/settings.py (the
convention ntx-model shares: 24GiB binary, 24GB decimal, a bare 24G refused), the file by
ntx_system/config_file.py (the reader ntx-admin shares). The keys keep their names on the way
down (EngineConfig's fields are the same names), and a backend named here must honour kv_dtype
and storage (backends.settle), else the key is refused at start.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from collections.abc import Callable
from typing import Any

from ntx_client import paths
from ntx_system import config_file
from ntx_system.config_file import ConfigError, boolean, kind as _kind, path, storage as storage_kind

from ntransformerd.engine import backends
from ntransformerd.engine.backends import BACKENDS
from ntransformerd.engine.layer_skip import parse_skip
from ntransformerd.engine.speculative import Mode, repeated_layers
from ntransformerd.settings import SettingError, Spelling, parse_rate, parse_size

DEFAULT_CONFIG_FILE = config_file.DEFAULT_PATH

__all__ = ["ConfigError", "DaemonConfig", "KEYS", "SPELLING", "argument_parser", "load"]


# ---- checks: (key, value) -> the value to use, or ConfigError naming the key ----------------------

Check = Callable[[str, Any], Any]


def integer(lo: int, hi: int) -> Check:
    def check(key, v):
        if not isinstance(v, int) or isinstance(v, bool):
            raise ConfigError(f"{key} = {v!r}: must be an integer in {lo}..{hi}, not {_kind(v)}")
        if not lo <= v <= hi:
            raise ConfigError(f"{key} = {v!r}: must be an integer in {lo}..{hi}")
        return v
    return check


def number(lo: float, hi: float, unit: str) -> Check:
    def check(key, v):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or not lo <= v <= hi:
            raise ConfigError(f"{key} = {v!r}: must be {unit} in {lo:g}..{hi:g}")
        return float(v)
    return check


def choice(*options: str) -> Check:
    def check(key, v):
        if not isinstance(v, str) or v.lower() not in options:
            raise ConfigError(f"{key} = {v!r}: use {', '.join(options[:-1])} or {options[-1]}")
        return v.lower()
    return check


_GROUP_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?")


def group_name(key: str, v: Any) -> str:
    if not isinstance(v, str):
        raise ConfigError(f"{key} = {v!r}: must be a group name in quotes (\"\" for none), not {_kind(v)}")
    if v and not _GROUP_NAME.fullmatch(v):
        raise ConfigError(f"{key} = {v!r}: not a group name (letters, digits, _ . -; \"\" for none)")
    return v


def host_port(key: str, v: Any) -> str:
    if not isinstance(v, str):
        raise ConfigError(f"{key} = {v!r}: must be \"HOST:PORT\" in quotes, not {_kind(v)}")
    host, sep, port = v.rpartition(":")
    if v and (not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536):
        raise ConfigError(f"{key} = {v!r}: write HOST:PORT, e.g. \"0.0.0.0:7443\" (all interfaces) or \"[::]:7443\"")
    return v


def size(minimum: int) -> Check:
    """Bytes (settings.parse_size: "24GiB", "24GB", a count of bytes; a bare "24G" is refused as
    ambiguous), or "auto" / "" / None: no limit (the tier plan uses what is free)."""
    def check(key, v):
        if v is None or (isinstance(v, str) and v.strip().lower() in ("", "auto")):
            return None
        try:
            n = parse_size(v, setting=key)
        except SettingError as e:
            raise ConfigError(e.worded(SPELLING)) from None
        if n < minimum:
            raise ConfigError(f"{key} = {v!r}: at least {minimum >> 20} MiB, or \"auto\" for what is free")
        return n
    return check


def rate(key: str, v: Any) -> float | None:
    """Bytes per second (settings.parse_rate: "6.5GB/s", "800MiB/s"), or "off" / "" / None."""
    if v is None or (isinstance(v, str) and v.strip().lower() in ("", "off")):
        return None
    if not isinstance(v, (str, float)):  # a bare 5 is more likely a slip than 5 bytes per second
        raise ConfigError(f'{key} = {v!r}: must be a rate in quotes such as "6.5GB/s", or "off"')
    try:
        return parse_rate(v, setting=key)
    except SettingError as e:
        raise ConfigError(e.worded(SPELLING)) from None


def _bool_flag(text: str) -> bool:
    low = text.lower()
    if low not in ("true", "false", "yes", "no", "1", "0"):
        raise argparse.ArgumentTypeError(f"{text!r}: use true or false")
    return low in ("true", "yes", "1")


def speculative_mode(key: str, v: Any) -> Mode:
    """The mode as a value (speculative.Mode), parsed once here; a Mode given stays itself."""
    if isinstance(v, Mode):
        return v
    if not isinstance(v, str):
        raise ConfigError(f"{key} = {v!r}: must be a mode in quotes, not {_kind(v)}")
    try:
        return Mode.parse(v)
    except ValueError as e:
        raise ConfigError(f"{key} = {v!r}: {e}") from None


def skip_spec(key: str, v: Any) -> str:
    if not isinstance(v, str):
        raise ConfigError(f"{key} = {v!r}: must be \"auto\", \"auto:0.03\", a count or \"3,7,11\" in quotes")
    try:
        parse_skip(v)
    except ValueError as e:
        raise ConfigError(f"{key} = {v!r}: {e}") from None
    twice = repeated_layers(v)
    if twice:
        raise ConfigError(f"{key} = {v!r}: {twice}, e.g. \"3,7,11\"")
    return v.strip().lower()


@dataclasses.dataclass(frozen=True)
class Key:
    """One configuration key: how its value is checked, and its flag."""

    check: Check
    help: str
    metavar: str = "TEXT"
    flag_type: Callable[[str], Any] = str  # how the flag's text becomes a value for `check`
    shown: str | None = None  # the default as --help shows it, where repr(default) would not say


KEYS: dict[str, Key] = {
    "socket": Key(path(), "user socket (also $NTX_SOCKET)", "PATH"),
    "admin_socket": Key(path(empty=""), "root-only admin socket", "PATH", shown="admin.sock next to --socket"),
    "socket_group": Key(group_name, "group owning the user socket when run as root ('' for none)", "GROUP"),
    "tcp_listen": Key(host_port, "also serve on TCP with TLS (needs the --tls-* files)", "HOST:PORT", shown="off"),
    "tls_cert": Key(path(empty=""), "this daemon's TLS certificate (PEM)", "PATH"),
    "tls_key": Key(path(empty=""), "the key of --tls-cert (PEM)", "PATH"),
    "tls_client_ca": Key(path(empty=""), "CA that signed the clients' certificates (PEM); clients must have one", "PATH"),
    "model": Key(path(empty=""), "GGUF file", "PATH", shown="the embedded SmolLM2-135M-Instruct"),
    "backend": Key(choice(*BACKENDS), ", ".join(BACKENDS[:-1]) + " or " + BACKENDS[-1], "NAME"),
    "vram_budget": Key(size(1 << 20), "VRAM the tier plan may use: 24GiB (binary) or 24GB (decimal); a bare 24G "
                       "is refused as ambiguous", "SIZE", shown="auto, what is free"),
    "pinned_budget": Key(size(1 << 20), "pinned host RAM for the tier plan, e.g. 64GiB", "SIZE",
                         shown="auto, what is free"),
    "max_batch": Key(integer(1, 4096), "sequences decoded together (KV-cache slots)", "N", int),
    "max_queue": Key(integer(0, 1 << 20), "requests waiting for a slot before RESOURCE_EXHAUSTED", "N", int),
    "max_ctx": Key(integer(16, 1 << 24), "positions per sequence (capped by the model)", "N", int),
    "kv_dtype": Key(choice("auto", "f32", "f16", "q8_0", "q4_0"), "KV-cache storage: auto (the backend's own: f32 "
                    "on the CPU, f16 on the GPU), f32, f16, q8_0 (half of f16's bytes, nearly lossless: bench/RESULTS.md) "
                    "or q4_0 (lossy); one the backend cannot store is refused", "TYPE"),
    "kv_blocks": Key(integer(0, 1 << 30), "KV-cache pool per device in blocks of 16 positions (0: the plan's "
                     "choice, `ntx-model --plan` shows it); max_ctx is a limit per sequence, not a reservation", "N", int,
                     shown="0, the plan's choice"),
    "kv_spill": Key(size(0), "host RAM for finished sequences' KV blocks when a GPU's pool needs their blocks: a "
                    "later prompt that repeats them restores them instead of prefilling; 0: dropped (the cpu "
                    "backend keeps its pool in RAM and ignores it)", "SIZE", shown="0, off"),
    "prefill_chunk": Key(integer(1, 1 << 20), "prompt tokens per scheduler step", "N", int),
    "prefix_cache": Key(boolean, "start prompts from the cached KV of earlier sequences sharing their prefix "
                        "(--no-prefix-cache: off)", shown="on"),
    "prefix_cache_share": Key(choice("none", "group", "all"), "whose cached prompts a request may start from: "
                              "none (only its caller's own), group (callers whose uid has the same primary "
                              "group) or all", "MODE"),
    "default_max_tokens": Key(integer(1, 1 << 24), "max_tokens of a request that does not say", "N", int),
    "drain_timeout": Key(number(0, 3600, "seconds"), "seconds in-flight requests get on SIGTERM / Drain", "S", float),
    "log_level": Key(choice("debug", "info", "warning", "error"), "debug, info, warning or error", "LEVEL"),
    "cpu_threads": Key(integer(0, 4096), "threads of the CPU backend's steps (0: every CPU the daemon may use)", "N", int),
    "host_compute": Key(choice("off", "auto"), "the host CPU computes some streamed layers beside the GPU, "
                        "per step shape from rates measured at load: off or auto", "MODE"),
    "link_cap": Key(rate, "pace the stream's host-to-device copies to this rate, e.g. 6.5GB/s "
                    "(a slower PCIe link emulated), or off", "RATE", shown="off"),
    # ---- storage and the NVMe drive (ntx_system.service reads the same keys) -------------------
    "storage": Key(storage_kind, "where streamed layers come from: file, odirect, mmap or nvme:SERIAL (the cpu "
                   "backend computes layers where they lie: file or mmap)", "KIND"),
    "nvme_queues": Key(integer(1, 64), "NVMe I/O queue pairs (reads in flight at once)", "N", int),
    "nvme_queue_depth": Key(integer(1, 4095), "NVMe commands in flight per queue pair", "N", int),
    "nvme_io_timeout": Key(number(0.1, 600, "seconds"), "seconds before an NVMe command counts as lost", "S",
                           float),
    "nvme_retries": Key(integer(1, 100), "drive bring-up attempts (at start, after a drive error)", "N", int),
    "nvme_release": Key(config_file.release, "on stop: hand the drive back to nvme, or keep it on vfio-pci",
                        "MODE"),
    "noiommu": Key(boolean, "accept VFIO without an IOMMU (unsafe: the drive can DMA anywhere)", "BOOL",
                   _bool_flag),
    # ---- end of storage keys --------------------------------------------------------------------
    "speculative": Key(speculative_mode, "speculative decoding of requests that do not say: off, auto, ngram, "
                       "draft, skip[:LAYERS] or prefix[:N] (lossless)", "MODE"),
    "draft": Key(path(empty=""), "a small GGUF with the model's vocabulary that drafts for it (speculative draft)",
                 "PATH", shown="none"),
    "skip_layers": Key(skip_spec, "layers left out of every step: auto[:THRESHOLD], N or 3,7,11 "
                       "(lossy; ntx-model calibrate-skip measures it)", "SPEC", shown="none"),
}


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
    backend: str = "auto"  # one of engine.backends.BACKENDS: cpu | cpu-ref | cuda | auto
    vram_budget: int | None = None  # bytes of VRAM the tier plan may use (None: what is free)
    pinned_budget: int | None = None  # bytes of pinned host RAM for the tier plan
    max_batch: int = 8  # sequences decoded together (KV-cache slots)
    max_queue: int = 64  # requests waiting for a slot before RESOURCE_EXHAUSTED
    max_ctx: int = 4096  # positions per sequence (capped by the model)
    kv_dtype: str = "auto"  # auto: the backend's own (backends.settle); one it cannot store is refused
    kv_blocks: int = 0  # KV pool in blocks (engine/kv_cache.py); 0: the plan's choice
    kv_spill: int = 0  # bytes of host RAM for spilled KV blocks (0: off)
    prefill_chunk: int = 256  # prompt tokens per step across all prefilling requests
    # keep finished sequences' KV in free slots and start prompts from the longest shared prefix
    prefix_cache: bool = True
    # whose cached KV a request may reuse: its caller's own (a unix uid, a TLS identity, a
    # gateway's API key under the gateway's uid), its uid's primary group's, or everyone's
    prefix_cache_share: str = "none"
    default_max_tokens: int = 512  # when a request does not say
    drain_timeout: float = 5.0  # seconds in-flight requests get to finish on SIGTERM / Drain
    log_level: str = "info"
    # Threads of the CPU backend's steps (the cpu backend's team; cpu-ref's BLAS threads), and of
    # the host's share beside a GPU. 0: every CPU the daemon may run on.
    cpu_threads: int = 0
    host_compute: str = "off"  # off | auto: engine/tiers/placement.py, from engine/figures.py's rates
    link_cap: float | None = None  # bytes/s ("6.5GB/s" given) the stream's copies are paced to; None: off
    # ---- storage and the NVMe drive (ntx_system.service reads the same keys) ---------------
    storage: str = "file"  # file | odirect | mmap | nvme:SERIAL (or nvme:PCI_ADDRESS)
    nvme_queues: int = 2  # I/O queue pairs: reads in flight at once (the stream's 2 readers)
    nvme_queue_depth: int = 32  # commands in flight per queue pair
    nvme_io_timeout: float = 10.0  # seconds before a command counts as lost (the drive is reset)
    nvme_retries: int = 3  # bring-up attempts, at start and after a drive error, before exiting 1
    nvme_release: str = "nvme"  # on stop: hand the drive back to nvme, or "keep" it on vfio-pci
    noiommu: bool = False  # accept VFIO without an IOMMU (unsafe: the drive can DMA anywhere)
    # ---- end of storage keys ------------------------------------------------------------------
    speculative: Mode = Mode()  # engine/speculative.py: the mode of requests that do not say ("skip:3,7" given)
    draft: str = ""  # the draft model of speculative "draft"
    skip_layers: str = ""  # engine/layer_skip.py: resolved against the model's cached calibration

    def __post_init__(self):
        for name in FIELDS:
            object.__setattr__(self, name, KEYS[name].check(name, getattr(self, name)))
        if not self.admin_socket:
            object.__setattr__(self, "admin_socket",
                               os.path.join(os.path.dirname(os.path.abspath(self.socket)), "admin.sock"))
        if self.socket == self.admin_socket:
            raise ConfigError(f"socket and admin_socket are both {self.socket}: give them different paths")
        self.validate_tcp()
        self.validate_backend()

    def validate_backend(self) -> None:
        """A backend named (not "auto") must honour kv_dtype and storage: refused now, before
        anything loads; "auto" is checked where it is resolved, at the model's load."""
        if self.backend == "auto":
            return
        try:
            backends.settle(backends.TYPES[self.backend], kv_dtype=self.kv_dtype, storage=self.storage)
        except SettingError as e:
            raise ConfigError(e.worded(SPELLING)) from None

    def validate_tcp(self) -> None:
        """The TCP keys: all or nothing, and TLS files that exist (a client certificate is required)."""
        tls = {"tls_cert": self.tls_cert, "tls_key": self.tls_key, "tls_client_ca": self.tls_client_ca}
        if not self.tcp_listen:
            if any(tls.values()):
                raise ConfigError("tls_cert, tls_key and tls_client_ca are set but tcp_listen is not: set "
                                  'tcp_listen = "HOST:PORT" to serve on TCP, or remove them')
            return
        missing = [k for k, v in tls.items() if not v]
        if missing:
            raise ConfigError(f"tcp_listen is set, so TLS is required: set {', '.join(missing)} (PEM files; "
                              "the README's 'Several hosts' section makes them)")
        for key, path in tls.items():
            if not os.path.isfile(path):
                raise ConfigError(f"{key} = {path!r}: no such file")


FIELDS = {f.name: f for f in dataclasses.fields(DaemonConfig)}
assert set(FIELDS) == set(KEYS), "every DaemonConfig field has its row in KEYS"
# How the daemon's errors name a setting: by its key (the flag is the same name with dashes).
# Settings the daemon does not have (stream_depth, devices, ...) are left out of the advice.
SPELLING = Spelling({name: name for name in KEYS})


def argument_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ntransformerd", description="Serve a GGUF model over gRPC on a unix socket.")
    p.add_argument("--config", help=f"TOML file (default: {DEFAULT_CONFIG_FILE} if it exists)")
    for name, key in KEYS.items():
        default = FIELDS[name].default
        shown = key.shown or (repr(default) if default == "" else str(default))
        if isinstance(default, bool):  # --name / --no-name
            p.add_argument(f"--{name.replace('_', '-')}", dest=name, action=argparse.BooleanOptionalAction,
                           default=None, help=f"{key.help} (default: {shown})")
            continue
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=key.flag_type, metavar=key.metavar,
                       help=f"{key.help} (default: {shown})")
    return p


def from_file(path: str) -> dict:
    """The keys of the TOML file at `path` (config_file.read, the reader ntx-admin shares)."""
    data = config_file.read(path)
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
    return DaemonConfig(**values)
