"""The engine on the CUDA backend against the CPU backend, through Engine.step (which routes
one-token steps to the captured decode graphs): synthetic models, and a real-weights slice of
the default model (`ntx-model slice --layers 4`: NTX_REAL_SLICE or .gpu-data/smollm2-4l.gguf where
one was carried, else made here from the default model)."""

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from ntransformerd.engine.runtime.engine import Engine, EngineConfig  # noqa: E402
from ntransformerd.engine.gguf_file import GGUFModel  # noqa: E402
from ntransformerd.tools.synth import synthesize  # noqa: E402

from .real_weights import greedy, real_slice, teacher_forced  # noqa: E402,F401 (real_slice: a fixture)


@pytest.mark.parametrize("ftype", ["q8_0", "q4_k_m"])
def test_engine_cuda_agrees_with_cpu(tmp_path, ftype):
    path = str(tmp_path / f"small-{ftype}.gguf")
    synthesize(path, shape="small", ftype=ftype, seed=3)
    m = GGUFModel(path)
    cfg = EngineConfig(backend="cpu-ref", max_batch=2, max_ctx=256)
    cpu_e = Engine(m, config=cfg)
    gpu_e = Engine(m, config=EngineConfig(backend="cuda", max_batch=2, max_ctx=256))
    assert gpu_e.backend_name == "cuda" and gpu_e.steps is not None
    tokens = [int(x) for x in np.random.default_rng(0).integers(100, 40000, 68)]
    a, b = teacher_forced(cpu_e, tokens), teacher_forced(gpu_e, tokens)
    rel = np.abs(a - b).max() / np.abs(a).max()
    top1 = float((a.argmax(-1) == b.argmax(-1)).mean())
    assert rel < 2e-2, rel
    assert top1 >= 0.99, top1


def test_real_slice_greedy_identical(real_slice):
    m = GGUFModel(real_slice)
    cpu_e = Engine(m, config=EngineConfig(backend="cpu-ref", max_batch=1, max_ctx=256))
    gpu_e = Engine(m, config=EngineConfig(backend="cuda", max_batch=1, max_ctx=256))
    for text in ("The capital of France is", "def fibonacci(n):"):
        prompt = cpu_e.tokenizer.encode(text)
        assert greedy(gpu_e, prompt, 32) == greedy(cpu_e, prompt, 32), text


def test_real_slice_f16_legacy_batched_close_to_cpu(real_slice, monkeypatch):
    """NTX_F16_LEGACY=1: the default model's Q4_1 matrices multiply on the f16 tensor cores in
    steps of 4+ rows (mmh_q4_1). Eight sequences of the real slice decoding together stay within
    the engines' agreement bound of the exact float32 run, each sequence alone, and pick its ids."""
    from gguf import GGMLQuantizationType as Q
    from ntransformerd.engine.backends import cuda
    monkeypatch.setenv("NTX_F16_LEGACY", "1")
    m = GGUFModel(real_slice)
    cpu_e = Engine(m, config=EngineConfig(backend="cpu-ref", max_batch=1, max_ctx=128))
    gpu_e = Engine(m, config=EngineConfig(backend="cuda", max_batch=8, max_ctx=128))
    assert cuda.CudaSettings.from_env().f16_legacy
    assert any(m.tensor(t.name).qtype == Q.Q4_1 for t in m.reader.tensors)
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(100, 40000, int(n))] for n in rng.integers(3, 20, 8)]
    slots = [gpu_e.open() for _ in prompts]
    try:
        last = [gpu_e.prefill(s, p) for s, p in zip(slots, prompts)]
        fed = [list(p) for p in prompts]
        worst, agree, total = 0.0, 0, 0
        for _ in range(6):
            toks = [int(np.argmax(x)) for x in last]
            for f, t in zip(fed, toks):
                f.append(t)
            last = gpu_e.step([(s, [t]) for s, t in zip(slots, toks)])  # one step of 8 rows
            for f, got in zip(fed, last):
                c = cpu_e.open()
                try:
                    want = cpu_e.prefill(c, f)  # the exact float32 logits after the same ids
                finally:
                    cpu_e.close(c)
                worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
                agree += int(np.argmax(got) == np.argmax(want))
                total += 1
    finally:
        for s in slots:
            gpu_e.close(s)
    assert worst < 2e-2, worst
    assert agree >= 0.95 * total, (agree, total)


@pytest.mark.parametrize("v", (7, 1000, 49152, 128256))
@pytest.mark.parametrize("n", (1, 3, 40, 256))
def test_top_rows_kernel_matches_host(v, n):
    """kernels/sample.cu top_rows against sampler.TopLogits.of: the same ids and logits, ties at
    the n-th resolved to the lowest ids (rows 1-5, coarse values; row 0 has none), NaNs counted and
    never chosen; output poisoned first."""
    from ntransformerd.engine.backends import cuda
    from ntransformerd.engine.generation.sampler import TopLogits
    n = min(n, v)
    rng = np.random.default_rng()
    x = np.round(rng.standard_normal((6, v)) * 2, 1).astype(np.float32)  # coarse: ties at the n-th
    x[0] = rng.standard_normal(v) * 2  # distinct: no tie at the n-th (the kernel's unordered last pass)
    x[1, rng.integers(0, v, max(1, v // 4))] = -np.inf
    x[2, rng.integers(0, v, 3)] = np.nan
    x[3] = 0.5  # all tied
    x[4, -1] = np.inf
    x[5] = -np.inf
    ref = TopLogits.of(x, n)
    poisoned = cp.full((6, 2 * n + 1), -7, cp.int32)
    got = TopLogits(*cuda.top_rows(cp.asarray(x), n, out=poisoned))
    np.testing.assert_array_equal(got.nan, ref.nan)
    ok = ref.nan == 0  # a row with NaNs is refused by the sampler; its ids need not match
    np.testing.assert_array_equal(got.ids[ok], ref.ids[ok])
    np.testing.assert_array_equal(got.vals[ok], ref.vals[ok])


@pytest.mark.parametrize("params", [dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0),
                                    dict(), dict(temperature=1.5, top_k=100, top_p=0.9, min_p=0.0)],
                         ids=("greedy", "defaults", "hot"))
def test_generate_samples_on_device_as_on_host(tmp_path, params):
    """engine.generate asks a decode step for the sampler's most likely ids alone (picked on the
    GPU by top_rows); with the same seed it must produce what sampling from whole rows does."""
    from ntransformerd.engine.runtime import engine as eng
    from ntransformerd.engine.generation.sampler import SamplingParams
    path = str(tmp_path / "small-q8_0.gguf")
    synthesize(path, shape="small", ftype="q8_0", seed=5)
    e = Engine(GGUFModel(path), config=EngineConfig(backend="cuda", max_batch=1, max_ctx=256))
    p = SamplingParams(seed=11, max_tokens=24, ignore_eos=True, **params)
    prompt = [int(t) for t in np.random.default_rng(1).integers(100, 40000, 9)]
    got = [ev.token for ev in eng.generate(e, prompt, p)]
    full = e.step  # the same generation with whole rows of logits (top ignored)
    e.step = lambda items, *, all_logits=False, top=None, layers=None, sample=None: full(
        items, all_logits=all_logits, layers=layers, sample=sample)
    try:
        want = [ev.token for ev in eng.generate(e, prompt, p)]
    finally:
        e.step = full
    assert len(got) == 24 and got == want
