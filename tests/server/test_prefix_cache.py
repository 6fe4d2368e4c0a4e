"""The prefix cache: its scopes on a fake engine (which caller may reuse whose sequence), then on
a real daemon (CPU, the default model): the same greedy output with it on and off, the second
turn of a long chat prefilled from the cache, concurrent requests sharing a prefix computing it
once, LRU eviction, the per-request opt-out and the config switch; two callers that do not share
(two keys of one uid; as root, two unix users) and prefix_cache_share that makes them."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import statistics
import subprocess
import sys

import grpc
import numpy as np
import pytest

from ntransformerd import config
from ntransformerd.server.callers import Caller
from ntransformerd.server.prefix_cache import PrefixCache, scope
from ntx_client import Client, NtxError

SLOTS = 4

# ---- scopes, on a fake engine --------------------------------------------------------------------

ALICE = Caller("uid:1001", uid=1001, gid=100)
BOB = Caller("uid:1002", uid=1002, gid=100)  # Alice's primary group
CAROL = Caller("uid:1003", uid=1003, gid=200)
TLS = Caller("tls:CN=client of test CA")


class SlotEngine:
    """The engine calls PrefixCache makes, on slots whose KV is a list of token ids: a parked
    slot keeps what it held, a freed one forgets it, and a copy moves ids, so a sequence's start
    shows where it came from. Opening hands out free slots only, as the engine's does."""

    def __init__(self, slots: int):
        self.kv: list[list[int]] = [[] for _ in range(slots)]
        self.free = list(range(slots))
        self.parked: set[int] = set()
        self.copies: list[tuple[int, int, int]] = []

    def open(self):
        slot = self.free.pop(0)
        self.kv[slot] = []
        return slot

    def park(self, slot):
        self.parked.add(slot)

    def reopen(self, slot, *, keep):
        self.parked.remove(slot)
        self.kv[slot] = self.kv[slot][:keep]

    @property
    def free_slots(self):
        return len(self.free)

    def kept(self, slot):
        return len(self.kv[slot])

    def copy_prefix(self, src, dst, n):
        self.copies.append((src, dst, n))
        self.kv[dst] = list(self.kv[src][:n])

    def close(self, slot):
        self.parked.discard(slot)
        self.kv[slot] = []
        self.free.append(slot)


def serve(cache: PrefixCache, engine: SlotEngine, prompt: list[int], caller, live=()) -> int:
    """One request of `caller` start to end: open, prefill the rest, close keeping its KV; the
    positions it took from the cache (checked to be `prompt`'s own ids)."""
    slot, n = cache.open(prompt, list(live), use=True, caller=caller)
    assert engine.kv[slot][:n] == prompt[:n]
    engine.kv[slot] = list(prompt)
    cache.close(slot, prompt, keep=True, caller=caller)
    return n


PROMPT = list(range(100, 140))


def test_a_held_slot_is_reused_only_as_far_as_its_kv_still_holds():
    """A paged pool reclaims a closed slot's blocks when others need them (engine.kept): the
    cache then reuses what is left, never positions that are gone."""
    engine = SlotEngine(SLOTS)
    kept = {}
    engine.kept = lambda slot: kept.get(slot, len(engine.kv[slot]))
    cache = PrefixCache(engine, enabled=True)
    assert serve(cache, engine, PROMPT, ALICE) == 0
    (held,) = cache.held
    kept[held] = 16  # the pool took all but the first 16 positions' blocks
    engine.kv[held] = engine.kv[held][:16]
    assert serve(cache, engine, PROMPT, ALICE) == 16  # serve() checks the ids it took are the prompt's own
    kept.clear()
    assert serve(cache, engine, PROMPT, ALICE) == len(PROMPT) - 1


@pytest.mark.parametrize("share,expected", [
    ("none", {ALICE: "uid:1001", BOB: "uid:1002", ALICE.below("key:1"): "uid:1001/key:1", TLS: TLS.principal}),
    ("group", {ALICE: "gid:100", BOB: "gid:100", CAROL: "gid:200", ALICE.below("key:1"): "gid:100/key:1",
               TLS: TLS.principal, Caller("uid:7", uid=7): "uid:7"}),
    ("all", {ALICE: "", CAROL: "", ALICE.below("key:1"): "", TLS: ""}),
])
def test_the_scope_of_each_caller_under_each_share_mode(share, expected):
    assert {c: scope(c, share) for c in expected} == expected
    assert scope(None, share) == ""  # the daemon's own process (in-process requests)


def test_a_cached_sequence_is_reused_only_by_its_own_caller():
    engine = SlotEngine(4)
    cache = PrefixCache(engine, enabled=True)
    assert serve(cache, engine, PROMPT, ALICE) == 0
    assert serve(cache, engine, PROMPT, BOB) == 0 and not engine.copies  # Alice's stays hers
    assert serve(cache, engine, PROMPT, ALICE) == len(PROMPT) - 1
    assert serve(cache, engine, PROMPT, BOB) == len(PROMPT) - 1  # Bob's own, kept from his first
    assert serve(cache, engine, PROMPT + [7], TLS) == 0
    assert cache.hit_tokens == 2 * (len(PROMPT) - 1)


def test_a_live_sequence_is_copied_only_by_its_own_caller():
    engine = SlotEngine(4)
    cache = PrefixCache(engine, enabled=True)
    running = engine.open()
    engine.kv[running] = PROMPT[:30]  # Alice's request, 30 positions prefilled so far
    live = [(running, PROMPT, 30, ALICE)]  # its KV holds the first 30 of its ids
    slot, n = cache.open(PROMPT, live, use=True, caller=BOB)
    assert n == 0 and not engine.copies
    assert cache.catch_up(slot, PROMPT, 0, live, caller=BOB) == 0 and not engine.copies
    assert not cache.shares(ALICE, BOB)  # nor does Bob wait for Alice's prefill to finish
    slot2, n2 = cache.open(PROMPT, live, use=True, caller=ALICE)
    assert n2 == 30 and engine.copies == [(running, slot2, 30)]


def test_keys_under_one_uid_keep_apart_and_one_key_reuses_its_own():
    engine = SlotEngine(4)
    cache = PrefixCache(engine, enabled=True, share="group")  # a group does not merge what a caller split
    one, two = ALICE.below("key:1"), ALICE.below("key:2")
    assert serve(cache, engine, PROMPT, one) == 0
    assert serve(cache, engine, PROMPT, two) == 0
    assert serve(cache, engine, PROMPT, ALICE) == 0
    assert serve(cache, engine, PROMPT, one) == len(PROMPT) - 1
    assert serve(cache, engine, PROMPT, BOB.below("key:1")) == len(PROMPT) - 1  # same group, same key


@pytest.mark.parametrize("share,bob_hits,carol_hits", [("none", False, False), ("group", True, False),
                                                       ("all", True, True)])
def test_share_group_and_all_open_the_cache_to_more_callers(share, bob_hits, carol_hits):
    engine = SlotEngine(4)
    cache = PrefixCache(engine, enabled=True, share=share)
    serve(cache, engine, PROMPT, ALICE)
    assert serve(cache, engine, PROMPT + [1], BOB) == (len(PROMPT) if bob_hits else 0)
    assert serve(cache, engine, PROMPT + [2], CAROL) == (len(PROMPT) if carol_hits else 0)
    assert cache.shares(ALICE, BOB) == bob_hits and cache.shares(ALICE, CAROL) == carol_hits


def chosen_as_read_whole(cache: PrefixCache, prompt, live, caller, but=-1) -> tuple[int | None, int]:
    """The source open (catch_up: `but` its own slot) must choose, found the plain way: every
    candidate of the caller's scope cut to what its KV holds and compared id by id, the first
    sharing the most (as far as the prompt's last id) winning; a held one where it shares as
    much as any live one. (source slot, positions), (None, 0) for none."""
    limit, key = len(prompt) - 1, scope(caller, cache.share)

    def best(candidates):
        best_slot, best_n = None, 0
        for slot, tokens in candidates:
            n = 0
            while n < min(len(prompt), len(tokens)) and prompt[n] == tokens[n]:
                n += 1
            if min(n, limit) > best_n:
                best_slot, best_n = slot, min(n, limit)
        return best_slot, best_n
    held = best((slot, t[:min(len(t), cache.engine.kept(slot))]) for slot, (k, t) in cache.held.items() if k == key)
    ours = best((slot, t[:n]) for slot, t, n, c in live if scope(c, cache.share) == key and slot != but)
    if but < 0 and held[1] and held[1] >= ours[1]:
        return held
    return ours


@pytest.mark.parametrize("seed", range(6))
def test_open_and_catch_up_choose_what_reading_every_candidate_whole_chooses(seed):
    """open and catch_up read candidates lazily, stop at one sharing all they may and pass over
    those too short to win: their choice is the one of every candidate read whole, on many
    prompts that share prefixes of every length (ties, partly reclaimed held slots, live
    sequences partly prefilled, two callers)."""
    rng = np.random.default_rng(seed)
    engine = SlotEngine(12)
    kept = {}
    engine.kept = lambda slot: kept.get(slot, len(engine.kv[slot]))
    cache = PrefixCache(engine, enabled=True)
    stems = [list(rng.integers(1, 4, 40)) for _ in range(3)]
    live: dict[int, tuple[list[int], object]] = {}  # slot → (its ids, caller); its KV: the prefix it holds
    checked = 0
    for _ in range(300):
        stem = stems[int(rng.integers(len(stems)))]
        prompt = [int(t) for t in stem[:int(rng.integers(1, 41))]] + [int(t) for t in rng.integers(1, 4, 3)]
        caller = ALICE if rng.random() < 0.7 else BOB
        entries = [(slot, ids, len(engine.kv[slot]), c) for slot, (ids, c) in live.items()]
        if live and rng.random() < 0.3:  # a live sequence catches up
            slot = list(live)[int(rng.integers(len(live)))]
            ids, c = live[slot]
            filled = len(engine.kv[slot])
            src, n = chosen_as_read_whole(cache, ids, entries, c, but=slot)
            engine.copies.clear()
            got = cache.catch_up(slot, ids, filled, iter(entries), caller=c)
            assert got == max(n, filled) and engine.copies == ([(src, slot, n)] if n > filled else [])
            checked += 1
        elif engine.free_slots + len(cache.held) and len(live) < 8:
            src, n = chosen_as_read_whole(cache, prompt, entries, caller)
            from_held = src in cache.held
            engine.copies.clear()
            slot, got = cache.open(prompt, iter(entries), use=True, caller=caller)
            assert got == n
            if n and from_held:
                assert slot == src or engine.copies == [(src, slot, n)]
            else:
                assert engine.copies == ([(src, slot, n)] if n else [])
            engine.kv[slot] = list(prompt[:int(rng.integers(got, len(prompt) + 1))])  # prefilled so far
            live[slot] = (prompt, caller)
            checked += 1
        if live and rng.random() < 0.4:  # one ends, kept or not; a held one loses blocks
            slot = list(live)[int(rng.integers(len(live)))]
            ids, c = live.pop(slot)
            kept.pop(slot, None)
            cache.close(slot, engine.kv[slot], keep=rng.random() < 0.8, caller=c)
            if cache.held and rng.random() < 0.3:
                held = list(cache.held)[int(rng.integers(len(cache.held)))]
                kept[held] = int(rng.integers(0, len(engine.kv[held]) + 1))
    assert checked > 200 and cache.hit_tokens > 0


def test_a_bad_share_setting_names_the_key():
    with pytest.raises(config.ConfigError, match="prefix_cache_share = 'everyone': use none, group or all"):
        config.load(["--config", os.devnull, "--prefix-cache-share", "everyone"])
    assert config.load(["--config", os.devnull]).prefix_cache_share == "none"
    assert config.load(["--config", os.devnull, "--prefix-cache-share", "GROUP"]).prefix_cache_share == "group"
    with pytest.raises(ValueError, match="prefix_cache_share"):
        PrefixCache(SlotEngine(1), enabled=True, share="some")


# ---- on a real daemon ----------------------------------------------------------------------------


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


def test_two_callers_sending_one_prompt_do_not_share_and_share_all_makes_them(daemon, new_daemon):
    prompt = "Quartz. " + STORY * 2  # a first token no other test's prompt starts with
    with Client(daemon.socket) as c:
        a1 = c.complete(prompt, max_tokens=2, temperature=0, on_behalf_of="key:alice")
        b1 = c.complete(prompt, max_tokens=2, temperature=0, on_behalf_of="key:bob")
        own = c.complete(prompt, max_tokens=2, temperature=0)  # the uid itself: a third scope
        a2 = c.complete(prompt, max_tokens=2, temperature=0, on_behalf_of="key:alice")
        b2 = c.complete(prompt, max_tokens=2, temperature=0, on_behalf_of="key:bob")
        assert c.status().prefix_cache_share == "none"
    n = len(a1.prompt_ids)
    assert [r.usage["cached_prompt_tokens"] for r in (a1, b1, own, a2, b2)] == [0, 0, 0, n - 1, n - 1]
    assert a1.ids == b1.ids == own.ids == a2.ids == b2.ids
    d = new_daemon("--max-batch", "2", "--max-ctx", "512", "--prefix-cache-share", "all").wait_ready()
    try:
        with Client(d.socket) as c:
            a = c.complete(prompt, max_tokens=2, temperature=0, on_behalf_of="key:alice")
            b = c.complete(prompt, max_tokens=2, temperature=0, on_behalf_of="key:bob")
            assert c.status().prefix_cache_share == "all"
        assert a.usage["cached_prompt_tokens"] == 0 and b.usage["cached_prompt_tokens"] == n - 1
        assert a.ids == b.ids == a1.ids
    finally:
        d.cleanup()


@pytest.mark.parametrize("name", ["key/alice", "x" * 129, "key alice", "ключ"])
def test_a_bad_on_behalf_of_is_refused_by_name(daemon, name):
    with Client(daemon.socket) as c, pytest.raises(NtxError) as e:
        c.complete("hi", max_tokens=1, on_behalf_of=name)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "on_behalf_of" in str(e.value)


# ---- as root: two unix users through the group socket ---------------------------------------------

TRIES = 20
# A client that runs as another user: one JSON command per line in, one JSON answer per line out.
WORKER = r"""
import json, sys, time
from ntx_client import Client
with Client(sys.argv[1]) as c:
    for line in sys.stdin:
        cmd = json.loads(line)
        if "status" in cmd:
            s = c.status()
            out = {"live": s.live_requests, "requests": [r.prompt_tokens for r in s.requests]}
        else:
            t0, ttft = time.perf_counter(), None
            for chunk in c.generate(cmd["prompt"], max_tokens=1, temperature=0):
                ttft = time.perf_counter() - t0 if ttft is None else ttft
                usage = chunk.usage or {}
            out = {"ttft": ttft, "cached": usage["cached_prompt_tokens"], "prompt": usage["prompt_tokens"]}
        print(json.dumps(out), flush=True)
"""
# each try's prompt starts with its own first token: nothing of one try is a prefix of another's
WORDS = ["Apple", "Bridge", "Cobalt", "Dragon", "Ember", "Falcon", "Glacier", "Harbor", "Ivory", "Jungle",
         "Kettle", "Lantern", "Meadow", "Nickel", "Orchid", "Pepper", "Quartz", "Ribbon", "Saddle", "Thunder"]


class User:
    """WORKER as uid `uid` (supplementary group `gid`: the socket's)."""

    def __init__(self, uid: int, gid: int, socket: str):
        self.proc = subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={uid}", f"--groups={gid}", "--",
                                      sys.executable, "-c", WORKER, socket], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the worker exited {self.proc.wait()}"
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


def _two_users() -> tuple[int, int]:
    import pwd
    others = sorted({p.pw_uid for p in pwd.getpwall()} - {0, 65534})
    if not others:
        pytest.skip("needs a second user besides nobody in the user database")
    return 65534, others[0]


def _spread(xs: list[float]) -> str:
    q = statistics.quantiles(xs, n=10)
    return f"median {statistics.median(xs) * 1e3:.1f} ms, p10 {q[0] * 1e3:.1f}, p90 {q[-1] * 1e3:.1f}"


@pytest.mark.root
def test_two_unix_users_do_not_share_a_prompt(new_daemon):
    import grp
    d = new_daemon("--max-batch", str(SLOTS), "--max-ctx", "1024", "--prefill-chunk", "512")
    if os.geteuid() != 0 or shutil.which("setpriv") is None or not d.group:
        d.cleanup()
        pytest.skip("needs root, setpriv and the group 'users'")
    gid = grp.getgrnam(d.group).gr_gid
    (uid_a, uid_b), users = _two_users(), []
    try:
        d.wait_ready()
        users = [User(uid_a, gid, d.socket), User(uid_b, gid, d.socket)]
        a, b = users
        with Client(d.socket) as c:
            firsts = {c.tokenize(w + ". " + STORY * 3)[0] for w in WORDS}
        assert len(firsts) == TRIES  # no try shares a first token with another
        cold, other, hit, own = [], [], [], []
        for w in WORDS:
            prompt = w + ". " + STORY * 3  # about 100 tokens
            cold.append(a.ask(prompt=prompt))  # A's first: nothing cached
            other.append(b.ask(prompt=prompt))  # B, A's exact prompt
            hit.append(a.ask(prompt=prompt))  # A's repeat
            own.append(b.ask(prompt=prompt))  # B's repeat
        n = statistics.median(x["prompt"] for x in cold)
        report = (f"TTFT over {TRIES} tries of a {n:.0f}-token prompt: A cold {_spread([x['ttft'] for x in cold])}; "
                  f"B, A's prompt {_spread([x['ttft'] for x in other])}; A's repeat (hit) "
                  f"{_spread([x['ttft'] for x in hit])}; B's repeat {_spread([x['ttft'] for x in own])}")
        print(report)
        assert [x["cached"] for x in cold] == [0] * TRIES, report
        assert [x["cached"] for x in other] == [0] * TRIES, report
        assert all(x["cached"] == x["prompt"] - 1 for x in hit + own), report  # all but the last token
        # Status lists B none of A's requests, while A sees its own
        long = subprocess.Popen(["setpriv", f"--reuid={uid_a}", f"--regid={uid_a}", f"--groups={gid}", "--",
                                 sys.executable, "-m", "ntx_client.cli", "--socket", d.socket, "generate", "--raw",
                                 "--json", "--max-tokens", "400", "--ignore-eos", "Tell me a long story."],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert long.stdout.readline()  # A's request is live
            seen_b, seen_a = b.ask(status=1), a.ask(status=1)
        finally:
            long.kill()
            long.wait()
        assert seen_b["live"] >= 1 and seen_b["requests"] == [], seen_b
        assert len(seen_a["requests"]) == 1, seen_a
    finally:
        for u in users:
            u.close()
        d.cleanup()


@pytest.mark.root
def test_share_all_lets_a_second_unix_user_start_from_the_first_ones_prompt(new_daemon):
    import grp
    d = new_daemon("--max-batch", "2", "--max-ctx", "512", "--prefix-cache-share", "all")
    if os.geteuid() != 0 or shutil.which("setpriv") is None or not d.group:
        d.cleanup()
        pytest.skip("needs root, setpriv and the group 'users'")
    gid = grp.getgrnam(d.group).gr_gid
    (uid_a, uid_b), users = _two_users(), []
    try:
        d.wait_ready()
        users = [User(uid_a, gid, d.socket), User(uid_b, gid, d.socket)]
        first = users[0].ask(prompt="Lantern. " + STORY)
        second = users[1].ask(prompt="Lantern. " + STORY)
        assert first["cached"] == 0 and second["cached"] == first["prompt"] - 1
    finally:
        for u in users:
            u.close()
        d.cleanup()
