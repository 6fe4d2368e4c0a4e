"""Log-probabilities over gRPC, against the exact CPU engine (backend cpu-ref): the top 20 of the
first generated position of each reference prompt are log-softmax of that engine's logits, and
a prompt's log-probabilities sum to what perplexity computes over the same tokens."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from ntx_client import Client, NtxError
from ntransformerd.engine.runtime.engine import Engine, EngineConfig
from ntransformerd.engine.calibration.perplexity import perplexity

GOLDEN = os.path.join(os.path.dirname(__file__), os.pardir, "golden", "forward_smollm2.json")
TOL = 1e-4


@pytest.fixture(scope="module")
def ref_daemon(new_daemon):
    d = new_daemon("--backend", "cpu-ref", "--max-ctx", "512", "--prefill-chunk", "128", "--speculative", "off")
    try:
        yield d.wait_ready()
    finally:
        d.cleanup()


@pytest.fixture(scope="module")
def ref_engine():
    return Engine.load(None, config=EngineConfig(backend="cpu-ref", max_batch=1, max_ctx=512, prefill_chunk=128))


def log_softmax(x: np.ndarray) -> np.ndarray:
    z = x.astype(np.float64)
    return z - (z.max() + np.log(np.exp(z - z.max()).sum()))


def test_top_logprobs_are_log_softmax_of_the_exact_engine(ref_daemon, ref_engine):
    prompts = json.load(open(GOLDEN))["prompts"]
    assert len(prompts) == 6
    with Client(ref_daemon.socket, timeout=300) as c:
        for p in prompts:
            done = c.complete(prompt_ids=p["prompt_ids"], max_tokens=1, temperature=0, logprobs=20)
            slot = ref_engine.open()
            try:
                want = log_softmax(ref_engine.prefill(slot, p["prompt_ids"]))
            finally:
                ref_engine.close(slot)
            (lp,) = done.logprobs
            assert lp.id == done.ids[0] == int(np.argmax(want)), p["name"]
            got_ids = [t.id for t in lp.top]
            assert len(got_ids) == 20 and len(set(got_ids)) == 20
            order = np.argsort(-want, kind="stable")[:20]
            assert got_ids == order.tolist(), p["name"]
            err = max(abs(t.logprob - want[t.id]) for t in lp.top)
            assert err < TOL and abs(lp.logprob - want[lp.id]) < TOL, (p["name"], err)
            assert all(t.piece == ref_engine.tokenizer.token_bytes(t.id) for t in lp.top)


def test_prompt_logprobs_sum_to_perplexity(ref_daemon, ref_engine):
    text = ("The river runs past the mill and under the old stone bridge, where children throw "
            "sticks into the water and race to the other side to see whose stick comes out first.")
    ids = ref_engine.tokenizer.encode(text, parse_special=False, add_special=True)
    ppl = perplexity(ref_engine, ids, ctx=len(ids))
    with Client(ref_daemon.socket, timeout=300) as c:
        done = c.complete(prompt_ids=ids, max_tokens=1, temperature=0, logprobs=2, prompt_logprobs=True)
    assert [t.id for t in done.prompt_logprobs] == ids[1:]
    assert all(len(t.top) == 2 and t.top[0].logprob >= t.top[1].logprob >= t.logprob - 1e9 for t in done.prompt_logprobs)
    first = len(ids) // 2  # perplexity scores the tokens after the first half of its chunk
    scored = [t.logprob for t in done.prompt_logprobs[first:]]
    assert len(scored) == ppl.tokens_scored
    assert abs(-sum(scored) - ppl.nll * ppl.tokens_scored) < 1e-3 * ppl.tokens_scored


def test_logprobs_out_of_range_is_invalid_argument(ref_daemon):
    with Client(ref_daemon.socket, timeout=60) as c:
        with pytest.raises(NtxError, match=r"logprobs 21 is out of range: ask for 0\.\.20"):
            c.complete("Hi", max_tokens=1, logprobs=21)
