"""Sampling from a row's most likely ids (TopLogits, what the GPU decode step hands back)
draws exactly what sampling from the whole row draws: the same ids from the same seeds, over
ties, -inf logits, banned end-of-generation ids and every filter; and where that cannot hold
(penalties, no top-k) the sampler says so."""

from __future__ import annotations

import numpy as np
import pytest

from ntransformerd.engine.generation.sampler import TOP_MAX, InvalidLogits, SamplingParams, Sampler, TopLogits, top_sorted

V = 2000


def _rows(rng, n_rows: int) -> np.ndarray:
    """Logits with the awkward cases: coarse values (many ties, also at the k-th), -inf runs,
    a row whose best logits are all ties."""
    x = np.round(rng.standard_normal((n_rows, V)) * 2, 1).astype(np.float32)
    x[1, rng.integers(0, V, 300)] = -np.inf
    x[2, :] = -np.inf
    x[2, rng.integers(0, V, 7)] = 1.5  # seven ids tied for the best, nothing else finite
    x[3, 100:140] = 9.0  # forty ties at the top
    return x


PARAMS = [
    SamplingParams.greedy(),
    SamplingParams(temperature=0.0, top_k=40),
    SamplingParams(),  # the defaults: top_k 40, top_p 0.95, min_p 0.05, temperature 0.8
    SamplingParams(temperature=1.3, top_k=1),
    SamplingParams(temperature=0.7, top_k=5, top_p=1.0, min_p=0.0),
    SamplingParams(temperature=1.0, top_k=200, top_p=0.5, min_p=0.0),
    SamplingParams(temperature=2.0, top_k=64, top_p=0.99, min_p=0.2),
    SamplingParams(temperature=1.0, top_k=TOP_MAX - 3, top_p=1.0, min_p=0.0),
]


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"t{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
@pytest.mark.parametrize("ignore_eos", (False, True))
def test_top_rows_draw_what_whole_rows_draw(params, ignore_eos):
    rng = np.random.default_rng()
    x = _rows(rng, 12)
    eog = [int(np.argmax(x[0])), 3, 120]  # one of them the best id of row 0, one inside row 3's ties
    import dataclasses
    params = dataclasses.replace(params, seed=int(rng.integers(1 << 62)), ignore_eos=ignore_eos)
    whole, part = Sampler(params, V, eog_ids=eog), Sampler(params, V, eog_ids=eog)
    n = part.need()
    assert n == min((1 if params.temperature == 0 else params.top_k) + (3 if ignore_eos else 0), V)
    top = TopLogits.of(x, n)
    for r in range(len(x)):
        for _ in range(5):  # several draws per row: the generators must stay in step
            try:
                want = whole.sample(x[r], [])
            except ValueError as e:
                with pytest.raises(ValueError, match=str(e).split(":")[0]):
                    part.sample(top[r], [])
                continue
            assert part.sample(top[r], []) == want, (r, params)


def test_need_is_none_where_the_whole_row_matters():
    assert Sampler(SamplingParams(repetition_penalty=1.1), V).need() is None
    assert Sampler(SamplingParams(presence_penalty=0.5), V).need() is None
    assert Sampler(SamplingParams(temperature=0.8, top_k=0), V).need() is None
    assert Sampler(SamplingParams(top_k=TOP_MAX + 1), V).need() is None
    assert Sampler(SamplingParams(repetition_penalty=1.1, penalty_last_n=0), V).need() == 40  # penalties off
    assert Sampler(SamplingParams(temperature=0.0, top_k=0, presence_penalty=0.0), V).need() == 1  # greedy
    s = Sampler(SamplingParams(repetition_penalty=1.1), V)
    with pytest.raises(ValueError, match="whole row"):
        s.sample(TopLogits.of(np.zeros((1, V), np.float32), 40)[0])


def test_top_rows_report_nan_and_short_rows():
    x = np.zeros((2, V), np.float32)
    x[1, 7] = np.nan
    top = TopLogits.of(x, 5)
    s = Sampler(SamplingParams(), V)
    assert top[0].nan == 0 and top[1].nan == 1
    with pytest.raises(InvalidLogits, match="NaN"):
        s.sample(top[1])
    x[0, 3] = np.inf
    with pytest.raises(InvalidLogits, match=r"\+inf"):
        s.sample(TopLogits.of(x, 40)[0])
    with pytest.raises(ValueError, match="most likely ids"):
        s.sample(TopLogits.of(x[:1], 3)[0])  # top_k 40 needs 40


def test_unsorted_top_rows_are_put_in_order():
    """The device writes a row's ids in any order; TopLogits sorts them as top_sorted does."""
    rng = np.random.default_rng()
    x = np.round(rng.standard_normal((3, V)), 1).astype(np.float32)
    ref = TopLogits.of(x, 50)
    perm = np.stack([rng.permutation(50) for _ in range(3)])
    got = TopLogits(np.take_along_axis(ref.ids, perm, -1), np.take_along_axis(ref.vals, perm, -1), ref.nan)
    np.testing.assert_array_equal(got.ids, ref.ids)
    np.testing.assert_array_equal(got.vals, ref.vals)
    for r in range(3):
        np.testing.assert_array_equal(ref.ids[r], top_sorted(x[r], 50))
