"""Status shows where the layers ran at each step shape of a hybrid plan (the host beside the main
device): the plan's prediction and the measured steps."""

from __future__ import annotations

import types

import pytest

from ntransformerd.engine import tiers
from ntransformerd.engine.runtime.engine import Engine, EngineConfig
from ntransformerd.engine.gguf_file import GGUFModel
from ntransformerd.engine.tiers.placement import Figures
from ntransformerd.server.servicer import placements
from ntx_client import cli
from ntx_proto.ntransformer.v1 import inference_pb2 as pb


def test_placements_count_the_steps_of_each_shape(synth_model, capsys):
    model = GGUFModel(synth_model("small", "q4_k_m"))
    config = EngineConfig(backend="cpu-ref", max_batch=2, max_ctx=64, prefill_chunk=3, max_vram_layers=1,
                          host_compute="auto")
    plan = tiers.model_plan(model, config, backend="cpu", figures=Figures(1e9, {1: 1e9, 2: 1e9}))
    e = Engine(model, config=config, plan=plan)
    e.pipeline.steering = None  # the placement at load throughout: its steps are counted below
    assert placements(Engine(model, config=EngineConfig(backend="cpu-ref", max_batch=1, max_ctx=16))) == []
    s = e.open()
    e.prefill(s, [1, 2, 3, 4])  # a 3-row chunk and a 1-row one
    for t in range(4):
        e.step([(s, [t])])  # 1 row each
    got = placements(e)
    rows = [p.rows for p in plan.schedule.placements]
    assert [p.rows for p in got] == rows
    by_rows = {p.rows: p for p in got}
    one = by_rows[rows[0]]
    assert one.steps == 5 and one.measured_step_seconds > 0 and one.predicted_step_seconds > 0
    assert list(one.host_layers) == plan.schedule.placements[0].host_layers and one.host_layers
    assert sum(p.steps for p in got) == 6  # and the 3-row chunk in the entry that covers 3 rows
    assert next(p for p in got if p.rows >= 3).steps == 1
    # ntx-client status prints one line per shape
    status = pb.StatusResponse(model="m", backend="cpu-ref", placements=got)
    client = types.SimpleNamespace(status=lambda: status)
    cli.cmd_status(client, types.SimpleNamespace(json=False))
    out = capsys.readouterr().out
    assert f"steps of ≤ {rows[0]} rows: host {len(one.host_layers)} layers [" in out
    assert "measured" in out and "over 5 steps" in out
    e.close(s)
    e.unload()


@pytest.mark.parametrize("host_layers, shown", [([7, 0, 1, 2, 3, 9, 10], "7 layers [0-3,7,9-10]"), ([], "0 layers [-]"),
                                                ([5], "1 layers [5]")])
def test_status_shows_the_host_layers_as_ranges(capsys, host_layers, shown):
    status = pb.StatusResponse(model="m", placements=[pb.Placement(rows=4, host_layers=host_layers)])
    cli.cmd_status(types.SimpleNamespace(status=lambda: status), types.SimpleNamespace(json=False))
    assert f"steps of ≤ 4 rows: host {shown}, link 0" in capsys.readouterr().out
