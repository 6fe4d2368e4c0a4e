"""A GPU and the host in one step (tiers/step_pipeline.py): the host computes some streamed layers at
small step shapes, the GPU replays its resident stretches as captured pieces and the steps it
runs alone as whole captured steps, and each layer's KV positions follow it between the devices.
Against an all-resident GPU engine fed the same tokens (random weights: the logits are compared,
not greedy ids, which near-flat random logits flip)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from ntransformerd.engine import tiers
from ntransformerd.engine.runtime.engine import Engine, EngineConfig
from ntransformerd.engine.gguf_file import GGUFModel
from ntransformerd.engine.tiers.placement import Figures
from ntransformerd.engine.tiers.planner import PINNED, VRAM
from ntransformerd.engine.tiers.step_pipeline import DeviceKV

CONFIG = dict(backend="cuda", max_batch=4, max_ctx=128, prefill_chunk=40, kv_dtype="f16")


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    from ntransformerd.tools.synth import synthesize
    path = os.path.join(tmp_path_factory.mktemp("hybrid"), "small-q4_k_m.gguf")
    synthesize(path, shape="small", ftype="q4_k_m", seed=5)
    return GGUFModel(path)


def _hybrid(model, resident: int, host_rows=(1, 2)):
    """`resident` layers on the GPU, the rest streamed; by made-up figures (link and host alike,
    the host measured at `host_rows` only) the host computes some streamed layers in steps of
    those row counts, and larger steps stream them all."""
    from ntransformerd.engine.backends import cuda
    config = EngineConfig(**CONFIG, max_vram_layers=resident, host_compute="auto")
    sizes = [cuda.layer_nbytes(model, i) for i in range(model.config.n_layers)]
    figures = Figures(1e9, {r: 1e9 for r in host_rows})
    plan = tiers.model_plan(model, config, backend="cuda", vram_free=cuda.vram_free(), layer_bytes=sizes,
                            figures=figures)
    return Engine(model, config=config, plan=plan)


def _steps(e):
    """Fixed tokens through every kind of step: prefill chunks, decode of 1, 2 and 3 rows, a
    verify step of 4 tokens, a rejected draft, a prefix shared with copy_prefix."""
    a, b, c = e.open(), e.open(), e.open()
    outs = [e.prefill(a, list(range(1, 50)))[None]]  # chunks of 40 and 9 rows
    for t in range(3):
        outs.append(e.step([(a, [t + 5])]))
    outs.append(e.prefill(b, [3, 1, 4, 1, 5])[None])
    for t in range(3):
        outs.append(e.step([(a, [t + 9]), (b, [t + 2])]))
    outs.append(e.prefill(c, [2, 7, 1, 8])[None])
    for t in range(3):
        outs.append(e.step([(a, [t]), (b, [t + 1]), (c, [t + 2])]))
    outs.append(e.step([(a, [1, 2, 3, 4])], all_logits=True))
    e.truncate(a, e.length(a) - 3)
    for t in range(2):
        outs.append(e.step([(a, [t + 20])]))
    e.close(c)
    c = e.open()
    e.copy_prefix(a, c, e.length(a) - 1)
    outs.append(e.step([(c, [7]), (b, [8])]))
    for s in (a, b, c):
        e.close(s)
    return outs


@pytest.fixture(scope="module")
def reference(small):
    e = Engine(small, config=EngineConfig(**CONFIG))
    assert e.plan is None or e.plan.all_resident
    return _steps(e)


@pytest.mark.parametrize("resident", [2, 0])
def test_hybrid_steps_match_the_resident_gpu(small, reference, resident):
    e = _hybrid(small, resident)
    n = small.config.n_layers
    assert e.plan.tiers == (VRAM,) * resident + (PINNED,) * (n - resident), e.plan.explain()
    host = e.plan.schedule.host_layers
    assert host and isinstance(e.kv, DeviceKV), e.plan.explain()
    assert [st.name for st in e.pipeline.stages] == ["cuda:0", "host"]
    got = _steps(e)
    assert len(got) == len(reference)
    for k, (x, y) in enumerate(zip(got, reference)):
        assert x.shape == y.shape, k
        err = np.linalg.norm(x - y) / np.linalg.norm(y)
        assert err < 2e-2, (k, err)
    g = e.steps
    whole = [b for b in g.captured.values() if not b.piece]
    pieces = [b for b in g.captured.values() if b.piece]
    assert whole and all(b.graph is not None for b in whole)  # the 3-row and 4-token steps: the GPU alone
    if resident >= 1:
        assert pieces and all(b.graph is not None for b in pieces)  # its resident layers between the host's
    assert e.kv.stats["syncs"] > 0 and e.pipeline.handoff.stats["copies"] > 0
    e.unload()


def test_without_the_kv_sync_the_gpu_reads_holes(small, reference, monkeypatch):
    """The check behind the test above: the same steps with the sync off differ beyond its bound."""
    monkeypatch.setattr(DeviceKV, "sync", lambda self, batch, groups: None)
    e = _hybrid(small, 2)
    got = _steps(e)
    e.unload()
    errs = [np.linalg.norm(x - y) / np.linalg.norm(y) for x, y in zip(got, reference)]
    assert max(errs) >= 2e-2, errs
