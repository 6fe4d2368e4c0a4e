"""The one way an engine runs (tiers/step_pipeline.py): model.forward over the plan's runs, on simulated
CPU devices: layers [0, b) on device 0, [b, c) on device 1, ..., the activation handed over
between them with the old buffer poisoned; bit-identical to the one-device run."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from ntransformerd.engine.runtime import engine as engine_module
from ntransformerd.engine.runtime.engine import Engine, EngineConfig
from ntransformerd.engine.gguf_file import GGUFModel
from ntransformerd.engine import tiers
from ntransformerd.engine.tiers import step_pipeline as runs
from ntransformerd.engine.tiers.multi import MultiPlan, plan_devices
from ntransformerd.engine.tiers.placement import Figures
from ntransformerd.engine.tiers.planner import HOST, PINNED, SKIP, STORAGE, VRAM, Plan
from ntransformerd.engine.tiers.step_pipeline import DeviceKV, Run, layout_of, runs_of


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


CONFIG = dict(backend="cpu-ref", max_batch=2, max_ctx=64, prefill_chunk=3)


def _engine(model, **kw):
    return Engine(model, config=EngineConfig(**CONFIG), **kw)


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


def test_engine_has_one_mode():
    """No pipeline= or ops-less engine: every engine is built from a plan and runs its runs."""
    assert list(inspect.signature(Engine).parameters) == ["model", "config", "plan", "poison"]
    assert not hasattr(engine_module, "pipeline_engine")


def test_one_device_is_model_forward_itself(tiny, monkeypatch):
    model, e, ref = tiny
    assert len(e.pipeline.stages) == 1 and e.pipeline.kv is e.kv is e.pipeline.stages[0].kv
    calls = []
    forward = runs.llama.forward
    monkeypatch.setattr(runs.llama, "forward", lambda *a, **k: calls.append(k["layers"]) or forward(*a, **k))
    s = e.open()
    try:
        got = e.prefill(s, [1, 2, 3, 4, 5, 6, 7])
    finally:
        e.close(s)
    assert calls == [[0, 1]] * 3 and np.array_equal(got, ref[0])
    assert e.pipeline.handoff.stats["copies"] == 0


@pytest.mark.parametrize("mix", [[[VRAM], [VRAM]], [[PINNED], [STORAGE]], [[STORAGE], [VRAM]], [[VRAM, PINNED]]])
def test_two_devices_bit_identical_tiny(tiny, mix):
    model, _, ref = tiny
    e = _engine(model, plan=_mp(model, mix), poison=True)  # slots and the handed-off activation poisoned
    got = _run(e)
    e.unload()
    for x, y in zip(got, ref):
        assert np.array_equal(x, y), mix
    steps = 3 + 1 + 3 + 1  # prefill chunks (3 + 1), decode steps, the all-logits step
    assert e.pipeline.handoff.stats["copies"] == (len(mix) - 1) * steps
    if len(mix) == 2:
        assert e.pipeline.layout.runs_for(1) == (Run(0, mix[0][0], (0,)), Run(1, mix[1][0], (1,)))
        assert [st.name for st in e.pipeline.stages] == ["cpu-ref:0", "cpu-ref:1"]


def test_planned_devices_bit_identical_small(small):
    """The planner's own split of a 4-layer model over 3 small devices, each streaming its share
    over its own slot ring (pinned, and storage where the RAM budget ends)."""
    model, _, ref = small
    lb = [model.layer_bytes(i) for i in range(4)]
    m = max(lb)
    mp = plan_devices(lb, vram_free=[None] * 3, vram_budget=[int(1.6 * m)] * 3, ram_available=None,
                      pinned_budget=int(3.5 * m), stream_depth=1)
    assert mp.n_devices == 3 and len(mp.streamed) == 4 and mp.layers(STORAGE), mp.explain()
    e = _engine(model, plan=mp, poison=True)
    got = _run(e, steps=2)
    assert all(st.weights.stream.stats["copies"] > 0 for st in e.pipeline.stages)
    e.unload()
    for x, y in zip(got, ref):
        assert np.array_equal(x, y)


def test_config_devices_on_the_host_split_the_layers(small):
    """devices = '0,1' on a host backend: two simulated devices from the config's budgets, each
    its own KV cache for its own layers."""
    model, _, ref = small
    e = Engine(model, config=EngineConfig(**CONFIG, devices="0,1", vram_budget="3GiB"), poison=True)
    assert e.plan.n_devices == 2 and e.plan.all_resident and e.plan.ranges == [(0, 2), (2, 4)], e.plan.explain()
    assert [len(st.kv.cache.layers) for st in e.pipeline.stages] == [2, 2]
    for x, y in zip(_run(e, steps=2), ref):
        assert np.array_equal(x, y)
    assert e.pipeline.handoff.stats["copies"] > 0


def _host_engine(model, **kw):
    """The main device resident on layer 0 and streaming 1-3; beside it the host, which (by
    made-up figures: link and host alike, the host unmeasured beyond 2 rows) computes some
    streamed layers in steps of 1 or 2 rows; steps of 3 rows (prefill chunks) stream them all."""
    config = EngineConfig(**CONFIG, max_vram_layers=1, host_compute="auto")
    plan = tiers.model_plan(model, config, backend="cpu", figures=Figures(1e9, {1: 1e9, 2: 1e9}))
    return Engine(model, config=config, plan=plan, poison=True, **kw)


def test_host_beside_the_main_device_bit_identical(small):
    """Two CPU "devices", the main one and the host, the layers moving between them with the
    step shape: each step's hand-offs are poisoned, the KV of a layer both compute is synced,
    and the output is bit-identical to one device."""
    model, _, ref = small
    e = _host_engine(model)
    e.pipeline.steering = None  # the placement at load throughout: the hand-offs are counted below
    assert e.plan.tiers == (VRAM, PINNED, PINNED, PINNED) and e.plan.schedule.host_layers, e.plan.explain()
    assert [st.name for st in e.pipeline.stages] == ["cpu-ref:0", "host"]
    host = set(e.plan.schedule.host_layers)
    assert {r.device for r in e.pipeline.layout.runs_for(2)} == {0, 1}
    assert all(r.device == 0 for r in e.pipeline.layout.runs_for(3))  # a prefill chunk: the link brings all
    # the host holds every streamed layer (the placement may move any of them there), the main device all
    assert isinstance(e.kv, DeviceKV) and e.kv.homes == {0: (0,), 1: (0, 1), 2: (0, 1), 3: (0, 1)}
    got = _run(e, steps=2)
    e.unload()
    for x, y in zip(got, ref):
        assert np.array_equal(x, y)
    def handoffs(rows):  # the embedding and the output on device 0
        ds = [0] + [r.device for r in e.pipeline.layout.runs_for(rows)] + [0]
        return sum(a != b for a, b in zip(ds, ds[1:]))

    # steps of ≤ 2 rows: the prompt's last chunk (1 row) and the 2 decode steps (2 rows)
    assert handoffs(2) >= 2 and e.pipeline.handoff.stats["copies"] == handoffs(1) + 2 * handoffs(2)
    assert "host compute" in e.plan.explain() and HOST in e.plan.schedule.placements[0].tiers


def test_without_the_kv_sync_the_host_reads_holes(small, monkeypatch):
    """What the sync does: a prefill chunk computed on the main device leaves the host's cache
    of the layers it shares empty; the host's next decode then differs."""
    model, _, ref = small
    monkeypatch.setattr(DeviceKV, "sync", lambda self, batch, groups: None)
    e = _host_engine(model)
    got = _run(e, steps=2)
    e.unload()
    assert not all(np.array_equal(x, y) for x, y in zip(got, ref))


def _edits(engine):
    """Steps that move a sequence's layers between devices mid-sequence, with a rejected draft
    (truncate) and a prefix shared through copy_prefix: the logits of each step."""
    a = engine.open()
    outs = [engine.prefill(a, [5, 6, 7, 8, 9, 10, 11])]  # chunks of 3 and 1 rows: main, then host
    outs.append(engine.step([(a, [3, 4, 5])], all_logits=True))  # 3 rows: the main device again
    engine.truncate(a, 8)  # two of the three rejected
    for t in (12, 13):  # 1 row: the host, which lacks position 8's keys of the layers it computes
        outs.append(engine.step([(a, [t])]))
    b = engine.open()
    engine.copy_prefix(a, b, 9)
    outs.append(engine.step([(b, [7]), (a, [8])]))  # 2 rows: b's prefix is on the device that wrote it
    outs.append(engine.step([(b, [1, 2, 3])], all_logits=True))
    engine.close(a)
    engine.close(b)
    return outs


def test_the_kv_sync_follows_truncation_and_shared_prefixes(small):
    """A sequence truncated and a prefix copied while its layers move between the devices:
    bit-identical to one device, and in a steady run of one shape nothing is copied."""
    model, one, _ = small
    ref = _edits(one)
    e = _host_engine(model)
    got = _edits(e)
    for x, y in zip(got, ref):
        assert np.array_equal(x, y)
    assert e.kv.stats["syncs"] > 0
    s = e.open()
    e.prefill(s, [1, 2, 3])  # 3 rows: on the main device; the next steps of 1 row on the host
    e.step([(s, [4])])
    before = dict(e.kv.stats)
    for t in range(5):
        e.step([(s, [t])])
    assert e.kv.stats == before  # the host holds what it computes: no copy per step
    e.close(s)
    e.unload()


def test_a_position_no_device_holds_is_an_error(small):
    """The sync refuses to run a layer over positions no device wrote (not silently zeros)."""
    model, _, _ = small
    e = _host_engine(model)
    s = e.open()
    e.prefill(s, [1, 2, 3])
    e.kv.valid[:, :, s] = 0  # as if every device had lost the sequence
    with pytest.raises(RuntimeError, match="on no device"):
        e.step([(s, [4])])
    e.unload()


def test_a_poisoned_handoff_shows_a_stale_read(tiny, monkeypatch):
    """The check behind the tests above: a hand-off that gives the next device the old buffer
    (a view, not a copy) reads NaN once the source is poisoned."""
    model, _, _ = tiny
    e = _engine(model, plan=_mp(model, [[VRAM], [VRAM]]), poison=True)
    monkeypatch.setattr(e.pipeline.stages[1].backend, "to_device", lambda x, device=0: x)
    s = e.open()
    assert np.isnan(e.prefill(s, [1, 2, 3])).all()


def test_runs_of_and_layouts():
    assert runs_of([VRAM, VRAM, PINNED, SKIP, PINNED, STORAGE], [0] * 6) == (
        Run(0, VRAM, (0, 1)), Run(0, PINNED, (2, 4)), Run(0, STORAGE, (5,)))
    assert runs_of([VRAM, VRAM, VRAM], [0, 1, 1]) == (Run(0, VRAM, (0,)), Run(1, VRAM, (1, 2)))
    one = layout_of(None, [10, 10, 10])
    assert len(one.devices) == 1 and one.runs_for(1) == one.runs_for(512) == (Run(0, VRAM, (0, 1, 2)),)
    lb = [10] * 4
    mp = plan_devices(lb, vram_free=[None] * 2, vram_budget=[25, 25], ram_available=None, stream_depth=1)
    lay = layout_of(mp, lb)
    assert (lay.embed, lay.head) == (0, 1) and lay.homes() == {0: (0,), 1: (0,), 2: (1,), 3: (1,)}
    assert [d.plan.tiers for d in lay.devices] == [(VRAM, VRAM, SKIP, SKIP), (SKIP, SKIP, VRAM, VRAM)]


def test_a_layer_outside_every_run_is_refused(tiny):
    _, e, _ = tiny
    with pytest.raises(ValueError, match=r"layers \[5\] are in no run"):
        e.pipeline.groups(1, [0, 5])


def test_a_shared_prefix_stays_shared_on_every_device(small):
    """copy_prefix shares whole blocks by reference on each device's cache; the next step writes
    past the shared positions, so no device copies a shared block (each cache reserves from the
    slot's length the engine keeps), and the logits equal one device's."""
    model, one, _ = small
    e = _host_engine(model)
    outs = {}
    for name, eng in (("one", one), ("two", e)):
        a = eng.open()
        eng.prefill(a, list(range(1, 41)))  # 40 positions: two whole blocks and a part
        b = eng.open()
        eng.copy_prefix(a, b, 40)
        eng.kv.lengths[b] = 40
        caches = [st.kv.cache for st in eng.pipeline.stages] if name == "two" else [eng.kv]
        free = [c.blocks.free_blocks for c in caches]
        outs[name] = eng.step([(b, [7])])
        if name == "two":
            # the step wrote position 40, in the third block, which b holds alone (copied by
            # copy_prefix as a partial block): the two whole blocks stay shared
            assert [c.blocks.free_blocks for c in caches] == free, (free, [c.blocks.free_blocks for c in caches])
            for c in caches:
                assert (c.blocks.tables[b, :2] == c.blocks.tables[a, :2]).all()
        eng.close(a)
        eng.close(b)
    e.unload()
    assert np.array_equal(outs["one"], outs["two"])
