"""The `deterministic` setting and the hybrid placement (issue 35, item 3): beside a GPU the host
computes no streamed layer when the setting is on, so no row's bits follow where its layers ran
(the host's kernels round differently from the GPU's, and the placement differs by step shape and
moves with the steps). Beside a host main device both compute with the same kernels, and the
placement stays."""

from __future__ import annotations

import pytest

from ntransformerd.engine import tiers
from ntransformerd.engine.runtime.engine import EngineConfig
from ntransformerd.engine.gguf_file import GGUFModel


@pytest.fixture(scope="module")
def model(synth_model):
    return GGUFModel(synth_model("small", "q4_k_m"))


def _plan(model, backend: str, **kw):
    config = EngineConfig(max_ctx=64, max_vram_layers=1, host_compute="auto", prefill_chunk=48, **kw)
    return tiers.model_plan(model, config, backend=backend, vram_free=8 << 30)


def test_beside_a_gpu_the_deterministic_setting_keeps_every_layer_on_it(model):
    hybrid, fixed = _plan(model, "cuda"), _plan(model, "cuda", deterministic=True)
    assert hybrid.schedule is not None and hybrid.streamed  # the same plan without the setting has a host share
    assert fixed.schedule is None
    assert fixed.tiers == hybrid.tiers  # the same layers resident and streamed: only who computes them differs
    assert tiers.host_computes(EngineConfig(host_compute="auto"), "cuda")
    assert not tiers.host_computes(EngineConfig(host_compute="auto", deterministic=True), "cuda")


def test_beside_a_host_main_device_the_placement_stays(model):
    assert _plan(model, "cpu", deterministic=True).schedule is not None
    assert tiers.host_computes(EngineConfig(host_compute="auto", deterministic=True), "cpu")
    assert not tiers.host_computes(EngineConfig(deterministic=True), "cuda")
