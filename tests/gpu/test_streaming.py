"""Streamed weights on the GPU: output bit-identical to resident weights running the same
kernels (model.forward, no captured decode), for tier mixes, depths 1-3, with poisoned slots."""

from __future__ import annotations

import os

import numpy as np
import pytest

from ntransformerd.engine.engine import Engine, EngineConfig
from ntransformerd.engine.gguf_file import GGUFModel
from ntransformerd.engine.tiers.planner import PINNED, STORAGE, VRAM, Plan


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    from ntransformerd.engine.synth import synthesize
    path = os.path.join(tmp_path_factory.mktemp("stream"), "small-q4_k_m.gguf")
    synthesize(path, shape="small", ftype="q4_k_m", seed=3)
    return GGUFModel(path)


def _engine(model, **kw):
    e = Engine(model, config=EngineConfig(backend="cuda", max_seqs=4, max_ctx=128, prefill_chunk=40, **kw))
    e._decoder = None  # the same kernels as the streamed path (model.forward)
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
    from ntransformerd.engine.backends import cuda_stream
    from ntransformerd.engine.tiers.sources import ODirectSource
    e = _engine(small)
    sizes = [cuda_stream.LayerLayout(small, i).nbytes for i in range(4)]
    plan = Plan(mix, tuple(sizes), depth, max(sizes), 0, 0, 0, -1, -1)
    src = ODirectSource(small.path, threads=4) if STORAGE in mix else None
    e.weights = cuda_stream.StreamedCudaWeights(small, plan, source=src, poison=True)
    got = _run(e)
    for x, y in zip(got, reference):
        assert np.array_equal(x, y), (mix, depth)
    e.weights.close()


def test_engine_plans_and_streams(small, reference):
    e = Engine(small, config=EngineConfig(backend="cuda", max_seqs=4, max_ctx=128, prefill_chunk=40,
                                          max_vram_layers=2))
    assert e.plan.tiers == (VRAM, VRAM, PINNED, PINNED) and e._decoder is None
    for x, y in zip(_run(e), reference):
        assert np.array_equal(x, y)
