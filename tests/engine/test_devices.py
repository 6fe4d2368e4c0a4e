"""The declared device interfaces (engine/runtime/devices.py) against each backend, and the registry
that resolves backend names (engine/backends/__init__.py)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from ntransformerd.engine import backends
from ntransformerd.engine.runtime import devices
from ntransformerd.engine.backends import cpu, cuda
from ntransformerd.engine.gguf_file import GGUFModel
from ntransformerd.engine.tiers import HOST, PINNED, SKIP, STORAGE, VRAM, Plan
from ntransformerd.engine.tiers.sources import ODirectSource


def members(proto) -> set[str]:
    """The names a protocol declares: its methods, properties and annotated attributes."""
    return set(vars(proto).get("__annotations__", {})) | {n for n in vars(proto) if not n.startswith("_")}


def missing(obj, proto) -> set[str]:
    return {n for n in members(proto) if not hasattr(obj, n)}


def test_members_reads_a_protocol():
    assert members(devices.Weights) == {"token_embd", "output", "output_norm", "prefetch", "acquire", "release",
                                        "link_busy"}
    assert missing(object(), devices.Weights) == members(devices.Weights)


@pytest.fixture(scope="module")
def small(synth_model):
    return GGUFModel(synth_model("small", "q4_k_m"))


def _share(model, tiers, depth=0):
    lb = tuple(model.layer_bytes(i) for i in range(model.config.n_layers))
    return Plan(tuple(tiers), lb, depth, max(lb) if depth else 0, 0, 0, 0, -1, -1)


@pytest.mark.parametrize("tiers", [(VRAM,) * 4, (VRAM, PINNED, STORAGE, SKIP), (SKIP, HOST, HOST, SKIP)])
def test_cpu_ref_answers_the_protocols(small, tiers):
    b = backends.resolve("cpu-ref")
    assert not missing(b, devices.Backend) and b.is_host and b.available()
    src = ODirectSource(small.path, threads=1) if STORAGE in tiers else None
    ops, w = b.load(small, _share(small, tiers, 2 if PINNED in tiers else 0), source=src)
    kv = b.kv_cache(small.config, n_slots=2, max_ctx=8, dtype="f32")
    assert not missing(ops, devices.Ops) and not missing(w, devices.Weights) and not missing(kv, devices.KV)
    assert not missing(kv.layer(0), devices.KVLayer)
    held = [i for i, t in enumerate(tiers) if t != SKIP]
    w.prefetch(held)
    for i in held:
        assert not missing(w.acquire(i), devices.Layer)
        w.release(i)
    if tiers[0] == SKIP:  # another device's layer is never loaded
        assert 0 not in w.resident and 3 not in w.resident
    x = np.arange(6, dtype=np.float32)
    y = b.to_device(x)
    assert np.array_equal(x, y) and not np.shares_memory(x, y)
    assert b.capture(ops, w, kv) is None
    if hasattr(w, "close"):
        w.close()


def test_cuda_classes_answer_the_protocols():
    """Without a GPU the CUDA classes are checked by their members (tests/gpu runs them)."""
    assert not missing(cuda.CudaOps, devices.Ops) - {"cfg"}  # cfg is set per instance
    assert not {"prefetch", "acquire", "release"} - set(dir(cuda.CudaWeights))
    assert not {"layer", "alloc", "park", "reopen", "free", "copy_prefix", "free_slots"} - set(dir(cuda.CudaKVCache))
    assert not {"read"} - set(dir(cuda.CudaKVLayer))
    assert not missing(backends.Cuda(cuda), devices.Backend)
    assert not {"covers", "logits", "top"} - set(dir(cuda.StepGraphs))


def test_resolve_names(monkeypatch, caplog):
    with pytest.raises(ValueError, match="not one of cpu, cpu-ref, cuda, auto"):
        backends.resolve("gpu")
    assert backends.resolve("cpu-ref").name == "cpu-ref"
    monkeypatch.setattr(cuda, "available", lambda: False)
    with pytest.raises(RuntimeError, match="needs CuPy and a visible NVIDIA GPU"):
        backends.resolve("cuda")
    # No host kernels here (or not available): cpu is the reference, with one warning.
    monkeypatch.setattr(backends, "backend_module", lambda m: None if m.endswith(".host") else cuda)
    backends._fallback.cache_clear()
    with caplog.at_level(logging.WARNING, logger="ntransformerd.engine.backends"):
        assert backends.resolve("cpu").name == "cpu-ref"
        assert backends.resolve("auto").name == "cpu-ref"
    assert [r.getMessage() for r in caplog.records] == [
        "backend cpu: the host kernels (backends/host) are not installed; using cpu-ref, the float32 reference"]


def test_resolve_prefers_the_host_kernels_and_the_gpu(monkeypatch):
    class FakeHost:
        def __init__(self, ok):
            self.ok = ok

        def available(self):
            return self.ok

        def load(self, model, *, resident=None, cpu_kernels="auto"):
            self.cpu_kernels = cpu_kernels
            return "ops", resident

    host = FakeHost(True)
    monkeypatch.setattr(backends, "backend_module", lambda m: host if m.endswith(".host") else cuda)
    b = backends.resolve("cpu")
    assert isinstance(b, backends.Host) and b.name == "cpu" and b.is_host
    # the host keeps its vram and host layers; streamed ones it reads from the page cache
    assert b.load(None, Plan((VRAM, PINNED, HOST, SKIP), (1,) * 4, 2, 1, 0, 0, 0, -1, -1)) == ("ops", {0, 2})
    b.load(None, Plan((VRAM,), (1,), 1, 0, 0, 0, 0, -1, -1), cpu_kernels="generic")
    assert host.cpu_kernels == "generic"  # the setting reaches the host module's load
    host.ok = False
    assert backends.resolve("cpu").name == "cpu-ref"
    monkeypatch.setattr(cuda, "available", lambda: True)
    assert backends.resolve("auto").name == "cuda"


def test_optional_tells_absence_from_breakage(monkeypatch):
    assert backends.backend_module("ntransformerd.engine.backends.no_such_backend") is None

    def broken(name):
        raise ModuleNotFoundError("No module named 'ntx_kernels'", name="ntx_kernels")

    monkeypatch.setattr(backends.importlib, "import_module", broken)
    with pytest.raises(ImportError, match="ntx_kernels"):  # an installed backend whose own import breaks
        backends.backend_module("ntransformerd.engine.backends.host")
