"""The pipeline over simulated devices on the CPU backend: layers [0, b) on device 0, [b, c) on
device 1, ..., the activation handed over between them; bit-identical to the one-device run."""

from __future__ import annotations

import numpy as np
import pytest

from ntransformerd.engine.engine import Engine, EngineConfig, pipeline_engine
from ntransformerd.engine.gguf_file import GGUFModel
from ntransformerd.engine.tiers.multi import MultiPlan, plan_devices
from ntransformerd.engine.tiers.runs import Handoff
from ntransformerd.engine.tiers.planner import PINNED, STORAGE, VRAM, Plan
from ntransformerd.engine.tiers.sources import ODirectSource


def _run(engine, prompt=(1, 2, 3, 4, 5, 6, 7), steps=3):
    """Prefill in 3-token chunks, greedy decode, and a batched step of two sequences."""
    a, b = engine.open(), engine.open()
    try:
        outs = [engine.prefill(a, list(prompt))]
        tok = int(np.argmax(outs[-1]))
        engine.prefill(b, [3, 1, 4])
        for _ in range(steps):
            outs.append(engine.step([(a, [tok]), (b, [tok])]))
            tok = int(np.argmax(outs[-1][0]))
        outs.append(engine.step([(a, [tok, 5, 9])], all_logits=True))
        return outs
    finally:
        engine.close(a)
        engine.close(b)


def _engine(model):
    return Engine(model, config=EngineConfig(backend="cpu", max_seqs=2, max_ctx=64, prefill_chunk=3))


def _mp(model, per_device: list[list[str]]) -> MultiPlan:
    """A MultiPlan with the given tiers per device (ranges follow from the lengths)."""
    plans, starts, a = [], [], 0
    for tiers in per_device:
        lb = tuple(model.layer_bytes(i) for i in range(a, a + len(tiers)))
        streams = any(t != VRAM for t in tiers)
        plans.append(Plan(tuple(tiers), lb, 2 if streams else 0, max(lb) if streams else 0, 0, 0, 0, -1, -1))
        starts.append(a)
        a += len(tiers)
    return MultiPlan(tuple(plans), tuple(starts), (55e9,) * len(plans), -1)


@pytest.fixture(scope="module")
def tiny(synth_model):
    m = GGUFModel(synth_model("tiny", "q8_0"))
    e = _engine(m)
    return m, e, _run(e)


@pytest.fixture(scope="module")
def small(synth_model):
    m = GGUFModel(synth_model("small", "q4_k_m"))
    e = _engine(m)
    return m, e, _run(e, steps=2)


@pytest.mark.parametrize("mix", [[[VRAM], [VRAM]], [[PINNED], [STORAGE]], [[STORAGE], [VRAM]], [[VRAM, PINNED]]])
def test_two_devices_bit_identical_tiny(tiny, mix):
    model, ref_engine, ref = tiny
    mp = _mp(model, mix)
    sources = {d: ODirectSource(model.path, threads=2) for d, p in enumerate(mp.devices) if p.layers(STORAGE)}
    h = Handoff(poison=True)  # the source activation is NaN after each handoff
    e = pipeline_engine(ref_engine, mp, sources=sources, poison=True, handoff=h)
    got = _run(e)
    e.pipeline.close()
    for x, y in zip(got, ref):
        assert np.array_equal(x, y), mix
    steps = 3 + 1 + 3 + 1  # prefill chunks (3 + 1), decode steps, the all-logits step
    assert h.stats["copies"] == (len(mix) - 1) * steps
    if len(mix) == 2:
        assert [(s.start, s.stop, s.device) for s in e.pipeline.stages] == [(0, 1, 0), (1, 2, 1)]


def test_planned_devices_bit_identical_small(small):
    """The planner's own split of a 4-layer model over 3 small devices, each streaming its share
    over its own slot ring (pinned, and storage where the RAM budget ends)."""
    model, ref_engine, ref = small
    lb = [model.layer_bytes(i) for i in range(4)]
    m = max(lb)
    mp = plan_devices(lb, vram_free=[None] * 3, vram_budget=[int(1.6 * m)] * 3, ram_available=None,
                      ram_budget=int(3.5 * m), stream_depth=1)
    assert mp.n_devices == 3 and len(mp.streamed) == 4 and mp.layers(STORAGE), mp.explain()
    sources = {d: ODirectSource(model.path, threads=2) for d, p in enumerate(mp.devices) if p.layers(STORAGE)}
    e = pipeline_engine(ref_engine, mp, sources=sources, poison=True, handoff=Handoff(poison=True))
    got = _run(e, steps=2)
    assert all(s.weights.stream.stats["copies"] > 0 for s in e.pipeline.stages)
    e.pipeline.close()
    for x, y in zip(got, ref):
        assert np.array_equal(x, y)


def test_stages_must_cover_the_layers(tiny):
    from ntransformerd.engine.tiers.runs import Pipeline, Stage
    model, _, _ = tiny
    with pytest.raises(ValueError, match="contiguously"):
        Pipeline([Stage(0, 0, 1, None, None, None)], model.config)
