"""Sampler: determinism, filters against brute-force references, penalty arithmetic by hand,
parameter validation, stop strings split across deltas, and a step's rows drawn at once
(sample_rows) giving each row's own draws."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from ntransformerd.engine.generation.sampler import (
    FAULT_INF, FAULT_NAN, RECENT_ROW_SETS, InvalidLogits, NoAllowedToken, SampleRows, SamplingParams, Sampler,
    StopMatcher, TopLogits, apply_penalties, candidates, penalty_window, prompt_logprobs, sample_rows, token_logprobs,
)

V = 1000


def _logits(seed: int, n: int = V, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


def _run(params: SamplingParams, steps: int = 50, n: int = V) -> list[int]:
    s = Sampler(params, n)
    return [s.sample(_logits(100 + i, n), []) for i in range(steps)]


# ---- determinism and greedy ---------------------------------------------------------------

def test_same_seed_same_sequence_different_seed_differs():
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    assert _run(p) == _run(p)
    assert _run(p) != _run(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=8))


def test_two_samplers_do_not_share_random_state():
    p = SamplingParams(temperature=1.0, seed=3)
    a, b = Sampler(p, V), Sampler(p, V)
    xs = [_logits(i) for i in range(20)]
    seq_a = []
    for x in xs:  # interleave: b drawing must not disturb a's sequence
        seq_a.append(a.sample(x, []))
        b.sample(x, [])
    c = Sampler(p, V)
    assert [c.sample(x, []) for x in xs] == seq_a


def test_greedy_is_argmax_with_lowest_id_on_ties():
    x = np.zeros(10, np.float32)
    x[[3, 7]] = 5.0
    assert Sampler(SamplingParams.greedy(), 10).sample(x, []) == 3
    for i in range(5):
        y = _logits(i)
        assert Sampler(SamplingParams(temperature=0.0, seed=i), V).sample(y, []) == int(np.argmax(y))


def test_top_k_1_equals_greedy():
    p = SamplingParams(temperature=1.5, top_k=1, top_p=1.0, min_p=0.0, seed=1)
    s = Sampler(p, V)
    for i in range(20):
        y = _logits(i)
        assert s.sample(y, []) == int(np.argmax(y))


def test_draws_follow_the_distribution():
    x = np.log(np.array([0.5, 0.3, 0.2], np.float32))
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0), 3)
    counts = np.bincount([s.sample(x, []) for _ in range(4000)], minlength=3) / 4000
    assert np.allclose(counts, [0.5, 0.3, 0.2], atol=0.03)


# ---- filters against brute force ------------------------------------------------------------

def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z.astype(np.float64) - z.max())
    return e / e.sum()


def _reference(x: np.ndarray, top_k: int, top_p: float, min_p: float) -> set[int]:
    """The survivors by the definitions, with plain Python loops."""
    order = sorted(range(len(x)), key=lambda i: (-float(x[i]), i))
    if top_k > 0:
        order = order[:top_k]
    if top_p < 1.0:
        probs = _softmax(x[order])
        kept, total = [], 0.0
        for i, pr in zip(order, probs):
            kept.append(i)
            total += pr
            if total >= top_p:
                break
        order = kept
    if min_p > 0.0:
        probs = _softmax(x[order])
        order = [i for i, pr in zip(order, probs) if pr >= min_p * probs.max() * (1 - 1e-6)]
    return set(order)


@pytest.mark.parametrize("case", range(40))
def test_filters_match_brute_force(case):
    rng = np.random.default_rng(case)
    n = int(rng.integers(2, 40))
    x = (rng.standard_normal(n) * rng.uniform(0.1, 5)).astype(np.float32)
    if case % 5 == 0:
        x[rng.integers(0, n, 3)] = x.max()  # ties at the top
    top_k = int(rng.choice([0, 1, 3, n // 2, n + 5]))
    top_p = float(rng.choice([1.0, 0.9, 0.5, 0.1]))
    min_p = float(rng.choice([0.0, 0.05, 0.3]))
    ids = candidates(x, top_k, top_p, min_p)
    assert list(ids) == sorted(ids, key=lambda i: (-float(x[i]), i)), "not sorted by logit"
    assert set(ids.tolist()) == _reference(x, top_k, top_p, min_p), (top_k, top_p, min_p)


def test_top_p_keeps_the_token_that_crosses_p():
    x = np.log(np.array([0.4, 0.3, 0.2, 0.1], np.float32))
    assert candidates(x, 0, 0.4, 0.0).tolist() == [0]
    assert candidates(x, 0, 0.5, 0.0).tolist() == [0, 1]
    assert candidates(x, 0, 0.85, 0.0).tolist() == [0, 1, 2]


def test_min_p_is_relative_to_the_most_likely():
    x = np.log(np.array([0.5, 0.2, 0.05, 0.25], np.float32))
    assert candidates(x, 0, 1.0, 0.4).tolist() == [0, 3, 1]  # 0.2 >= 0.4 * 0.5
    assert candidates(x, 0, 1.0, 0.5).tolist() == [0, 3]


def test_sampled_ids_never_leave_the_filtered_set():
    p = SamplingParams(temperature=2.0, top_k=5, top_p=0.8, min_p=0.1, seed=5)
    s = Sampler(p, V)
    for i in range(100):
        y = _logits(i)
        assert s.sample(y, []) in set(candidates(y, 5, 0.8, 0.1).tolist())


# ---- penalties --------------------------------------------------------------------------------

def test_penalty_arithmetic_by_hand():
    x = np.array([2.0, -1.0, 0.5, 3.0, 0.0], np.float32)
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, penalty_last_n=4)
    # last 4 of the history: [1, 0, 0, 4]; id 3 is older and out of the window
    y = apply_penalties(x.copy(), [3, 1, 0, 0, 4], p)
    expected = [
        2.0 / 2.0 - (2 * 0.5 + 0.25),   # id 0: positive -> divided; seen twice
        -1.0 * 2.0 - (1 * 0.5 + 0.25),  # id 1: negative -> multiplied; seen once
        0.5,                            # id 2: not seen
        3.0,                            # id 3: outside the last 4
        0.0 * 2.0 - (0.5 + 0.25),       # id 4: zero counts as "<= 0"
    ]
    assert np.allclose(y, expected)


def test_penalty_window_options():
    x = np.ones(4, np.float32)
    p = SamplingParams(presence_penalty=1.0, penalty_last_n=0)
    assert np.array_equal(apply_penalties(x.copy(), [0, 1], p), x)
    p = SamplingParams(presence_penalty=1.0, penalty_last_n=-1)  # whole history
    assert apply_penalties(x.copy(), [0] + [3] * 100, p).tolist() == [0.0, 1.0, 1.0, 0.0]


def test_repetition_penalty_changes_greedy_choice():
    x = np.array([1.0, 0.9, 0.0], np.float32)
    assert Sampler(SamplingParams.greedy(), 3).sample(x, [0]) == 0
    assert Sampler(SamplingParams.greedy(repetition_penalty=1.5), 3).sample(x, [0]) == 1


def test_ignore_eos_bans_end_of_generation_ids():
    x = np.array([0.0, 9.0, 1.0], np.float32)
    assert Sampler(SamplingParams.greedy(ignore_eos=True), 3, eog_ids={1}).sample(x, []) == 2
    assert Sampler(SamplingParams.greedy(), 3, eog_ids={1}).sample(x, []) == 1


def test_bad_logits_are_rejected():
    s = Sampler(SamplingParams(), 4)
    with pytest.raises(ValueError, match="shape"):
        s.sample(np.zeros(5, np.float32), [])
    for row, words in (([0, np.nan, 0, 0], "NaN"), ([0, np.inf, 0, 0], r"\+inf"), ([-np.inf] * 4, "every logit is -inf")):
        with pytest.raises(InvalidLogits, match=words):
            s.sample(np.array(row, np.float32), [])
        with pytest.raises(InvalidLogits, match=words):
            s.distribution(np.array(row, np.float32), [])
    banned = Sampler(SamplingParams(ignore_eos=True), 4, eog_ids={2})  # NaN under a banned id is still NaN
    with pytest.raises(InvalidLogits, match="NaN"):
        banned.sample(np.array([0, 0, np.nan, 0], np.float32), [])


def test_tiny_temperatures_are_greedy():
    for t in (5e-324, 1e-300, 1e-6):
        s = Sampler(SamplingParams(temperature=t, seed=1), V)
        assert s.params.is_greedy and s.need() == 1
        for i in range(5):
            y = _logits(i)
            assert s.sample(y, []) == int(np.argmax(y))
            ids, p = s.distribution(y, [])
            assert ids.tolist() == [int(np.argmax(y))] and p.tolist() == [1.0]
    assert not SamplingParams(temperature=1e-4).is_greedy


def test_penalties_that_would_empty_the_distribution_are_refused():
    for r in (1e-300, 1e-40, 0.001, 101.0):
        with pytest.raises(ValueError, match=r"repetition_penalty must be in \[0.01, 100\]"):
            SamplingParams(repetition_penalty=r).validate()
    SamplingParams(repetition_penalty=0.01).validate()
    SamplingParams(repetition_penalty=100.0).validate()


@pytest.mark.parametrize("params", [SamplingParams.greedy(repetition_penalty=0.01),
                                    SamplingParams(repetition_penalty=0.01, temperature=1.0, seed=3),
                                    SamplingParams(repetition_penalty=100.0, temperature=1.0, seed=3)])
def test_a_row_the_penalties_overflow_draws_the_unpenalised_argmax(params):
    x = np.array([1e37, 3e38, -3e38, 0.5], np.float32)  # within float32, but x / 0.01 and x * 100 are not
    s = Sampler(params, 4)
    for _ in range(10):
        assert s.sample(x, [0, 2]) == 1
    ids, p = s.distribution(x, [0, 2])
    assert ids.tolist() == [1] and p.tolist() == [1.0]
    y = np.array([2.0, 1.0, -1.0, 0.5], np.float32)  # an ordinary row keeps the penalties
    assert Sampler(SamplingParams.greedy(repetition_penalty=100.0), 4).sample(y, [0]) == 1


# ---- validation -------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, message", [
    ("temperature", -0.1, "temperature must be in"),
    ("temperature", math.nan, "temperature must be a finite number"),
    ("temperature", math.inf, "finite"),
    ("top_k", -1, "top_k must be in"),
    ("top_k", 2.5, "top_k must be an integer"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
    ("top_p", 1.5, "top_p"),
    ("min_p", -0.01, "min_p"),
    ("repetition_penalty", 0.0, "repetition_penalty"),
    ("frequency_penalty", 2.5, "frequency_penalty"),
    ("presence_penalty", math.nan, "presence_penalty"),
    ("penalty_last_n", -2, "penalty_last_n"),
    ("max_tokens", 0, "max_tokens"),
    ("seed", -1, "seed"),
    ("seed", "7", "seed must be an integer"),
    ("stop", ("",), "non-empty"),
    ("stop", ("x",) * 17, "at most 16"),
    ("ignore_eos", "yes", "ignore_eos"),
])
def test_validate_names_the_problem(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value}).validate()


def test_valid_params():
    p = SamplingParams(stop=["</s>", "\n\n"], seed=2**64 - 1).validate()
    assert p.stop == ("</s>", "\n\n") and hash(p)
    assert SamplingParams(stop="END").stop == ("END",)


# ---- stop strings -----------------------------------------------------------------------------

def _stream(stops, deltas):
    m = StopMatcher(stops)
    out, stopped = [], False
    for d in deltas:
        text, stopped = m.feed(d)
        out.append(text)
        if stopped:
            break
    return out, stopped, m.flush()


def test_stop_across_delta_boundaries():
    out, stopped, rest = _stream(["STOP"], ["hello S", "T", "O", "P and more"])
    assert out == ["hello ", "", "", ""] and stopped and rest == ""
    out, stopped, _ = _stream(["<|end|>"], ["a<|e", "nd|>b"])
    assert "".join(out) == "a" and stopped


def test_false_start_is_released():
    out, stopped, rest = _stream(["STOP"], ["ST", "ART", "S"])
    assert out == ["", "START", ""] and not stopped and rest == "S"


def test_earliest_stop_wins_and_overlaps():
    out, stopped, _ = _stream(["bc", "abcd"], ["xabcd"])  # "abcd" starts first
    assert out == ["x"] and stopped
    out, stopped, _ = _stream(["bc", "abcd"], ["xabce"])
    assert out == ["xa"] and stopped
    out, stopped, _ = _stream(["aab"], ["a", "a", "a", "b"])  # "aaab": stop starts at 1
    assert "".join(out) == "a" and stopped


def test_no_stops_passes_text_through():
    m = StopMatcher([])
    assert m.feed("abc") == ("abc", False) and m.flush() == ""
    m = StopMatcher(["x"])
    assert m.feed("x") == ("", True) and m.feed("more") == ("", True)


def test_stop_matcher_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(300):
        text = "".join(rng.choice(list("ab c"), int(rng.integers(0, 20))))
        stops = ["".join(rng.choice(list("abc"), int(rng.integers(1, 4)))) for _ in range(2)]
        cuts = sorted(rng.integers(0, len(text) + 1, 4).tolist())
        deltas = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        out, stopped, rest = _stream(stops, deltas)
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            assert stopped and "".join(out) + rest == text[: min(hits)], (text, stops, deltas)
        else:
            assert not stopped and "".join(out) + rest == text, (text, stops, deltas)


# ---- log-probabilities and the constraint's mask --------------------------------------------------

def test_token_logprobs_are_log_softmax_in_float64():
    rng = np.random.default_rng(7)
    row = (rng.standard_normal(5000) * 4).astype(np.float32)
    row[[11, 12]] = row.max() + 1.0  # a tie at the top: the lower id first
    lp, top, top_lp = token_logprobs(row, 3, 5)
    z = row.astype(np.float64)
    want = z - np.log(np.exp(z - z.max()).sum()) - z.max()
    assert abs(lp - want[3]) < 1e-12
    assert top.tolist()[:2] == [11, 12] and top.tolist() == np.lexsort((np.arange(5000), -want))[:5].tolist()
    assert np.allclose(top_lp, want[top], atol=1e-12)
    assert token_logprobs(row, 3, 0)[1].size == 0
    with pytest.raises(InvalidLogits):
        token_logprobs(np.array([0.0, np.nan], np.float32), 0, 1)


def test_prompt_logprobs_row_by_row():
    rng = np.random.default_rng(8)
    rows = rng.standard_normal((4, 300)).astype(np.float32)
    out = prompt_logprobs(rows, [5, 6, 7, 8], 3)
    for row, t, (lp, top, top_lp) in zip(rows, [5, 6, 7, 8], out):
        want = token_logprobs(row, t, 3)
        assert lp == pytest.approx(want[0], abs=1e-12) and top.tolist() == want[1].tolist()


def test_the_mask_applies_to_greedy_sampled_and_the_distribution():
    rng = np.random.default_rng(9)
    row = rng.standard_normal(1000).astype(np.float32)
    mask = np.zeros(1000, bool)
    mask[[3, 500, 900]] = True
    greedy = Sampler(SamplingParams.greedy(), 1000)
    assert greedy.sample(row, (), mask) == [3, 500, 900][int(np.argmax(row[[3, 500, 900]]))]
    sampled = Sampler(SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=1), 1000)
    assert {sampled.sample(row, (), mask) for _ in range(200)} <= {3, 500, 900}
    ids, p = sampled.distribution(row, (), mask)
    assert set(ids.tolist()) == {3, 500, 900} and abs(p.sum() - 1) < 1e-12
    with pytest.raises(ValueError, match="whole row"):
        greedy.sample(TopLogits.of(row[None], 1)[0], (), mask)


def test_a_mask_that_allows_nothing_is_the_requests_fault():
    row = np.zeros(10, np.float32)
    row[:5] = -np.inf
    mask = np.zeros(10, bool)
    mask[:5] = True  # only ids the model gives no chance
    with pytest.raises(NoAllowedToken, match="constraint allows no token"):
        Sampler(SamplingParams.greedy(), 10).sample(row, (), mask)
    assert not issubclass(NoAllowedToken, InvalidLogits)  # not the model's fault: serving goes on


# ---- a step's rows at once ------------------------------------------------------------------------

BATCH_PARAMS = [
    SamplingParams.greedy(),
    SamplingParams.greedy(repetition_penalty=1.3, presence_penalty=0.5),
    SamplingParams.greedy(ignore_eos=True),
    SamplingParams(seed=1),
    SamplingParams(seed=2, top_k=0, top_p=0.8, min_p=0.0, temperature=1.3),
    SamplingParams(seed=3, top_k=5, top_p=1.0, min_p=0.2, temperature=0.5, frequency_penalty=0.7),
    SamplingParams(seed=4, repetition_penalty=0.7, penalty_last_n=-1, ignore_eos=True),
    SamplingParams.greedy(),
]
EOG = (7, 11)


def test_rows_drawn_at_once_equal_each_row_drawn_alone():
    """Eight rows of mixed chains over 30 steps: the batched draw gives every row the id its own
    Sampler gives alone, from whole rows and from top ids, and consumes the same random numbers."""
    alone = [Sampler(p, V, eog_ids=EOG) for p in BATCH_PARAMS]
    batched = [Sampler(p, V, eog_ids=EOG) for p in BATCH_PARAMS]
    hist_a = [[3, 5, 5, 9] for _ in BATCH_PARAMS]
    hist_b = [list(h) for h in hist_a]
    for step in range(30):
        x = np.stack([_logits(1000 * step + i) for i in range(len(BATCH_PARAMS))])
        want = [s.sample(row, h) for s, row, h in zip(alone, x, hist_a)]
        top_ok = all(s.need() is not None for s in batched) and step % 2
        got = sample_rows(TopLogits.of(x, max(s.need() for s in batched)) if top_ok else x,
                          SampleRows.of(batched, hist_b))
        assert got.ids.tolist() == want and not got.fault.any(), step
        for h, t in zip(hist_a, want):
            h.append(t)
        for h, t in zip(hist_b, got.ids.tolist()):
            h.append(t)
    seeded = [i for i, p in enumerate(BATCH_PARAMS) if p.seed is not None]
    assert [alone[i].rng.random() for i in seeded] == [batched[i].rng.random() for i in seeded]  # the same draws


def _rows_one_by_one(samplers, histories):
    """SampleRows as it was built before Sampler.chain: every field of every row written one by one."""
    n = len(samplers)
    f = np.zeros(n)
    draws, greedy, top_k, need = np.zeros(n, bool), np.zeros(n, bool), np.zeros(n, np.int64), np.zeros(n, np.int64)
    temperature, top_p, min_p, rep, freq, pres, uniform = f.copy(), np.ones(n), f.copy(), np.ones(n), f.copy(), \
        f.copy(), np.full(n, np.nan)
    penalty, banned = [None] * n, [np.zeros(0, np.int64)] * n
    for i, (s, h) in enumerate(zip(samplers, histories)):
        if s is None:
            continue
        p = s.params
        draws[i], greedy[i] = True, p.is_greedy
        temperature[i], top_k[i], top_p[i], min_p[i] = p.temperature, p.top_k, p.top_p, p.min_p
        rep[i], freq[i], pres[i] = p.repetition_penalty, p.frequency_penalty, p.presence_penalty
        need[i] = s.need() or 0
        ids, counts = penalty_window(h, p, s.vocab_size)
        penalty[i] = None if ids is None else (ids, counts)
        banned[i] = s.banned
        if not p.is_greedy:
            uniform[i] = s.uniform()
    return SampleRows(draws, greedy, temperature, top_k, top_p, min_p, rep, freq, pres, need, uniform,
                      tuple(penalty), tuple(banned), (None,) * n)


def test_rows_of_a_step_equal_each_field_written_row_by_row():
    """SampleRows.of reads each sampler's fixed numbers from Sampler.chain, and shares them with
    the next step of the same rows: every field equals the row-by-row build, step after step, as
    rows repeat, join, leave and change chains, and the uniforms come from the same generators in
    the same order (a uniform given back comes first)."""
    rng = np.random.default_rng(0)
    params = BATCH_PARAMS + [SamplingParams(seed=9, penalty_last_n=0, repetition_penalty=1.5),
                             SamplingParams(seed=10, temperature=2.0, top_k=0, top_p=1.0, min_p=0.0)]
    mine = [Sampler(p, V, eog_ids=EOG) for p in params]
    ref = [Sampler(p, V, eog_ids=EOG) for p in params]
    hists = [list(rng.integers(0, V, int(rng.integers(0, 80)))) for _ in params]
    rows, idle = [], []
    for step in range(60):
        if step % 3 == 0:  # the others repeat the last step's rows (SampleRows.of shares what they fix)
            rows = rng.permutation(len(params))[:int(rng.integers(1, len(params) + 1))]  # who runs this step
            idle = rng.random(len(rows)) < 0.2  # a prompt chunk that does not draw
        if step % 7 == 3:
            i = int(rows[0])
            mine[i].give_back(0.25)
            ref[i].give_back(0.25)
        a = SampleRows.of([None if o else mine[i] for i, o in zip(rows, idle)], [hists[i] for i in rows])
        b = _rows_one_by_one([None if o else ref[i] for i, o in zip(rows, idle)], [hists[i] for i in rows])
        for f in dataclasses.fields(SampleRows):
            x, y = getattr(a, f.name), getattr(b, f.name)
            if isinstance(y, np.ndarray):
                assert x.dtype == y.dtype and np.array_equal(x, y, equal_nan=True), (step, f.name)
            else:
                assert len(x) == len(y), (step, f.name)
                for u, v in zip(x, y):
                    if isinstance(v, tuple):
                        assert all(np.array_equal(p, q) for p, q in zip(u, v)), (step, f.name)
                    else:
                        assert (u is None and v is None) or np.array_equal(u, v), (step, f.name)
        for i in rows:
            hists[i].append(int(rng.integers(0, V)))
        with pytest.raises(ValueError, match="read-only"):
            a.temperature[0] = 2.0  # shared with the next step's rows: nobody writes them


def test_row_sets_that_take_turns_keep_their_tables_and_draw_as_rebuilt_ones():
    """Steps whose rows take turns between sets (on a device, a request in the step in flight
    waits for it: a set comes back a step or two later) reuse the tables of the last
    RECENT_ROW_SETS sets, not rebuilt, and draw what tables rebuilt at every step draw: the same
    ids, from whole rows and from top ids, and the same random numbers."""
    params = BATCH_PARAMS + [SamplingParams(seed=9, top_k=5), SamplingParams(seed=10, temperature=2.0)]
    mine = [Sampler(p, V, eog_ids=EOG) for p in params]
    ref = [Sampler(p, V, eog_ids=EOG) for p in params]
    hists = [[3, 5, 5, 9] for _ in params]
    # row sets by sampler (None: a prompt chunk that does not draw); the last two differ by one row
    sets = [[0, 3, 4, 8], [1, 2, 5, None, 6, 7, 9], [3, 9, 0], [0, 3, 4, 8, 9], [0, 3, 4, 8, 1], [5, 6]]
    turns = [0, 1, 0, 1, 2, 0, 2, 1, 3, 3, 0, 1, 2, 3, 4, 3, 4, 5, 1, 0, 1, 0] * 3
    recent, tables = [], {}  # the sets of the last steps, latest first; each one's tables when it last ran
    for step, which in enumerate(turns):
        rows = sets[which]
        a = SampleRows.of([None if i is None else mine[i] for i in rows], [hists[i or 0] for i in rows])
        kept, SampleRows._recent = SampleRows._recent, ()  # the reference: its tables built anew
        b = SampleRows.of([None if i is None else ref[i] for i in rows], [hists[i or 0] for i in rows])
        SampleRows._recent = kept
        if which in recent[:2]:  # back after one other set at most (two sets taking turns): its own tables
            assert a.temperature is tables[which].temperature, step
        reused = which in recent[:RECENT_ROW_SETS]
        assert (a.temperature is tables.get(which, b).temperature) == reused, step
        assert (a.need is tables.get(which, b).need) == reused, step
        recent = [which] + [w for w in recent if w != which]
        tables[which] = a
        x = np.stack([_logits(1000 * step + j) for j in range(len(rows))])
        got, want = sample_rows(x, a), sample_rows(x, b)
        assert got.ids.tolist() == want.ids.tolist() and np.array_equal(got.fault, want.fault), step
        needs = [mine[i].need() for i in rows if i is not None]
        if None not in needs:
            assert sample_rows(TopLogits.of(x, max(needs)), a).ids.tolist() == want.ids.tolist(), step
        for i, t in zip(rows, want.ids.tolist()):
            if i is not None:
                hists[i].append(t)
    seeded = [i for i, p in enumerate(params) if p.seed is not None]
    assert [mine[i].rng.random() for i in seeded] == [ref[i].rng.random() for i in seeded]  # the same draws


def test_rows_drawn_at_once_with_top_ids_when_every_row_allows():
    params = [SamplingParams.greedy(), SamplingParams(seed=5), SamplingParams(seed=6, top_k=3, ignore_eos=True)]
    alone = [Sampler(p, V, eog_ids=EOG) for p in params]
    batched = [Sampler(p, V, eog_ids=EOG) for p in params]
    need = max(s.need() for s in batched)
    for step in range(20):
        x = np.stack([_logits(77 * step + i) for i in range(3)])
        want = [s.sample(row) for s, row in zip(alone, x)]
        assert sample_rows(TopLogits.of(x, need), SampleRows.of(batched, [[]] * 3)).ids.tolist() == want


def test_a_bad_row_is_its_own_fault_and_rows_that_do_not_draw_get_none():
    x = np.stack([_logits(1), _logits(2), _logits(3), _logits(4)])
    x[1, 9] = np.nan
    x[2, 4] = np.inf
    samplers = [Sampler(SamplingParams.greedy(), V), Sampler(SamplingParams.greedy(), V),
                Sampler(SamplingParams(seed=1), V), None]
    d = sample_rows(x, SampleRows.of(samplers, [[]] * 4))
    assert d.ids[0] == int(np.argmax(x[0])) and d.ids[3] == -1
    assert d.fault.tolist() == [0, FAULT_NAN, FAULT_INF, 0]
    with pytest.raises(InvalidLogits, match="NaN"):
        d.id(1)
    with pytest.raises(InvalidLogits, match=r"\+inf"):
        d.id(2)
