"""Tiers: the planner table, the sources, and the streamed CPU pipeline against resident output."""

from __future__ import annotations

import itertools
import os
import random

import numpy as np
import pytest

from ntransformerd.engine.runtime.engine import Engine, EngineConfig
from ntransformerd.engine.gguf_file import GGUFModel
from ntransformerd.engine.tiers import model_plan, planner
from ntransformerd.engine.tiers.planner import PINNED, STORAGE, VRAM, Plan, PlanError, plan_tiers
from ntransformerd.engine.tiers.sources import MmapSource, ODirectSource, SlowSource, open_source, plan_reads
from ntransformerd.engine.backends.cpu import StreamedCpuWeights

GiB, MiB = 1 << 30, 1 << 20

# ---- the planner table ------------------------------------------------------------------------

# Llama-3-8B Q4_K_M (synthetic): 32 layers of ~0.128 GiB (Q6_K ffn_down on some), ~0.4 GiB fixed.
L8 = [int(0.1285 * GiB)] * 32
F8 = int(0.40 * GiB)
# Llama-3-70B Q4_K_M: 80 layers of ~0.48 GiB, ~0.8 GiB fixed.
L70 = [int(0.48 * GiB)] * 80
F70 = int(0.80 * GiB)
KV = 1 * GiB
WS = 1 * GiB

TABLE = [
    # name, layers, fixed, vram_free, ram, overrides → (vram, pinned, storage) layer counts, depth
    ("8b fits the H200", L8, F8, 139 * GiB, 120 * GiB, {}, (32, 0, 0), 0),
    ("8b, 24 layers asked", L8, F8, 139 * GiB, 120 * GiB, {"max_vram_layers": 24}, (24, 8, 0), 2),
    ("8b, 0 layers asked", L8, F8, 139 * GiB, 120 * GiB, {"max_vram_layers": 0}, (0, 32, 0), 2),
    ("8b on a 4 GiB card", L8, F8, 139 * GiB, 120 * GiB, {"vram_budget": 4 * GiB}, (10, 22, 0), 2),
    ("8b on a 4 GiB card, depth 3", L8, F8, 139 * GiB, 120 * GiB, {"vram_budget": 4 * GiB, "stream_depth": 3},
     (9, 23, 0), 3),
    ("8b, 2 GiB RAM", L8, F8, 139 * GiB, 120 * GiB, {"max_vram_layers": 0, "pinned_budget": 2 * GiB}, (0, 13, 19), 2),
    ("70b on a 24 GiB budget", L70, F70, 139 * GiB, 120 * GiB, {"vram_budget": 24 * GiB}, (42, 38, 0), 2),
    ("70b on the whole H200", L70, F70, 139 * GiB, 120 * GiB, {}, (80, 0, 0), 0),
    ("70b, 24 GiB card, 16 GiB RAM", L70, F70, 139 * GiB, 20 * GiB, {"vram_budget": 24 * GiB}, (42, 31, 7), 2),
]


@pytest.mark.parametrize("name,layers,fixed,vram,ram,over,counts,depth", TABLE, ids=[t[0] for t in TABLE])
def test_planner_table(name, layers, fixed, vram, ram, over, counts, depth):
    p = plan_tiers(layers, fixed_bytes=fixed, kv_bytes=KV, workspace_bytes=WS, vram_free=vram, ram_available=ram,
                   **over)
    assert (len(p.layers(VRAM)), len(p.layers(PINNED)), len(p.layers(STORAGE))) == counts, p.explain()
    assert p.depth == depth
    assert p.vram_bytes <= p.vram_limit
    if p.ram_limit >= 0:
        assert p.ram_bytes <= p.ram_limit
    # Resident layers first; storage layers a contiguous tail; streamed bytes add up.
    order = {VRAM: 0, PINNED: 1, STORAGE: 2}
    assert [order[t] for t in p.tiers] == sorted(order[t] for t in p.tiers)
    assert p.streamed_bytes_per_step == sum(layers[i] for i in p.streamed)
    text = p.explain()
    assert "VRAM-resident" in text and "streamed/step" in text


def test_plan_70b_24gib_expected_rate():
    p = plan_tiers(L70, fixed_bytes=F70, kv_bytes=KV, workspace_bytes=WS, vram_free=139 * GiB,
                   ram_available=120 * GiB, vram_budget=24 * GiB)
    # ~17.8 GiB streamed per token at 55 GB/s: ~2.9 tok/s is the PCIe bound
    assert 2.5 < p.expected_tok_s() < 3.2
    assert p.to_dict()["layers"]["pinned"] == list(range(42, 80))


@pytest.mark.parametrize("over,match", [
    ({"vram_budget": 2 * GiB}, "cannot hold the fixed weights"),
    ({"vram_budget": int(2.6 * GiB)}, "cannot hold even the 2 streaming slots"),
    ({"vram_budget": 3 * GiB, "stream_depth": 8}, "cannot hold even the 8 streaming slots"),
    ({"max_vram_layers": 0, "pinned_budget": 100 * MiB}, "cannot hold even the 2 storage staging buffers"),
    ({"stream_depth": 0}, "out of range"),
])
def test_planner_clear_errors(over, match):
    with pytest.raises(PlanError, match=match):
        plan_tiers(L8, fixed_bytes=F8, kv_bytes=KV, workspace_bytes=WS, vram_free=139 * GiB,
                   ram_available=120 * GiB, **over)


# ---- sources --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(synth_model):
    return GGUFModel(synth_model("tiny", "q8_0"))


@pytest.fixture(scope="module")
def small(synth_model):
    return GGUFModel(synth_model("small", "q4_k_m"))


@pytest.mark.parametrize("kind", ["mmap", "odirect"])
def test_sources_read_layer_spans(small, kind):
    src = MmapSource(small.path) if kind == "mmap" else ODirectSource(small.path, threads=3, chunk=64 << 10)
    with src:
        for i in range(small.config.n_layers):
            ts = small.layer_tensors(i)
            r = plan_reads(ts.values(), 4096)
            assert len(r.reads) == 1  # the layer's tensors are contiguous: one aligned span
            from ntransformerd.engine.tiers.sources import HostMemory
            buf = HostMemory().alloc(r.nbytes)
            r.fill(src, buf)
            for t in ts.values():
                assert np.array_equal(r.raw(buf, t), np.asarray(t.data).view(np.uint8).reshape(-1))


def test_the_engine_leaves_the_nvme_drive_to_the_daemon(small):
    """A storage string naming the staged drive is refused with what to do: the engine opens no
    device (the daemon brings the drive up and hands over the opened source)."""
    with pytest.raises(ValueError, match="ntransformerd brings up.*storage = file, odirect or mmap"):
        open_source("nvme:0000:00:04.0", small.path)
    with pytest.raises(ValueError, match="not one of file, odirect, mmap"):
        open_source("tape", small.path)


def test_plan_reads_splits_far_tensors(small):
    ts = [small.tensor("blk.0.attn_q.weight"), small.tensor("blk.3.ffn_down.weight")]
    r = plan_reads(ts, 4096, max_gap=0)
    assert len(r.reads) == 2 and all(off % 4096 == 0 and n % 4096 == 0 for off, n, _ in r.reads)


# ---- the streamed CPU pipeline: bit-identical to resident ---------------------------------------

def _run(engine, prompt=(1, 2, 3, 4, 5, 6, 7), steps=3):
    """Prefill (in 3-token chunks), decode a few greedy tokens, and a batched step of two."""
    a, b = engine.open(), engine.open()
    try:
        outs = [engine.prefill(a, list(prompt))]
        tok = int(np.argmax(outs[-1]))
        engine.prefill(b, [3, 1, 4])
        for _ in range(steps):
            outs.append(engine.step([(a, [tok]), (b, [tok])]))
            tok = int(np.argmax(outs[-1][0]))
        return outs
    finally:
        engine.close(a)
        engine.close(b)


def _streamed_engine(model, plan, source=None, poison=True):
    """An engine like the reference, its weights streamed under `plan` (the reference's embedding
    and resident layers shared)."""
    return _swap_weights(_engine(model), model, plan, source, poison)


def _engine(model, **kw):
    return Engine(model, config=EngineConfig(backend="cpu-ref", max_batch=2, max_ctx=64, prefill_chunk=3, **kw))


_refs = {}


def _reference(model):
    if model.path not in _refs:
        e = _engine(model)
        _refs[model.path] = (e, _run(e))
    return _refs[model.path][1]


def _plan(model, tiers, depth):
    lb = [model.layer_bytes(i) for i in range(model.config.n_layers)]
    return Plan(tuple(tiers), tuple(lb), depth, max(lb), 0, 0, 0, -1, -1)


def _swap_weights(engine, model, plan, source=None, poison=True):
    _reference(model)
    engine.weights = StreamedCpuWeights(model, plan, source=source, poison=poison, shared=_refs[model.path][0].weights)
    return engine


@pytest.mark.parametrize("mix", sorted(set(itertools.product((VRAM, PINNED, STORAGE), repeat=2))))
def test_every_tier_mix_is_bit_identical_tiny(tiny, mix):
    ref = _reference(tiny)
    src = ODirectSource(tiny.path, threads=2) if STORAGE in mix else None
    _reference(tiny)
    e = _streamed_engine(tiny, _plan(tiny, mix, 2), src)
    got = _run(e)
    e.weights.close()
    for x, y in zip(got, ref):
        assert np.array_equal(x, y), mix


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_race_poisoned_slots_slow_readers(small, depth):
    """Freed slots are poisoned (0xFF: NaN norms) and readers sleep at random: any slot reused
    too early, or read too late, changes the output."""
    ref = _reference(small)
    rng = random.Random(depth)
    for mix in ([STORAGE] * 4, [VRAM, STORAGE, PINNED, STORAGE]):
        src = SlowSource(ODirectSource(small.path, threads=2), lambda: rng.random() * 0.004)
        e = _streamed_engine(small, _plan(small, mix, depth), src)
        got = _run(e, steps=2)
        stats = dict(e.weights.stream.stats)
        e.weights.close()
        for x, y in zip(got, ref):
            assert np.array_equal(x, y), (mix, depth)
        assert src.reads == stats["reads"] > 0


def test_engine_config_streams_beyond_ram_budget(small):
    """A model larger than the RAM budget: the planner sends the tail to storage (O_DIRECT)."""
    ref = _reference(small)
    lb = max(small.layer_bytes(i) for i in range(small.config.n_layers))
    e = _engine(small, max_vram_layers=1, pinned_budget=lb * 5 // 2, stream_depth=1)
    assert e.plan.tiers == (VRAM, PINNED, STORAGE, STORAGE)
    assert sum(small.layer_bytes(i) for i in e.plan.streamed) > lb * 5 // 2
    got = _run(e)
    assert e.weights.source.name == "odirect"
    for x, y in zip(got, ref):
        assert np.array_equal(x, y)
    e.weights.close()


@pytest.mark.parametrize("over", [{}, {"max_vram_layers": 1, "stream_depth": 1}])
def test_load_progress_reports_every_layer_once(small, over):
    """model.on_layer_loaded sees each layer once as the backend loads it (resident, pinned, or
    storage once its reads are planned), and nothing while the plan is only being made."""
    seen = []
    lb = max(small.layer_bytes(i) for i in range(small.config.n_layers))
    if over:
        over = dict(over, pinned_budget=lb * 5 // 2)  # VRAM, PINNED, STORAGE, STORAGE
    small.on_layer_loaded(seen.append)
    try:
        model_plan(small, EngineConfig(backend="cpu-ref", **over), backend="cpu")
        assert seen == []
        e = _engine(small, **over)
    finally:
        small.on_layer_loaded(None)
    assert sorted(seen) == list(range(small.config.n_layers))
    if over:
        assert e.plan.tiers == (VRAM, PINNED, STORAGE, STORAGE)
        e.weights.close()


def test_engine_config_budget_too_small(small):
    with pytest.raises(PlanError, match="staging buffers"):
        _engine(small, max_vram_layers=0, pinned_budget=1 << 20)  # the least a budget may be


def test_default_model_streams_bit_identical(default_model):
    """The real default model (SmolLM2, 30 layers): half pinned, half from storage via mmap."""
    prompt = [1, 504, 3145, 28, 253, 4000]
    ref = _run(_engine(default_model), prompt, steps=1)
    n = default_model.config.n_layers
    tiers = [VRAM] * 10 + [PINNED] * 10 + [STORAGE] * (n - 20)
    e = _engine(default_model)
    e.weights = StreamedCpuWeights(default_model, _plan(default_model, tiers, 2), source=MmapSource(default_model.path),
                                   poison=True, shared=e.weights)
    for x, y in zip(_run(e, prompt, steps=1), ref):
        assert np.array_equal(x, y)
    e.weights.close()
