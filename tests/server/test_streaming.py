"""The streaming thread (server/streaming.py) and the step runner's view of the step in flight
(server/steps.py): a step's rows handed over at once still reach every stream whole and in
order, whether its reader keeps up or falls behind, or reads at most once an interval."""

from __future__ import annotations

import queue
import threading
import types

from ntransformerd.server.request import Request
from ntransformerd.server.steps import StepRunner
from ntransformerd.server.streaming import Streamer


class _Text:
    """decode.Text's surface: each token's text is its id in brackets."""

    def push(self, token: int, finish):
        return f"[{token}]", finish


def _request(rid: int):
    r = types.SimpleNamespace(id=rid, text=_Text(), text_done=False, ended=False, completion_tokens=0,
                              prompt_ids=[rid], seq=types.SimpleNamespace(prompt_logprobs=None),
                              outputs=queue.SimpleQueue(), t_done=None, last_queued=threading.Event())
    r.usage = lambda: {"completion_tokens": r.completion_tokens}
    return r


def _steps(reqs, n_steps: int):
    """n_steps steps of every request: request k accepts tokens 100k+i (two in every third step,
    as a verify step would), the last step ends each with "length"."""
    steps, next_id = [], {r.id: 0 for r in reqs}
    for i in range(n_steps):
        step = []
        for r in reqs:
            n = 2 if i % 3 == 0 else 1
            toks = [100 * r.id + next_id[r.id] + j for j in range(n)]
            next_id[r.id] += n
            step.append((r, toks, None, "length" if i == n_steps - 1 else None))
        steps.append(step)
    return steps, next_id


def _read(r, interval: float = 0.0) -> list:
    return list(Request.stream(r, interval=interval))


def test_a_steps_rows_handed_over_at_once_reach_every_stream_in_order():
    streamer = Streamer(on_error=lambda r, e: (_ for _ in ()).throw(e))
    streamer.start()
    reqs = [_request(k) for k in range(1, 6)]
    steps, counts = _steps(reqs, 40)
    for step in steps:
        streamer.send(step)
    streamer.send([])  # a step that accepted nothing hands nothing over
    for r in reqs:
        streamer.end(r, None)
    streamer.stop()
    for r in reqs:
        outs = _read(r)  # read after the whole run: every output queued, so they come as one
        ids = [t for o in outs for t in o.token_ids]
        assert ids == [100 * r.id + i for i in range(counts[r.id])]
        assert "".join(o.text for o in outs) == "".join(f"[{t}]" for t in ids)
        assert outs[0].prompt_ids == [r.id] and outs[-1].finish_reason == "length"
        assert outs[-1].usage == {"completion_tokens": counts[r.id]}


def test_a_reader_that_keeps_up_and_one_that_lags_get_the_same_tokens():
    streamer = Streamer(on_error=lambda r, e: (_ for _ in ()).throw(e))
    streamer.start()
    fast, slow = _request(1), _request(2)
    steps, counts = _steps([fast, slow], 60)
    got: list = []
    reader = threading.Thread(target=lambda: got.extend(_read(fast)))
    reader.start()
    for step in steps:
        streamer.send(step)
    for r in (fast, slow):
        streamer.end(r, None)
    reader.join(30)
    streamer.stop()
    late = _read(slow)
    for r, outs in ((fast, got), (slow, late)):
        assert [t for o in outs for t in o.token_ids] == [100 * r.id + i for i in range(counts[r.id])]
        assert [o.finish_reason for o in outs].count("length") == 1 and outs[-1].finish_reason == "length"


def test_inline_streaming_writes_the_step_at_once_in_order():
    streamer = Streamer(on_error=lambda r, e: (_ for _ in ()).throw(e), inline=True)
    reqs = [_request(k) for k in range(1, 4)]
    steps, counts = _steps(reqs, 5)
    for step in steps:
        streamer.send(step)
        assert all(not r.outputs.empty() for r in reqs)  # written before send returned
    for r in reqs:
        streamer.end(r, None)
        assert [t for o in _read(r) for t in o.token_ids] == [100 * r.id + i for i in range(counts[r.id])]


def test_a_reader_with_an_interval_gets_the_steps_of_that_time_as_one_output():
    streamer = Streamer(on_error=lambda r, e: (_ for _ in ()).throw(e), inline=True)
    r = _request(1)
    steps, counts = _steps([r], 6)
    outs = Request.stream(r, interval=0.001)
    streamer.send(steps[0])
    assert next(outs).token_ids == [100, 101]  # the first output goes at once
    for step in steps[1:3]:  # two steps while the reader waits out its interval
        streamer.send(step)
    assert next(outs).token_ids == [102, 103]
    for step in steps[3:]:
        streamer.send(step)
    streamer.end(r, None)
    rest = list(outs)
    assert [t for o in rest for t in o.token_ids] == [104 + i for i in range(counts[1] - 4)]
    assert rest[-1].finish_reason == "length"


def test_the_last_output_ends_an_intervals_wait():
    """A reader that waits an hour between outputs still gets the last one, and the stream's
    end, as soon as they are queued (the streaming thread sets last_queued)."""
    streamer = Streamer(on_error=lambda r, e: (_ for _ in ()).throw(e), inline=True)
    done, cut = _request(1), _request(2)
    (first, last), _ = _steps([done], 2)
    for r, end in ((done, lambda: (streamer.send(last), streamer.end(done, None))),
                   (cut, lambda: streamer.end(cut, None))):
        outs = Request.stream(r, interval=3600.0)
        streamer.send(first if r is done else [(cut, [200], None, None)])
        next(outs)
        assert not r.last_queued.is_set()
        end()
        assert r.last_queued.is_set()
        rest = list(outs)  # waits for nothing: the wait ends with the last output
        if r is done:
            assert [o.finish_reason for o in rest] == ["length"]
        else:
            assert rest == []


def _row(tokens: int, decoding: bool):
    return types.SimpleNamespace(tokens=[7] * tokens, seq=types.SimpleNamespace(decoding=decoding))


def test_the_step_in_flight_names_its_requests_and_their_prompt_positions():
    runner = StepRunner(streamer=None, metrics=None, preempt=lambda e: False, fail=lambda r, e, d: None)
    a, b, c = (types.SimpleNamespace(id=k) for k in (1, 2, 3))
    assert runner.in_flight is None and runner.prompt_in_flight(a) == 0
    prefilling = _row(5, decoding=False)
    runner.pending = (object(), [(a, _row(1, decoding=True)), (b, prefilling)])
    assert runner.in_flight == frozenset({1, 2})
    assert runner.prompt_in_flight(a) == 0  # a decode row holds no prompt positions
    assert runner.prompt_in_flight(b) == 5
    assert runner.prompt_in_flight(c) == 0  # not in the step
    prefilling.seq.decoding = True  # its prompt is all in (as after a restart's replay): asked anew each time
    assert runner.prompt_in_flight(b) == 0
    runner.pending = None
    assert runner.in_flight is None and runner.prompt_in_flight(b) == 0
