"""ntransformerd's configuration: one keyword-only object from the TOML file, the flags and the
environment.

Precedence: flag > file > environment > default. The file is `--config PATH`, else
/etc/ntransformer/ntransformerd.toml when it exists. Keys are the flag names with underscores
(packaging/ntransformerd.toml lists them all).

Every key is a row of settings.SETTINGS: the row reads and checks its value (an error names
the key), gives the field its default, and makes the flag and its --help. A new key is a row
there (FILE and DAEMON in its `where`), a field of DaemonConfig and a line of the example file.

The keys keep their names on the way down: `engine_config` hands the engine's settings to
EngineConfig by name, typed already. A backend named here must honour kv_dtype and storage
(backends.settle), else the key is refused at start.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from ntx_proto import paths
from ntx_system import config_file
from ntx_system.config_file import ConfigError

from ntransformerd import settings
from ntransformerd.engine import backends
from ntransformerd.engine.runtime.engine import EngineConfig
from ntransformerd.engine.generation.speculative_mode import Mode
from ntransformerd.settings import DAEMON, FILE, SettingError, field

DEFAULT_CONFIG_FILE = config_file.DEFAULT_PATH
KEYS = settings.of(FILE)  # the daemon's settings: every key of the file
# How the daemon's errors name a setting: by its key (the flag is the same name with dashes).
# Settings the daemon does not have (stream_depth, devices, ...) are left out of the advice.
SPELLING = settings.spelling(DAEMON)

__all__ = ["ConfigError", "DaemonConfig", "KEYS", "SPELLING", "argument_parser", "load"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DaemonConfig:
    """Everything ntransformerd is configured with, passed down as one object; each field's
    default, type and limits are its row's (settings.SETTINGS)."""

    socket: str = field("socket")
    admin_socket: str = field("admin_socket")  # empty: paths.default_admin_socket (after __post_init__ "": none)
    socket_group: str = field("socket_group")  # group owning the user socket when run as root; "" = none
    # ---- TCP with TLS, for clients on other hosts (off unless tcp_listen is set) ---------------
    tcp_listen: str = field("tcp_listen")  # host:port, e.g. "0.0.0.0:7443" (port 0: any free one, logged)
    tls_cert: str = field("tls_cert")
    tls_key: str = field("tls_key")
    tls_client_ca: str = field("tls_client_ca")  # clients must present a certificate signed by this CA
    # ---- the model and its engine (EngineConfig's fields of the same names) ---------------------
    model: str = field("model")  # GGUF path; empty: the embedded default model
    backend: str = field("backend")  # one of engine.backends.BACKENDS: cpu | cpu-ref | cuda | auto
    vram_budget: int | None = field("vram_budget")  # bytes of VRAM the tier plan may use (None: what is free)
    pinned_budget: int | None = field("pinned_budget")  # bytes of pinned host RAM for the tier plan
    max_batch: int = field("max_batch")  # sequences decoded together (KV-cache slots)
    max_ctx: int = field("max_ctx")  # positions per sequence (capped by the model)
    kv_dtype: str = field("kv_dtype")  # auto: the backend's own (backends.settle); one it cannot store is refused
    kv_blocks: int = field("kv_blocks")  # KV pool in blocks (engine/runtime/kv_cache.py); 0: the plan's choice
    kv_spill: int = field("kv_spill")  # bytes of host RAM for spilled KV blocks (0: off)
    prefill_chunk: int = field("prefill_chunk")  # prompt tokens per step across all prefilling requests
    # Threads of the CPU backend's steps (the cpu backend's team; cpu-ref's BLAS threads), and of
    # the host's share beside a GPU. 0: every CPU the daemon may run on.
    cpu_threads: int = field("cpu_threads")
    cpu_kernels: str = field("cpu_kernels")  # auto | avx512 | avx2 | generic: the host kernels' build (numerics)
    host_compute: str = field("host_compute")  # off | auto: engine/tiers/placement.py, from engine/calibration/figures.py's rates
    link_cap: float | None = field("link_cap")  # bytes/s ("6.5GB/s" given) the stream's copies are paced to
    storage: str = field("storage")  # file | odirect | mmap | nvme:SERIAL (or nvme:PCI_ADDRESS)
    deterministic: bool = field("deterministic")  # a request's output independent of the rows sharing its steps
    speculative: Mode = field("speculative")  # engine/generation/speculative.py: the mode of requests that do not say
    draft: str = field("draft")  # the draft model of speculative "draft"
    skip_layers: str = field("skip_layers")  # engine/calibration/layer_skip.py: resolved against the model's calibration
    # ---- serving ---------------------------------------------------------------------------------
    max_queue: int = field("max_queue")  # requests waiting for a slot before RESOURCE_EXHAUSTED
    # keep finished sequences' KV in free slots and start prompts from the longest shared prefix
    prefix_cache: bool = field("prefix_cache")
    # whose cached KV a request may reuse: its caller's own (a unix uid, a TLS identity, a
    # gateway's API key under the gateway's uid), its uid's primary group's, or everyone's
    prefix_cache_share: str = field("prefix_cache_share")
    default_max_tokens: int = field("default_max_tokens")  # when a request does not say
    stream_interval: float = field("stream_interval")  # seconds between a stream's messages (servicer.py)
    drain_timeout: float = field("drain_timeout")  # seconds in-flight requests get to finish on SIGTERM / Drain
    log_level: str = field("log_level")
    state_dir: str = field("state_dir")  # empty: settings.state_dir()'s default (root: /var/lib/ntransformer)
    # ---- storage and the NVMe drive (ntx_system.service reads storage, model, noiommu, nvme_release) --
    nvme_queues: int = field("nvme_queues")  # I/O queue pairs: reads in flight at once (the stream's 2 readers)
    nvme_queue_depth: int = field("nvme_queue_depth")  # commands in flight per queue pair
    nvme_io_timeout: float = field("nvme_io_timeout")  # seconds before a command counts as lost (the drive is reset)
    nvme_retries: int = field("nvme_retries")  # bring-up attempts, at start and after a drive error, before exiting 1
    nvme_release: str = field("nvme_release")  # on stop: hand the drive back to nvme, or "keep" it on vfio-pci
    noiommu: bool = field("noiommu")  # accept VFIO without an IOMMU (unsafe: the drive can DMA anywhere)

    def __post_init__(self):
        for name, row in KEYS.items():
            try:
                object.__setattr__(self, name, row.parse(getattr(self, name)))
            except SettingError as e:
                raise ConfigError(e.worded(SPELLING)) from None
        if not self.admin_socket:
            object.__setattr__(self, "admin_socket", paths.default_admin_socket(self.socket))
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

    def engine_config(self, **decided) -> EngineConfig:
        """The engine's settings of this config, by name and typed already, with what a load
        decides (`decided`): the backend ("auto" resolved, or a LoadModel's), the storage source
        opened, skip_layers resolved against the model's calibration (layer_skip.skip_layers_for;
        EngineConfig reads a list of layers itself). A SettingError is the caller's to word with
        SPELLING."""
        return EngineConfig(**{**{name: getattr(self, name) for name in ENGINE_KEYS}, **decided})


FIELDS = {f.name: f for f in dataclasses.fields(DaemonConfig)}
assert set(FIELDS) == set(KEYS), "DaemonConfig has a field for every key of the file, and no other"
ENGINE_KEYS = tuple(name for name in FIELDS if name in EngineConfig.__dataclass_fields__)


def argument_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ntransformerd", description="Serve a GGUF model over gRPC on a unix socket.")
    p.add_argument("--config", help=f"TOML file (default: {DEFAULT_CONFIG_FILE} if it exists)")
    settings.add_flags(p, DAEMON)
    return p


def from_file(path: str) -> dict:
    """The keys of the TOML file at `path`, as written (config_file.read, the reader ntx-admin shares)."""
    return settings.file_values(path, DAEMON)


def load(argv: list[str] | None = None, *, environ=os.environ) -> DaemonConfig:
    """Flags over the file over the environment over the defaults. Raises ConfigError with a
    message to show as is."""
    args = argument_parser().parse_args(argv)
    file = args.config or (DEFAULT_CONFIG_FILE if os.path.exists(DEFAULT_CONFIG_FILE) else None)
    return DaemonConfig(**settings.given(DAEMON, flags=vars(args), file=from_file(file) if file else {},
                                         environ=environ))


def apply_to_process(cfg: DaemonConfig, environ=os.environ) -> None:
    """What the configuration asks of the whole process, set once at start: the state directory
    every part reads (settings.state_dir), and the host kernels' threads (OpenMP and BLAS read
    theirs from the environment; numpy's BLAS is loaded already and is limited per step)."""
    settings.export_state_dir(cfg.state_dir, environ)
    if cfg.cpu_threads:
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            environ.setdefault(var, str(cfg.cpu_threads))
