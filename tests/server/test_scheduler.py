"""The scheduler's rules on a fake engine (fast): bounded queue, chunked prefill that does not
stall decoders, cancellation and deadlines within one step, drain, stop strings found on the
streaming thread."""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
import types

import numpy as np
import pytest

from ntransformerd.config import DaemonConfig
from ntransformerd.engine.generation import decode
from ntransformerd.engine.generation.decode import generate
from ntransformerd.engine.runtime.engine import Engine, EngineConfig, Launch, Ran
from ntransformerd.engine.generation.sampler import SamplingParams, TopLogits, sample_rows
from ntransformerd.engine.generation.speculative import Mode
from ntransformerd.server import errors, policy
from ntransformerd.server.callers import Caller
from ntransformerd.server.prefix_cache import scope
from ntransformerd.server.scheduler import Output, Request, Scheduler
from ntransformerd.server.systemd import Notifier
from ntx_proto.states import RequestState, ServingState


class FakeEngine:
    """The engine API the scheduler uses (server/served.py); the next token is a function of the
    last one. It keeps no prefix (no park, reopen or copy_prefix): its schedulers run with
    prefix_cache=False."""

    def __init__(self, tokenizer, *, slots: int, max_ctx: int = 512):
        self.tokenizer, self.max_ctx = tokenizer, max_ctx
        self.backend = types.SimpleNamespace(is_host=False)  # a device's steps: text on the streaming thread
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
        # whole slots: no blocks to count (kv_cache.SlotTable's answers)
        return types.SimpleNamespace(free_slots=len(self.free), blocks_for=lambda n: 0, available=lambda: 0,
                                     kept=lambda slot: self.max_ctx)

    def launch(self, items, *, sample=None, all_logits=False, top=None, after=None, rows=None):
        """Engine.launch as a host backend runs it: at once, after's draws as the tokens."""
        if after is not None:
            ids = after.result().ids
            items = [(slot, [int(ids[j])]) if j >= 0 else (slot, t) for (slot, t), j in zip(items, rows)]
        return Launch(Ran(self.step(items, sample=sample, all_logits=all_logits, top=top)))

    @property
    def free_slots(self):
        return len(self.free)

    def open(self):
        slot = self.free.pop(0)
        self.lengths[slot] = 0
        return slot

    def close(self, slot):
        del self.lengths[slot]
        self.free.append(slot)

    def length(self, slot):
        return self.lengths[slot]

    def truncate(self, slot, n):
        self.lengths[slot] = n

    def step(self, items, *, top=None, sample=None, all_logits=False):
        time.sleep(self.delay)
        self.steps.append([(s, len(t)) for s, t in items])
        self.tops.append(top)
        rows = [list(t) if all_logits else [t[-1]] for _, t in items]
        out = np.zeros((sum(map(len, rows)), self.cfg.vocab_size), np.float32)
        k = 0
        for slot, tokens in items:
            self.lengths[slot] += len(tokens)
        for toks in rows:
            for t in toks:
                out[k, 1000 + (t * 7) % 1000] = 1.0  # ids 1000..1999: no end-of-generation
                k += 1
        if self.fault is not None:
            self.fault(items, out)
        out = out if top is None else TopLogits.of(out, top)
        return out if sample is None else sample_rows(out, sample)


@pytest.fixture(scope="module")
def tokenizer(default_model):
    from ntransformerd.engine.generation.tokenizer import Tokenizer
    return Tokenizer.from_metadata(default_model.metadata)


def make(tokenizer, **cfg):
    config = DaemonConfig(socket="/tmp/x.sock", prefix_cache=False, **cfg)
    s = Scheduler(config=config, notifier=Notifier(environ={}))
    engine = FakeEngine(tokenizer, slots=config.max_batch)
    s.attach(engine)
    s.lifecycle.serving()  # what the daemon does once it attached a model
    return s, engine


def iterate(s: Scheduler) -> str:
    """One iteration of the scheduler loop, on this thread."""
    return s.iterate()


def iterate_until_done(s: Scheduler, reqs, limit: int, after=None) -> None:
    """Iterations on this thread until every request is done, at most `limit`; `after` runs after each."""
    for _ in range(limit):
        if all(r.state == RequestState.DONE for r in reqs):
            return
        s.iterate()
        if after is not None:
            after()


GREEDY = SamplingParams.greedy(ignore_eos=True)


def test_queue_past_its_bound_is_queue_full(tokenizer):
    s, _ = make(tokenizer, max_batch=2, max_queue=1)
    for _ in range(3):
        s.schedule([1, 2, 3], GREEDY, max_tokens=4)
    with pytest.raises(errors.QueueFull, match="max_queue"):
        s.schedule([1, 2, 3], GREEDY, max_tokens=4)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_long_prompt_is_chunked_and_decoders_advance_every_step(tokenizer, overlap):
    """Overlapped, each step is finished one iteration later: the decoder's first token (its
    prompt's last chunk) is still in flight when the long prompt's first chunk is launched, and
    the long prompt's last chunk is finished an iteration later; its chunks follow one another
    while the one before is in flight."""
    s, engine = make(tokenizer, max_batch=4, prefill_chunk=8)
    s.overlap = overlap
    short = s.schedule([5, 6], GREEDY, max_tokens=30)
    iterate(s)  # short prefills and samples its first token
    long = s.schedule(list(range(10, 110)), GREEDY, max_tokens=2)
    for _ in range(13 + overlap):
        iterate(s)
    assert long.state == RequestState.DECODE and long.prefilled == 100
    for step in engine.steps[1 + overlap:14 + overlap]:
        assert (short.slot, 1) in step  # the decoder got its token in every step
        assert sum(n for slot, n in step if slot == long.slot) <= 8  # the prompt in chunks of 8
    assert short.generated == 14 - overlap


def test_batched_outputs_equal_solo_outputs(tokenizer):
    prompts = [[5, 6], list(range(10, 40)), [7], list(range(50, 61))]
    solo = []
    for p in prompts:
        s, _ = make(tokenizer, max_batch=1)
        r = s.schedule(p, GREEDY, max_tokens=6)
        while r.state != RequestState.DONE:
            iterate(s)
        solo.append([i for o in r.stream() for i in o.token_ids])
    s, _ = make(tokenizer, max_batch=4, prefill_chunk=16)
    reqs = [s.schedule(p, GREEDY, max_tokens=6) for p in prompts]
    while any(r.state != RequestState.DONE for r in reqs):
        iterate(s)
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
    s = Scheduler(config=DaemonConfig(socket="/tmp/x.sock", prefix_cache=False), notifier=Notifier(environ={}))
    assert s.lifecycle.status().progress == "starting"
    with pytest.raises(errors.NotReady, match="ntransformerd is starting.*--wait"):
        s.schedule([1], GREEDY, max_tokens=1)
    s.lifecycle.loading("loading layer 3/30", 0.1)
    with pytest.raises(errors.NotReady, match="loading layer 3/30"):
        s.tokenize(text="hi")
    s.attach(FakeEngine(tokenizer, slots=1))
    s.lifecycle.serving()
    s.detach()
    s.lifecycle.no_model()
    with pytest.raises(errors.NotReady, match="no model is loaded"):
        s.schedule([1], GREEDY, max_tokens=1)


def test_drain_refuses_new_work_and_cancels_what_does_not_finish(tokenizer):
    s, engine = make(tokenizer, max_batch=2)
    engine.delay = 0.01
    r = s.schedule([1, 2, 3], GREEDY, max_tokens=500)  # 5 s of steps
    s.start()
    try:
        s.lifecycle.draining("ntransformerd is shutting down")  # Daemon.drain: no new requests, then wait
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
    assert a.generated == 3 and a.state != RequestState.DECODE


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
    assert len(engine.free) == 4 and s.lifecycle.state == ServingState.SERVING


def test_a_request_whose_sampling_raises_fails_alone(tokenizer):
    s, engine = make(tokenizer, max_batch=4)
    a = s.schedule([1, 2, 3], GREEDY, max_tokens=6)
    b = s.schedule([4, 5], GREEDY, max_tokens=6)

    def broken(tokens):
        raise KeyError("the sequence lost its table")
    a.seq.accept = broken
    for _ in range(10):
        iterate(s)
    assert a.state == b.state == RequestState.DONE
    with pytest.raises(errors.EngineFailed, match="sampling its next token.*KeyError"):
        list(a.stream())
    assert len(_tokens(b)) == 6 and len(engine.free) == 4


def test_invalid_logits_fail_their_requests_and_stop_serving_the_model(tokenizer):
    faults = []
    s, engine = make(tokenizer, max_batch=2)
    s.overlap = False  # the step a fault lands in is pinned by iteration: steps finished where they run
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
    assert s.lifecycle.state == ServingState.FAILED and len(faults) == 1 and "ntx-admin model load" in faults[0]
    with pytest.raises(errors.NotReady, match="Fake Llama.*ntx-admin model load"):
        s.schedule([1], GREEDY, max_tokens=1)
    s.detach()
    s.attach(FakeEngine(tokenizer, slots=2))  # a good load
    s.lifecycle.serving()
    d = s.schedule([1], GREEDY, max_tokens=2)
    for _ in range(6):  # overlapped again (attach): each step finished an iteration later
        iterate(s)
    assert len(_tokens(d)) == 2


def test_inf_logits_of_a_whole_row_are_a_model_fault_too(tokenizer):
    s, engine = make(tokenizer, max_batch=2)
    r = s.schedule([1, 2], SamplingParams(repetition_penalty=1.1, seed=1), max_tokens=3)  # whole rows
    engine.fault = lambda items, out: out.__setitem__((0, 5), np.inf)
    iterate(s)  # launched (overlap: the fake is a device)
    iterate(s)  # finished: the draw fails
    iterate(s)  # retired
    with pytest.raises(errors.ModelFault, match=r"\+inf"):
        list(r.stream())
    assert s.lifecycle.state == ServingState.FAILED


class _Pings:
    def __init__(self):
        self.n = 0

    def watchdog(self):
        self.n += 1


def test_watchdog_is_pinged_only_while_iterations_get_through(tokenizer):
    pings = _Pings()
    s = Scheduler(config=DaemonConfig(socket="/tmp/x.sock", prefix_cache=False), notifier=pings)
    s.attach(FakeEngine(tokenizer, slots=2))
    s.lifecycle.serving()

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
    from ntransformerd.engine.generation import speculative
    calls = []

    def step_costs(engine, draft_engine=None):
        calls.append(engine)
        return speculative.StepCosts({1: 1.0, 2: 1.1, 4: 1.5})
    monkeypatch.setattr(speculative, "step_costs", step_costs)
    s, engine = make(tokenizer, max_batch=2)  # the daemon's default: no speculation
    for _ in range(2):
        assert iterate(s) == "idle"
    assert calls == [] and s.costs is None  # loads and idle time pay nothing
    r = s.schedule([1, 2, 3], GREEDY, max_tokens=2, speculative=Mode.parse("ngram"))
    assert r.state == RequestState.QUEUED
    iterate(s)
    assert calls == [engine] and r.state != RequestState.QUEUED  # measured first, then admitted
    assert r.speculator.costs.verify == {1: 1.0, 2: 1.1, 4: 1.5}
    r.cancel()
    iterate(s)
    s.schedule([4, 5], GREEDY, max_tokens=2, speculative=Mode.parse("ngram"))
    iterate(s)
    assert len(calls) == 1  # once per model

    s, engine = make(tokenizer, max_batch=2, speculative="ngram")  # speculating by default
    iterate(s)
    assert calls[-1] is engine and s.costs is not None  # measured on the first idle iteration


# ---- text off the loop: the streaming thread ---------------------------------------------------

def _pieces(tokenizer, n: int) -> tuple[list[int], list[str]]:
    """The fake engine's first n tokens after [5, 6] and the text each adds (each step's Output as
    queued: Request.stream would join them)."""
    s, _ = make(tokenizer, max_batch=1)
    r = s.schedule([5, 6], GREEDY, max_tokens=n)
    while r.state != RequestState.DONE:
        iterate(s)
    s.stop()
    outs = list(iter(r.outputs.get_nowait, None))
    return [i for o in outs for i in o.token_ids], [o.text for o in outs]


def test_a_stop_string_found_while_streaming_ends_the_request_as_if_at_once(tokenizer):
    ids, texts = _pieces(tokenizer, 12)
    k = next(i for i in range(3, 12) if texts[i].strip())  # a token whose text can be a stop string
    stop = texts[k].strip()
    s, engine = make(tokenizer, max_batch=2)
    params = SamplingParams.greedy(ignore_eos=True, stop=(stop,))
    r = s.schedule([5, 6], params, max_tokens=12)
    other = s.schedule([7], GREEDY, max_tokens=12)
    while r.state != RequestState.DONE:
        iterate(s)
    outs = list(r.stream())
    got = [i for o in outs for i in o.token_ids]
    first = next(i for i, t in enumerate(texts) if stop in "".join(texts[:i + 1]))
    assert got == ids[:first + 1], (got, ids)  # nothing the loop drew after the stop
    assert outs[-1].finish_reason == "stop" and stop not in "".join(o.text for o in outs)
    assert outs[-1].usage["completion_tokens"] == first + 1
    while other.state != RequestState.DONE:
        iterate(s)
    assert len(_tokens(other)) == 12 and len(engine.free) == 2


def test_slow_text_work_does_not_hold_the_steps_back(tokenizer):
    """Detokenizing and writing happen on the streaming thread: the loop's steps go on while a
    request's text is held back, and every piece still arrives, in order."""
    s, engine = make(tokenizer, max_batch=1)
    assert not s.streamer.inline
    r = s.schedule([5, 6], GREEDY, max_tokens=10)
    push, released, on_the_loop = r.text.push, threading.Event(), []
    loop = threading.current_thread()

    def held_back(token, finish):
        if threading.current_thread() is loop:
            on_the_loop.append(token)
        else:
            released.wait(120)  # a hang guard: released once the loop has run every step
        return push(token, finish)
    r.text.push = held_back
    while r.state != RequestState.DONE:  # all 10 steps while no piece of text has been written
        iterate(s)
    released.set()
    assert on_the_loop == [], "the loop wrote the text itself"
    outs = list(r.stream())
    assert [i for o in outs for i in o.token_ids] == _pieces(tokenizer, 10)[0]
    assert outs[-1].finish_reason == "length"


def test_on_a_host_backend_the_text_runs_inline_with_the_same_output(tokenizer):
    """A host backend's step takes every core: the text runs on the loop's thread after the step,
    and the outputs are the same."""
    want = _pieces(tokenizer, 8)
    config = DaemonConfig(socket="/tmp/x.sock", max_batch=1, prefix_cache=False)
    s = Scheduler(config=config, notifier=Notifier(environ={}))
    engine = FakeEngine(tokenizer, slots=1)
    engine.backend = types.SimpleNamespace(is_host=True)
    s.attach(engine)
    s.lifecycle.serving()
    assert s.streamer.inline
    r = s.schedule([5, 6], GREEDY, max_tokens=8)
    while r.state != RequestState.DONE:
        iterate(s)
    assert r.outputs.qsize() == 8 + 1  # written by the loop itself: every output and the end are there
    outs = list(iter(r.outputs.get_nowait, None))
    assert ([i for o in outs for i in o.token_ids], [o.text for o in outs]) == want


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.9, top_k=40, seed=11, ignore_eos=True)],
                         ids=["greedy", "sampled"])
def test_a_full_kv_pool_preempts_the_youngest_and_outputs_stay_those_of_solo_runs(default_model, params, overlap):
    """kv_blocks too small for every request at full length: the youngest request yields its
    blocks and recomputes later (Scheduler.preempt); every output is the one it gets alone, and
    none fails."""
    engine = Engine(default_model, config=EngineConfig(backend="cpu", max_batch=4, max_ctx=128, kv_blocks=9))
    prompts = [engine.tokenizer.encode(t) for t in ("The quick brown fox", "Once upon a time", "def main():",
                                                    "The capital of France is")]
    n = 40  # ~3-4 blocks of 16 positions each at the end: 4 requests need ~14 of the 9
    solo = [[ev.token for ev in generate(engine, p, dataclasses.replace(params, max_tokens=n))] for p in prompts]
    s = Scheduler(config=DaemonConfig(socket="/tmp/x.sock", max_batch=4, prefix_cache=False),
                  notifier=Notifier(environ={}))
    s.attach(engine)
    s.streamer.inline, s.overlap = False, overlap
    s.lifecycle.serving()
    preempted = []
    real = s.preempt
    s.preempt = lambda cause: preempted.append(cause) or real(cause)
    reqs = [s.schedule(p, params, max_tokens=n) for p in prompts]
    iterate_until_done(s, reqs, 2000)
    s.stop()
    got = [[t for o in r.stream() for t in o.token_ids] for r in reqs]
    assert preempted, "the pool never ran short: the test proves nothing"
    assert got == solo


def test_steps_launched_ahead_give_the_outputs_of_solo_runs(default_model, monkeypatch):
    """The overlapped loop (Scheduler.run launching step n+1 before step n's draws are taken; on
    a host backend each launch runs at once, the order of the bookkeeping is the device's):
    greedy and seeded requests, ends by EOS and by length found a step late, a stop string,
    requests joining mid-way: every output is the one it gets alone."""
    engine = Engine(default_model, config=EngineConfig(backend="cpu", max_batch=4, max_ctx=256))
    texts = ["The capital of France is", "Once upon a time", "def main():", "2 + 2 =", "My favourite colour is"]
    prompts = [engine.tokenizer.encode(t) for t in texts]
    params = [SamplingParams.greedy(max_tokens=24), SamplingParams(temperature=0.8, top_k=40, seed=5, max_tokens=30),
              SamplingParams.greedy(max_tokens=7), SamplingParams(temperature=1.2, top_k=20, top_p=0.9, seed=9,
                                                                  max_tokens=40, stop=("\n\n",)),
              SamplingParams.greedy(max_tokens=16, stop=(" the",))]
    solo = ["".join(ev.text for ev in generate(engine, p, q)) for p, q in zip(prompts, params)]
    s = Scheduler(config=DaemonConfig(socket="/tmp/x.sock", max_batch=4, prefix_cache=False),
                  notifier=Notifier(environ={}))
    s.attach(engine)
    s.streamer.inline, s.overlap = False, True
    s.lifecycle.serving()
    launched, ended = [], []
    real = decode.launch
    monkeypatch.setattr(decode, "launch", lambda *a, **k: launched.append(1) or real(*a, **k))
    close, reqs = s.prefix.close, []

    def check(slot, tokens, **kw):  # an ended sequence's slot holds its tokens but the last, none past its end
        r = next(q for q in reqs if q.slot == slot)
        if r.seq.finish is not None:
            ended.append(r.seq.finish)
            assert engine.length(slot) == len(r.seq.history) - 1, r.seq.finish
        close(slot, tokens, **kw)
    s.prefix.close = check  # where a retired request's slot goes back
    try:
        reqs += [s.schedule(p, q, max_tokens=q.max_tokens) for p, q in zip(prompts, params)]
        iterate_until_done(s, reqs, 3000)
    finally:
        s.stop()
    got = ["".join(o.text for o in r.stream()) for r in reqs]
    assert len(launched) > 20, "no step was launched ahead: the test proves nothing"
    assert got == solo
    assert len(ended) >= 3 and engine.kv.free_slots == 4


def test_outputs_queued_behind_a_busy_reader_come_as_one_with_the_same_text():
    r = types.SimpleNamespace(outputs=queue.Queue())
    for k in range(3):
        r.outputs.put(Output([k], f"t{k}", prompt_ids=[9] if k == 0 else None, logprobs=[(k, -1.0, [], [])]))
    r.outputs.put(Output([3], "!", finish_reason="length", usage={"n": 4}, logprobs=[(3, -2.0, [], [])]))
    r.outputs.put(None)
    (one,) = list(Request.stream(r))
    assert one.token_ids == [0, 1, 2, 3] and one.text == "t0t1t2!" and one.prompt_ids == [9]
    assert [lp[0] for lp in one.logprobs] == [0, 1, 2, 3] and one.finish_reason == "length" and one.usage == {"n": 4}
    r.outputs.put(Output([5], "a"))
    r.outputs.put(errors.Cancelled("gone"))
    got = []
    with pytest.raises(errors.Cancelled):
        for o in Request.stream(r):
            got.append(o.text)
    assert got == ["a"]  # what came before the error, then the error


def test_a_prompt_waits_for_blocks_instead_of_taking_them_from_running_requests(default_model):
    """A pool of 6 blocks and three prompts of 3 blocks each: two run, the third waits in the
    queue (not admitted, so nothing is preempted) until one leaves, then runs; every output is
    the one it gets alone."""
    engine = Engine(default_model, config=EngineConfig(backend="cpu", max_batch=4, max_ctx=128, kv_blocks=6))
    text = "The history of the city begins with a small village by the river, where fishermen and traders met"
    ids = engine.tokenizer.encode(text * 3)
    prompts = [ids[k:k + 40] for k in (0, 3, 7)]  # 40 positions: 3 blocks of 16 each
    params = SamplingParams.greedy(max_tokens=4)
    solo = [[ev.token for ev in generate(engine, p, params)] for p in prompts]
    s = Scheduler(config=DaemonConfig(socket="/tmp/x.sock", max_batch=4, prefix_cache=False),
                  notifier=Notifier(environ={}))
    s.attach(engine)
    s.streamer.inline = False
    s.lifecycle.serving()
    preempted, queued_behind = [], []
    real = s.preempt
    s.preempt = lambda cause: preempted.append(cause) or real(cause)
    reqs = [s.schedule(p, params, max_tokens=4) for p in prompts]
    iterate_until_done(s, reqs, 500,
                       after=lambda: queued_behind.append(sum(1 for r in reqs if r.state == RequestState.QUEUED)))
    s.stop()
    got = [[t for o in r.stream() for t in o.token_ids] for r in reqs]
    assert queued_behind[0] == 1, queued_behind  # the first iteration admitted two: the third waited for blocks
    assert not preempted and got == solo



@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_every_kind_of_step_goes_through_the_overlapped_pipeline_with_solo_outputs(default_model, monkeypatch,
                                                                                   sampled):
    """Prompt chunks, plain decode rows and speculating rows (n-gram, a prefix self-draft, a
    skip self-draft) through the overlapped loop: verify steps and prompt chunks are launched
    while another step is in flight (decode.launch with `after`), and every request's ids are
    the ones it gets alone, synchronously (generate, with its own speculator of the same mode)."""
    from ntransformerd.engine.generation import speculative
    costs = speculative.StepCosts({1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1, 16: 1.2})
    engine = Engine(default_model, config=EngineConfig(backend="cpu", max_batch=5, max_ctx=256))
    texts = ["1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,", "The capital of France is",
             "The cat sat on the mat. The cat sat on the mat. The cat sat on the",
             "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return",
             "Once upon a time, once upon a time, there was a"]
    modes = ["ngram", None, "ngram", "prefix:12", "skip:8,12,16"]
    prompts = [engine.tokenizer.encode(t) for t in texts]
    n = 14

    def params(i):
        if sampled:
            return SamplingParams(temperature=0.9, top_k=40, seed=7 + i, max_tokens=n, ignore_eos=True)
        return SamplingParams.greedy(max_tokens=n, ignore_eos=True)

    def speculator(mode):
        return None if mode is None else speculative.Speculator(
            engine, speculative.make_draft(Mode.parse(mode), engine), costs=costs)
    solo = [[ev.token for ev in generate(engine, p, params(i), speculator=speculator(m))]
            for i, (p, m) in enumerate(zip(prompts, modes))]
    s = Scheduler(config=DaemonConfig(socket="/tmp/x.sock", max_batch=5, prefix_cache=False, prefill_chunk=8),
                  notifier=Notifier(environ={}))
    s.attach(engine, costs=costs)
    s.streamer.inline, s.overlap = False, True
    s.lifecycle.serving()
    launched = []  # per launch: (behind a step in flight, holds a verified draft, holds a prompt chunk)
    real = decode.launch

    def counting(engine_, rows, after=None, **kw):
        chunk = any(not r.seq.decoding for r in rows)
        out = real(engine_, rows, after, **kw)
        launched.append((after is not None, any(r.draft is not None and r.draft.tokens for r in rows), chunk))
        return out
    monkeypatch.setattr(decode, "launch", counting)
    try:
        reqs = [s.schedule(p, params(i), max_tokens=n, speculative=None if m is None else Mode.parse(m))
                for i, (p, m) in enumerate(zip(prompts, modes))]
        iterate_until_done(s, reqs, 3000)
    finally:
        s.stop()
    got = [[t for o in r.stream() for t in o.token_ids] for r in reqs]
    assert got == solo
    assert any(flying and verify for flying, verify, _ in launched), "no verify step was launched behind another"
    assert any(flying and chunk for flying, _, chunk in launched), "no prompt chunk was launched behind another step"
    assert s.speculation.status().accepted > 0


def test_the_cost_table_is_measured_with_no_step_in_flight(tokenizer, monkeypatch):
    """ensure_costs runs the engine: on a device the step in flight is finished first (its
    tokens streamed), so the measurement neither waits behind it nor runs beside it."""
    from ntransformerd.engine.generation import speculative
    s, engine = make(tokenizer, max_batch=2)
    assert s.overlap  # the fake is a device: steps are launched and finished an iteration later
    in_flight = []

    def step_costs(engine_, draft_engine=None):
        in_flight.append(s.runner.pending is not None)
        return speculative.StepCosts({1: 1.0, 2: 1.1, 4: 1.5})
    monkeypatch.setattr(speculative, "step_costs", step_costs)
    a = s.schedule([1, 2, 3], GREEDY, max_tokens=20)
    for _ in range(3):
        iterate(s)
    assert s.runner.pending is not None
    s.schedule([4, 5], GREEDY, max_tokens=2, speculative=Mode.parse("ngram"))
    iterate(s)
    assert in_flight == [False] and a.generated >= 2


def test_admission_sees_the_running_set_as_a_fresh_description_of_it(default_model, monkeypatch):
    """admit describes the running set once and appends each request it admits: every
    admission decision must see what a fresh description of the live requests says (their
    blocks owed included), as requests join a running one, in one iteration and over several."""
    engine = Engine(default_model, config=EngineConfig(backend="cpu", max_batch=6, max_ctx=128, kv_blocks=12))
    s = Scheduler(config=DaemonConfig(socket="/tmp/x.sock", max_batch=6, prefix_cache=False),
                  notifier=Notifier(environ={}))
    s.attach(engine)
    s.lifecycle.serving()
    seen = []
    real = policy.admits

    def admits(head, running, room):
        seen.append(([dataclasses.replace(x) for x in running], s._describe(s._live, owed=True, fresh=True)))
        return real(head, running, room)

    monkeypatch.setattr(policy, "admits", admits)
    ids = engine.tokenizer.encode("The history of the city begins with a small village by the river " * 4)
    first = s.schedule(ids[:20], SamplingParams.greedy(ignore_eos=True), max_tokens=6)
    iterate(s)
    reqs = [first] + [s.schedule(ids[k:k + 30], SamplingParams.greedy(ignore_eos=True), max_tokens=6)
                      for k in (1, 2, 3, 4, 5)]
    iterate_until_done(s, reqs, 200)
    s.stop()
    assert len(seen) >= 6 and any(len(got) > 1 for got, _ in seen)
    assert any(r.owed_blocks for got, _ in seen for r in got)  # what it checks is there to see
    for got, fresh in seen:
        assert got == fresh


def described_as_fresh(s: Scheduler, monkeypatch, during=None) -> list[policy.Running]:
    """Every description the policy is handed (admits, compose, victim) checked, when it is
    handed, against a fresh one of the same requests (_describe(fresh=True): each record made
    anew and described whole); `during(s)` runs after each admission (after retire, before
    compose: where another thread may cancel a request). The records it saw, as they were."""
    seen = []

    def check(running, owed):
        snapshot = [dataclasses.replace(x) for x in running]
        assert snapshot == s._describe(s._live, owed=owed, fresh=True)
        seen.extend(snapshot)

    real_admits, real_compose, real_victim = policy.admits, policy.compose, policy.victim

    def admits(head, running, room):
        check(running, True)
        return real_admits(head, running, room)

    def compose(running, prefill_chunk, *, overlap=False):
        check(running, False)
        return real_compose(running, prefill_chunk, overlap=overlap)

    def victim(running):
        check(running, False)
        return real_victim(running)

    monkeypatch.setattr(policy, "admits", admits)
    monkeypatch.setattr(policy, "compose", compose)
    monkeypatch.setattr(policy, "victim", victim)
    if during is not None:
        real_admit = s.admit
        monkeypatch.setattr(s, "admit", lambda: (real_admit(), during(s)))
    return seen


def test_kept_records_describe_the_running_set_as_fresh_ones_do_on_a_device(tokenizer, monkeypatch):
    """The loop keeps a policy.Running per live request and brings it up to date each step: the
    policy must see what a record made anew would say, as prompts are chunked behind a chunk in
    flight, decode rows run ahead or wait (penalties, log-probabilities), requests join, end and
    are cancelled between retire and compose."""
    s, engine = make(tokenizer, max_batch=6, prefill_chunk=8)
    assert s.overlap
    penalized = SamplingParams(repetition_penalty=1.2, seed=3, ignore_eos=True)
    reqs = [s.schedule(list(range(10, 30)), GREEDY, max_tokens=30),
            s.schedule(list(range(40, 52)), penalized, max_tokens=25),
            s.schedule(list(range(60, 70)), GREEDY, max_tokens=20, logprobs=2),
            s.schedule(list(range(100, 140)), GREEDY, max_tokens=12)]
    cancelled = []

    def during(s_):
        r = reqs[1]
        if not cancelled and r.generated >= 4:  # described as decoding for a few steps already
            r.cancel(errors.Cancelled("the caller went away"))
            cancelled.append(r)

    seen = described_as_fresh(s, monkeypatch, during)
    for _ in range(10):
        iterate(s)
    reqs += [s.schedule(list(range(200, 230)), GREEDY, max_tokens=15),
             s.schedule([5, 6, 7], penalized, max_tokens=8)]
    iterate_until_done(s, reqs, 400)
    s.stop()
    assert all(r.state == RequestState.DONE for r in reqs) and cancelled
    # what it checks is there to see
    assert any(r.decoding and r.in_flight and r.runs_ahead for r in seen)
    assert any(r.decoding and r.in_flight and r.ready and not r.runs_ahead for r in seen)
    assert any(not r.decoding and r.in_flight and r.runs_ahead for r in seen)  # a chunk behind a chunk
    assert any(r.decoding and not r.ready for r in seen)  # the cancelled one, before it retired
    assert any(r.host for r in seen) and any(r.owed_blocks == 0 for r in seen)


def test_kept_records_describe_the_running_set_as_fresh_ones_do_with_the_prefix_cache(default_model, monkeypatch):
    """As above on the CPU engine (steps launched ahead) with the prefix cache on: two callers'
    scopes, prompts copied from live requests (catch_up), a request that fails (it stops sharing
    its prefix) and a KV pool too small for all, so requests are preempted (policy.victim) and
    readmitted."""
    engine = Engine(default_model, config=EngineConfig(backend="cpu", max_batch=5, max_ctx=128, kv_blocks=10))
    s = Scheduler(config=DaemonConfig(socket="/tmp/x.sock", max_batch=5, prefill_chunk=16),
                  notifier=Notifier(environ={}))
    s.attach(engine)
    s.streamer.inline, s.overlap = False, True  # steps launched ahead, as on a device
    s.lifecycle.serving()
    alice, bob = Caller("uid:1001", uid=1001, gid=100), Caller("uid:1002", uid=1002, gid=100)
    ids = engine.tokenizer.encode("The history of the city begins with a small village by the river " * 4)
    failed = []

    def during(s_):
        r = reqs[2] if len(reqs) > 2 else None
        if not failed and r is not None and r.state == RequestState.PREFILL:
            s_.fail_request(r, errors.Cancelled("the stream broke"), "turning its tokens into text")
            failed.append(r)

    seen = described_as_fresh(s, monkeypatch, during)
    preempted = []
    real_preempt = s.preempt
    monkeypatch.setattr(s, "preempt", lambda cause: preempted.append(real_preempt(cause)) or preempted[-1])
    greedy = SamplingParams.greedy(ignore_eos=True)
    reqs = [s.schedule(ids[:36], greedy, max_tokens=30, caller=alice)]
    iterate(s)
    reqs += [s.schedule(ids[:20 + k], greedy, max_tokens=30, caller=alice if k % 2 else bob) for k in (1, 2, 3, 4)]
    iterate_until_done(s, reqs, 1000)
    s.stop()
    assert all(r.state == RequestState.DONE for r in reqs) and failed
    assert any(preempted)
    assert {r.scope for r in seen} >= {"uid:1001", "uid:1002", None}
    assert s.prefix.hit_tokens > 0 and any(r.owed_blocks for r in seen)


def test_a_requests_prefix_scope_is_its_callers_under_the_share_asked():
    """Request.scope keeps its caller's scope (the policy reads it every step): it is
    prefix_cache.scope's for whichever share is asked, the share changed included."""
    alice = Caller("uid:1001", uid=1001, gid=100, on_behalf_of="key:1")
    seq = types.SimpleNamespace(engine=types.SimpleNamespace(tokenizer=None), params=types.SimpleNamespace(stop=()))
    for caller in (alice, None):
        r = Request(seq, deadline=None, caller=caller)
        for share in ("none", "group", "all", "group", "none"):
            assert r.scope(share) == scope(caller, share)


def test_a_prompt_chunk_that_does_not_draw_leaves_the_steps_top_ids_alone(tokenizer):
    """A step asks for the most likely ids its drawing rows need: a prompt chunk that does not
    end its prompt draws nothing, so its sampler (penalties: whole rows) does not widen it until
    the chunk that ends it."""
    s, engine = make(tokenizer, max_batch=4, prefill_chunk=2)
    n_eog = len(tokenizer.eog_ids)
    s.schedule([5], GREEDY, max_tokens=12)
    iterate(s)
    s.schedule(list(range(10, 20)), SamplingParams(repetition_penalty=1.2, seed=2), max_tokens=3)
    for _ in range(6):
        iterate(s)
    mixed = [top for step, top in zip(engine.steps, engine.tops) if sorted(n for _, n in step) == [1, 2]]
    # the chunks before the last draw nothing; the last one draws, with penalties: whole rows
    assert len(mixed) >= 2 and mixed[:-1] == [1 + n_eog] * (len(mixed) - 1) and mixed[-1] is None, mixed
