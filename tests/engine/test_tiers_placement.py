"""The host's share of the streamed layers per step shape (tiers/placement.py), from made-up
figures: pure functions, no device."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from ntransformerd.engine.tiers.placement import (Figures, pass_seconds, place_rows, spread, with_schedule)
from ntransformerd.engine.tiers.planner import HOST, PINNED, SKIP, STORAGE, VRAM, Plan

GB = 1e9


def plan(tiers, nbytes=1e9, depth=2) -> Plan:
    return Plan(tuple(tiers), (int(nbytes),) * len(tiers), depth, int(nbytes), 0, 0, 0, -1, -1)


def test_pass_seconds_by_hand():
    """3 streamed layers of 1 GB, link 1 GB/s, depth 2, GPU compute free: all over the link the
    pass waits for each copy (3 s); the host taking the middle one while the third is copied
    makes it 2 s; a hand-off costs its time each way."""
    p = plan([PINNED] * 3)
    f = Figures(1 * GB, {1: 1 * GB})
    assert pass_seconds(p, set(), f, 1).seconds == pytest.approx(3.0)
    mid = pass_seconds(p, {1}, f, 1)
    assert (mid.seconds, mid.link_seconds, mid.host_seconds, mid.handoffs) == pytest.approx((2.0, 2.0, 1.0, 2))
    assert pass_seconds(p, {1}, dataclasses.replace(f, handoff_s=0.1), 1).seconds == pytest.approx(2.2)
    assert pass_seconds(p, {2}, f, 1).seconds == pytest.approx(3.0)  # host last: the link idles meanwhile
    # depth 1: the third copy waits for the first layer's slot (released when computed at 1 s)
    assert pass_seconds(plan([PINNED] * 3, depth=1), set(), f, 1).seconds == pytest.approx(3.0)
    # GPU compute counted: 0.5 s per layer; resident layers cost compute only
    g = dataclasses.replace(f, gpu_bps={1: 2 * GB})
    assert pass_seconds(plan([VRAM, PINNED]), set(), g, 1).seconds == pytest.approx(1.5)


def test_storage_layers_are_bound_by_the_disk_either_way():
    p = plan([STORAGE, STORAGE])
    f = Figures(10 * GB, {1: 10 * GB}, disk_bps=1 * GB)
    assert pass_seconds(p, set(), f, 1).link_seconds == pytest.approx(2.0)
    assert pass_seconds(p, {1}, f, 1).host_seconds == pytest.approx(1.0)


@pytest.mark.parametrize("link,host,depth", [(55, 64.2, 2), (55, 55, 2), (6.5, 40, 2), (40, 6.5, 8)])
def test_the_host_share_balances_the_two_paths(link, host, depth):
    """40 streamed layers after 8 resident: the chosen pass is near the balanced bound
    bytes / (link + host), below the all-streamed one, and the host's share of the bytes near
    host / (link + host)."""
    tiers = [VRAM] * 8 + [PINNED] * 40
    f = Figures(link * GB, {1: host * GB}, gpu_bps={1: 3000 * GB})
    p = place_rows(plan(tiers, 0.5e9, depth), f, 1)
    total = 40 * 0.5e9
    bound = total / ((link + host) * GB) + 48 * 0.5e9 / (3000 * GB)
    assert p.time.seconds <= bound * 1.12, (p.time, bound)
    assert p.time.seconds < p.streamed.seconds
    share = len(p.host_layers) / 40
    assert abs(share - host / (link + host)) < 0.12, (share, p.host_layers)
    assert all(tiers[i] == PINNED for i in p.host_layers)  # never a resident layer
    assert max(p.time.link_seconds, p.time.host_seconds) <= p.time.seconds + 1e-9


def test_a_short_ring_keeps_a_slow_host_out():
    """A host 6× slower than the link: one host layer lasts 6 copies, a ring of 2 slots hides only
    2 of them, so the host takes nothing; a ring of 8 lets it take its share."""
    tiers = [VRAM] * 8 + [PINNED] * 40
    f = Figures(40 * GB, {1: 6.5 * GB})
    assert place_rows(plan(tiers, 0.5e9, 2), f, 1).host_layers == []
    assert place_rows(plan(tiers, 0.5e9, 8), f, 1).host_layers


def test_large_steps_stream_everything():
    """The host measured compute-bound at 512 rows (1 GB/s) and unmeasured beyond 512: the link
    takes every layer there; at batch 1 the host takes its share."""
    f = Figures(55 * GB, {1: 64 * GB, 16: 20 * GB, 512: 1 * GB})
    p = with_schedule(plan([VRAM] * 4 + [PINNED] * 28, 0.13e9), f, (1, 16, 512, 1024))
    by = {x.rows: x for x in p.schedule.placements}
    assert len(by[1].host_layers) > len(by[16].host_layers) > 0
    assert by[512].host_layers == [] and by[1024].host_layers == []
    assert p.schedule.host_layers == sorted(set(by[1].host_layers) | set(by[16].host_layers))
    assert f.host(8) == pytest.approx(1 / (8 / 15 / (64 * GB) + 7 / 15 / (20 * GB)))  # time per byte interpolated
    assert f.host(2048) == 0 and f.host(1) == 64 * GB


def test_handoffs_are_paid_for():
    """Hand-offs cost time: costly ones make a slower pass than free ones, still ahead of
    streaming everything; one dearer than what the host saves leaves the host out."""
    tiers = [PINNED] * 32
    free = place_rows(plan(tiers, 0.1e9), Figures(50 * GB, {1: 50 * GB}), 1)
    costly = place_rows(plan(tiers, 0.1e9), Figures(50 * GB, {1: 50 * GB}, handoff_s=1e-3), 1)
    assert free.time.seconds < costly.time.seconds < costly.streamed.seconds
    assert costly.time.seconds >= costly.time.handoffs * 1e-3
    assert place_rows(plan(tiers, 0.1e9), Figures(50 * GB, {1: 50 * GB}, handoff_s=0.05), 1).host_layers == []


def test_a_host_not_faster_than_nothing_takes_nothing():
    p = place_rows(plan([PINNED] * 8), Figures(50 * GB, {1: 0.01 * GB}), 1)
    assert p.host_layers == [] and p.tiers == (PINNED,) * 8 and p.time == p.streamed
    assert place_rows(plan([VRAM, SKIP, VRAM]), Figures(1 * GB, {1: 1 * GB}), 1).host_layers == []


def test_a_small_saving_leaves_the_step_to_the_gpu_alone():
    """The host takes layers only where that saves more than HYBRID_MARGIN of the pass: a step
    on the GPU alone replays one captured graph, a hybrid one runs its streamed layers eagerly."""
    from ntransformerd.engine.tiers import placement
    tiers = [VRAM] * 30 + [PINNED] * 2
    figs = Figures(50 * GB, {1: 40 * GB}, {1: 3000 * GB})
    margin = placement.HYBRID_MARGIN
    try:
        placement.HYBRID_MARGIN = 0.0
        small = place_rows(plan(tiers, 0.1e9), figs, 1)
        assert small.host_layers and small.time.seconds < small.streamed.seconds
        saving = 1 - small.time.seconds / small.streamed.seconds
        placement.HYBRID_MARGIN = saving * 1.01
        assert place_rows(plan(tiers, 0.1e9), figs, 1).host_layers == []
        placement.HYBRID_MARGIN = saving * 0.99
        assert place_rows(plan(tiers, 0.1e9), figs, 1).host_layers == small.host_layers
    finally:
        placement.HYBRID_MARGIN = margin


def test_spread():
    assert spread(6, 1, 3) == [False, True] * 3
    assert spread(3, 1, 1, 0.5) == [False, True, False]
    assert spread(8, 2, 2) == [False, False, True, True] * 2
    assert spread(5, 1, 5) == [True] * 5 and sum(spread(7, 3, 1)) in (1, 3)


def test_schedule_explained_and_serialised():
    f = Figures.assumed()
    p = with_schedule(plan([VRAM] * 2 + [PINNED] * 6, 0.2e9), f, (1, 4))
    text = p.explain()
    assert "host compute   by step rows (assumed, not measured" in text
    assert "    1 rows  host" in text and "    4 rows  host   0" in text  # assumed figures know batch 1 only
    d = json.loads(json.dumps(p.to_dict()))
    assert [r["rows"] for r in d["host_compute"]["by_rows"]] == [1, 4] and d["host_compute"]["by_rows"][0]["host"]


@pytest.mark.parametrize("bad", [dict(link_bps=0, host_bps={1: 1.0}), dict(link_bps=1.0, host_bps={}),
                                 dict(link_bps=1.0, host_bps={0: 1.0}),
                                 dict(link_bps=1.0, host_bps={1: 1.0}, handoff_s=-1)])
def test_figures_refuse_nonsense(bad):
    with pytest.raises(ValueError, match="figures"):
        Figures(**bad)


def test_the_config_asks_for_host_compute(synth_model):
    from ntransformerd.engine import tiers
    from ntransformerd.engine.runtime.engine import EngineConfig
    from ntransformerd.engine.gguf_file import GGUFModel
    with pytest.raises(ValueError, match="host_compute = 'on': use off or auto"):
        EngineConfig(host_compute="on").validate()
    model = GGUFModel(synth_model("small", "q4_k_m"))
    config = EngineConfig(backend="cpu-ref", max_ctx=64, max_vram_layers=1, host_compute="auto", prefill_chunk=48)
    p = tiers.model_plan(model, config, backend="cpu")
    assert [x.rows for x in p.schedule.placements] == [1, 2, 4, 8, 16, 32, 48] and not p.schedule.figures.measured
    assert tiers.model_plan(model, EngineConfig(max_ctx=64, max_vram_layers=1), backend="cpu").schedule is None
    with pytest.raises(tiers.PlanError, match="host compute over 2 devices"):
        tiers.model_plan_devices(model, config, backend="cpu", vram_free=[None, None])


def test_host_tier_in_a_placement():
    p = place_rows(plan([PINNED] * 3), Figures(1 * GB, {1: 1 * GB}), 1)
    assert p.tiers == (PINNED, HOST, PINNED) and p.host_layers == [1]
    assert math.isclose(p.time.seconds, 2.0)


# ---- the placement follows the steps (placement.Steering) ------------------------------------------

def _steered(host=64.0, link=55.0):
    """24 streamed layers after 8 resident, placed from figures where the host reads 64 GB/s."""
    from ntransformerd.engine.tiers.placement import Steering
    p = with_schedule(plan([VRAM] * 8 + [PINNED] * 24, 0.2e9), Figures(link * GB, {1: host * GB, 16: 8 * GB},
                                                                       {1: 3000 * GB}), (1, 16))
    return Steering(p, dwell=4, probe=32)


def _step(st, rows, host_bps, link_bps):
    """What a step at `rows` on st's current placement reports when the host and the link run at
    these rates (the truth the steering does not know)."""
    from ntransformerd.engine.tiers.placement import Observation
    pl = next(p for p in st.schedule.placements if p.rows >= rows)
    hb = sum(st.plan.layer_bytes[i] for i in pl.host_layers)
    lb = sum(st.plan.layer_bytes[i] for i, t in enumerate(pl.tiers) if t in (PINNED, STORAGE))
    return st.observe(Observation(rows, hb / host_bps, hb, lb / link_bps, lb))


def _host_layers(st, rows=1):
    return len(next(p for p in st.schedule.placements if p.rows >= rows).host_layers)


def test_steering_keeps_a_placement_the_steps_confirm():
    st = _steered()
    at_load = _host_layers(st)
    assert at_load > 0
    for _ in range(200):
        assert _step(st, 1, 64 * GB * 1.05, 55 * GB * 0.97) is None  # within the noise: nothing moves
    assert st.changes == 0 and _host_layers(st) == at_load


def test_steering_moves_layers_off_a_slowed_host_and_back_when_it_recovers():
    """The host's rate halves mid-run (a neighbour copying memory): within 8 steps the host holds
    fewer layers and the predicted step is no slower than all over the link; when it recovers,
    a probe gives them back within 2 probe periods."""
    st = _steered()
    at_load = _host_layers(st)
    for _ in range(20):
        _step(st, 1, 64 * GB, 55 * GB)
    moved_at = None
    for k in range(1, 40):
        if _step(st, 1, 16 * GB, 55 * GB) is not None and moved_at is None:
            moved_at = k
    assert moved_at is not None and moved_at <= 8, moved_at
    slow = _host_layers(st)
    assert slow < at_load
    one = st.schedule.placements[0]
    assert one.time.seconds <= one.streamed.seconds  # never planned slower than the link alone
    load = st.base

    def predicted(s):  # the current placement's step at 1 row, on the figures at load (the truth again)
        return pass_seconds(s.plan, set(s.schedule.placements[0].host_layers), load, 1).seconds
    best = place_rows(st.plan, load, 1).time.seconds
    assert predicted(st) > best * 1.05
    back_at = None
    for k in range(1, 400):
        _step(st, 1, 64 * GB, 55 * GB)
        if predicted(st) <= best * 1.05:
            back_at = k
            break
    assert back_at is not None and back_at <= 2 * 32 + 2 * 4 + 16, back_at


def test_steering_follows_a_slower_link_too():
    st = _steered()
    at_load = _host_layers(st)
    for _ in range(30):
        _step(st, 1, 64 * GB, 20 * GB)  # the link at 20 GB/s, not 55: the host should take more
    assert _host_layers(st) > at_load and st.link_scale < 0.5


def test_a_probe_that_finds_the_host_still_slow_waits_longer_next_time():
    st = _steered()
    for _ in range(40):
        _step(st, 1, 4 * GB, 55 * GB)  # so slow the host takes nothing
    assert _host_layers(st) == 0
    probes = []
    for k in range(3000):
        before = _host_layers(st)
        _step(st, 1, 4 * GB, 55 * GB)
        if before == 0 and _host_layers(st) > 0:
            probes.append(k)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(probes) >= 2 and all(b >= a for a, b in zip(gaps, gaps[1:])) and gaps[-1] > gaps[0], probes


# ---- the context: the host's attention (Figures.host_attn_s) ----------------------------------------

ATTN_S = 0.65e-6  # the host's attention per position per layer: issue 34's 8B (f16 KV), the first kernel


def _eight_b(attn_s=ATTN_S):
    """An 8B of 32 layers of 0.22 GB with 24 resident, the host reading 64 GB/s, the link 55."""
    p = plan([VRAM] * 24 + [PINNED] * 8, 0.22e9)
    return p, Figures(55 * GB, {1: 64 * GB, 16: 8 * GB}, {1: 3000 * GB}, host_attn_s=attn_s)


def test_a_longer_context_gives_the_host_fewer_layers():
    p, f = _eight_b()
    hosted = [len(place_rows(p, f, 1, context).host_layers) for context in (0, 1024, 4096, 16384, 65536)]
    assert hosted[0] > 0 and all(b <= a for a, b in zip(hosted, hosted[1:])) and hosted[-1] < hosted[0], hosted
    # a host layer's time: its bytes at the host's rate and its attention over the context
    one = pass_seconds(plan([PINNED], 0.22e9), {0}, f, 2, 1000)
    assert one.host_seconds == pytest.approx(0.22e9 / f.host(2) + 2 * 1000 * ATTN_S)
    s = with_schedule(p, f, (1, 16), context=4096).schedule
    assert s.context == 4096 and "context 4096 positions" in s.explain()[0]
    assert s.placements[0].host_layers == place_rows(p, f, 1, 4096).host_layers
    # without the figure the context costs nothing: the placement at load, whatever the context
    assert place_rows(p, dataclasses.replace(f, host_attn_s=0.0), 1, 65536).host_layers == \
        place_rows(p, f, 1, 0).host_layers


def _grow(st, contexts, attn_s=ATTN_S, host_bps=64 * GB, link_bps=55 * GB):
    """Decode steps of one row at each context in turn, the host's time holding its attention
    (what a real step shows); the host layers at each step."""
    from ntransformerd.engine.tiers.placement import Observation
    hosted = []
    for c in contexts:
        pl = st.schedule.placements[0]
        hb = sum(st.plan.layer_bytes[i] for i in pl.host_layers)
        lb = sum(st.plan.layer_bytes[i] for i, t in enumerate(pl.tiers) if t in (PINNED, STORAGE))
        n = len(pl.host_layers)
        st.observe(Observation(1, hb / host_bps + n * c * attn_s, hb, lb / link_bps, lb, keys=c, host_layers=n))
        hosted.append(len(st.schedule.placements[0].host_layers))
    return hosted


def test_steering_does_not_take_a_longer_context_for_a_slower_host():
    """Context from 1 to 4096, one position a step, on a host whose speed never changes: the
    host's factor stays at 1, the placement gives the host fewer layers as the attention grows,
    in at most 12 weighs (x1.25 from 256); the steering without the figure takes the growing
    attention for a slower host."""
    from ntransformerd.engine.tiers.placement import Steering
    p, f = _eight_b()
    st = Steering(with_schedule(p, f, (1, 16)), dwell=4, probe=32)
    hosted = _grow(st, range(1, 4097))
    assert 0.99 < st.host_scale < 1.01, st.status()
    assert hosted[-1] < hosted[0] and hosted[-1] == len(place_rows(p, f, 1, 4096).host_layers), (hosted[0], hosted[-1])
    assert 1 <= st.weighs <= 12 and st.changes <= st.weighs, st.status()
    blind = Steering(with_schedule(p, dataclasses.replace(f, host_attn_s=0.0), (1, 16)), dwell=4, probe=32)
    _grow(blind, range(1, 4097))
    assert blind.host_scale < 0.9, blind.status()  # it reads a slow host


def test_a_new_short_context_gives_the_host_its_layers_back():
    from ntransformerd.engine.tiers.placement import Steering
    p, f = _eight_b()
    st = Steering(with_schedule(p, f, (1, 16)), dwell=4, probe=32)
    long = _grow(st, [16384] * 8)
    assert long[-1] < len(place_rows(p, f, 1, 0).host_layers)
    short = _grow(st, range(1, 9))  # a new conversation: back at once (after the dwell)
    assert short[-1] == len(place_rows(p, f, 1, 0).host_layers) and 0.99 < st.host_scale < 1.01


def test_each_context_jump_weighs_an_80_layer_plan_again():
    """Each jump of the context by CONTEXT_STEP or more makes the placement again at every shape
    of an 80-layer plan (the work bench/ timing of the step includes; no timing here)."""
    from ntransformerd.engine.tiers.placement import Observation, Steering
    p = plan([VRAM] * 40 + [PINNED] * 40, 0.5e9)
    f = Figures(55 * GB, {1: 64 * GB, 16: 8 * GB}, {1: 3000 * GB}, host_attn_s=ATTN_S)
    st = Steering(with_schedule(p, f, (1, 2, 4, 8, 16, 32, 512)), dwell=1)
    for c in (4096, 256, 4096):
        st.observe(Observation(1, 0.0, 0, 0.0, 0, keys=c))
    assert st.weighs == 3


# ---- what the periods show: the loop's cost and what host layers cost the rest ----------------------

class _Loop:
    """A decode loop over a Steering at one row: each step's true period is its pass on the true
    figures, plus the loop's own `loop_s`, plus `host_layer_s` per host layer it ran (the host's
    threads slowing the rest: what the figures cannot see); each observation carries the
    previous step's period, as the pipeline reports it, and the host's own pieces at the true
    rate (so host_scale stays near 1)."""

    def __init__(self, st, host_layer_s, loop_s=0.001):
        self.st, self.truth, self.h, self.c = st, st.base, host_layer_s, loop_s
        self.period = 0.0
        self.periods: list[float] = []
        self.hosted: list[int] = []

    def step(self, waited: float = 0.0):
        from ntransformerd.engine.tiers.placement import Observation
        st = self.st
        pl = st.schedule.placements[0]
        hb = sum(st.plan.layer_bytes[i] for i in pl.host_layers)
        lb = sum(st.plan.layer_bytes[i] for i, t in enumerate(pl.tiers) if t in (PINNED, STORAGE))
        n = len(pl.host_layers)
        st.observe(Observation(1, hb / self.truth.host(1), hb, lb / self.truth.link_bps, lb, host_layers=n,
                               period=self.period + waited if self.period else 0.0))
        self.period = pass_seconds(st.plan, set(pl.host_layers), self.truth, 1).seconds + self.c + self.h * n
        self.periods.append(self.period)
        self.hosted.append(n)

    def run(self, steps):
        for _ in range(steps):
            self.step()
        return self


def _off_period(st, loop_s=0.001):
    return pass_seconds(st.plan, set(), st.base, 1).seconds + loop_s


def test_a_host_that_slows_the_rest_is_placed_out():
    """8 streamed layers beside 24 resident; each host layer costs the step 20 ms more than its
    own pieces show (a host so busy that its threads starve the loop): the first trial on the GPU
    alone reads the loop's cost, the hybrid steps after it the host layers' extra, and within 40
    steps the host holds none; from there the loop runs no slower than with the host off, its
    probes included (auto ≥ off)."""
    from ntransformerd.engine.tiers.placement import Steering
    p, f = _eight_b(attn_s=0.0)
    st = Steering(with_schedule(p, f, (1, 16)), dwell=4, probe=32)
    assert _host_layers(st) > 0
    loop = _Loop(st, host_layer_s=0.020).run(40)
    assert st.trials >= 1 and st.loop_s == pytest.approx(0.001, abs=1e-4), st.status()
    assert loop.hosted[-1] == 0, (loop.hosted, st.status())
    loop.run(2000)
    assert sum(loop.periods[-2000:]) / 2000 <= _off_period(st) * 1.02, st.status()


@pytest.mark.parametrize("extra", (0.0005, 0.002))
def test_the_placement_follows_what_host_layers_cost_the_rest(extra):
    """24 streamed layers, each host layer costing `extra` more than its pieces show: within 600
    steps the loop runs within HYBRID_MARGIN of the best placement on the truth (the figures with
    that cost known), with fewer host layers than at load, and faster than the GPU alone."""
    from ntransformerd.engine.tiers.placement import HYBRID_MARGIN
    st = _steered()
    at_load = _host_layers(st)
    loop = _Loop(st, host_layer_s=extra).run(600)
    truth = dataclasses.replace(st.base, host_layer_s=extra)
    best = place_rows(st.plan, truth, 1)
    best_period = best.time.seconds + 0.001
    assert loop.periods[-1] <= best_period * (1 + HYBRID_MARGIN), (loop.hosted[-1], len(best.host_layers), st.status())
    assert loop.hosted[-1] <= at_load and loop.periods[-1] < _off_period(st), (loop.hosted[-1], at_load)
    if extra >= 0.002:
        assert loop.hosted[-1] < at_load


def test_a_host_that_costs_nothing_more_keeps_its_layers():
    """Host layers whose pieces say all they cost: after the trials (once early, then only where
    the hybrid's saving is small: not here) the placement at load holds, and the trials' steps
    on the GPU alone are a small share of the run."""
    st = _steered()
    at_load = _host_layers(st)
    loop = _Loop(st, host_layer_s=0.0).run(3000)
    assert loop.hosted[-1] == at_load and st.host_layer_s < 1e-4, st.status()
    assert loop.hosted.count(0) <= 2 * st.trial and st.trials <= 2, (loop.hosted.count(0), st.status())
    best = pass_seconds(st.plan, set(place_rows(st.plan, st.base, 1).host_layers), st.base, 1).seconds + 0.001
    assert sum(loop.periods) / len(loop.periods) <= best * 1.01


def test_a_wait_for_work_is_not_taken_for_the_loops_cost():
    """A period holding a wait (the loop idle between requests: seconds) teaches nothing."""
    st = _steered()
    loop = _Loop(st, host_layer_s=0.0).run(60)
    before = (st.loop_s, st.host_layer_s)
    loop.step(waited=5.0)
    loop.step()
    assert (st.loop_s, st.host_layer_s) == before


def test_without_periods_nothing_is_tried():
    """A pipeline that reports no periods (Observation.period 0) gets no trials."""
    st = _steered()
    for _ in range(600):
        _step(st, 1, 64 * GB, 55 * GB)
    assert st.trials == 0 and st.loop_s is None


def test_the_learned_host_cost_is_kept_with_the_figures(tmp_path):
    from ntransformerd.engine.tiers.placement import load_figures, save_figures
    f = Figures(55 * GB, {1: 64 * GB}, {1: 3000 * GB}, host_layer_s=0.002)
    save_figures(str(tmp_path / "f.json"), f)
    assert load_figures(str(tmp_path / "f.json")).host_layer_s == 0.002
    assert "2.00 ms more a host layer" in f.describe()
    with pytest.raises(ValueError):
        Figures(55 * GB, {1: 64 * GB}, host_layer_s=-1.0)
