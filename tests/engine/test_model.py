"""The forward pass: golden agreement with llama.cpp, and the engine's batching invariants."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from ntransformerd.engine.backends import cpu
from ntransformerd.engine.runtime.engine import Engine, EngineConfig
from ntransformerd.engine.gguf_file import GGUFModel
from ntransformerd.engine.runtime.model import Batch, Segment

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "golden")


@pytest.fixture(scope="module")
def golden():
    with open(os.path.join(GOLDEN, "forward_smollm2.json")) as f:
        g = json.load(f)
    logits = np.load(os.path.join(GOLDEN, "forward_smollm2_logits.npz"))
    return g, logits


def greedy(engine: Engine, prompt_ids, n: int):
    slot = engine.open()
    try:
        logits = engine.prefill(slot, prompt_ids)
        first = logits.copy()
        out = []
        for _ in range(n):
            tok = int(np.argmax(logits))
            out.append(tok)
            logits = engine.step([(slot, [tok])])[0]
        return first, out
    finally:
        engine.close(slot)


@pytest.fixture(scope="module")
def ours(default_engine, golden):
    """Our last-prompt-position logits and 64-token greedy continuation for every golden prompt."""
    g, _ = golden
    return {p["name"]: greedy(default_engine, p["prompt_ids"], g["n_generate"]) for p in g["prompts"]}


def test_golden_prompts_cover_the_acceptance(golden):
    g, _ = golden
    assert len(g["prompts"]) >= 5
    assert any("messages" in p for p in g["prompts"])
    assert max(len(p["prompt_ids"]) for p in g["prompts"]) >= 300


def test_forward_matches_llama_cpp_f32(default_engine, golden, ours):
    """Against llama.cpp on the all-F32 copy with an F32 KV cache.

    Our CPU backend dequantizes every weight to float32 at load with gguf.quants (bit-exact
    with ggml), so running it on the Q4_1 file computes exactly what it computes on the F32
    copy that llama.cpp ran; tests/golden/make_forward_golden.py says how that was made.
    """
    g, ref_logits = golden
    tok = default_engine.tokenizer
    for p in g["prompts"]:
        ids = p["prompt_ids"]
        assert tok.encode(p["text"]) == ids, p["name"]
        if "messages" in p:
            assert default_engine.encode_chat(p["messages"]) == ids, p["name"]
        first, cont = ours[p["name"]]
        err = float(np.abs(first - ref_logits[p["name"]]).max())
        assert err < 1e-3, f"{p['name']}: last-position logits differ by {err:.2e}"
        diverge = next((i for i, (a, b) in enumerate(zip(cont, p["f32_continuation"])) if a != b), None)
        assert diverge is None, (f"{p['name']}: greedy continuation diverges at step {diverge}: "
                                 f"{cont[diverge]} vs llama.cpp {p['f32_continuation'][diverge]}")


def test_q4_1_greedy_matches_where_llama_cpp_is_decisive(golden, ours):
    """llama.cpp on the Q4_1 file rounds activations to 8 bits; where its top-2 margin is
    > 1.0 our float32 engine must pick the same token (compared up to the first close call)."""
    g, _ = golden
    compared = []
    for p in g["prompts"]:
        _, cont = ours[p["name"]]
        n = next((i for i, m in enumerate(p["q4_1_margins"]) if m <= 1.0), len(p["q4_1_margins"]))
        assert cont[:n] == p["q4_1_continuation"][:n], p["name"]
        compared.append(n)
    assert max(compared) >= 16, f"too few decisive steps to compare: {compared}"


def test_batched_decode_equals_solo(default_engine):
    e = default_engine
    prompts = [e.tokenizer.encode(t) for t in ("Once upon a time", "import numpy as np\n", "1 2 3 4")]
    solo = [greedy(e, p, 8)[1] for p in prompts]
    slots = [e.open() for _ in prompts]
    try:
        logits = np.stack([e.prefill(s, p) for s, p in zip(slots, prompts)])
        outs = [[] for _ in prompts]
        for _ in range(8):
            toks = [int(np.argmax(row)) for row in logits]
            for o, t in zip(outs, toks):
                o.append(t)
            logits = e.decode(slots, toks)
        assert outs == solo
    finally:
        for s in slots:
            e.close(s)


def test_mixed_prefill_and_decode_in_one_step(default_engine):
    """A step may carry one sequence's prefill chunk beside another's decode token."""
    e = default_engine
    a, b = e.tokenizer.encode("The sun is"), e.tokenizer.encode("def add(a, b):")
    ref_a = greedy(e, a, 2)[1]
    ref_b_first = greedy(e, b, 1)[0]
    sa, sb = e.open(), e.open()
    try:
        la = e.prefill(sa, a)
        t = int(np.argmax(la))
        out = e.step([(sa, [t]), (sb, b)])
        assert [t, int(np.argmax(out[0]))] == ref_a
        np.testing.assert_allclose(out[1], ref_b_first, atol=1e-4)
    finally:
        e.close(sa)
        e.close(sb)


def test_a_batch_flattens_its_segments_in_order():
    """Batch.of (and Batch.packed, which the engine builds from rows it already holds flat): row r
    is the r-th token of the segments in order, at its segment's start plus its place in it."""
    segs = [Segment(3, 10, np.array([5, 6, 7])), Segment(0, 0, [9]), Segment(1, 31, (2, 4))]
    b = Batch.of(segs)
    assert b.tokens.tolist() == [5, 6, 7, 9, 2, 4] and b.positions.tolist() == [10, 11, 12, 0, 31, 32]
    assert b.offsets.tolist() == [0, 3, 4, 6] and b.last_rows.tolist() == [2, 3, 5]
    assert b.tokens.dtype == b.positions.dtype == b.offsets.dtype == np.int64 and b.segments == tuple(segs)
    with pytest.raises(ValueError):
        Batch.of([])


def test_decode_rows_in_a_step_are_their_own_arrays(default_engine, monkeypatch):
    """The engine packs a step of one-token rows at once: each segment's tokens are its own array,
    apart from the batch's (a device writing a draw into a segment leaves the batch as built)."""
    e = default_engine
    seen = []
    monkeypatch.setattr(e.pipeline, "step", lambda batch, **kw: seen.append(batch) or np.zeros((3, 1), np.float32))
    slots = [e.open() for _ in range(3)]
    try:
        e.step([(s, [t]) for s, t in zip(slots, (11, 12, 13))])
        batch, = seen
        batch.segments[0].tokens[-1] = 99
        assert batch.tokens.tolist() == [11, 12, 13] and [s.tokens.tolist() for s in batch.segments] == [[99], [12], [13]]
        assert batch.positions.tolist() == [0, 0, 0] and [s.slot for s in batch.segments] == slots
        assert [e.length(s) for s in slots] == [1, 1, 1]
    finally:
        for s in slots:
            e.close(s)


def test_chunked_prefill_equals_whole(default_model):
    prompt = list(range(1000, 1100))
    whole = Engine(default_model, config=EngineConfig(backend="cpu", max_batch=1, max_ctx=256, prefill_chunk=512))
    chunked = Engine(default_model, config=EngineConfig(backend="cpu", max_batch=1, max_ctx=256, prefill_chunk=7))
    sw, sc = whole.open(), chunked.open()
    np.testing.assert_allclose(chunked.prefill(sc, prompt), whole.prefill(sw, prompt), atol=2e-4)


def test_f16_kv_cache_close_to_f32(default_model):
    prompt = list(range(2000, 2040))
    e16 = Engine(default_model, config=EngineConfig(backend="cpu-ref", max_batch=1, max_ctx=128, kv_dtype="f16"))
    e32 = Engine(default_model, config=EngineConfig(backend="cpu-ref", max_batch=1, max_ctx=128))
    a, b = e16.prefill(e16.open(), prompt), e32.prefill(e32.open(), prompt)
    assert np.abs(a - b).max() < 0.05 and not np.array_equal(a, b)
    assert np.argmax(a) == np.argmax(b)


def test_context_full_is_an_error(default_model):
    from ntransformerd.engine.runtime.engine import ContextFull
    e = Engine(default_model, config=EngineConfig(backend="cpu", max_batch=1, max_ctx=8))
    s = e.open()
    e.prefill(s, [1, 2, 3, 4, 5, 6])
    with pytest.raises(ContextFull):
        e.step([(s, [1, 2, 3])])
    assert e.length(s) == 6


def test_a_launch_after_a_step_runs_its_draws_and_checks_its_rows(default_model):
    """Engine.launch with `after` (a step whose draws the host holds here): item i runs after's
    draw of row rows[i] where rows[i] ≥ 0, its own tokens elsewhere; with every rows[i] < 0 it
    runs its own; an item that runs a draw runs one token, whether every row runs a draw or
    some do (nothing runs then)."""
    from ntransformerd.engine.generation.sampler import Drawn
    from ntransformerd.engine.runtime.engine import Launch, Ran
    e = Engine(default_model, config=EngineConfig(backend="cpu", max_batch=4, max_ctx=64))
    a, b, c, d = (e.open() for _ in range(4))
    e.step([(s, [1, 2, 3]) for s in (a, b, c, d)])
    after = Launch(Ran(Drawn(np.array([7, 9]), np.zeros(2, np.int8))))
    got = e.launch([(a, [0]), (b, [5])], after=after, rows=[1, -1]).result()
    assert np.array_equal(got, e.step([(c, [9]), (d, [5])]))
    got = e.launch([(a, [4]), (b, [6])], after=after, rows=[-1, -1]).result()
    assert np.array_equal(got, e.step([(c, [4]), (d, [6])]))
    for rows in ([0, 1], [0, -1]):
        with pytest.raises(ValueError, match="runs one token"):
            e.launch([(a, [1, 2]), (b, [3])], after=after, rows=rows)
    assert [e.length(s) for s in (a, b, c, d)] == [5, 5, 5, 5]


# ---- op-level references -------------------------------------------------------------------

def _ops(neox: bool, rope_dim: int = 16, factors=None):
    from ntransformerd.engine.gguf_file import LlamaConfig
    cfg = LlamaConfig(n_layers=1, d_model=32, d_ff=64, n_heads=2, n_kv_heads=1, head_dim=16, vocab_size=10,
                      context_length=64, rms_eps=1e-5, rope_base=10000.0, rope_dim=rope_dim, rope_neox=neox,
                      rope_scale=1.0, tied_output=True)
    return cpu.CpuOps(cfg, factors), cfg


@pytest.mark.parametrize("neox", [False, True])
def test_rope_against_complex_rotation(neox):
    ops, cfg = _ops(neox, rope_dim=12)
    rng = np.random.default_rng()
    x = rng.standard_normal((5, 2 * 16)).astype(np.float32)
    pos = np.array([0, 1, 7, 33, 63])
    y = ops.rope(x, ops.rope_table(pos), 2).reshape(5, 2, 16)
    xs = x.reshape(5, 2, 16).astype(np.float64)
    half = 6
    if neox:
        z = xs[..., :half] + 1j * xs[..., half:12]
    else:
        z = xs[..., 0:12:2] + 1j * xs[..., 1:12:2]
    theta = pos[:, None, None] * 10000.0 ** (-2 * np.arange(half) / 12)
    r = z * np.exp(1j * theta)
    want = xs.copy()
    if neox:
        want[..., :half], want[..., half:12] = r.real, r.imag
    else:
        want[..., 0:12:2], want[..., 1:12:2] = r.real, r.imag
    np.testing.assert_allclose(y, want, atol=1e-5)
    np.testing.assert_array_equal(y[..., 12:], x.reshape(5, 2, 16)[..., 12:])  # beyond rope_dim untouched


def test_rope_freq_factors_divide_frequencies():
    factors = np.array([1, 2, 4, 8, 8, 8, 8, 8], np.float32)
    ops, _ = _ops(False, factors=factors)
    plain, _ = _ops(False)
    np.testing.assert_allclose(ops.freqs, plain.freqs / factors)


def test_llama31_rope_factors_shape():
    from ntransformerd.tools.synth import llama31_rope_factors
    f = llama31_rope_factors(128, 500000.0)
    assert f.shape == (64,) and f[0] == 1.0 and f[-1] == 8.0 and np.all(np.diff(f) >= 0)


def test_rms_norm_and_swiglu_reference():
    x = np.array([[3.0, 4.0]], np.float32)
    y = cpu.CpuOps.rms_norm(x, np.array([1.0, 2.0], np.float32), 0.0)
    np.testing.assert_allclose(y, [[3 / np.sqrt(12.5), 8 / np.sqrt(12.5)]], rtol=1e-6)
    g, u = np.array([0.0, 1.0], np.float32), np.array([2.0, 3.0], np.float32)
    np.testing.assert_allclose(cpu.CpuOps.swiglu(g, u), [0.0, 3 / (1 + np.exp(-1))], rtol=1e-6)


@pytest.mark.parametrize("ftype", ["q2_k", "q3_k", "q4_k_m", "q5_k", "q6_k", "bf16"])
def test_synthetic_model_runs(synth_model, ftype):
    m = GGUFModel(synth_model("tiny", ftype))
    e = Engine(m, config=EngineConfig(backend="cpu", max_batch=2, max_ctx=64))
    logits = e.prefill(e.open(), [1, 2, 3, 4])
    assert logits.shape == (49152,) and np.isfinite(logits).all()
