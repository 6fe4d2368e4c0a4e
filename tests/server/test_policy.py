"""The scheduler's policy (server/policy.py) on records alone: no thread, lock, engine or model.
Who is admitted, what a step holds, when a step runs ahead, who is preempted; and the module
imports nothing that runs threads, talks gRPC or touches the engine."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

from ntransformerd.server import policy
from ntransformerd.server.policy import Queued, Room, Row, Running, admits, compose, victim

ROOM = Room(max_batch=4, slots_open=4, blocks_free=10)


def decoding(key, **kw) -> Running:
    return Running(key, decoding=True, **kw)


def prefilling(key, left, **kw) -> Running:
    return Running(key, decoding=False, left=left, **kw)


# ---- admission ---------------------------------------------------------------------------------

def test_the_head_is_admitted_while_the_batch_a_slot_and_the_blocks_have_room():
    assert admits(Queued(blocks=3), [], ROOM)
    two = [decoding(1, owed_blocks=2), decoding(2, owed_blocks=3)]
    assert admits(Queued(blocks=5), two, ROOM)  # 5 + 2 + 3 owed = 10 free
    assert not admits(Queued(blocks=6), two, ROOM)  # one block short: it waits for a request to leave
    assert admits(Queued(blocks=50), [], ROOM)  # alone it runs (or fails) whatever it needs
    assert not admits(Queued(blocks=1), [decoding(k) for k in range(4)], ROOM)  # max_batch
    assert not admits(Queued(blocks=1), [], Room(4, slots_open=0, blocks_free=10))  # no slot


def test_the_head_waits_for_the_cost_table_and_a_preempted_one_for_requests_to_leave():
    assert not admits(Queued(blocks=1, waits_for_costs=True), [], ROOM)
    running = [decoding(1), decoding(2)]
    assert not admits(Queued(blocks=1, resume_below=2), running, ROOM)
    assert admits(Queued(blocks=1, resume_below=3), running, ROOM)


# ---- what a step holds ----------------------------------------------------------------------------

def test_decoders_first_then_prompt_chunks_oldest_first_within_the_budget():
    running = [prefilling(1, left=100), decoding(2), prefilling(3, left=5), decoding(4, ready=False), decoding(5)]
    assert compose(running, prefill_chunk=8) == [Row(2, 1), Row(5, 1), Row(1, 8)]
    assert compose(running, prefill_chunk=103) == [Row(2, 1), Row(5, 1), Row(1, 100), Row(3, 3)]
    assert compose([prefilling(1, left=0)], prefill_chunk=8) == [Row(1, 1)]  # its prompt is in: its last token


@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_the_prompt_chunks_never_pass_the_budget(chunk):
    running = [prefilling(k, left=k * 5 + 1) for k in range(1, 8)]
    rows = compose(running, prefill_chunk=chunk)
    assert sum(r.tokens for r in rows) == min(chunk, sum(r.left for r in running))
    assert [r.key for r in rows] == [r.key for r in running][:len(rows)]  # oldest first, none skipped


def test_a_prompt_whose_prefix_an_older_request_computes_waits_for_it():
    prompt = list(range(40))
    older = prefilling(1, left=32, prompt=prompt, prefilled=8, scope="uid:1")
    younger = prefilling(2, left=40, prompt=prompt[:30] + [99] * 10, prefilled=0, scope="uid:1")
    assert compose([older, younger], prefill_chunk=64) == [Row(1, 32)]  # it copies them next iteration
    other_scope = prefilling(2, left=40, prompt=younger.prompt, scope="uid:2")
    no_cache = prefilling(2, left=40, prompt=younger.prompt, scope=None)
    for r in (other_scope, no_cache):
        assert compose([older, r], prefill_chunk=64) == [Row(1, 32), Row(2, 32)]
    caught_up = prefilling(2, left=10, prompt=younger.prompt, prefilled=30, scope="uid:1")
    assert compose([older, caught_up], prefill_chunk=64) == [Row(1, 32), Row(2, 10)]


# ---- running ahead and preemption --------------------------------------------------------------------

def test_overlapped_the_next_step_holds_what_does_not_wait_for_the_step_in_flight():
    """A device runs step n while step n+1 is composed: a plain decode row in flight runs ahead
    (its token the draw still on the device); a row in flight that needs its draws (a verified
    draft, a prompt chunk) waits; nothing to run means: finish step n first."""
    plain = [decoding(1, in_flight=True, runs_ahead=True), decoding(2, in_flight=True, runs_ahead=True)]
    assert compose(plain, 8, overlap=True) == [Row(1, 1), Row(2, 1)]
    assert compose(plain + [decoding(3)], 8, overlap=True) == [Row(1, 1), Row(2, 1), Row(3, 1)]  # 3 joins
    spec = decoding(3, in_flight=True, host=True)
    chunk = prefilling(4, left=20, in_flight=True)
    assert compose(plain + [spec, chunk], 8, overlap=True) == [Row(1, 1), Row(2, 1)]  # 3 and 4 wait for their step
    assert compose([spec, chunk], 8, overlap=True) == []  # nothing composed: finish the step in flight
    assert compose([spec, chunk], 8) == [Row(3, 1), Row(4, 8)]  # no overlap: every step runs whole


def test_overlapped_rows_that_need_the_host_take_turns_with_the_others():
    """A step whose logits go to the host holds no request in flight (they would all wait for
    it): host rows and the others alternate, and where every row needs the host, two halves do."""
    p1, p2 = decoding(1, runs_ahead=False), decoding(2)
    s3, s4, s5 = decoding(3, host=True), decoding(4, host=True), decoding(5, host=True)
    assert compose([p1, p2, s3, s4], 8, overlap=True) == [Row(1, 1), Row(2, 1)]  # nothing in flight: the others first
    flying = [decoding(1, in_flight=True, runs_ahead=True), decoding(2, in_flight=True, runs_ahead=True), s3, s4]
    assert compose(flying, 8, overlap=True) == [Row(3, 1), Row(4, 1)]  # 1 and 2 are finished meanwhile
    back = [p1, p2, decoding(3, in_flight=True, host=True), decoding(4, in_flight=True, host=True)]
    assert compose(back, 8, overlap=True) == [Row(1, 1), Row(2, 1)]
    assert compose([s3, s4, s5], 8, overlap=True) == [Row(3, 1), Row(4, 1)]  # the older half
    assert compose([s3, decoding(4, in_flight=True, host=True), s5], 8, overlap=True) == [Row(3, 1), Row(5, 1)]
    assert compose([s3], 8, overlap=True) == [Row(3, 1)]  # alone: nothing to alternate with
    assert compose([s3, s4, s5], 8) == [Row(3, 1), Row(4, 1), Row(5, 1)]


def test_the_youngest_yields_its_blocks_and_one_alone_yields_none():
    running = [decoding(1, admitted_at=5.0), decoding(2, admitted_at=9.0), decoding(3, admitted_at=7.0)]
    assert victim(running) == 2
    assert victim(running[:1]) is None


def test_the_cost_table_is_measured_when_a_request_waits_or_the_idle_daemon_speculates():
    assert policy.measures_costs(queued_speculating=1, speculates_by_default=False, running=3)
    assert policy.measures_costs(queued_speculating=0, speculates_by_default=True, running=0)
    assert not policy.measures_costs(queued_speculating=0, speculates_by_default=True, running=1)
    assert not policy.measures_costs(queued_speculating=0, speculates_by_default=False, running=0)


# ---- what it imports --------------------------------------------------------------------------------

FORBIDDEN = ("threading", "queue", "concurrent", "multiprocessing", "grpc", "ntransformerd.engine", "ntx_proto",
             "numpy")


def test_common_prefix_counts_the_ids_two_sequences_share_as_one_at_a_time_does():
    """common_prefix compares runs of ids at once (doubling, then halving to the difference):
    its count is the one of comparing id by id, wherever the first difference lies, at every
    length around its run sizes, for a list against a list or a tuple."""
    def one_at_a_time(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n
    for size in (0, 1, 2, 15, 16, 17, 31, 32, 33, 47, 48, 49, 100, 1000, 1025):
        a = [7 + i % 5 for i in range(size)]
        for at in sorted({0, 1, size // 3, size // 2, size - 2, size - 1, size}):
            if not 0 <= at <= size:
                continue
            b = a[:at] + [99] + a[at + 1:]
            for other in (b, b[:at], b + [1, 2], tuple(b)):
                assert policy.common_prefix(a, other) == one_at_a_time(a, other), (size, at, other)
                assert policy.common_prefix(other, a) == one_at_a_time(other, a), (size, at, other)


def test_the_policy_imports_no_thread_grpc_or_engine_module():
    path = pathlib.Path(policy.__file__)
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
    assert not [n for n in names if n.startswith(FORBIDDEN)], names
    # and nothing it imports brings one in
    probe = ("import sys, ntransformerd.server.policy; "
             f"print(sorted(m for m in sys.modules if m.startswith({FORBIDDEN!r})))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
