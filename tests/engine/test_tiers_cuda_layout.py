"""The CUDA weights' layout and streaming on a fake CuPy (numpy arrays, memmove copies): every
field acquire(i) hands out equals the GGUF bytes laid out independently, for every tier, in CI;
so do passes recorded under capture (their copies inside the graph), their slots taken back and
forth with the LayerStream. (Only the data and the slot bookkeeping: the event ordering needs the
GPU, tests/gpu/test_streaming.py.)"""

from __future__ import annotations

import ctypes
import types

import numpy as np
import pytest

from ntransformerd.engine.gguf_file import GGUFModel
from ntransformerd.engine.tiers.planner import PINNED, STORAGE, VRAM, Plan
from ntransformerd.engine.tiers.sources import ODirectSource


class FakeArray(np.ndarray):
    @property
    def data(self):  # cupy's MemoryPointer: .ptr
        return types.SimpleNamespace(ptr=self.ctypes.data)

    def set(self, a, stream=None):
        self[...] = a


class _Event:
    def __init__(self, *a, **k):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


class _Stream:
    ptr = 0
    capturing = False  # what is_capturing() answers (the tests set it)

    def is_capturing(self):
        return _Stream.capturing

    def __init__(self, *a, **k):
        pass

    def wait_event(self, ev):
        pass

    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def _fake_cupy():
    cp = types.SimpleNamespace()
    cp.ndarray = FakeArray
    cp.float32, cp.float16, cp.int32, cp.uint8 = np.float32, np.float16, np.int32, np.uint8
    cp.empty = lambda shape, dtype=np.float32: np.zeros(shape, dtype).view(FakeArray)
    cp.asarray = lambda a, dtype=None: np.array(a, dtype=dtype).view(FakeArray)
    runtime = types.SimpleNamespace(
        memcpyHostToDevice=1, memGetInfo=lambda: (80 << 30, 80 << 30),
        memcpyAsync=lambda dst, src, n, kind, stream: ctypes.memmove(dst, src, n))
    pinned = lambda n: bytearray(n)  # noqa: E731
    cp.cuda = types.SimpleNamespace(
        runtime=runtime, Stream=_Stream, Event=_Event, get_current_stream=lambda: _Stream(),
        alloc_pinned_memory=pinned, memory=types.SimpleNamespace(OutOfMemoryError=MemoryError))
    return cp


@pytest.fixture
def fake(monkeypatch):
    from ntransformerd.engine.backends.cuda import nvrtc, weights
    cp = _fake_cupy()
    monkeypatch.setattr(nvrtc, "cp", cp)
    monkeypatch.setattr(weights, "cp", cp)
    return weights


def _same(a, b):
    if hasattr(a, "planes"):
        assert a.qtype == b.qtype and a.shape == b.shape and len(a.planes) == len(b.planes)
        for p, q in zip(a.planes, b.planes):
            assert p.shape == q.shape and np.array_equal(np.asarray(p), np.asarray(q))
    else:
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


NAMES = ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
STACKS = (("attn_qkv", ("attn_q", "attn_k", "attn_v")), ("ffn_gate_up", ("ffn_gate", "ffn_up")))


def _check_layer(weights, model, i, ly):
    """Every field of layer i against the GGUF bytes laid out independently (host_planes,
    dequantize), and every stack member the same rows as its named view."""
    from ntransformerd.engine.quants import dequantize
    t = model.layer_tensors(i)
    for nm in NAMES:
        got = getattr(ly, nm)
        if nm.endswith("_norm"):
            assert np.array_equal(np.asarray(got), dequantize(np.asarray(t[nm].data).view(np.uint8).reshape(-1),
                                                              t[nm].qtype, t[nm].shape)), (i, nm)
            continue
        want = weights.host_planes(t[nm].qtype, t[nm].data, tuple(t[nm].shape))
        assert got.qtype == t[nm].qtype and got.shape == tuple(t[nm].shape), (i, nm)
        for p, q in zip(got.planes, want):
            assert np.array_equal(np.asarray(p), q), (i, nm)
    for stack, names in STACKS:
        st = getattr(ly, stack)
        assert len(st.members) == len(names)
        for (j, r0, rows), nm in zip(st.members, names):
            _same(st.pieces[j].rows(r0, r0 + rows), getattr(ly, nm))
        assert len({st.pieces[j].qtype for j, _, _ in st.members}) == len(st.pieces)  # one piece per type run


def _plan(model, weights, tiers, depth):
    sizes = [weights.layer_nbytes(model, i) for i in range(model.config.n_layers)]
    return Plan(tuple(tiers), tuple(sizes), depth, max(sizes), 0, 0, 0, -1, -1)


@pytest.mark.parametrize("shape,ftype", [("tiny", "q8_0"), ("small", "q4_k_m")])
def test_every_tier_hands_out_the_gguf_layout(fake, synth_model, shape, ftype):
    weights = fake
    model = GGUFModel(synth_model(shape, ftype))
    n = model.config.n_layers
    loaded = []
    model.on_layer_loaded(loaded.append)
    resident = weights.CudaWeights(model, _plan(model, weights, [VRAM] * n, 0))
    assert loaded == list(range(n))  # load progress: every layer once, in order
    loaded.clear()
    tiers = ([VRAM, PINNED, STORAGE, STORAGE] * n)[:n] if n > 2 else [PINNED, STORAGE]
    plan = _plan(model, weights, tiers, 2)
    w = weights.CudaWeights(model, plan, source=ODirectSource(model.path, threads=2), poison=True)
    model.on_layer_loaded(None)
    assert sorted(loaded) == list(range(n))  # resident, pinned and storage layers, each once
    assert not w.capturable and resident.capturable
    for _step in range(3):
        w.prefetch(range(n))
        for i in range(n):
            _check_layer(weights, model, i, w.acquire(i))
            _check_layer(weights, model, i, resident.acquire(i))
            w.release(i)
    assert w.stream.stats["reads"] > 0 and w.stream.stats["copies"] >= 3 * len(plan.streamed)
    assert w.stream.stats["restarts"] == 0
    w.close()


@pytest.mark.parametrize("tiers,depth", [((PINNED,) * 4, 1), ((PINNED,) * 4, 3), ((VRAM, PINNED, VRAM, PINNED), 2),
                                         ((PINNED, VRAM, VRAM, VRAM), 2)])
def test_captured_and_eager_passes_share_the_slots(fake, synth_model, depth, tiers):
    """Passes recorded while capturing (their copies queued on the capture's own copy stream)
    interleaved with eager passes through the LayerStream, with prefixes and skips: every
    layer's fields are right in both, whichever used the slots last."""
    weights = fake
    model = GGUFModel(synth_model("small", "q4_k_m"))
    n = model.config.n_layers
    w = weights.CudaWeights(model, _plan(model, weights, tiers, depth), poison=True)
    assert w.capturable

    def run(layers, capturing):
        _Stream.capturing = capturing
        try:
            w.prefetch(layers)
            for i in layers:
                _check_layer(weights, model, i, w.acquire(i))
                w.release(i)
        finally:
            _Stream.capturing = False

    passes = [(range(n), False), (range(n), True), (range(n), True), ([0, 1], False), ([0, 2, 3], True),
              ([1, 3], False), (range(n), False), ([0, 1, 2], True), (range(n), False)]
    for layers, capturing in passes:
        run(list(layers), capturing)
    eager = sum(1 for _, c in passes if not c)
    assert w.stream.stats["passes"] == eager and w.stream.stats["restarts"] == 0
    w.close()


def test_a_skipped_layer_is_not_loaded(fake, synth_model):
    weights = fake
    model = GGUFModel(synth_model("small", "q4_k_m"))
    plan = _plan(model, weights, [VRAM, "skip", PINNED, VRAM], 2)
    w = weights.CudaWeights(model, plan)
    with pytest.raises(ValueError, match="skips"):
        w.acquire(1)
    w.prefetch([0, 2, 3])
    for i in (0, 2, 3):
        _check_layer(weights, model, i, w.acquire(i))
        w.release(i)


def test_plan_on_fake_gpu(fake, synth_model, monkeypatch):
    from ntransformerd.engine import tiers
    from ntransformerd.engine.backends import cuda
    from ntransformerd.engine.runtime.engine import EngineConfig
    monkeypatch.setattr(cuda, "vram_free", lambda: 80 << 30)
    model = GGUFModel(synth_model("small", "q4_k_m"))
    p = tiers.cuda_plan(cuda, model, EngineConfig(backend="cuda", max_vram_layers=1, max_ctx=64))
    assert p.tiers == (VRAM, PINNED, PINNED, PINNED) and p.depth == 2
