"""A request never touches KV another owns (kv_cache.SlotState): a slot the prefix cache keeps is
parked, and nothing but the cache can have it back, so no measurement, calibration or other
request writes over a cached prompt.

First the case that was found: on a daemon with no step-cost table, one user's first
speculative request measured step costs on "any free slot", which was a slot the prefix cache
still counted as another user's cached prompt; that user's next request from the cache answered
wrongly, with no error. Then a randomized hunt (hypothesis) over interleaved requests of every
kind on the scheduler, with the owner check on in the allocator: every request's greedy ids are
its solo run's, and no step writes a block another owner holds."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ntransformerd.config import DaemonConfig
from ntransformerd.engine.generation import constraints
from ntransformerd.engine.generation import speculative as sp
from ntransformerd.engine.generation.decode import generate
from ntransformerd.engine.runtime.engine import Engine, EngineConfig
from ntransformerd.engine.generation.sampler import SamplingParams
from ntransformerd.server.callers import Caller
from ntransformerd.server.errors import InvalidRequest, ServiceError
from ntransformerd.server.scheduler import Scheduler
from ntransformerd.server.systemd import Notifier
from ntx_client import Client
from ntx_proto.states import RequestState

# ---- the allocator ---------------------------------------------------------------------------------


def test_a_parked_slot_is_never_handed_out_and_never_written(default_model):
    e = Engine(default_model, config=EngineConfig(backend="cpu", max_batch=2, max_ctx=64))
    a = e.open()
    e.prefill(a, list(range(5, 25)))
    e.park(a)
    b = e.open()
    assert b != a
    with pytest.raises(RuntimeError, match="all 2 KV cache slots are live or kept by the prefix cache"):
        e.open()
    with pytest.raises(RuntimeError, match=f"KV slot {a} is not live"):
        e.step([(a, [7])])  # a step over a parked slot: refused before anything is written
    e.copy_prefix(a, b, 16)  # reading a parked slot is its owner's to allow: one whole block shared
    with pytest.raises(ValueError, match=f"KV slot {a} is parked, not free"):
        e.kv.alloc(a)
    e.reopen(a, keep=20)
    assert e.length(a) == 20
    e.step([(b, [9])])  # b writes position 16: a block of its own, the shared one stays a's too
    e.step([(a, [7])])
    e.close(a)
    assert e.kv.kept(a) == 0 and e.free_slots == 1  # freed: forgotten, blocks back in the pool
    e.close(b)


def test_the_owner_check_refuses_a_write_into_a_shared_block(default_model):
    e = Engine(default_model, config=EngineConfig(backend="cpu", max_batch=2, max_ctx=64))
    a, b = e.open(), e.open()
    e.prefill(a, list(range(5, 25)))
    e.copy_prefix(a, b, 16)
    t = e.kv.blocks
    with pytest.raises(RuntimeError, match="does not hold alone"):
        t._check_write(b, 0, 16)  # what a write without its copy on write would be
    e.close(a)
    e.close(b)


# ---- the case that was found: a real daemon, one user's cache, another's first speculation ---------

# A client run as another user: one JSON command per line in, the greedy ids out.
WORKER = r"""
import json, sys
from ntx_client import Client
with Client(sys.argv[1]) as c:
    for line in sys.stdin:
        cmd = json.loads(line)
        r = c.complete(cmd["prompt"], max_tokens=cmd["n"], temperature=0, ignore_eos=True,
                       speculative=cmd.get("speculative", ""), on_behalf_of=cmd.get("key") or None)
        print(json.dumps({"ids": list(r.ids), "cached": r.usage["cached_prompt_tokens"]}), flush=True)
"""

KEY_PROMPT = "1, 2, 3, 4, 5, 6, 7, 8,"
FILLERS = [f"Filler prompt number {i}: the {w} sat on the mat and" for i, w in
           enumerate(["cat", "dog", "fox", "owl", "bee", "elk", "ant", "yak", "emu", "gnu", "cod"])]


class Caller_:
    """Completes prompts as one caller: a unix user through WORKER where the test runs as root
    (setpriv into the socket's group), else this process under its own on_behalf_of key."""

    def __init__(self, socket: str, *, uid: int | None, gid: int | None, key: str):
        self.socket, self.key, self.proc = socket, key, None
        if uid is not None:
            self.proc = subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={uid}", f"--groups={gid}", "--",
                                          sys.executable, "-c", WORKER, socket], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)

    def complete(self, prompt: str, n: int = 6, speculative: str = "") -> dict:
        if self.proc is None:
            with Client(self.socket) as c:
                r = c.complete(prompt, max_tokens=n, temperature=0, ignore_eos=True, speculative=speculative,
                               on_behalf_of=self.key)
            return {"ids": list(r.ids), "cached": r.usage["cached_prompt_tokens"]}
        self.proc.stdin.write(json.dumps({"prompt": prompt, "n": n, "speculative": speculative}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the worker exited {self.proc.wait()}"
        return json.loads(line)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(30)


def _callers(d) -> tuple[Caller_, Caller_]:
    import grp
    import pwd
    others = sorted({p.pw_uid for p in pwd.getpwall()} - {0, 65534})
    if os.geteuid() == 0 and d.group and shutil.which("setpriv") and others:
        gid = grp.getgrnam(d.group).gr_gid
        return (Caller_(d.socket, uid=others[0], gid=gid, key="key:victim"),
                Caller_(d.socket, uid=65534, gid=gid, key="key:other"))
    return Caller_(d.socket, uid=None, gid=None, key="key:victim"), Caller_(d.socket, uid=None, gid=None, key="key:other")


@pytest.mark.parametrize("mode", ["ngram", "auto", "draft", "prefix"])
def test_another_users_first_speculative_request_leaves_a_cached_prompt_alone(new_daemon, default_model_path, mode):
    """The daemon starts with no step-cost table (its own state directory), so the first
    speculative request measures one; the victim's cached prompts answer as before."""
    d = new_daemon("--max-batch", "4", "--max-ctx", "512", "--prefill-chunk", "64", "--draft", default_model_path)
    victim, other = _callers(d)
    try:
        d.wait_ready()
        assert not [f for f in os.listdir(d.dir) if f.startswith("step-costs")]
        want = {p: victim.complete(p) for p in FILLERS + [KEY_PROMPT]}  # the cache holds the last 4
        assert want[KEY_PROMPT]["cached"] == 0
        other.complete("A different user's first question, asked with speculation on:", n=8, speculative=mode)
        assert [f for f in os.listdir(d.dir) if f.startswith("step-costs")], "no table was measured: proves nothing"
        again = victim.complete(KEY_PROMPT)
        assert again["cached"] > 0, "the key prompt did not come from the cache: the test proves nothing"
        assert again["ids"] == want[KEY_PROMPT]["ids"]
        for p in FILLERS[-3:]:  # the other prompts the cache still held
            assert victim.complete(p)["ids"] == want[p]["ids"], p
    finally:
        victim.close()
        other.close()
        d.cleanup()


# ---- the hunt: interleaved requests of every kind on the scheduler ---------------------------------

PROMPTS = ["1, 2, 3, 4, 5, 6, 7, 8,", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,", "The quick brown fox jumps over",
           "The quick brown fox jumps over the lazy dog. The quick"]
# plain requests and prefix-cache hits weigh more: the faults hunted for need a cached prompt
# first and its reuse after, with other work between
MODES = ["off"] * 5 + ["ngram", "auto", "draft", "prefix:15", "skip:10,20"]
CALLERS = [None, Caller("uid:1001", uid=1001, gid=100)]
REGEX = r"[0-9]+(, [0-9]+)*"
MAX_CTX = 96


@pytest.fixture(scope="module")
def rig(default_model):
    """The engine the hunt serves from (small pool: parked slots lose blocks, some to a spill),
    a draft engine, the constraint compiler and a memo of solo runs."""
    e = Engine(default_model, config=EngineConfig(backend="cpu", max_batch=3, max_ctx=MAX_CTX, prefill_chunk=16,
                                                  kv_blocks=12))
    draft = Engine(default_model, config=EngineConfig(backend="cpu", max_batch=3, max_ctx=MAX_CTX, prefill_chunk=16))
    yield e, draft, constraints.compiler_for(e.tokenizer, e.cfg.vocab_size), {}
    e.unload()
    draft.unload()


request = st.fixed_dictionaries({
    "prompt": st.sampled_from(range(len(PROMPTS))),
    "mode": st.sampled_from(MODES),
    "n": st.integers(1, 8),
    "regex": st.booleans(),
    "cache": st.sampled_from([True, True, True, False]),
    "caller": st.sampled_from(range(len(CALLERS))),
    "gap": st.integers(0, 8),  # iterations after the one before it arrived
    "cancel_at": st.one_of(st.none(), st.integers(1, 8)),  # iterations after arriving
    "too_long": st.integers(0, 15).map(lambda x: x == 0),
})


@settings(max_examples=int(os.environ.get("NTX_HUNT_EXAMPLES", "40")), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.data_too_large])
@given(work=st.lists(request, min_size=2, max_size=8), table=st.booleans(), spill=st.booleans())
def test_interleaved_requests_each_get_their_solo_output(rig, tmp_path_factory, monkeypatch, work, table, spill):
    e, draft, compiler, memo = rig
    # the owner check is on (tests/conftest.py)
    monkeypatch.setenv("NTX_STATE_DIR", str(tmp_path_factory.mktemp("state")))  # table absent unless given
    e.kv.spill_limit = (1 << 22) if spill else 0
    ids = [e.tokenizer.encode(p) for p in PROMPTS]
    at = 0
    for w in work:
        at = w["at"] = at + w["gap"]

    def solo(w) -> list[int]:
        key = (w["prompt"], w["n"], w["regex"])
        if key not in memo:
            c = compiler.compile("regex", REGEX) if w["regex"] else None
            params = SamplingParams.greedy(max_tokens=w["n"], ignore_eos=True)
            memo[key] = [ev.token for ev in generate(e, ids[w["prompt"]], params, constraint=c)]
        return memo[key]

    want = [solo(w) for w in work]
    s = Scheduler(config=DaemonConfig(socket="/tmp/ntx-hunt.sock", max_batch=3, max_queue=16, prefill_chunk=16),
                  notifier=Notifier(environ={}))
    s.attach(e, draft_engine=draft, costs=sp.StepCosts({1: 1.0, 2: 1.05, 4: 1.1, 8: 1.2, 16: 1.4}) if table else None)
    s.lifecycle.serving()
    reqs: list = [None] * len(work)
    try:
        for it in range(400):
            for k, w in enumerate(work):
                if w["at"] == it:
                    prompt = ids[w["prompt"]] * (MAX_CTX if w["too_long"] else 1)
                    try:
                        reqs[k] = s.schedule(prompt, SamplingParams.greedy(max_tokens=w["n"], ignore_eos=True),
                                             max_tokens=w["n"], prefix_cache=w["cache"],
                                             speculative=sp.Mode.parse(w["mode"]), caller=CALLERS[w["caller"]],
                                             constraint=compiler.compile("regex", REGEX) if w["regex"] else None)
                    except InvalidRequest:
                        assert w["too_long"]
                        reqs[k] = "refused"
                if w["cancel_at"] is not None and reqs[k] not in (None, "refused") and it == w["at"] + w["cancel_at"]:
                    reqs[k].cancel()
            assert s.iterate() != "failed"
            if it > max(w["at"] for w in work) and all(r == "refused" or r.state == RequestState.DONE for r in reqs):
                break
        else:
            pytest.fail("the requests did not end in 400 iterations")
        for w, r, ids_solo in zip(work, reqs, want):
            if r == "refused":
                continue
            got = []
            try:
                for o in r.stream():
                    got += o.token_ids
            except ServiceError:
                assert w["cancel_at"] is not None and r.error is not None, (w, r.error)
            if w["cancel_at"] is not None and r.error is not None:
                assert got == ids_solo[:len(got)], (w, got, ids_solo)  # cancelled: a prefix of its solo run
            else:
                assert r.error is None, (w, r.error)
                assert got == ids_solo, (w, got, ids_solo)
    finally:
        s.stop()  # what the prefix cache kept goes back
    assert e.kv.free_slots == e.kv.n_slots  # every slot is free again: nothing leaked
