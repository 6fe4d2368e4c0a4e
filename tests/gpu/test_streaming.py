"""Streamed weights on the GPU: output bit-identical to resident weights running the same
kernels (model.forward, no captured decode), for tier mixes, depths 1-3, with poisoned slots;
and the captured decode step on streamed weights (their copies inside the graph, or the eager
step with storage layers) against the resident engine's captured decode, with prefill chunks
(model.forward through the LayerStream) between decode steps, so the slots change hands; and a
plan with skipped layers against model.forward over the same layers."""

from __future__ import annotations

import os

import numpy as np
import pytest

from ntransformerd.engine.runtime.engine import Engine, EngineConfig
from ntransformerd.engine.gguf_file import GGUFModel
from ntransformerd.engine.tiers.planner import PINNED, STORAGE, VRAM, Plan


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    from ntransformerd.tools.synth import synthesize
    path = os.path.join(tmp_path_factory.mktemp("stream"), "small-q4_k_m.gguf")
    synthesize(path, shape="small", ftype="q4_k_m", seed=3)
    return GGUFModel(path)


def _engine(model, **kw):
    e = Engine(model, config=EngineConfig(backend="cuda", max_batch=4, max_ctx=128, prefill_chunk=40, **kw))
    e.steps = None  # the same kernels as the streamed path (model.forward, eagerly)
    return e


def _run(e):
    a, b = e.open(), e.open()
    try:
        outs = [e.prefill(a, list(range(1, 90)))]  # 3 chunks: 40, 40 (dequant + cuBLAS) and 9 rows (matvec)
        e.prefill(b, [5, 6, 7])
        tok = int(np.argmax(outs[-1]))
        for _ in range(3):
            outs.append(e.step([(a, [tok]), (b, [tok + 1])]))
            tok = int(np.argmax(outs[-1][0]))
        return outs
    finally:
        e.close(a)
        e.close(b)


@pytest.fixture(scope="module")
def reference(small):
    return _run(_engine(small))


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("mix", [(PINNED,) * 4, (VRAM, PINNED, STORAGE, PINNED), (STORAGE,) * 4])
def test_streamed_equals_resident_on_gpu(small, reference, mix, depth):
    from ntransformerd.engine.backends import cuda
    from ntransformerd.engine.tiers.sources import ODirectSource
    e = _engine(small)
    sizes = [cuda.layer_nbytes(small, i) for i in range(4)]
    plan = Plan(mix, tuple(sizes), depth, max(sizes), 0, 0, 0, -1, -1)
    src = ODirectSource(small.path, threads=4) if STORAGE in mix else None
    e.weights = cuda.CudaWeights(small, plan, source=src, poison=True)
    got = _run(e)
    for x, y in zip(got, reference):
        assert np.array_equal(x, y), (mix, depth)
    e.weights.close()


def test_engine_plans_and_streams(small, reference):
    e = Engine(small, config=EngineConfig(backend="cuda", max_batch=4, max_ctx=128, prefill_chunk=40,
                                          max_vram_layers=2))
    assert e.plan.tiers == (VRAM, VRAM, PINNED, PINNED) and e.steps is not None
    e.steps = None  # model.forward eagerly, as the reference; test_engine_plans_and_decodes_in_graphs has the graphs
    for x, y in zip(_run(e), reference):
        assert np.array_equal(x, y)


# ---- the captured decode step on streamed weights ---------------------------------------------

def _decoding_engine(model, mix=None, depth=2, source=None):
    """An engine decoding through the captured step: resident weights, or streamed ones of `mix`
    (slots poisoned on release)."""
    from ntransformerd.engine.backends import cuda
    e = Engine(model, config=EngineConfig(backend="cuda", max_batch=4, max_ctx=128, prefill_chunk=40))
    if mix is not None:
        sizes = [cuda.layer_nbytes(model, i) for i in range(len(mix))]
        plan = Plan(mix, tuple(sizes), depth, max(sizes), 0, 0, 0, -1, -1)
        e.weights = cuda.CudaWeights(model, plan, source=source, poison=True)
        e.steps = cuda.graphs(e.ops, e.weights, e.kv)
    return e


def _interleaved(e, batch):
    """Sequences join one at a time: each prompt's prefill chunks (model.forward) run between
    decode steps (the captured step) of the sequences already going, at every bucket up to
    `batch`. Returns every step's logits, (rows, V) each."""
    slots, toks, outs = [], [], []

    def decode(n):
        for _ in range(n):
            outs.append(e.step([(s, [t]) for s, t in zip(slots, toks)]))
            toks[:] = [int(t) for t in np.argmax(outs[-1], axis=1)]

    try:
        for j in range(batch):
            slots.append(e.open())
            prompt = [(7 * j + t) % 1000 + 1 for t in range(45 + 20 * j)]  # chunks of 40 and the rest
            outs.append(e.prefill(slots[-1], prompt)[None])
            toks.append(int(np.argmax(outs[-1][0])))
            decode(2)
        decode(3)
        return outs
    finally:
        for s in slots:
            e.close(s)


def _assert_close(got, want, what):
    assert len(got) == len(want), what
    for n, (x, y) in enumerate(zip(got, want)):
        assert x.shape == y.shape, (what, n)
        assert np.array_equal(np.argmax(x, axis=1), np.argmax(y, axis=1)), (what, n)  # greedy tokens
        err = np.abs(x - y).max() / np.abs(y).max()
        assert err <= 1e-5, (what, n, err)


@pytest.fixture(scope="module")
def resident_decoded(small):
    """batch → the resident engine's _interleaved run (its captured decode), made once."""
    runs = {}

    def get(batch):
        if batch not in runs:
            e = _decoding_engine(small)
            assert e.steps.use_graphs
            runs[batch] = _interleaved(e, batch)
        return runs[batch]

    return get


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("mix", [(PINNED,) * 4, (VRAM, PINNED, VRAM, PINNED), (VRAM, VRAM, VRAM, PINNED)])
def test_streamed_decode_in_graphs_equals_resident(small, resident_decoded, mix, depth, batch):
    """Pinned layers: their copies are captured into the decode step's graph."""
    e = _decoding_engine(small, mix, depth)
    assert e.weights.capturable and e.steps.use_graphs
    got = _interleaved(e, batch)
    assert e.steps.captured and all(b.graph is not None for b in e.steps.captured.values())  # replayed graphs
    _assert_close(got, resident_decoded(batch), (mix, depth, batch))
    e.weights.close()


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("mix", [(VRAM, PINNED, STORAGE, PINNED), (STORAGE,) * 4])
def test_streamed_decode_with_storage_runs_eagerly(small, resident_decoded, mix, depth):
    """Storage layers: the decode step runs eagerly through the LayerStream (reader threads)."""
    from ntransformerd.engine.tiers.sources import ODirectSource
    e = _decoding_engine(small, mix, depth, ODirectSource(small.path, threads=4))
    assert not e.weights.capturable and not e.steps.use_graphs
    got = _interleaved(e, 3)
    assert not e.steps.captured and e.weights.stream.stats["reads"] > 0
    _assert_close(got, resident_decoded(3), (mix, depth))
    e.weights.close()


def test_engine_plans_and_decodes_in_graphs(small, resident_decoded):
    """The engine's own plan (2 layers resident, 2 pinned) decodes through the graph."""
    e = Engine(small, config=EngineConfig(backend="cuda", max_batch=4, max_ctx=128, prefill_chunk=40,
                                          max_vram_layers=2))
    assert e.plan.tiers == (VRAM, VRAM, PINNED, PINNED) and e.steps.use_graphs
    _assert_close(_interleaved(e, 3), resident_decoded(3), "engine plan")
    assert e.steps.captured


def test_skipped_layers_are_not_loaded_and_steps_skip_them(small):
    """skip_layers: the plan marks them, the weights never load them, and every step (prefill
    eagerly, decode captured) runs model.forward over the other layers."""
    from ntransformerd.engine.tiers.planner import SKIP
    e = Engine(small, config=EngineConfig(backend="cuda", max_batch=2, max_ctx=128, prefill_chunk=40,
                                          max_vram_layers=1, skip_layers=(2,)))
    assert e.plan.tiers[2] == SKIP and e.layers == (0, 1, 3) and 2 not in e.weights.layouts
    ref = _engine(small)  # every layer resident, eager: the reference over layers 0, 1, 3
    a, b = e.open(), ref.open()
    la = e.prefill(a, list(range(1, 50)))
    lb = ref.step([(b, list(range(1, 41)))], layers=(0, 1, 3))
    lb = ref.step([(b, list(range(41, 50)))], layers=(0, 1, 3))[0]
    assert np.abs(la - lb).max() / np.abs(lb).max() < 1e-5
    for _ in range(3):
        t = int(np.argmax(la))
        la, lb = e.step([(a, [t])])[0], ref.step([(b, [t])], layers=(0, 1, 3))[0]
        assert np.argmax(la) == np.argmax(lb) and np.abs(la - lb).max() / np.abs(lb).max() < 1e-4
    assert e.steps.captured
