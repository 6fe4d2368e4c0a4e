"""The backends by name, resolved in one place: `resolve(name)` → a devices.Backend.

    cpu      the host's fast CPU backend (backends/host: quantized kernels on GGUF blocks) where
             it is installed and available; else the reference below, with one warning
    cpu-ref  the float32 numpy reference (backends/cpu.py) every other backend is tested against
    cuda     CuPy and our kernels (backends/cuda), on an NVIDIA GPU
    auto     cuda where a GPU is visible, else cpu

Each backend module keeps its own functions (load, kv_cache, ...); the small classes here
present them as the one `Backend` interface the engine builds devices with. The GPU and host
modules are imported when first resolved: CuPy and the host kernels are optional.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
from collections.abc import Sequence

import numpy as np

from ntransformerd.engine.backends import cpu
from ntransformerd.engine.devices import Backend
from ntransformerd.engine.gguf_file import GGUFModel, LlamaConfig
from ntransformerd.engine.kv_cache import default_blocks
from ntransformerd.engine.tiers.planner import HOST, VRAM

BACKENDS = ("cpu", "cpu-ref", "cuda", "auto")
log = logging.getLogger(__name__)


class CpuRef:
    """backends/cpu.py as a Backend: exact float32, host memory."""

    name, is_host = "cpu-ref", True

    def available(self) -> bool:
        return True

    def layer_bytes(self, model: GGUFModel, i: int) -> int:
        return model.layer_bytes(i)

    def free_memory(self, device: int = 0) -> None:
        return None

    def load(self, model, share, *, device=0, source=None, poison=False, link_cap=None):
        return cpu.load_share(model, share, source=source, poison=poison, link_cap=link_cap)

    def kv_cache(self, cfg: LlamaConfig, *, n_slots: int, max_ctx: int, dtype: str, device: int = 0,
                 n_blocks: int | None = None):
        return cpu.kv_cache(cfg, n_slots=n_slots, max_ctx=max_ctx, dtype=dtype, n_blocks=n_blocks)

    def capture(self, ops, weights, kv, *, threads: int | None = None) -> None:
        return None

    def context(self, device: int = 0):
        return contextlib.nullcontext()

    def to_device(self, x, device: int = 0) -> np.ndarray:
        return np.array(x, copy=True, order="C")


class Host(CpuRef):
    """backends/host (quantized kernels on the GGUF blocks, at the host's memory bandwidth): its
    layers are read where they lie, so a share's resident set is what it keeps repacked and
    every other layer it computes straight from the page cache."""

    name = "cpu"

    def __init__(self, module):
        self.module = module

    def available(self) -> bool:
        return self.module.available()

    def load(self, model, share, *, device=0, source=None, poison=False, link_cap=None):
        # nothing streams here (layers are computed where they lie), so there is no copy to pace
        return self.module.load(model, resident={i for i, t in enumerate(share.tiers) if t in (VRAM, HOST)})

    def kv_cache(self, cfg, *, n_slots, max_ctx, dtype, device=0, n_blocks=None):
        return self.module.kv_cache(cfg, n_slots=n_slots, max_ctx=max_ctx, dtype=dtype, n_blocks=n_blocks)

    def capture(self, ops, weights, kv, *, threads: int | None = None):
        return self.module.graphs(ops, weights, kv, threads=threads)


class Cuda:
    """backends/cuda as a Backend: each GPU by its ordinal."""

    name, is_host = "cuda", False

    def __init__(self, module):
        self.module = module

    def available(self) -> bool:
        return self.module.available()

    def layer_bytes(self, model, i):
        return self.module.layer_nbytes(model, i)

    def free_memory(self, device=0):
        with self.context(device):
            return self.module.vram_free()

    def load(self, model, share, *, device=0, source=None, poison=False, link_cap=None):
        with self.context(device):
            return self.module.load(model, share, source=source, poison=poison, link_cap=link_cap)

    def kv_cache(self, cfg, *, n_slots, max_ctx, dtype, device=0, n_blocks=None):
        if n_blocks is not None and n_blocks != default_blocks(n_slots, max_ctx):
            raise ValueError(f"kv_blocks {n_blocks}: the cuda backend's KV cache holds whole slots (max_seqs × "
                             f"max_ctx) until its paged form lands; leave kv_blocks unset")
        with self.context(device):
            return self.module.kv_cache(cfg, n_slots=n_slots, max_ctx=max_ctx, dtype=dtype)

    def capture(self, ops, weights, kv, *, threads: int | None = None):
        return self.module.graphs(ops, weights, kv)

    def context(self, device=0):
        return self.module.cp.cuda.Device(device)

    def to_device(self, x, device=0):
        with self.context(device):
            return self.module.cp.array(x, copy=True)


def _optional(module: str):
    """The backend module, or None where its package or dependency is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if e.name is not None and not module.startswith(e.name) and not e.name.startswith(module):
            raise  # a broken import inside an installed backend is a bug, not an absence
        return None


def resolve(name: str) -> Backend:
    """The backend called `name` (one of BACKENDS); a clear error where it cannot run here."""
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r} is not one of {', '.join(BACKENDS)}")
    if name == "auto":
        gpu = _optional("ntransformerd.engine.backends.cuda")
        return resolve("cuda" if gpu is not None and gpu.available() else "cpu")
    if name == "cuda":
        gpu = _optional("ntransformerd.engine.backends.cuda")
        if gpu is None or not gpu.available():
            raise RuntimeError("the cuda backend needs CuPy and a visible NVIDIA GPU "
                               "(pip install 'ntransformer[gpu]'); use --backend cpu")
        return Cuda(gpu)
    if name == "cpu":
        host = _optional("ntransformerd.engine.backends.host")
        if host is not None and host.available():
            return Host(host)
        _fallback("installed" if host is None else "available on this machine")
    return CpuRef()


@functools.cache
def _fallback(why: str) -> None:
    log.warning("backend cpu: the host kernels (backends/host) are not %s; using cpu-ref, the float32 reference", why)


def device_free(ids: Sequence[int], name: str = "auto") -> tuple[str, list[int | None]]:
    """(kind, free memory of each device): each GPU's free VRAM where `name` resolves to cuda;
    else ('cpu', unlimited), where budgets simulate the devices (tiers/multi.py)."""
    backend = resolve(name)
    return ("cpu", [None] * len(ids)) if backend.is_host else (backend.name, [backend.free_memory(d) for d in ids])
