"""The backends by name, resolved in one place: `resolve(name)` → a devices.Backend.

    cpu      the host's fast CPU backend (backends/host: quantized kernels on GGUF blocks) where
             it is installed and available; else the reference below, with one warning
    cpu-ref  the float32 numpy reference (backends/cpu.py) every other backend is tested against
    cuda     CuPy and our kernels (backends/cuda), on an NVIDIA GPU
    auto     cuda where a GPU is visible, else cpu

What a backend can honour is declared beside it (`kv_dtypes`, `reads_storage`), and `settle`
checks a configuration against it: a KV-cache type it cannot store, or a storage it does not
read from, is a SettingError naming the setting, never a silent substitute. A daemon checks a
backend it was told by name at start (TYPES: no GPU library imported), "auto" once resolved.

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
from ntransformerd.engine.runtime.devices import Backend
from ntransformerd.engine.gguf_file import GGUFModel, LlamaConfig
from ntransformerd.engine.runtime.kv_cache import KV_DTYPES as HOST_KV_DTYPES
from ntransformerd.engine.tiers.planner import HOST, VRAM
from ntransformerd.settings import SettingError

BACKENDS = ("cpu", "cpu-ref", "cuda", "auto")
log = logging.getLogger(__name__)


class CpuRef:
    """backends/cpu.py as a Backend: exact float32, host memory."""

    name, is_host = "cpu-ref", True
    kv_dtypes = tuple(HOST_KV_DTYPES)  # f32 first: exact
    reads_storage = True

    def available(self) -> bool:
        return True

    def layer_bytes(self, model: GGUFModel, i: int) -> int:
        return model.layer_bytes(i)

    def free_memory(self, device: int = 0) -> None:
        return None

    def load(self, model, share, *, device=0, source=None, poison=False, link_cap=None, deterministic=False,
             cpu_kernels="auto"):
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
    reads_storage = False  # layers are computed where they lie: the model file's page cache

    def __init__(self, module):
        self.module = module

    def available(self) -> bool:
        return self.module.available()

    def load(self, model, share, *, device=0, source=None, poison=False, link_cap=None, deterministic=False,
             cpu_kernels="auto"):
        # nothing streams here (layers are computed where they lie), so there is no copy to pace
        return self.module.load(model, resident={i for i, t in enumerate(share.tiers) if t in (VRAM, HOST)},
                                cpu_kernels=cpu_kernels)

    def kv_cache(self, cfg, *, n_slots, max_ctx, dtype, device=0, n_blocks=None):
        return self.module.kv_cache(cfg, n_slots=n_slots, max_ctx=max_ctx, dtype=dtype, n_blocks=n_blocks)

    def capture(self, ops, weights, kv, *, threads: int | None = None):
        return self.module.graphs(ops, weights, kv, threads=threads)


class Cuda:
    """backends/cuda as a Backend: each GPU by its ordinal."""

    name, is_host = "cuda", False
    kv_dtypes = ("f16", "q8_0")  # backends/cuda/kv.py (CUDA_KV_DTYPES; the module needs CuPy to import)
    reads_storage = True

    def __init__(self, module):
        self.module = module

    def available(self) -> bool:
        return self.module.available()

    def layer_bytes(self, model, i):
        return self.module.layer_nbytes(model, i)

    def free_memory(self, device=0):
        with self.context(device):
            return self.module.vram_free()

    def load(self, model, share, *, device=0, source=None, poison=False, link_cap=None, deterministic=False,
             cpu_kernels="auto"):
        with self.context(device):
            settings = self.module.CudaSettings.from_env().replace(deterministic=deterministic)
            return self.module.load(model, share, source=source, poison=poison, link_cap=link_cap, settings=settings)

    def kv_cache(self, cfg, *, n_slots, max_ctx, dtype, device=0, n_blocks=None):
        with self.context(device):
            return self.module.kv_cache(cfg, n_slots=n_slots, max_ctx=max_ctx, dtype=dtype, n_blocks=n_blocks)

    def capture(self, ops, weights, kv, *, threads: int | None = None):
        return self.module.graphs(ops, weights, kv)

    def context(self, device=0):
        return self.module.cp.cuda.Device(device)

    def to_device(self, x, device=0):
        with self.context(device):
            return self.module.cp.array(x, copy=True)


TYPES: dict[str, type] = {"cpu": Host, "cpu-ref": CpuRef, "cuda": Cuda}  # what each name can honour


def settle(backend, *, kv_dtype: str, storage, asked: str | None = None) -> str:
    """The KV-cache type `kv_dtype` means on `backend` ("auto": the first it stores), once the
    backend is known to honour it and `storage` (a kind, or a Source with its `kind`); else a
    SettingError naming the setting. backend: a Backend, or its class from TYPES; asked: the
    backend setting as given ("auto" says so in the message)."""
    how = f"the {backend.name} backend" + (" (what backend auto chose on this machine)" if asked == "auto" else "")
    if kv_dtype != "auto" and kv_dtype not in backend.kv_dtypes:
        fix = " or ".join(f'"{t}"' for t in ("auto", *backend.kv_dtypes))
        able = [f'"{n}"' for n, t in TYPES.items() if n != backend.name and kv_dtype in t.kv_dtypes]
        raise SettingError(f"{how} stores its KV cache as {' or '.join(backend.kv_dtypes)} only: set {{kv_dtype}} "
                           f"to {fix}" + (f", or {{backend}} to {' or '.join(able)}" if able else ""),
                           setting="kv_dtype", value=kv_dtype)
    kind = storage if isinstance(storage, str) or storage is None else storage.kind
    if kind and not backend.reads_storage and (kind == "odirect" or kind.startswith("nvme:")):
        readers = " or ".join(f'"{n}"' for n, t in TYPES.items() if t.reads_storage)
        raise SettingError(f"{how} computes every layer where it lies in memory (the model file's page cache) "
                           f'and streams nothing from storage: set {{storage}} to "file" or "mmap", or {{backend}} '
                           f"to {readers}", setting="storage", value=kind)
    return backend.kv_dtypes[0] if kv_dtype == "auto" else kv_dtype


def backend_module(module: str):
    """The backend module (backends.cuda, backends.host), or None where its package or its
    dependency is not installed; resolve() asks here, and a test stands a fake module in."""
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
        gpu = backend_module("ntransformerd.engine.backends.cuda")
        return resolve("cuda" if gpu is not None and gpu.available() else "cpu")
    if name == "cuda":
        gpu = backend_module("ntransformerd.engine.backends.cuda")
        if gpu is None or not gpu.available():
            raise RuntimeError("the cuda backend needs CuPy and a visible NVIDIA GPU "
                               "(pip install 'ntransformer[gpu]'); use --backend cpu")
        return Cuda(gpu)
    if name == "cpu":
        host = backend_module("ntransformerd.engine.backends.host")
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
