"""The prefix cache on a real daemon (CPU, the default model): the same greedy output with it on
and off, the second turn of a long chat prefilled from the cache, concurrent requests sharing a
prefix computing it once, LRU eviction, the per-request opt-out and the config switch."""

from __future__ import annotations

import concurrent.futures

import pytest

from ntx_client import Client

SLOTS = 4


@pytest.fixture(scope="module")
def daemon(new_daemon):
    d = new_daemon("--max-batch", str(SLOTS), "--max-ctx", "2048", "--prefill-chunk", "256")
    try:
        yield d.wait_ready()
    finally:
        d.cleanup()


def counters(c: Client) -> dict:
    s = c.status()
    return dict(prompt=s.prompt_tokens_total, prefill=s.prefill_tokens_total, hit=s.prefix_hit_tokens_total,
                evictions=s.prefix_evictions_total, held=s.prefix_cached_slots)


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


STORY = ("The lighthouse keeper climbed the spiral stairs every evening, counting the steps aloud. "
         "At the top he trimmed the wick, polished the great lens and watched the ships pass. ")


def test_greedy_output_is_identical_with_the_cache_on_and_off(daemon):
    prompts = [STORY * 3 + "He", STORY * 3 + "One night", STORY * 3 + "One night a storm", STORY + "The end."]
    with Client(daemon.socket) as c:
        off = [c.complete(p, max_tokens=12, temperature=0, ignore_eos=True, prefix_cache=False) for p in prompts]
        before = counters(c)
        on = [c.complete(p, max_tokens=12, temperature=0, ignore_eos=True) for p in prompts]
        again = [c.complete(p, max_tokens=12, temperature=0, ignore_eos=True) for p in prompts]
        d = delta(counters(c), before)
    for p, a, b, r in zip(prompts, off, on, again):
        assert b.ids == a.ids and r.ids == a.ids, f"prompt {p[-20:]!r}: cache on {b.ids} / {r.ids} != off {a.ids}"
    assert all(r.usage["cached_prompt_tokens"] == len(r.prompt_ids) - 1 for r in again)  # all but the last
    assert d["hit"] > 0.8 * d["prompt"] and d["prefill"] == d["prompt"] - d["hit"]


def test_second_turn_of_a_long_chat_prefills_under_a_tenth_of_its_history(daemon):
    history = [{"role": "system", "content": "You are a careful assistant who answers briefly."}]
    for i in range(16):
        history += [{"role": "user", "content": f"Question {i}: " + STORY},
                    {"role": "assistant", "content": f"Answer {i}: the keeper trims the wick and counts the steps."}]
    history.append({"role": "user", "content": "Summarise the story in one line."})
    with Client(daemon.socket) as c:
        n_history = len(c.tokenize(messages=history))
        assert n_history >= 1000
        turn1 = c.complete(messages=history, max_tokens=8, temperature=0)
        turn2_messages = history + [{"role": "assistant", "content": turn1.text},
                                    {"role": "user", "content": "Thank you. And in three words?"}]
        before = counters(c)
        turn2 = c.complete(messages=turn2_messages, max_tokens=8, temperature=0)
        d = delta(counters(c), before)
        reference = c.complete(messages=turn2_messages, max_tokens=8, temperature=0, prefix_cache=False)
    assert d["prefill"] < 0.1 * n_history, f"turn 2 prefilled {d['prefill']} tokens of a {n_history}-token history"
    assert d["hit"] >= n_history - 2 and turn2.usage["cached_prompt_tokens"] == d["hit"]
    assert turn2.ids == reference.ids


def test_concurrent_requests_sharing_a_prefix_compute_it_once(daemon):
    shared = STORY * 5  # several prefill chunks
    prompts = [shared + "Question: who climbs the stairs?", shared + "Question: what does he polish?"]
    with Client(daemon.socket) as c:
        n_shared = len(c.tokenize(shared))
        refs = [c.complete(p, max_tokens=6, temperature=0, ignore_eos=True, prefix_cache=False) for p in prompts]
        before = counters(c)

        def run(p):
            with Client(daemon.socket) as cc:
                return cc.complete(p, max_tokens=6, temperature=0, ignore_eos=True)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(run, prompts))
        d = delta(counters(c), before)
    assert [o.ids for o in outs] == [r.ids for r in refs]
    # the shared part was prefilled at most once (none of it, where a cached slot already held it)
    assert d["prefill"] <= d["prompt"] - n_shared + 2, d


def test_lru_eviction_and_the_per_request_opt_out(daemon):
    with Client(daemon.socket) as c:
        before = counters(c)
        for i in range(SLOTS + 2):  # more distinct prompts than slots: the oldest cached ones go
            c.complete(f"{i} {i} {i}: a completely different prompt number {i}", max_tokens=2, temperature=0)
        d = delta(counters(c), before)
        assert d["evictions"] >= 2 and counters(c)["held"] == SLOTS
        # an opted-out request neither uses nor leaves KV
        p = "Private: do not keep this prompt in any cache, please."
        first = c.complete(p, max_tokens=2, temperature=0, prefix_cache=False)
        second = c.complete(p, max_tokens=2, temperature=0, prefix_cache=False)
        assert first.usage["cached_prompt_tokens"] == second.usage["cached_prompt_tokens"] == 0
        third = c.complete(p, max_tokens=2, temperature=0)
        assert third.usage["cached_prompt_tokens"] == 0  # nothing of it was kept
        assert c.status().prefix_cache


def test_config_switch_turns_it_off(new_daemon):
    d = new_daemon("--max-batch", "2", "--max-ctx", "256", "--no-prefix-cache").wait_ready()
    try:
        with Client(d.socket) as c:
            a = c.complete(STORY, max_tokens=3, temperature=0)
            b = c.complete(STORY, max_tokens=3, temperature=0)
            s = c.status()
        assert not s.prefix_cache and s.prefix_hit_tokens_total == 0 and s.prefix_cached_slots == 0
        assert s.prefill_tokens_total == s.prompt_tokens_total == 2 * len(a.prompt_ids)
        assert a.ids == b.ids and b.usage["cached_prompt_tokens"] == 0
    finally:
        d.cleanup()
