"""Speculation inside the daemon's continuous batching: concurrent requests, each with its own
draft, verified together, give exactly their solo non-speculative greedy outputs; status shows
the drafting; a mode the daemon cannot serve is a clear INVALID_ARGUMENT."""

from __future__ import annotations

import concurrent.futures

import pytest

from ntx_client import Client
from ntx_client.errors import NtxError

# repetitive prompts give the n-gram lookup something to find; the self-drafts draft anywhere
PROMPTS = ["1, 2, 3, 4, 5, 6, 7, 8,", "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return",
           "The cat sat on the mat. The cat sat on the", "Paris is the capital of France. Berlin is the capital of",
           "a b c d e f g a b c d", "Once upon a time, once upon a time,", "red green blue red green",
           "<|im_start|>user\nSay hello twice.<|im_end|>\n<|im_start|>assistant\n"]
MODES = ["ngram", "prefix:15", "skip:8,12,16,20", "ngram"]
N = 20


def test_8_concurrent_speculating_requests_equal_their_solo_greedy_outputs(daemon, engine, solo):
    expected = [solo(engine, engine.tokenizer.encode(p), N, ignore_eos=True) for p in PROMPTS]
    with Client(daemon.socket) as c:
        before = c.status().speculation

    def run(i: int):
        with Client(daemon.socket) as c:
            return c.complete(PROMPTS[i], max_tokens=N, temperature=0, ignore_eos=True,
                              speculative=MODES[i % len(MODES)])

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(run, range(len(PROMPTS))))
    for i, r in enumerate(results):
        assert r.ids == expected[i], f"request {i} ({MODES[i % len(MODES)]}): {r.ids} != solo {expected[i]}"
        assert r.finish_reason == "length"
    with Client(daemon.socket) as c:
        s = c.status()
    sp = s.speculation
    assert sp.passes > before.passes and sp.accepted > before.accepted, sp
    assert sp.tokens_per_pass > 1.0 and sp.cost_table, sp
    assert s.live_requests == 0 and s.free_slots == daemon.max_batch


def test_a_mode_the_daemon_cannot_serve_is_invalid_argument(daemon):
    with Client(daemon.socket) as c:
        with pytest.raises(NtxError, match="needs a draft model"):
            c.complete("Hi", max_tokens=2, speculative="draft")
        with pytest.raises(NtxError, match="speculative 'fastest'"):
            c.complete("Hi", max_tokens=2, speculative="fastest")
