"""The scheduler's rules on a fake engine (fast): bounded queue, chunked prefill that does not
stall decoders, cancellation and deadlines within one step, drain."""

from __future__ import annotations

import time
import types

import numpy as np
import pytest

from ntransformerd.config import DaemonConfig
from ntransformerd.engine.sampler import SamplingParams, TopLogits
from ntransformerd.server import errors
from ntransformerd.server.scheduler import Scheduler
from ntransformerd.server.systemd import Notifier


class FakeEngine:
    """The engine API the scheduler uses; the next token is a function of the last one."""

    def __init__(self, tokenizer, *, slots: int, max_ctx: int = 512):
        self.tokenizer, self.max_ctx = tokenizer, max_ctx
        self.cfg = types.SimpleNamespace(vocab_size=tokenizer.vocab_size, n_layers=4)
        self.lengths: dict[int, int] = {}
        self.free = list(range(slots))
        self.delay = 0.0  # seconds per step
        self.steps: list[list[tuple[int, int]]] = []  # per step: (slot, n tokens)
        self.tops: list[int | None] = []  # per step: how many most likely ids it was asked for
        self.model = types.SimpleNamespace(metadata={"general.name": "Fake Llama"}, path="/models/fake.gguf")
        self.fault = None  # fault(items, logits): raise, or change the logits of a step

    @property
    def kv(self):
        return types.SimpleNamespace(free_slots=len(self.free))

    def open(self):
        slot = self.free.pop(0)
        self.lengths[slot] = 0
        return slot

    def close(self, slot):
        del self.lengths[slot]
        self.free.append(slot)

    def length(self, slot):
        return self.lengths[slot]

    def step(self, items, *, top=None):
        time.sleep(self.delay)
        self.steps.append([(s, len(t)) for s, t in items])
        self.tops.append(top)
        out = np.zeros((len(items), self.cfg.vocab_size), np.float32)
        for row, (slot, tokens) in enumerate(items):
            self.lengths[slot] += len(tokens)
            out[row, 1000 + (tokens[-1] * 7) % 1000] = 1.0  # ids 1000..1999: no end-of-generation
        if self.fault is not None:
            self.fault(items, out)
        return out if top is None else TopLogits.of(out, top)


@pytest.fixture(scope="module")
def tokenizer(default_model):
    from ntransformerd.engine.tokenizer import Tokenizer
    return Tokenizer.from_metadata(default_model.metadata)


def make(tokenizer, **cfg):
    config = DaemonConfig(socket="/tmp/x.sock", **cfg)
    s = Scheduler(config=config, notifier=Notifier(environ={}))
    engine = FakeEngine(tokenizer, slots=config.max_batch)
    s.attach(engine)
    return s, engine


def iterate(s: Scheduler) -> str:
    """One iteration of the scheduler loop, on this thread."""
    return s.iterate()


GREEDY = SamplingParams.greedy(ignore_eos=True)


def test_queue_past_its_bound_is_queue_full(tokenizer):
    s, _ = make(tokenizer, max_batch=2, max_queue=1)
    for _ in range(3):
        s.schedule([1, 2, 3], GREEDY, max_tokens=4)
    with pytest.raises(errors.QueueFull, match="max_queue"):
        s.schedule([1, 2, 3], GREEDY, max_tokens=4)


def test_long_prompt_is_chunked_and_decoders_advance_every_step(tokenizer):
    s, engine = make(tokenizer, max_batch=4, prefill_chunk=8)
    short = s.schedule([5, 6], GREEDY, max_tokens=30)
    iterate(s)  # short prefills and samples its first token
    long = s.schedule(list(range(10, 110)), GREEDY, max_tokens=2)
    for _ in range(13):
        iterate(s)
    assert long.state == "decode" and long.prefilled == 100
    for step in engine.steps[1:14]:
        assert (short.slot, 1) in step  # the decoder got its token in every step
        assert sum(n for slot, n in step if slot == long.slot) <= 8  # the prompt in chunks of 8
    assert short.generated == 14


def test_batched_outputs_equal_solo_outputs(tokenizer):
    prompts = [[5, 6], list(range(10, 40)), [7], list(range(50, 61))]
    solo = []
    for p in prompts:
        s, _ = make(tokenizer, max_batch=1)
        r = s.schedule(p, GREEDY, max_tokens=6)
        while r.state != "done":
            iterate(s)
        r.outputs.put(None)
        solo.append([i for o in r.stream() for i in o.token_ids])
    s, _ = make(tokenizer, max_batch=4, prefill_chunk=16)
    reqs = [s.schedule(p, GREEDY, max_tokens=6) for p in prompts]
    while any(r.state != "done" for r in reqs):
        iterate(s)
    for r in reqs:
        r.outputs.put(None)
    assert [[i for o in r.stream() for i in o.token_ids] for r in reqs] == solo


def test_cancel_frees_the_slot_at_the_next_iteration(tokenizer):
    s, engine = make(tokenizer, max_batch=2)
    r = s.schedule([1, 2, 3], GREEDY, max_tokens=100)
    iterate(s)
    iterate(s)
    assert len(engine.free) == 1
    n = len(engine.steps)
    r.cancel()
    iterate(s)
    assert len(engine.free) == 2 and len(engine.steps) == n  # gone before another step ran
    with pytest.raises(errors.Cancelled):
        list(r.stream())


def test_deadline_ends_the_request(tokenizer):
    s, engine = make(tokenizer, max_batch=2)
    r = s.schedule([1, 2, 3], GREEDY, max_tokens=100, deadline=time.monotonic() + 0.05)
    iterate(s)
    time.sleep(0.06)
    iterate(s)
    assert len(engine.free) == 2
    with pytest.raises(errors.DeadlineExceeded, match="deadline"):
        list(r.stream())


def test_not_ready_while_starting_loading_and_without_a_model(tokenizer):
    s = Scheduler(config=DaemonConfig(socket="/tmp/x.sock"), notifier=Notifier(environ={}))
    assert s.state == "starting" and s.snapshot()["load_progress"] == "starting"
    with pytest.raises(errors.NotReady, match="ntransformerd is starting.*--wait"):
        s.schedule([1], GREEDY, max_tokens=1)
    s.set_loading("loading layer 3/30", 0.1)
    with pytest.raises(errors.NotReady, match="loading layer 3/30"):
        s.tokenize(text="hi")
    s.attach(FakeEngine(tokenizer, slots=1))
    s.detach()
    with pytest.raises(errors.NotReady, match="no model is loaded"):
        s.schedule([1], GREEDY, max_tokens=1)


def test_drain_refuses_new_work_and_cancels_what_does_not_finish(tokenizer):
    s, engine = make(tokenizer, max_batch=2)
    engine.delay = 0.01
    r = s.schedule([1, 2, 3], GREEDY, max_tokens=500)  # 5 s of steps
    s.start()
    try:
        finished, cancelled = s.drain(0.2)
        assert (finished, cancelled) == (0, 1)
        with pytest.raises(errors.ShuttingDown, match="shutting down"):
            list(r.stream())
        with pytest.raises(errors.Draining):
            s.schedule([1], GREEDY, max_tokens=1)
    finally:
        s.stop()
    assert len(engine.free) == 2


def test_steps_ask_for_the_most_likely_ids_their_samplers_need(tokenizer):
    """A step asks the engine for each row's most likely ids alone (what a GPU step then picks on
    the device) when every sampler drawing in it can do with them; penalties need whole rows."""
    s, engine = make(tokenizer, max_batch=4)
    n_eog = len(tokenizer.eog_ids)  # banned with ignore_eos: the sampler skips them
    a = s.schedule([5, 6], GREEDY, max_tokens=3)
    iterate(s)
    assert engine.tops[-1] == 1 + n_eog
    s.schedule([7], SamplingParams(seed=1, ignore_eos=True), max_tokens=3)  # top_k 40
    iterate(s)
    assert engine.tops[-1] == 40 + n_eog
    s.schedule([8], SamplingParams(repetition_penalty=1.2, seed=2), max_tokens=3)
    iterate(s)
    assert engine.tops[-1] is None
    for _ in range(4):
        iterate(s)
    assert a.generated == 3 and a.state != "decode"


# ---- failures: the loop outlives every request ------------------------------------------------

def _tokens(r) -> list[int]:
    return [i for o in r.stream() for i in o.token_ids]


def test_a_step_that_raises_fails_its_requests_and_the_loop_goes_on(tokenizer):
    s, engine = make(tokenizer, max_batch=4)

    def lost(items, out):
        engine.fault = None
        raise RuntimeError("device lost " + "x" * 5000)
    engine.fault = lost
    s.start()
    try:
        a = s.schedule([1, 2, 3], GREEDY, max_tokens=4)
        with pytest.raises(errors.EngineFailed, match="RuntimeError: device lost") as e:
            list(a.stream())
        assert len(str(e.value)) < 600  # a bounded part of the exception's text
        b = s.schedule([4, 5], GREEDY, max_tokens=4)
        assert len(_tokens(b)) == 4
    finally:
        s.stop()
    assert len(engine.free) == 4 and s.state == "serving"


def test_a_request_whose_sampling_raises_fails_alone(tokenizer):
    s, engine = make(tokenizer, max_batch=4)
    a = s.schedule([1, 2, 3], GREEDY, max_tokens=6)
    b = s.schedule([4, 5], GREEDY, max_tokens=6)

    def broken(logits):
        raise KeyError("the detokenizer lost its table")
    a.cont.sample = broken
    for _ in range(10):
        iterate(s)
    assert a.state == b.state == "done"
    with pytest.raises(errors.EngineFailed, match="sampling its next token.*KeyError"):
        list(a.stream())
    assert len(_tokens(b)) == 6 and len(engine.free) == 4


def test_invalid_logits_fail_their_requests_and_stop_serving_the_model(tokenizer):
    faults = []
    s, engine = make(tokenizer, max_batch=2)
    s.on_fault = faults.append
    a = s.schedule([1, 2, 3], GREEDY, max_tokens=6)
    b = s.schedule([4, 5], SamplingParams(repetition_penalty=1.1, seed=1, ignore_eos=True), max_tokens=6)
    c = s.schedule([6], GREEDY, max_tokens=6)  # queued: max_batch 2
    iterate(s)  # a and b prefill and draw their first tokens
    engine.fault = lambda items, out: out.__setitem__(0, np.nan)  # row 0 is a's
    iterate(s)
    engine.fault = None
    for _ in range(8):
        iterate(s)
    for r in (a, c):
        with pytest.raises(errors.ModelFault, match="model 'Fake Llama' produced invalid logits.*NaN"):
            list(r.stream())
    assert len(_tokens(b)) == 6  # its rows were fine: it finishes
    assert s.state == "failed" and len(faults) == 1 and "ntx-admin model load" in faults[0]
    with pytest.raises(errors.NotReady, match="Fake Llama.*ntx-admin model load"):
        s.schedule([1], GREEDY, max_tokens=1)
    s.detach()
    s.attach(FakeEngine(tokenizer, slots=2))  # a good load
    assert s.state == "serving"
    d = s.schedule([1], GREEDY, max_tokens=2)
    for _ in range(4):
        iterate(s)
    assert len(_tokens(d)) == 2


def test_inf_logits_of_a_whole_row_are_a_model_fault_too(tokenizer):
    s, engine = make(tokenizer, max_batch=2)
    r = s.schedule([1, 2], SamplingParams(repetition_penalty=1.1, seed=1), max_tokens=3)  # whole rows
    engine.fault = lambda items, out: out.__setitem__((0, 5), np.inf)
    iterate(s)
    iterate(s)
    with pytest.raises(errors.ModelFault, match=r"\+inf"):
        list(r.stream())
    assert s.state == "failed"


class _Pings:
    def __init__(self):
        self.n = 0

    def watchdog(self):
        self.n += 1


def test_watchdog_is_pinged_only_while_iterations_get_through(tokenizer):
    pings = _Pings()
    s = Scheduler(config=DaemonConfig(socket="/tmp/x.sock"), notifier=pings)
    s.attach(FakeEngine(tokenizer, slots=2))

    def broken():
        raise RuntimeError("the loop itself is broken")
    s.start()
    try:
        end = time.monotonic() + 5
        while pings.n < 2 and time.monotonic() < end:  # idle iterations ping
            time.sleep(0.01)
        assert pings.n >= 2
        s.admit = broken
        time.sleep(0.1)  # an iteration under way when it broke may still ping
        n = pings.n
        time.sleep(1.2)
        assert pings.n == n
        del s.admit
        end = time.monotonic() + 5
        while pings.n == n and time.monotonic() < end:
            time.sleep(0.01)
        assert pings.n > n
    finally:
        s.stop()


def test_the_speculation_cost_table_is_measured_when_first_needed(tokenizer, monkeypatch):
    from ntransformerd.engine import speculative
    calls = []

    def step_costs(engine, draft_engine=None):
        calls.append(engine)
        return speculative.StepCosts({1: 1.0, 2: 1.1, 4: 1.5})
    monkeypatch.setattr(speculative, "step_costs", step_costs)
    s, engine = make(tokenizer, max_batch=2)  # the daemon's default: no speculation
    for _ in range(2):
        assert iterate(s) == "idle"
    assert calls == [] and s.costs is None  # loads and idle time pay nothing
    r = s.schedule([1, 2, 3], GREEDY, max_tokens=2, speculative="ngram")
    assert r.state == "queued"
    iterate(s)
    assert calls == [engine] and r.state != "queued"  # measured first, then admitted
    assert r.speculator.costs.verify == {1: 1.0, 2: 1.1, 4: 1.5}
    r.cancel()
    iterate(s)
    s.schedule([4, 5], GREEDY, max_tokens=2, speculative="ngram")
    iterate(s)
    assert len(calls) == 1  # once per model

    s, engine = make(tokenizer, max_batch=2, speculative="ngram")  # speculating by default
    iterate(s)
    assert calls[-1] is engine and s.costs is not None  # measured on the first idle iteration
