"""The placement follows the steps (placement.Steering inside tiers/step_pipeline.py's Pipeline), on two CPU
"devices": the main one streams three layers over a link capped at 0.2 GB/s, the host beside it
computes what the placement gives it. The host is slowed mid-run (each layer 30 ms more, three
times the link's time, as on a host whose memory a neighbour saturates), then recovers; the
placement moves its layers to the link and back, and every token is the one a single device
gives. Cached figures the steps contradict are replaced in the cache."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from ntransformerd.engine.calibration import figures as figures_module
from ntransformerd.engine import tiers
from ntransformerd.engine.runtime.engine import Engine, EngineConfig
from ntransformerd.engine.gguf_file import GGUFModel
from ntransformerd.engine.tiers.placement import Figures, Steering

LINK = "0.2GB/s"  # the stand-in link: a streamed layer of the small model (~2 MB) takes ~10 ms
MOVE_WITHIN = 12  # steps after the host slows down
BACK_WITHIN = 3 * 16 + 12  # steps after it recovers: within the third probe (probe=16, then 32)


@pytest.fixture(scope="module")
def model(synth_model):
    return GGUFModel(synth_model("small", "q4_k_m"))


def _engine(model, figures):
    config = EngineConfig(backend="cpu-ref", max_batch=2, max_ctx=256, prefill_chunk=8, max_vram_layers=1,
                          host_compute="auto", link_cap=LINK)
    plan = tiers.model_plan(model, config, backend="cpu", figures=figures)
    e = Engine(model, config=config, plan=plan)
    e.pipeline.steering = Steering(e.plan, dwell=4, probe=16)
    return e


class SlowHost:
    """While on, each layer the host computes takes `seconds` longer (its weights' acquire waits),
    as on a host whose memory bandwidth a neighbour takes."""

    def __init__(self, stage, seconds: float):
        self.on, self.seconds, self.acquire = False, seconds, stage.weights.acquire
        stage.weights.acquire = self

    def __call__(self, i):
        if self.on:
            time.sleep(self.seconds)
        return self.acquire(i)


def _host_layers(e) -> int:
    return len(e.schedule.placements[0].host_layers)  # steps of 1 row


def test_a_slowed_host_gives_its_layers_to_the_link_and_gets_them_back(model):
    ref = Engine(model, config=EngineConfig(backend="cpu-ref", max_batch=1, max_ctx=256, prefill_chunk=8))
    prompt = [3, 14, 15, 92, 65, 35, 89, 79]
    settle = 16 + Steering.__init__.__kwdefaults__["trial"] + 2  # the first trial on the GPU alone done
    n_tokens = settle + MOVE_WITHIN + BACK_WITHIN + 8
    s = ref.open()
    want, logits = [], ref.prefill(s, prompt)
    for _ in range(n_tokens):
        want.append(int(np.argmax(logits)))
        logits = ref.step([(s, [want[-1]])])[0]

    # the figures at load: the host (~1.5 ms a layer here) several times faster than the link
    e = _engine(model, Figures(0.2e9, {1: 1.4e9, 2: 1.4e9}))
    assert _host_layers(e) == 3, e.plan.explain()
    slow = SlowHost(e.pipeline.stages[1], 0.03)  # 30 ms more a layer: three times the link's
    s = e.open()
    got, last = [], [e.prefill(s, prompt)]

    def decode(n):  # n greedy tokens, one step each
        for _ in range(n):
            got.append(int(np.argmax(last[0])))
            last[0] = e.step([(s, [got[-1]])])[0]
    # steady: the steps correct the figures to this machine's (a loaded host may give a layer up), and
    # the first trial on the GPU alone reads the loop's own cost from the steps' periods
    decode(settle)
    settled = _host_layers(e)
    assert settled > 0 and e.pipeline.steering.trials == 1, e.pipeline.steering.status()
    assert e.pipeline.steering.loop_s is not None, e.pipeline.steering.status()
    slow.on = True
    moved = None
    for k in range(1, MOVE_WITHIN + 1):
        decode(1)
        if _host_layers(e) < settled:
            moved = k
            break
    assert moved is not None, f"still {_host_layers(e)} host layers: {e.pipeline.steering.status()}"
    slow.on = False
    back = None
    for k in range(1, BACK_WITHIN + 1):
        decode(1)
        if _host_layers(e) >= settled:
            back = k
            break
    assert back is not None, f"{_host_layers(e)} host layers: {e.pipeline.steering.status()}"
    decode(n_tokens - len(got))
    assert got == want  # the layers moved between the devices, the KV followed them: the same tokens
    print(f"moved after {moved} slow steps, back after {back} steps; {e.pipeline.steering.status()}")
    e.unload()
    ref.unload()


def test_cached_figures_the_steps_contradict_are_replaced(model, tmp_path, monkeypatch):
    """Figures cached from a busy moment (a host at a tenth of its rate) move the placement once
    the steps show better, and the corrected figures are written back to the cache, so the next
    load starts from them."""
    monkeypatch.setenv("NTX_STATE_DIR", str(tmp_path))  # dirs.state_dir: figures/ there
    wrong = Figures(0.2e9, {1: 0.02e9, 2: 0.02e9})
    config = EngineConfig(backend="cpu-ref", max_batch=2, max_ctx=256, prefill_chunk=8, max_vram_layers=1,
                          host_compute="auto", link_cap=LINK)
    base = tiers.model_plan(model, config, backend="cpu", figures=None)
    path = figures_module.cache_path(model, base, gpu="", threads=config.cpu_threads, link_cap=config.link_cap,
                                     kv_dtype=config.kv_dtype, cpu_kernels=config.cpu_kernels)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(wrong.to_dict(), f)
    e = _engine(model, wrong)
    e.keep_figures(path)
    assert _host_layers(e) == 0
    s = e.open()
    logits = e.prefill(s, [5, 6, 7])
    for _ in range(120):
        logits = e.step([(s, [int(np.argmax(logits))])])[0]
        if _host_layers(e) > 0:
            break
    assert _host_layers(e) > 0, e.pipeline.steering.status()
    with open(path) as f:
        cached = Figures.from_dict(json.load(f))
    assert cached.host(1) > 5 * wrong.host(1) and cached.measured
    e.unload()
