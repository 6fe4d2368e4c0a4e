"""Perplexity equals llama.cpp's llama-perplexity on the default model (golden from
tests/golden/make_perplexity_golden.py: llama.cpp on the all-F32 copy, the same chunking)."""

from __future__ import annotations

import hashlib
import json
import math
import os

import numpy as np
import pytest

from ntransformerd.engine.calibration.perplexity import (Base, KLMeter, Recorder, chunk_nll, kl_divergence, kl_rows, perplexity,
                                           text_tokens, top_tokens)

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
    from ntransformerd.engine.runtime.engine import Engine, EngineConfig

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


# ---- KL divergence -------------------------------------------------------------------------------

def _kl_definition(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """Σ p (log p - log q) per row over the whole vocabulary, in float64."""
    lp = p_logits - np.log(np.exp(p_logits - p_logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - p_logits.max(-1, keepdims=True)
    lq = q_logits - np.log(np.exp(q_logits - q_logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - q_logits.max(-1, keepdims=True)
    return (np.exp(lp) * (lp - lq)).sum(-1)


def test_kl_rows_is_the_definition_and_folding_the_tail_lowers_it():
    rng = np.random.default_rng(2)
    base = (rng.normal(size=(6, 50)) * 3).astype(np.float32)
    run = (base + rng.normal(size=base.shape) * 0.3).astype(np.float32)
    targets = rng.integers(0, 50, 6)
    want = _kl_definition(base.astype(np.float64), run.astype(np.float64))
    full, folded = Recorder(50), Recorder(5)
    full(base, targets)
    folded(base, targets)
    for rec, exact in ((full, True), (folded, False)):
        b = rec.base(np.zeros(64, np.int64), 12, {})
        kl, same, dnll = kl_rows(run, targets, b.top_ids, b.top_logits, b.lse, b.tail_lse, b.nll)
        if exact:
            np.testing.assert_allclose(kl, want, rtol=1e-9)
        else:  # a lower bound, and not a trivial one
            assert np.all(kl <= want + 1e-12) and np.all(kl > 0.2 * want)
        np.testing.assert_array_equal(same, run.argmax(-1) == base.argmax(-1))
        np.testing.assert_allclose(dnll, chunk_nll(run, targets) - chunk_nll(base, targets), rtol=1e-9)


def test_top_tokens_ranks_ties_by_id_like_argmax():
    logits = np.array([[1.0, 3.0, 3.0, 0.5, 3.0]], np.float32)
    assert top_tokens(logits, 3).tolist() == [[1, 2, 4]]
    assert top_tokens(logits, 5).tolist() == [[1, 2, 4, 0, 3]]


@pytest.fixture(scope="module")
def kl_engines(synth_model):
    from ntransformerd.engine.runtime.engine import Engine, EngineConfig

    path = synth_model("tiny", "q8_0")
    cfg = dict(max_batch=1, max_ctx=64, prefill_chunk=24)
    ref = Engine.load(path, config=EngineConfig(backend="cpu-ref", **cfg))
    tokens = list(np.random.default_rng(3).integers(0, ref.cfg.vocab_size, 3 * 32 + 5))
    return ref, Engine.load(path, config=EngineConfig(backend="cpu", **cfg)), tokens


@pytest.mark.parametrize("top", [16, None])  # folded tail, whole vocabulary
def test_identical_runs_give_kl_zero_and_the_same_top_token(kl_engines, top, tmp_path):
    ref, _, tokens = kl_engines
    rec = Recorder(top or ref.cfg.vocab_size)
    p = perplexity(ref, tokens, ctx=32, observe=rec)
    rec.base(tokens, 32, {"backend": "cpu-ref"}).save(tmp_path / "base.npz")
    base = Base.load(str(tmp_path / "base.npz"))
    assert base.chunks == 3 and (base.tail_mass > 0) == (top is not None)
    again, kl = kl_divergence(ref, base)
    assert again.perplexity == p.perplexity
    assert kl.tokens == p.tokens_scored == 45
    assert kl.mean == kl.p99 == kl.max == 0.0 and kl.same_top == 1.0 and kl.ln_ppl_ratio == 0.0


def test_a_perturbed_run_gives_kl_above_zero(kl_engines):
    ref, fast, tokens = kl_engines
    rec = Recorder(ref.cfg.vocab_size)
    perplexity(ref, tokens, ctx=32, observe=rec)
    base = rec.base(tokens, 32, {})
    _, kl = kl_divergence(fast, base)  # quantized activations: close to the reference, not equal
    assert 0 < kl.mean <= kl.p99 <= kl.max and kl.tokens == 45

    meter = KLMeter(base)  # the reference with its logits moved: more so
    perplexity(ref, tokens, ctx=32, observe=lambda logits, t: meter(logits + np.linspace(0, 1, logits.shape[1]), t))
    moved = meter.result()
    assert moved.mean > kl.mean and moved.same_top < 1.0


def test_a_base_that_is_not_one_is_refused_by_name(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("not a base")
    np.savez(tmp_path / "other.npz", a=np.zeros(3))
    for path in (text, tmp_path / "other.npz"):
        with pytest.raises(ValueError, match="is not a KL base"):
            Base.load(str(path))


def test_cli_saves_a_base_and_compares_with_it(synth_model, tmp_path, capsys):
    from ntransformerd.tools.ntx_model import main

    path, base = synth_model("tiny", "q8_0"), str(tmp_path / "base.npz")
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"word{i}" for i in range(400)))
    assert main(["perplexity", path, "--file", str(text), "--ctx", "32", "--chunks", "2", "--backend", "cpu-ref",
                 "--save-logits", base, "--logits-top", "64"]) == 0
    capsys.readouterr()
    assert main(["perplexity", path, "--kl-divergence", base, "--backend", "cpu-ref", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ctx"] == 32 and out["chunks"] == 2
    kl = out["kl_divergence"]
    assert kl["mean"] == 0.0 and kl["same_top"] == 1.0 and kl["tokens"] == 2 * 15
    assert kl["base_about"]["backend"] == "cpu-ref"
    assert main(["perplexity", path, "--kl-divergence", base, "--ctx", "64"]) == 2
    assert "was run with --ctx 32" in capsys.readouterr().err
    assert main(["perplexity", path, "--kl-divergence", str(text)]) == 2
    assert "is not a KL base" in capsys.readouterr().err
