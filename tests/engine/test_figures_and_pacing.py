"""The figures a hybrid plan is placed from (engine/calibration/figures.py) and the emulated slower link
(LayerStream's link_cap): host rates from the real host backend on a synthetic model, their
cache, and copies paced to the cap on the CPU's stream."""

from __future__ import annotations

import os

import numpy as np
import pytest

from ntransformerd.engine import backends
from ntransformerd.engine.tiers import layer_stream as pipeline
from ntransformerd.engine.tiers.layer_stream import Device, LayerStream, parse_rate
from ntransformerd.engine.tiers.placement import Figures, load_figures, save_figures
from ntransformerd.engine.tiers.planner import Plan

MB = 1_000_000


class _Clock:
    """The stream's time (pipeline.time): it moves only while a paced copy holds the link, so the
    pacing is seen exactly, whatever else the machine is doing."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    c = _Clock()
    monkeypatch.setattr(pipeline, "time", c)
    return c


def _one_pass(cap: float | None, clock: _Clock, n: int = 4, nbytes: int = MB) -> float:
    host = {i: np.full(nbytes, i, np.uint8) for i in range(n)}
    s = LayerStream(list(range(n)), depth=2, slot_bytes=nbytes, nbytes={i: nbytes for i in range(n)},
                    device=Device(), host_layer=host.get, link_cap=cap)
    t0 = clock.perf_counter()
    s.begin(range(n))
    for i in range(n):
        slot = s.acquire(i)
        assert slot[0] == i and slot[-1] == i  # the layer's bytes, paced or not
        s.release(i)
    return clock.perf_counter() - t0


def test_copies_are_paced_to_the_link_cap(clock):
    assert _one_pass(None, clock) == 0.0  # no cap: nothing holds a copy
    # 4 layers of 1 MB at 10 MB/s: no copy completes before B / cap after its start
    assert _one_pass(parse_rate("10MB/s"), clock) == pytest.approx(0.4)


@pytest.mark.parametrize("text, bps", [("6.5GB/s", 6.5e9), ("800MiB/s", 800 * 2**20), ("10mb", 1e7),
                                       (2e9, 2e9), ("off", None), (None, None)])
def test_parse_rate(text, bps):
    assert parse_rate(text) == bps


@pytest.mark.parametrize("bad", ["fast", "0GB/s", "-3GB/s", True])
def test_a_bad_link_cap_says_what_it_takes(bad):
    from ntransformerd.engine.runtime.engine import EngineConfig
    with pytest.raises(ValueError, match="link_cap = .*: .*rate.* such as \"6.5GB/s\""):
        EngineConfig(link_cap=bad).validate()


def test_the_engine_paces_its_streamed_layers(synth_model, clock):
    from ntransformerd.engine.runtime.engine import Engine, EngineConfig
    from ntransformerd.engine.gguf_file import GGUFModel
    model = GGUFModel(synth_model("small", "q8_0"))
    config = EngineConfig(backend="cpu-ref", max_ctx=32, max_batch=1, max_vram_layers=0, link_cap="5MB/s")
    engine = Engine(model, config=config)
    stream = engine.weights.host.stream
    assert stream.link_cap == 5e6
    slot = engine.open()
    t0 = clock.perf_counter()
    engine.step([(slot, [1])])
    spent = clock.perf_counter() - t0
    streamed = sum(stream.nbytes[i] for i in stream.order)
    assert spent >= streamed / 5e6, (spent, streamed)
    engine.unload()


def _host_available() -> bool:
    try:
        return backends.resolve("cpu").name == "cpu"
    except Exception:
        return False


@pytest.mark.skipif(not _host_available(), reason="the host kernels (backends/host) are not built")
def test_host_rates_from_the_host_backend(synth_model, tmp_path, monkeypatch):
    from ntransformerd.engine.calibration import figures as fig
    from ntransformerd.engine.gguf_file import GGUFModel
    model = GGUFModel(synth_model("small", "q4_k_m"))
    rates = fig.host_rates(model, layers=[1, 2], threads=1, rows=(1, 4), repeats=2)
    assert sorted(rates) == [1, 4] and all(0 < r < 1e13 for r in rates.values())
    # the timed stretch: the streamed layers first, until it holds the sample's bytes
    sizes = [model.layer_bytes(i) for i in range(model.config.n_layers)]
    plan = Plan(("vram", "pinned", "pinned", "vram"), tuple(sizes), 2, max(sizes), 0, 0, 0, -1, -1)
    assert fig.host_sample(model, plan, nbytes=sizes[1]) == [1]
    assert fig.host_sample(model, plan, nbytes=sizes[1] + 1) == [1, 2]
    assert fig.host_sample(model, plan, nbytes=1 << 40) == [1, 2]  # the streamed ones: what the host may compute
    assert fig.host_sample(model, None, nbytes=1 << 40) == [0, 1, 2, 3]
    # measured once, then read from the cache keyed by model, plan and machine
    monkeypatch.setenv("NTX_STATE_DIR", str(tmp_path))  # dirs.state_dir: figures/ there
    calls = []
    real = fig.host_rates
    monkeypatch.setattr(fig, "host_rates", lambda *a, **k: calls.append(1) or real(*a, rows=(1,), repeats=1, **{
        n: v for n, v in k.items() if n != "rows"}))
    host = backends.resolve("cpu")
    first = fig.measured_figures(model, None, host, kv_dtype="f16", threads=1)
    again = fig.measured_figures(model, None, host, kv_dtype="f16", threads=1)
    assert calls == [1] and again == first and first.measured and list(first.host_bps) == [1]
    assert 0 < first.host_attn_s < 1e-3  # seconds per position per layer: the host's attention was timed
    fig.measured_figures(model, None, host, kv_dtype="f16", threads=2)  # another thread count: measured again
    assert calls == [1, 1]
    fig.measured_figures(model, None, host, kv_dtype="q8_0", threads=1)  # another KV dtype: measured again
    assert calls == [1, 1, 1]



@pytest.mark.skipif(not _host_available(), reason="the host kernels (backends/host) are not built")
def test_the_host_figures_are_timed_on_the_pinned_kernels(synth_model, tmp_path, monkeypatch):
    """With cpu_kernels set, the host's rates and its attention are timed on that build (generic:
    not what auto picks on an x86-64 machine), and each build's figures have their own cache file."""
    from ntransformerd.engine.backends.host import native
    from ntransformerd.engine.calibration import figures as fig
    from ntransformerd.engine.gguf_file import GGUFModel
    model = GGUFModel(synth_model("small", "q4_k_m"))
    loaded = []
    real = native.load

    def load(variant=None):
        lib = real(variant)
        loaded.append(lib.variant.name)
        return lib
    monkeypatch.setattr(native, "load", load)
    fig.host_rates(model, layers=[1], threads=1, cpu_kernels="generic", rows=(1,), repeats=1)
    fig.host_attention_seconds(model.config, kv_dtype="f16", threads=1, cpu_kernels="generic", positions=64,
                               repeats=1)
    assert len(loaded) == 2 and set(loaded) == {"generic"}, loaded
    monkeypatch.setenv("NTX_STATE_DIR", str(tmp_path))  # dirs.state_dir: figures/ there
    paths = {v: fig.cache_path(model, None, gpu="", threads=1, link_cap=None, kv_dtype="f16", cpu_kernels=v)
             for v in ("auto",) + tuple(v.name for v in native.VARIANTS)}
    assert len(set(paths.values())) == len(paths), paths
    loaded.clear()
    fig.measured_figures(model, None, backends.resolve("cpu"), kv_dtype="f16", threads=1, cpu_kernels="generic")
    assert loaded and set(loaded) == {"generic"}, loaded
    assert os.path.exists(paths["generic"]) and not os.path.exists(paths["auto"])


def test_the_engine_measures_its_figures_on_its_cpu_kernels(synth_model, monkeypatch):
    """Host compute beside a GPU: the plan's figures are measured on the build of the host's
    kernels that the host's steps will run (EngineConfig.cpu_kernels)."""
    from ntransformerd.engine.gguf_file import GGUFModel
    from ntransformerd.engine.runtime import engine as engine_module
    from ntransformerd.engine.runtime.engine import EngineConfig
    model = GGUFModel(synth_model("small", "q4_k_m"))

    class Gpu:  # what plan_for asks of a GPU backend
        name, is_host = "cuda", False

        def layer_bytes(self, m, i):
            return m.layer_bytes(i)

        def free_memory(self, device=0):
            return 1 << 40
    asked = {}
    monkeypatch.setattr(backends, "resolve", lambda name: Gpu())
    monkeypatch.setattr(engine_module, "measured_figures",
                        lambda model, plan, backend, **k: asked.update(k) or Figures(1e9, {1: 1e9}))
    plan = engine_module.plan_for(model, EngineConfig(backend="cuda", host_compute="auto", max_vram_layers=1,
                                                      cpu_kernels="generic"))
    assert plan.streamed and asked["cpu_kernels"] == "generic", (plan, asked)

def test_figures_cache_round_trip_and_bad_files(tmp_path):
    f = Figures(55e9, {1: 60e9, 16: 20e9}, {1: 3e12}, handoff_s=1e-5, host_attn_s=2e-9)
    path = str(tmp_path / "sub" / "f.json")
    save_figures(path, f)
    assert load_figures(path) == f
    (tmp_path / "bad.json").write_text("{not json")
    assert load_figures(str(tmp_path / "bad.json")) is None
    (tmp_path / "neg.json").write_text('{"link_bps": -1, "host_bps": {"1": 1}}')
    assert load_figures(str(tmp_path / "neg.json")) is None
    assert load_figures(str(tmp_path / "missing.json")) is None


def test_the_hybrid_host_device_uses_cpu_threads(synth_model):
    """A host device beside the main one records its steps with EngineConfig.cpu_threads."""
    if not _host_available():
        pytest.skip("the host kernels (backends/host) are not built")
    from ntransformerd.engine.runtime.engine import Engine, EngineConfig
    from ntransformerd.engine.gguf_file import GGUFModel
    model = GGUFModel(synth_model("small", "q4_k_m"))
    config = EngineConfig(backend="cpu", max_ctx=32, max_batch=2, max_vram_layers=1, host_compute="auto",
                          cpu_threads=2)
    engine = Engine(model, config=config)
    hosts = [st for st in engine.pipeline.stages if st.name == "host"]
    assert hosts and all(st.steps.threads == 2 for st in hosts)


# ---- the keys and flags -------------------------------------------------------------------------

@pytest.mark.parametrize("key, value, words", [("host_compute", '"on"', "host_compute = 'on': use off or auto"),
                                               ("link_cap", '"fast"', "link_cap = 'fast': not a rate"),
                                               ("link_cap", "5", 'link_cap = 5: must be a rate in quotes')])
def test_daemon_keys_name_themselves(tmp_path, key, value, words):
    from ntransformerd import config
    f = tmp_path / "d.toml"
    f.write_text(f"{key} = {value}\n")
    with pytest.raises(config.ConfigError, match=words):
        config.load(["--config", str(f)])


def test_daemon_keys_reach_the_engine_config(tmp_path):
    from ntransformerd import config
    from ntransformerd.engine.runtime.engine import EngineConfig
    c = config.load(["--host-compute", "auto", "--link-cap", "6.5GB/s", "--socket", str(tmp_path / "s.sock")])
    assert (c.host_compute, c.link_cap) == ("auto", 6.5e9)  # bytes per second, parsed once
    assert EngineConfig(host_compute=c.host_compute, link_cap=c.link_cap).link_cap == 6.5e9
    assert config.load(["--socket", str(tmp_path / "s.sock")]).link_cap is None


def test_ntx_model_plan_shows_the_placement_per_step_shape(capsys):
    from ntransformerd.tools.ntx_model import main
    assert main(["run", "--plan", "--host-compute", "auto", "--max-vram-layers", "10", "--link-cap", "6.5GB/s"]) == 0
    out = capsys.readouterr().out
    assert "host compute   by step rows (assumed, not measured" in out and "    1 rows  host" in out, out
    assert main(["run", "--plan", "--max-vram-layers", "10"]) == 0
    assert "host compute" not in capsys.readouterr().out


def test_a_step_wholly_on_a_recorded_main_device(synth_model):
    """A hybrid engine whose main device is the host: a step the schedule keeps off the host
    device (2 rows here) runs as the main device's recorded pass, with the one-device result."""
    if not _host_available():
        pytest.skip("the host kernels (backends/host) are not built")
    from ntransformerd.engine.runtime.engine import Engine, EngineConfig
    from ntransformerd.engine.gguf_file import GGUFModel
    model = GGUFModel(synth_model("small", "q4_k_m"))
    hybrid = Engine(model, config=EngineConfig(backend="cpu", max_ctx=32, max_batch=2, max_vram_layers=1,
                                               host_compute="auto", cpu_threads=1))
    assert len(hybrid.pipeline.layout.devices) == 2 and hybrid.pipeline.groups(2, None) == [(0, [0, 1, 2, 3])]
    plain = Engine(model, config=EngineConfig(backend="cpu", max_ctx=32, max_batch=2, cpu_threads=1))
    for e in (hybrid, plain):
        e.slots = [e.open(), e.open()]
    for toks in ([3, 5], [7, 11]):
        a = hybrid.step(list(zip(hybrid.slots, [[t] for t in toks])))
        b = plain.step(list(zip(plain.slots, [[t] for t in toks])))
        np.testing.assert_array_equal(a, b)
