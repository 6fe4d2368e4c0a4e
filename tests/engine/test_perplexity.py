"""Perplexity equals llama.cpp's llama-perplexity on the default model (golden from
tests/golden/make_perplexity_golden.py: llama.cpp on the all-F32 copy, the same chunking)."""

from __future__ import annotations

import hashlib
import json
import math
import os

import numpy as np
import pytest

from ntransformerd.engine.perplexity import chunk_nll, perplexity, text_tokens

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "golden", "perplexity_smollm2.json")
CI_CHUNKS = 2  # of the golden's 14: the figure over these is what CI compares


@pytest.fixture(scope="module")
def golden():
    with open(GOLDEN) as f:
        g = json.load(f)
    if not os.path.exists(g["text"]):
        pytest.skip(f"{g['text']} is missing (Debian's common-licenses)")
    with open(g["text"], "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == g["text_sha256"], f"{g['text']} is not the text of the golden"
    return g


def test_tokens_equal_llama_cpp(default_engine, golden):
    with open(golden["text"], encoding="utf-8") as f:
        ours = text_tokens(default_engine, f.read())
    diff = next((i for i, (a, b) in enumerate(zip(ours, golden["ids"])) if a != b), None)
    assert diff is None and len(ours) == len(golden["ids"]), f"tokenization differs from llama.cpp at {diff}"


def test_perplexity_equals_llama_cpp(default_engine, golden):
    ctx = golden["ctx"]
    p = perplexity(default_engine, golden["ids"], ctx=ctx, max_chunks=CI_CHUNKS)
    ref = golden["chunks"][:CI_CHUNKS]
    want = math.exp(sum(c["nll_sum"] for c in ref) / sum(c["tokens"] for c in ref))
    assert p.chunks == CI_CHUNKS and p.tokens_scored == sum(c["tokens"] for c in ref) == CI_CHUNKS * (ctx - 1 - ctx // 2)
    assert abs(p.perplexity / want - 1) < 1e-3, f"perplexity {p.perplexity:.6f}, llama.cpp {want:.6f}"
    for ours, theirs in zip(p.chunk_perplexities, ref):
        assert ours == pytest.approx(math.exp(theirs["nll_sum"] / theirs["tokens"]), rel=1e-3)


def test_chunk_nll_is_the_log_softmax_of_the_target():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 7)).astype(np.float32) * 30  # large: a naive softmax would overflow in float32
    targets = rng.integers(0, 7, 5)
    z = logits.astype(np.float64)
    want = -(z[np.arange(5), targets] - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) - z.max(-1))
    np.testing.assert_allclose(chunk_nll(logits, targets), want, rtol=1e-12)


def test_chunking_scores_the_second_half_of_each_chunk(synth_model):
    from ntransformerd.engine.engine import Engine, EngineConfig

    e = Engine.load(synth_model("tiny", "q8_0"), config=EngineConfig(backend="cpu", max_batch=1, max_ctx=64, prefill_chunk=24))
    tokens = list(np.random.default_rng(1).integers(0, e.cfg.vocab_size, 3 * 32 + 5))
    p = perplexity(e, tokens, ctx=32)  # prefill steps of 24 rows straddle the scored half
    assert p.chunks == 3 and p.tokens_scored == 3 * 15
    nll = []
    for c in range(3):  # the definition, one whole chunk per step
        chunk = tokens[c * 32:(c + 1) * 32]
        slot = e.open()
        logits = e.step([(slot, chunk)], all_logits=True)
        e.close(slot)
        nll.append(chunk_nll(logits[16:31], np.array(chunk[17:32])))
    assert p.perplexity == pytest.approx(math.exp(np.concatenate(nll).mean()), rel=1e-5)
    with pytest.raises(ValueError, match="at least ctx"):
        perplexity(e, tokens[:20], ctx=32)
