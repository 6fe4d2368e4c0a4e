"""Speculative decoding is lossless: greedy ids equal plain greedy for every draft source on the
real model; sampled output keeps plain sampling's distribution (chi-square over 20,000 seeded
draws, which a broken rule fails); a seed gives one text; draft lengths adapt and switch off."""

from __future__ import annotations

import json
import math
import os
import types

import numpy as np
import pytest

from ntransformerd.engine.generation import speculative as sp
from ntransformerd.engine.generation.decode import Sequence
from ntransformerd.engine.runtime.engine import Engine, EngineConfig, generate
from ntransformerd.engine.generation.sampler import SamplingParams

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "golden")
# A PCIe-bound stream's shape (a 16-token step costs little more than one), fixed so draft lengths
# do not depend on this machine's timing.
FLAT = sp.StepCosts({1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1, 16: 1.2})


@pytest.fixture(scope="module")
def prompts(default_engine):
    with open(os.path.join(GOLDEN, "forward_smollm2.json")) as f:
        g = json.load(f)
    with open(os.path.join(GOLDEN, "code_edit_prompt.json")) as f:
        code = json.load(f)
    by_name = {p["name"]: p["prompt_ids"] for p in g["prompts"]}
    return {"numbers": by_name["numbers"], "chat": by_name["chat"],
            "code_edit": default_engine.encode_chat(code["messages"])}


@pytest.fixture(scope="module")
def draft_engine(default_engine, tmp_path_factory):
    """The Q4_0 copy of the default model as a separate draft engine."""
    from ntransformerd.tools.quantize import quantize_file

    path = str(tmp_path_factory.mktemp("draft") / "q4_0.gguf")
    quantize_file(default_engine.model.path, path, "q4_0")
    return sp.load_draft_engine(path, default_engine)


def plain(engine, ids, params):
    return [ev.token for ev in generate(engine, ids, params)]


def speculated(engine, ids, params, draft, costs=FLAT):
    s = sp.Speculator(engine, draft, costs=costs)
    return [ev.token for ev in sp.generate(engine, ids, params, s)], s.stats()


@pytest.mark.parametrize("source", ["ngram", "draft", "skip:8,12,16,20", "prefix:15"])
def test_greedy_ids_identical_for_every_source(default_engine, draft_engine, prompts, source):
    e = default_engine
    params = SamplingParams.greedy(max_tokens=24, ignore_eos=True)
    draft = sp.make_draft(source, e, draft_engine=draft_engine)
    for name in ("numbers", "chat"):
        ids = prompts[name]
        want = plain(e, ids, params)
        got, stats = speculated(e, ids, params, draft)
        assert got == want, f"{source} on {name}: diverges at {next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)}"
        assert stats["proposed"] > 0, f"{source} on {name}: nothing was drafted, nothing was verified"
        assert e.kv.free_slots == e.config.max_batch and (draft_engine.kv.free_slots == draft_engine.config.max_batch)


def test_ngram_yields_two_tokens_per_pass_on_a_code_edit(default_engine, prompts):
    e = default_engine
    params = SamplingParams.greedy(max_tokens=64)
    want = plain(e, prompts["code_edit"], params)
    got, stats = speculated(e, prompts["code_edit"], params, sp.NgramDraft())
    assert got == want
    assert stats["tokens_per_pass"] >= 2.0, stats


def test_sampled_speculation_is_repeatable_by_seed(default_engine, prompts):
    e = default_engine
    params = SamplingParams(temperature=1.0, top_k=40, top_p=0.95, min_p=0.02, repetition_penalty=1.2,
                            max_tokens=24, ignore_eos=True, seed=1234)
    a, sa = speculated(e, prompts["code_edit"], params, sp.NgramDraft())
    b, _ = speculated(e, prompts["code_edit"], params, sp.NgramDraft())
    c, _ = speculated(e, prompts["code_edit"], SamplingParams(**{**params.__dict__, "seed": 99}), sp.NgramDraft())
    assert a == b and sa["proposed"] > 0
    assert a != c


def test_draft_model_with_another_vocabulary_is_refused(default_engine):
    other = types.SimpleNamespace(path="other.gguf", config=default_engine.cfg,
                                  metadata=dict(default_engine.model.metadata))
    tokens = list(other.metadata["tokenizer.ggml.tokens"])
    tokens[1000] = "not-the-same"
    other.metadata["tokenizer.ggml.tokens"] = tokens
    with pytest.raises(sp.VocabularyMismatch, match="token 1000"):
        sp.check_vocabulary(default_engine.model, other)
    other.metadata["tokenizer.ggml.tokens"] = tokens[:-5]
    with pytest.raises(sp.VocabularyMismatch, match="different vocabularies"):
        sp.check_vocabulary(default_engine.model, other)
    sp.check_vocabulary(default_engine.model, default_engine.model)


def test_modes_parse_and_bad_ones_are_clear():
    assert sp.Mode.parse("") == sp.OFF and sp.Mode.parse("").off
    assert sp.Mode.parse("skip:3,7") == sp.Mode("skip", "3,7") and str(sp.Mode.parse(" Prefix:8 ")) == "prefix:8"
    for bad in ("fast", "ngram:3", "prefix:x"):
        with pytest.raises(ValueError, match="speculative"):
            sp.Mode.parse(bad)
    # a request's self-draft without layers takes the daemon's own, where the daemon uses that source
    default = sp.Mode.parse("skip:3,7")
    assert sp.Mode.parse("skip").within(default) == default
    assert sp.Mode.parse("prefix").within(default) == sp.Mode("prefix")
    assert sp.Mode.parse("skip:5").within(default) == sp.Mode("skip", "5")


def test_ngram_proposes_what_followed_the_latest_match():
    d = sp.NgramDraft()
    assert d.lookup([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3], 3) == [7, 8, 5]
    assert d.lookup([1, 2, 3, 4], 2) == []  # nothing repeats
    assert d.lookup([5, 6, 5], 4) == [6, 5]  # a 1-gram match, what follows it


def test_draft_length_adapts_and_switches_off():
    steep = sp.StepCosts({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0, 16: 16.0})  # compute-bound: k tokens cost k
    c = sp.Controller(steep, probe_every=4)
    for _ in range(5):
        c.update(4, 0)  # every draft rejected
    ks = [c.next_k(16) for _ in range(8)]
    assert ks.count(0) == 6 and ks.count(1) == 2, ks  # off, probing with one token every 4 passes
    c = sp.Controller(FLAT)
    for _ in range(10):
        c.update(8, 8)  # every draft accepted
    assert c.next_k(16) == 16 and c.next_k(5) == 5
    c = sp.Controller(sp.StepCosts({1: 1.0, 2: 1.3, 4: 1.9, 8: 3.1, 16: 5.5}))
    for _ in range(10):
        c.update(4, 2)
    assert 1 <= c.next_k(16) <= 4  # resident-like costs and middling acceptance: short drafts


def test_cost_table_interpolates_and_extends():
    t = sp.StepCosts({1: 1.0, 2: 1.5, 4: 2.5})
    assert t.verify_cost(3) == pytest.approx(2.0)
    assert t.verify_cost(6) == pytest.approx(3.5)


# ---- the distribution of sampled speculation -----------------------------------------------------

N_DRAWS = 20000
PARAMS = SamplingParams(temperature=0.9, top_k=12, top_p=0.9, min_p=0.05, repetition_penalty=1.5,
                        penalty_last_n=16, max_tokens=8, seed=0)


class Memo:
    """Logits and sampler distributions of one tiny model per token prefix, computed once: the
    20,000 draws below meet only a few dozen distinct prefixes."""

    def __init__(self, engine, layers=None):
        self.engine, self.layers, self.rows, self.dists = engine, layers, {}, {}

    def row(self, prefix: tuple) -> np.ndarray:
        if prefix not in self.rows:
            slot = self.engine.open()
            try:
                self.rows[prefix] = self.engine.step([(slot, list(prefix))], layers=self.layers)[0]
            finally:
                self.engine.close(slot)
        return self.rows[prefix]


class MemoSampler:
    """The real Sampler's distribution, memoized by history (which fixes the row here)."""

    def __init__(self, sampler, memo: dict):
        self.sampler, self.memo, self.vocab_size = sampler, memo, sampler.vocab_size

    def distribution(self, row, history, mask=None):
        assert mask is None, "these sequences have no constraint"
        key = (id(row), tuple(history))
        if key not in self.memo:
            self.memo[key] = self.sampler.distribution(row, history)
        return self.memo[key]


def two_tokens(engine, target: Memo, draft: Memo, prompt, seed: int, k: int, cache: dict, verify=sp.verify):
    """The first two tokens of a speculative continuation with draft length k, by the real rule."""
    cont = Sequence(engine, prompt, SamplingParams(**{**PARAMS.__dict__, "seed": seed}))
    cont.sampler = MemoSampler(cont.sampler, cache)
    seq = sp.SpecSeq(cont, controller=None, seed=seed)
    out = []
    while len(out) < 2:
        hist = tuple(cont.history)
        proposal = sp.Proposal([], [])
        for _ in range(k):
            sp.draw_draft(seq, draft.row(hist + tuple(proposal.tokens)), proposal)
        rows = [target.row(hist + tuple(proposal.tokens[:j])) for j in range(k + 1)]
        tokens, _ = verify(seq, rows, proposal)
        for t in tokens:
            cont.history.append(t)
            out.append(t)
    return tuple(out[:2])


def exact(engine, target: Memo, prompt, cache):
    """Plain sampling's exact distribution of the first token and of the second."""
    s = MemoSampler(Sequence(engine, prompt, PARAMS).sampler, cache)
    ids, p = s.distribution(target.row(tuple(prompt)), list(prompt))
    first = dict(zip(ids.tolist(), p))
    second: dict[int, float] = {}
    for y, py in first.items():
        ids2, p2 = s.distribution(target.row(tuple(prompt) + (y,)), list(prompt) + [y])
        for z, pz in zip(ids2.tolist(), p2):
            second[z] = second.get(z, 0.0) + py * pz
    return first, second


def chi_square_p(counts: dict, probs: dict, n: int) -> float:
    """p-value of Pearson's chi-square of counts against probs, cells of expected count < 5 pooled
    (Wilson-Hilferty's normal approximation of the chi-square tail)."""
    big = [i for i, p in probs.items() if p * n >= 5]
    obs = [counts.get(i, 0) for i in big] + [n - sum(counts.get(i, 0) for i in big)]
    exp_ = [probs[i] * n for i in big] + [n - sum(probs[i] * n for i in big)]
    cells = [(o, e) for o, e in zip(obs, exp_) if e > 1e-9] + [(o, 0.0) for o, e in zip(obs, exp_) if e <= 1e-9 and o]
    if any(e == 0.0 for _, e in cells):
        return 0.0  # a token plain sampling can never draw
    x = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    z = ((x / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.fixture(scope="module")
def tiny(synth_model):
    engine = Engine.load(synth_model("tiny", "q8_0"), config=EngineConfig(backend="cpu", max_batch=2, max_ctx=64))
    # the tiny model's 2 layers: its first layer alone drafts for it (close to it, not equal)
    return engine, Memo(engine), Memo(engine, layers=[0])


def spec_counts(tiny, verify=sp.verify):
    engine, target, draft = tiny
    prompt = [17, 300, 17, 4000, 52, 300]  # repeats: the repetition penalty changes the distributions
    cache: dict = {}
    firsts, seconds = {}, {}
    accepted = 0
    for seed in range(N_DRAWS):
        a, b = two_tokens(engine, target, draft, prompt, seed, k=1, cache=cache, verify=verify)
        firsts[a] = firsts.get(a, 0) + 1
        seconds[b] = seconds.get(b, 0) + 1
    return prompt, cache, firsts, seconds


def test_sampled_speculation_keeps_the_distribution(tiny):
    engine, target, _ = tiny
    prompt, cache, firsts, seconds = spec_counts(tiny)
    p1, p2 = exact(engine, target, prompt, cache)
    assert len(p1) >= 4 and len(p2) >= 8, "the filters left too few candidates for a meaningful test"
    assert chi_square_p(firsts, p1, N_DRAWS) > 1e-3
    assert chi_square_p(seconds, p2, N_DRAWS) > 1e-3


def test_a_broken_rule_is_caught(tiny, monkeypatch):
    """The same test fails a rule that draws the rejected case from p instead of the residual
    max(p - q, 0): it over-produces the draft's favourite tokens."""
    engine, target, _ = tiny
    monkeypatch.setattr(sp, "residual_draw", lambda ids, p, x, q, vocab, u: sp.draw_from(ids, p, u))
    prompt, cache, firsts, seconds = spec_counts(tiny)
    p1, p2 = exact(engine, target, prompt, cache)
    assert min(chi_square_p(firsts, p1, N_DRAWS), chi_square_p(seconds, p2, N_DRAWS)) < 1e-6


# ---- the cost table: measured robustly, kept per model, plan and machine ----------------------

class _Clock:
    """speculative.py's time: it moves only when a _TimedEngine steps, so that what the cost
    table makes of the steps' times does not depend on the machine's load."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    monotonic = perf_counter


@pytest.fixture
def clock(monkeypatch):
    c = _Clock()
    monkeypatch.setattr(sp, "time", c)
    return c


class _TimedEngine:
    """An engine whose step of T tokens takes cost(T) seconds of `clock`; some steps are delayed
    as if another process took the CPU."""

    def __init__(self, path: str, cost, clock: _Clock, *, delayed=()):
        self.clock = clock
        self.model = types.SimpleNamespace(path=path)
        self.cfg = types.SimpleNamespace(vocab_size=100, n_layers=4)
        self.config = types.SimpleNamespace(kv_dtype="f32", cpu_threads=0, max_ctx=256, max_batch=2)
        self.backend_name, self.plan, self.layers = "cpu", None, None
        self.cost, self.delayed, self.steps = cost, set(delayed), 0
        self.slots = [0, 1]

    def open(self):
        return self.slots.pop()

    def close(self, slot):
        self.slots.append(slot)

    def prefill(self, slot, ids):
        pass

    def truncate(self, slot, n):
        pass

    def step(self, items, *, all_logits=False, layers=None):
        self.steps += 1
        t = len(items[0][1])
        self.clock.now += self.cost(t) + (0.05 if self.steps in self.delayed else 0.0)


def test_cost_table_is_the_median_and_monotone_in_tokens(tmp_path, clock):
    # a real table's shape with a dip at 4 tokens, and one delayed step in every size's rounds
    base = {1: 0.004, 2: 0.006, 4: 0.005, 8: 0.008, 16: 0.012}
    e = _TimedEngine(str(tmp_path / "m.gguf"), base.get, clock, delayed=range(6, 40, 6))
    costs = sp.measure_costs(e, rounds=5)
    v = [costs.verify[t] for t in sp.COST_SIZES]
    # relative to one token 1, 1.5, 1.25, 2, 3; the dip pooled: monotone; the delayed steps
    # (50 ms, one in each size's 5 rounds) left no trace in the medians
    assert v == pytest.approx([1.0, 1.375, 1.375, 2.0, 3.0]), v
    assert e.steps == 6 * len(sp.COST_SIZES)  # a warm-up round and 5 timed rounds


def test_monotone_pools_violators():
    assert sp.monotone([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert sp.monotone([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert sp.monotone([3.0, 1.0]) == [2.0, 2.0]


def test_the_cost_table_is_kept_per_model_plan_and_machine(tmp_path, monkeypatch, clock):
    monkeypatch.setenv("NTX_STATE_DIR", str(tmp_path / "state"))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    cost = {1: 0.002, 2: 0.003, 4: 0.004, 8: 0.006, 16: 0.01}.get
    e = _TimedEngine(str(model), cost, clock)
    assert sp.cached_costs(e) is None
    first = sp.step_costs(e)
    measured = e.steps
    assert measured > 0 and os.path.exists(sp.cost_cache_path(e))
    again = _TimedEngine(str(model), cost, clock)  # a restart: the same model, plan and machine
    assert sp.step_costs(again) == first and again.steps == 0
    other_plan = _TimedEngine(str(model), cost, clock)
    other_plan.layers = (0, 1, 3)  # a layer skipped: another plan
    assert sp.cached_costs(other_plan) is None
    model.write_bytes(b"xy")  # the file changed
    assert sp.cached_costs(_TimedEngine(str(model), cost, clock)) is None


def test_mode_errors_name_the_cause_and_quote_the_input_bounded(tmp_path, monkeypatch):
    monkeypatch.setenv("NTX_STATE_DIR", str(tmp_path))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"no calibration for this one")
    e = types.SimpleNamespace(cfg=types.SimpleNamespace(n_layers=30), model=types.SimpleNamespace(path=str(model)),
                              layers=None)
    cases = [("x" * 20_000, "a speculative mode of 20000 characters is none: use off, auto"),
             ("prefix:²", "prefix:N takes a layer count in digits 0-9"),
             ("prefix:30", "runs the first 1..29 of the model's 30 layers"),
             ("skip:999", "one number is how many layers to skip (the most similar ones), and the model has 30 "
                          "layers, 28 of them skippable"),
             ("skip:3,99", "layer 99 does not exist: the model has layers 0..29"),
             ("skip:abc", "use skip:N"),
             ("skip:5", f"run `ntx-model calibrate-skip {model} --file TEXT` once")]
    for mode, words in cases:
        with pytest.raises(ValueError) as err:
            sp.make_draft(mode, e)
        assert words in str(err.value) and len(str(err.value)) < 400, (mode, str(err.value)[:300])
