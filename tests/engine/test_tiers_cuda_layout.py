"""The CUDA streamed weights' layout and pipeline on a fake CuPy (numpy arrays, memmove copies):
every field acquire(i) hands out equals what CudaWeights uploads, for every tier, in CI; so do
the decode step's feeds, their slots taken back and forth with the LayerStream. (Only the data
and the slot bookkeeping: the event ordering needs the GPU, tests/gpu/test_streaming.py.)"""

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
    from ntransformerd.engine.backends import cuda, cuda_stream
    cp = _fake_cupy()
    monkeypatch.setattr(cuda, "cp", cp)
    monkeypatch.setattr(cuda_stream, "cp", cp)
    return cuda, cuda_stream


def _same(a, b):
    if hasattr(a, "planes"):
        assert a.qtype == b.qtype and a.shape == b.shape and len(a.planes) == len(b.planes)
        for p, q in zip(a.planes, b.planes):
            assert p.shape == q.shape and np.array_equal(np.asarray(p), np.asarray(q))
    else:
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("shape,ftype", [("tiny", "q8_0"), ("small", "q4_k_m")])
def test_streamed_cuda_fields_match_cudaweights(fake, synth_model, shape, ftype):
    cuda, cuda_stream = fake
    model = GGUFModel(synth_model(shape, ftype))
    n = model.config.n_layers
    loaded = []
    model.on_layer_loaded(loaded.append)
    ref = cuda.CudaWeights(model)
    assert loaded == list(range(n))  # load progress: every layer once, in order
    loaded.clear()
    tiers = ([VRAM, PINNED, STORAGE, STORAGE] * n)[:n] if n > 2 else [PINNED, STORAGE]
    sizes = [cuda_stream.LayerLayout(model, i).nbytes for i in range(n)]
    plan = Plan(tuple(tiers), tuple(sizes), 2, max(sizes), 0, 0, 0, -1, -1)
    w = cuda_stream.StreamedCudaWeights(model, plan, source=ODirectSource(model.path, threads=2), poison=True)
    model.on_layer_loaded(None)
    assert sorted(loaded) == list(range(n))  # resident, pinned and storage layers, each once
    names = ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    for _step in range(3):
        for i in range(n):
            got, want = w.acquire(i), ref.acquire(i)
            for nm in names:
                _same(getattr(got, nm), getattr(want, nm))
            assert len(got.qkv) == len(want.qkv) and len(got.gate_up) == len(want.gate_up)
            for a, b in zip(got.qkv + got.gate_up, want.qkv + want.gate_up):
                _same(a, b)
            w.release(i)
    assert w.stream.stats["reads"] > 0 and w.stream.stats["copies"] >= 3 * len(plan.streamed)
    w.close()


NAMES = ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _same_layer(got, want):
    for nm in NAMES:
        _same(getattr(got, nm), getattr(want, nm))
    assert len(got.qkv) == len(want.qkv) and len(got.gate_up) == len(want.gate_up)
    for a, b in zip(got.qkv + got.gate_up, want.qkv + want.gate_up):
        _same(a, b)


def _shapes(ly):
    fields = [getattr(ly, nm) for nm in NAMES] + list(ly.qkv) + list(ly.gate_up)
    return [(getattr(t, "qtype", None), tuple(t.shape)) for t in fields]


@pytest.mark.parametrize("tiers,depth", [((PINNED,) * 4, 1), ((PINNED,) * 4, 3), ((VRAM, PINNED, VRAM, PINNED), 2),
                                         ((PINNED, VRAM, VRAM, VRAM), 2)])
def test_graph_feed_takes_slots_to_and_from_the_layer_stream(fake, synth_model, depth, tiers):
    """Decode steps through the GraphFeed interleaved with forward passes through the
    LayerStream: every layer's fields are right in both, whichever used the slots last."""
    cuda, cuda_stream = fake
    model = GGUFModel(synth_model("small", "q4_k_m"))
    n = model.config.n_layers
    ref = cuda.CudaWeights(model)
    sizes = [cuda_stream.LayerLayout(model, i).nbytes for i in range(n)]
    w = cuda_stream.StreamedCudaWeights(model, Plan(tiers, tuple(sizes), depth, max(sizes), 0, 0, 0, -1, -1),
                                        poison=True)
    for i in range(n):
        assert _shapes(w.describe(i)) == _shapes(ref.acquire(i))
    feed = w.decode_feed()
    assert isinstance(feed, cuda_stream.GraphFeed) and feed.capturable
    step = cuda.cp.cuda.Stream()

    def forward():
        for i in range(n):
            _same_layer(w.acquire(i), ref.acquire(i))
            w.release(i)

    def decode():
        feed.before_launch(step)
        feed.begin(step)
        for i in range(n):
            _same_layer(feed.acquire(i), ref.acquire(i))
            feed.release(i)
        feed.after_launch(step)

    for run in (forward, decode, decode, forward, forward, decode, forward):
        run()
    assert w.stream.stats["handoffs"] == 3
    w.close()


def test_decode_feed_with_storage_is_the_layer_stream(fake, synth_model):
    cuda, cuda_stream = fake
    model = GGUFModel(synth_model("small", "q4_k_m"))
    sizes = [cuda_stream.LayerLayout(model, i).nbytes for i in range(4)]
    plan = Plan((VRAM, PINNED, STORAGE, PINNED), tuple(sizes), 2, max(sizes), 0, 0, 0, -1, -1)
    w = cuda_stream.StreamedCudaWeights(model, plan, source=ODirectSource(model.path, threads=2), poison=True)
    feed = w.decode_feed()
    assert isinstance(feed, cuda_stream.LayerStreamFeed) and not feed.capturable
    ref = cuda.CudaWeights(model)
    for _step in range(2):
        feed.before_launch(None)
        feed.begin(None)
        for i in range(4):
            _same_layer(feed.acquire(i), ref.acquire(i))
            feed.release(i)
        feed.after_launch(None)
    assert w.stream.stats["reads"] >= 2 and w.stream.stats["handoffs"] == 0
    w.close()


def test_plan_on_fake_gpu(fake, synth_model):
    _, cuda_stream = fake
    from ntransformerd.engine.engine import EngineConfig
    model = GGUFModel(synth_model("small", "q4_k_m"))
    p = cuda_stream.plan(model, EngineConfig(backend="cuda", max_vram_layers=1, max_ctx=64))
    assert p.tiers == (VRAM, PINNED, PINNED, PINNED) and p.depth == 2
