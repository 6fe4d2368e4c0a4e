"""Tiers over several devices: the planner on 1-8 simulated devices of different sizes (CI)."""

from __future__ import annotations

import json
import math
import random

import pytest

from ntransformerd.engine.quants import QUANT_BLOCKS
from ntransformerd.tools.synth import SHAPES, tensor_shapes, tensor_types
from ntransformerd.engine.tiers.multi import parse_budgets, parse_devices, plan_devices
from ntransformerd.engine.tiers.planner import PINNED, STORAGE, VRAM, PlanError, plan_tiers

GiB, MiB = 1 << 30, 1 << 20


def shape_sizes(shape: str, ftype: str):
    """(layer bytes, embedding bytes, output bytes) of a synth model, without writing it."""
    s = SHAPES[shape]
    shapes, types = tensor_shapes(s), tensor_types(s, ftype)
    nb = {n: math.prod(shp) // QUANT_BLOCKS[types[n]][0] * QUANT_BLOCKS[types[n]][1] for n, shp in shapes.items()}
    lb = [sum(v for k, v in nb.items() if k.startswith(f"blk.{i}.")) for i in range(s.n_layers)]
    embd = nb["token_embd.weight"]
    return lb, embd, sum(v for k, v in nb.items() if not k.startswith("blk.")) - embd


L70, E70, O70 = shape_sizes("llama3-70b", "q4_k_m")
KV70 = 2 * 80 * 2 * 4096 * 1024 * 2  # the CUDA cache: F16, max_batch 1 + a scratch slot, 4096 positions
WS = 1 * GiB


def p70(n, budget, **kw):
    return plan_devices(L70, fixed_bytes=E70 + O70, fixed_split=(E70, O70), kv_bytes=KV70, workspace_bytes=WS,
                        vram_free=[139 * GiB] * n, ram_available=120 * GiB, vram_budget=budget, **kw)


def check(mp, n_layers):
    """Ranges contiguous and complete; inside each, resident first; budgets kept; bytes add up."""
    assert mp.starts[0] == 0
    ends = [b for _, b in mp.ranges]
    assert list(mp.starts[1:]) == ends[:-1] and ends[-1] == n_layers
    order = {VRAM: 0, PINNED: 1, STORAGE: 2}
    for p in mp.devices:
        assert [order[t] for t in p.tiers] == sorted(order[t] for t in p.tiers)
        assert p.vram_bytes <= p.vram_limit or p.vram_limit < 0
        assert (p.depth > 0) == bool(p.streamed)
    st = [order[t] for t in mp.tiers if t != VRAM]
    assert st == sorted(st)  # storage layers are one tail of the streamed ones
    assert mp.streamed_bytes_per_step == sum(mp.layer_bytes[i] for i in mp.streamed) == sum(mp.link_bytes)
    assert mp.ram_limit < 0 or mp.ram_bytes <= mp.ram_limit
    json.dumps(mp.to_dict())
    assert "VRAM-resident" in mp.explain()


# ---- one device is exactly today's plan --------------------------------------------------------

L8 = [int(0.1285 * GiB)] * 32
CASES = [({}, 139 * GiB, 120 * GiB), ({"max_vram_layers": 24}, 139 * GiB, 120 * GiB),
         ({"vram_budget": 4 * GiB}, 139 * GiB, 120 * GiB), ({"vram_budget": "4GiB", "stream_depth": 3}, 139 * GiB, 120 * GiB),
         ({"max_vram_layers": 0, "pinned_budget": 2 * GiB}, 139 * GiB, 120 * GiB), ({}, None, None)]


@pytest.mark.parametrize("over,vram,ram", CASES)
def test_one_device_is_plan_tiers(over, vram, ram):
    kw = dict(fixed_bytes=int(0.4 * GiB), kv_bytes=GiB, workspace_bytes=WS, ram_available=ram)
    mp = plan_devices(L8, vram_free=vram, **kw, **over)
    over = dict(over, vram_budget=parse_budgets(over.get("vram_budget"), 1)[0])
    assert mp.devices == (plan_tiers(L8, vram_free=vram, **kw, **over),)
    assert mp.explain() == mp.devices[0].explain()
    check(mp, 32)


# ---- the 70B at 24 GiB per GPU: 1 vs 2 devices -------------------------------------------------

def test_70b_24gib_one_vs_two_devices():
    one, two = p70(1, "24GiB"), p70(2, "24GiB")
    check(one, 80)
    check(two, 80)
    assert one.devices[0] == plan_tiers(L70, fixed_bytes=E70 + O70, kv_bytes=KV70, workspace_bytes=WS,
                                        vram_free=139 * GiB, ram_available=120 * GiB, vram_budget=24 * GiB)
    assert len(one.layers(VRAM)) == 39 and 19 * GiB < one.streamed_bytes_per_step < 20 * GiB
    # Two 24 GiB cards hold every layer of the 70B (38.2 GiB of layers): nothing streams at all,
    # which is at most half of one card's 19.6 GiB per token.
    assert two.all_resident and two.streamed_bytes_per_step == 0 <= one.streamed_bytes_per_step / 2
    assert [len(p.tiers) for p in two.devices] == [40, 40]


def test_70b_16gib_two_devices_stream_half():
    """Where both stream (16 GiB per card): half the bytes per token, each link a quarter."""
    one, two = p70(1, "16GiB"), p70(2, "16GiB")
    check(two, 80)
    r = two.streamed_bytes_per_step / one.streamed_bytes_per_step
    assert 0.45 < r < 0.55, two.explain()
    assert all(0.2 < b / one.streamed_bytes_per_step < 0.3 for b in two.link_bytes)
    s, m = two.step_seconds()
    assert m < s < one.step_seconds()[0] * 0.55 and math.isclose(s, sum(two.link_seconds()))
    text = two.explain()
    assert "device 1" in text and "sum" in text and "max" in text and "handoff" in text


# ---- 1-8 devices of different sizes ------------------------------------------------------------

@pytest.mark.parametrize("n", range(1, 9))
def test_random_uneven_devices(n):
    rng = random.Random(n)
    for _ in range(12):
        budgets = [rng.choice([8, 10, 12, 16, 24, 32, 48, 80]) * GiB for _ in range(n)]
        ram = rng.choice([20, 40, 120]) * GiB
        try:
            mp = plan_devices(L70, fixed_bytes=E70 + O70, fixed_split=(E70, O70), kv_bytes=KV70, workspace_bytes=WS,
                              vram_free=[139 * GiB] * n, ram_available=ram, vram_budget=budgets,
                              stream_depth=rng.choice([1, 2, 3]))
        except PlanError as e:
            assert "device" in str(e) or "RAM" in str(e)
            continue
        check(mp, 80)
        assert [p.vram_limit for p in mp.devices] == budgets


def test_uneven_sizes_get_proportional_shares():
    # Everything fits: layers in proportion to what each card holds (after its fixed share).
    mp = p70(2, ["16GiB", "32GiB"])
    assert mp.all_resident
    w = [p.bytes(VRAM) + p.kv_bytes for p in mp.devices]
    cap = [16 * GiB - E70 - WS, 32 * GiB - O70 - WS]
    assert abs(w[0] / sum(w) - cap[0] / sum(cap)) < 0.02, mp.explain()
    # Something streams: each card full of resident layers, the streamed ones split evenly.
    mp = p70(3, ["8GiB", "12GiB", "16GiB"])
    check(mp, 80)
    res = [p.bytes(VRAM) for p in mp.devices]
    assert res[0] < res[1] < res[2]
    for p in mp.devices:
        assert p.vram_limit - p.vram_bytes < max(L70) + p.kv_bytes // len(p.tiers) * 2
    links = mp.link_bytes
    assert max(links) - min(links) <= 3 * max(L70), mp.explain()


def test_link_rates_weight_the_shares():
    mp = p70(2, "12GiB", h2d_bps=[50e9, 25e9])
    a, b = mp.link_bytes
    assert 1.6 < a / b < 2.5, mp.explain()


def test_ram_limit_storage_tail_on_the_last_devices():
    mp = p70(2, "12GiB", pinned_budget=10 * GiB)
    check(mp, 80)
    assert mp.layers(STORAGE) and mp.bytes(STORAGE) + mp.bytes(PINNED) == mp.streamed_bytes_per_step
    assert mp.ram_bytes <= 10 * GiB
    # staging buffers only where storage layers are read
    assert all((p.staging_bytes > 0) == bool(p.layers(STORAGE)) for p in mp.devices)


@pytest.mark.parametrize("budgets,match", [
    (["24GiB", "1GiB"], "device 1: VRAM budget 1.00 GiB cannot hold its fixed weights"),
    (["14GiB", "2GiB"], "device 1: VRAM budget 2.00 GiB cannot hold even the 2 streaming slots"),
    (["1GiB", "24GiB"], "device 0: "),
    (["24GiB"] * 3, "3 VRAM budgets for 2 devices"),
])
def test_device_too_small_is_a_clear_error(budgets, match):
    with pytest.raises(PlanError, match=match):
        p70(2, budgets)


def test_parse():
    assert parse_devices("0,1") == (0, 1) and parse_devices(3) == (0, 1, 2) and parse_devices(None) is None
    with pytest.raises(ValueError):
        parse_devices("0,0")
    assert parse_budgets("24GiB,48GiB", 2) == [24 * GiB, 48 * GiB]
    assert parse_budgets("24GiB", 3) == [24 * GiB] * 3


def test_cli_plan_devices(synth_model, capsys):
    from ntransformerd.tools import ntx_model
    path = synth_model("small", "q4_k_m")
    args = ["run", path, "--plan", "--prompt", "x", "--backend", "cpu", "--ctx", "64"]
    assert ntx_model.main(args + ["--devices", "0,1", "--vram-budget", "26MiB,25MiB"]) == 0
    out = capsys.readouterr().out
    assert "over 2 devices" in out and "device 1" in out
    assert ntx_model.main(args + ["--devices", "0,1", "--vram-budget", "30MiB", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["device_ids"] == [0, 1] and d["n_devices"] == 2 and len(d["link_bytes"]) == 2
    assert ntx_model.main(args + ["--devices", "0,1", "--vram-budget", "64MiB,1MiB"]) == 2
    assert "device 1" in capsys.readouterr().err


def test_engine_loads_several_devices(synth_model):
    """Several devices are one engine: on a host backend, simulated devices with a share each
    (tests/engine/test_tiers_multi_pipeline.py runs them); a repeated device is refused."""
    from ntransformerd.engine.runtime.engine import Engine, EngineConfig
    with pytest.raises(ValueError, match="distinct"):
        EngineConfig(devices="0,0").validate()
    e = Engine.load(synth_model("tiny", "q8_0"), config=EngineConfig(backend="cpu-ref", devices="0,1", max_ctx=64))
    assert e.plan.n_devices == 2 and [st.name for st in e.pipeline.stages] == ["cpu-ref:0", "cpu-ref:1"]
