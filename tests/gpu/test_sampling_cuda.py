"""The device's draws (backends/cuda/sampling.py, kernels/sample.cu) against sampler.sample_rows on
the same logits: greedy ids exact, filtered draws equal but where float rounding moves a boundary
(counted and printed), faults and the host's redo of the rows the device cannot settle; and
Engine.step(sample=) on a captured CUDA step drawing what the host draws from its logits."""
import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from ntransformerd.engine.backends.cuda import sampling  # noqa: E402
from ntransformerd.engine.runtime.engine import Engine, EngineConfig  # noqa: E402
from ntransformerd.engine.generation.sampler import (FAULT_INF, FAULT_NAN, FAULT_NO_FINITE, SampleRows, Sampler,  # noqa: E402
                                          SamplingParams, sample_rows)
from ntransformerd.tools.synth import synthesize  # noqa: E402

V = 4096
EOG = (2, 5)

MIXES = [
    SamplingParams.greedy(),
    SamplingParams.greedy(ignore_eos=True),
    SamplingParams.greedy(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4),
    SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    SamplingParams(temperature=1.3, top_k=200, top_p=0.7, min_p=0.0),
    SamplingParams(temperature=0.5, top_k=1),
    SamplingParams(temperature=1.0, top_k=256, top_p=1.0, min_p=0.2, ignore_eos=True),
    SamplingParams(temperature=0.9, top_k=60, repetition_penalty=0.7, frequency_penalty=-1.0,
                   presence_penalty=1.5, penalty_last_n=-1),
    SamplingParams(temperature=0.7, top_k=100, top_p=0.9, min_p=1.0),
]


def rows_for(rng, b: int, seed: int):
    params = [MIXES[(seed + i) % len(MIXES)] for i in range(b)]
    samplers = [Sampler(SamplingParams(**{**p.__dict__, "seed": seed * 100 + i}), V, eog_ids=EOG)
                for i, p in enumerate(params)]
    histories = [list(rng.integers(0, V, rng.integers(1, 80))) for _ in range(b)]
    return SampleRows.of(samplers, histories)


def logits(rng, b: int) -> np.ndarray:
    x = rng.standard_normal((b, V)).astype(np.float32) * rng.uniform(0.5, 6)
    x[:, :64] = np.round(x[:, :64])  # ties at the top, some
    return x


def test_device_draws_match_the_host_reference_over_many_seeds():
    rng = np.random.default_rng(0)
    greedy_rows = filtered_rows = mismatched = 0
    for seed in range(300):
        b = int(rng.integers(1, 33))
        x = logits(rng, b)
        sample = rows_for(rng, b, seed)
        assert sampling.eligible(sample)
        got = sampling.draw(cp.asarray(x), sample)
        want = sample_rows(x, sample)
        np.testing.assert_array_equal(got.fault, want.fault)
        g = sample.greedy & sample.draws
        np.testing.assert_array_equal(got.ids[g], want.ids[g])  # greedy: exact
        greedy_rows += int(g.sum())
        filtered_rows += int((~g).sum())
        mismatched += int((got.ids[~g] != want.ids[~g]).sum())
    print(f"device draws: {greedy_rows} greedy rows exact, {mismatched} of {filtered_rows} filtered rows differ")
    assert greedy_rows > 500 and filtered_rows > 1000
    assert mismatched <= filtered_rows // 1000  # boundaries moved by rounding: rare


def test_faults_and_the_rows_the_host_redoes():
    x = np.zeros((6, V), np.float32)
    x[0, 9] = np.nan
    x[1, 3] = np.inf
    x[2] = -np.inf
    x[3, EOG[0]] = np.nan  # behind a ban: the host finds it (redo)
    x[4] = 3e38  # penalties overflow: the host reduces the row to its unpenalised argmax (redo)
    x[4, 17] = 3.3e38
    x[5, EOG[1]] = 9.0  # the largest one is banned: the next one wins
    params = [SamplingParams.greedy()] * 3 + [SamplingParams.greedy(ignore_eos=True),
                                              SamplingParams.greedy(repetition_penalty=0.01),
                                              SamplingParams(top_k=10, seed=3, ignore_eos=True)]
    sample = SampleRows.of([Sampler(p, V, eog_ids=EOG) for p in params], [[17, 4]] * 6)
    got = sampling.draw(cp.asarray(x), sample)
    want = sample_rows(x, sample)
    assert got.fault[:4].tolist() == [FAULT_NAN, FAULT_INF, FAULT_NO_FINITE, FAULT_NAN]
    np.testing.assert_array_equal(got.fault, want.fault)
    ok = want.fault == 0  # a faulted row's id means nothing (Drawn.id raises)
    np.testing.assert_array_equal(got.ids[ok], want.ids[ok])
    assert got.ids[4] == 17 and got.ids[5] not in EOG


def test_rows_that_do_not_draw_and_masked_rows():
    x = np.random.default_rng(1).standard_normal((3, V)).astype(np.float32)
    s = Sampler(SamplingParams.greedy(), V)
    sample = SampleRows.of([s, None, s], [[], [], []])
    got = sampling.draw(cp.asarray(x), sample)
    assert got.ids[1] == -1 and got.ids[0] == int(np.argmax(x[0])) and got.ids[2] == int(np.argmax(x[2]))
    mask = np.zeros(V, bool)
    mask[:10] = True
    assert not sampling.eligible(SampleRows.of([s], [[]], masks=[mask]))
    assert not sampling.eligible(SampleRows.of([Sampler(SamplingParams(top_k=0), V)], [[]]))


def test_engine_step_draws_on_the_device_what_the_host_draws(tmp_path, monkeypatch):
    path = str(tmp_path / "tiny.gguf")
    synthesize(path, shape="tiny", ftype="q8_0", seed=0)
    e = Engine.load(path, config=EngineConfig(backend="cuda", max_batch=8, max_ctx=128))
    try:
        vocab = e.cfg.vocab_size
        slots = [e.open() for _ in range(6)]
        for j, s in enumerate(slots):
            e.step([(s, [1 + j, 2, 3])])
        params = [SamplingParams.greedy(), SamplingParams(top_k=40, seed=1),
                  SamplingParams.greedy(repetition_penalty=1.5), SamplingParams(top_k=20, top_p=0.8, seed=2),
                  SamplingParams.greedy(ignore_eos=True), SamplingParams(top_k=5, temperature=2.0, seed=3)]
        calls = []
        real = sampling.draw_async
        monkeypatch.setattr(sampling, "draw_async", lambda *a, **k: calls.append(1) or real(*a, **k))
        for step in range(4):
            samplers = [Sampler(p, vocab, eog_ids=e.tokenizer.eog_ids) for p in params]
            items = [(s, [7 + step]) for s in slots]
            sample = SampleRows.of(samplers, [[1 + j, 2, 3, 7, 8, 9][:3 + step] for j in range(6)])
            drawn = e.step(items, sample=sample)
            for s in slots:
                e.truncate(s, e.length(s) - 1)
            want = sample_rows(e.step(items), sample)  # the same positions again: host logits, same uniforms
            np.testing.assert_array_equal(drawn.ids, want.ids)
        assert len(calls) == 4  # every draw was the device's
    finally:
        e.unload()
