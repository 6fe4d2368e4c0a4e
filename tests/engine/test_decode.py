"""decode.py's Sequence bookkeeping, checked against what it stands for (the decode loop itself
runs in tests/server/test_scheduler.py and test_decode_identity.py)."""

from __future__ import annotations

import types

import numpy as np

from ntransformerd.engine.generation.decode import Sequence
from ntransformerd.engine.generation.sampler import SamplingParams


def _engine(max_ctx: int = 64):
    return types.SimpleNamespace(max_ctx=max_ctx, cfg=types.SimpleNamespace(vocab_size=100),
                                 tokenizer=types.SimpleNamespace(eog_ids=frozenset({2})))


def test_decoding_is_what_prefilled_and_inputs_say_through_chunks_and_a_restart():
    """Sequence.decoding is kept beside prefilled, not computed: it must equal
    prefilled >= len(inputs) after every change of either (a chunk, the prefix cache's copy, a
    restart, a restart's own prompt)."""
    seq = Sequence(_engine(), [5, 6, 7, 8, 9], SamplingParams.greedy(ignore_eos=True), max_tokens=8)

    def check():
        assert seq.decoding == (seq.prefilled >= len(seq.inputs)), (seq.prefilled, len(seq.inputs))

    check()
    for n in (2, 4, 3, 5):  # chunks, and a prefix cache's copy setting it outright
        seq.prefilled = n
        check()
    assert seq.decoding
    seq.accept([11, 12, 13])
    check()
    seq.restart()  # its history is its prompt now: 8 positions, none in
    check()
    assert not seq.decoding and seq.prefilled == 0 and len(seq.inputs) == 8
    seq.prefilled += 7
    check()
    seq.prefilled += 1
    check()
    assert seq.decoding


def test_accept_ends_as_before_on_eos_budget_and_context():
    """accept's ends: an end-of-generation id, the token budget, the context (the token past it
    is accepted and ends the sequence unrun); numpy ids come back as ints."""
    eos = Sequence(_engine(), [5], SamplingParams.greedy(), max_tokens=8)
    assert eos.accept(np.array([3, 2, 4])) == [3, 2] and eos.finish == "eos"
    assert all(type(t) is int for t in eos.history)
    budget = Sequence(_engine(), [5], SamplingParams.greedy(ignore_eos=True), max_tokens=2)
    assert budget.accept([2, 3, 4]) == [2, 3] and budget.finish == "length"
    ctx = Sequence(_engine(max_ctx=3), [5, 6], SamplingParams.greedy(ignore_eos=True), max_tokens=8)
    assert ctx.accept([7]) == [7] and ctx.finish is None and ctx.free_positions() == 0
    assert ctx.accept([8, 9]) == [8] and ctx.finish == "length" and ctx.free_positions() < 0
