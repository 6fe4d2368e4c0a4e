"""The fast CPU backend (backends/host) against the float32 reference, step by step.

The reference (backends/cpu.py) dequantizes every weight to float32; the fast backend
multiplies GGUF blocks by int8-quantized activations. With F32 weights the two compute the same
sums in another order (agreement to float rounding); with quantized weights they differ by the
activations' 8-bit rounding, which the bound below allows for: each logit's error is a sum of
per-block errors of at most d_a/2 · Σ|w| (d_a = amax/127 of the block), so relative to the
logits' scale it stays within a few percent, and the argmax agrees wherever the top two
logits are not close.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from ntransformerd.engine.backends import cpu as ref
from ntransformerd.engine.backends import host
from ntransformerd.engine.backends.host import native
from ntransformerd.engine.gguf_file import GGUFModel
from ntransformerd.engine.runtime.engine import Engine, EngineConfig
from ntransformerd.engine.runtime.model import Batch, Segment, forward
from ntransformerd.engine.generation.sampler import TopLogits
from ntransformerd.settings import SettingError
from ntransformerd.tools import ntx_model
from ntransformerd.tools.synth import Shape, synthesize

pytestmark = pytest.mark.skipif(not host.available(), reason="no C compiler for the CPU kernels")

SMALL = Shape(n_layers=2, d_model=256, d_ff=512, n_heads=4, n_kv_heads=2, vocab=2048)
TYPES = ("f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k")


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("host")
    cache = {}

    def make(ftype: str) -> GGUFModel:
        if ftype not in cache:
            path = os.path.join(d, f"small-{ftype}.gguf")
            synthesize(path, shape=SMALL, ftype=ftype, seed=3)
            cache[ftype] = GGUFModel(path)
        return cache[ftype]

    return make


class Pair:
    """The fast backend and the reference on one model, each with its own KV cache."""

    def __init__(self, model: GGUFModel, *, kv_dtype: str = "f32", threads: int | None = None, max_ctx: int = 64):
        cfg = model.config
        self.cfg = cfg
        ops, w = host.load(model)
        self.kv = host.kv_cache(cfg, n_slots=4, max_ctx=max_ctx, dtype=kv_dtype)
        self.steps = host.HostSteps(ops, w, self.kv, threads=threads)
        self.rops, self.rw = ref.load(model)
        self.rkv = ref.kv_cache(cfg, n_slots=4, max_ctx=max_ctx, dtype=kv_dtype)

    def both(self, segments, **kw):
        b = Batch.of(segments)
        return self.steps.run(b, **kw), forward(self.rops, self.cfg, self.rw, self.rkv, b, **kw)


def ragged_steps(vocab: int, rng):
    """Prefill chunks of two sequences, then a step mixing a decode token, a 2-token verify
    segment and a third sequence's prefill."""
    yield [Segment(0, 0, rng.integers(0, vocab, 7)), Segment(2, 0, rng.integers(0, vocab, 3))]
    yield [Segment(0, 7, rng.integers(0, vocab, 1)), Segment(2, 3, rng.integers(0, vocab, 2)),
           Segment(1, 0, rng.integers(0, vocab, 5))]
    yield [Segment(s, p, rng.integers(0, vocab, 1)) for s, p in ((0, 8), (1, 5), (2, 5))]


def close_enough(fast: np.ndarray, exact: np.ndarray, ftype: str) -> str | None:
    """None if `fast` is within the bound of its type, else what is wrong."""
    scale = float(np.abs(exact).max())
    err = float(np.abs(fast - exact).max())
    if ftype in ("f32", "f16", "bf16"):
        bound = 1e-4 * scale  # float sums in another order
    else:
        bound = 0.04 * scale  # 8-bit activations through two layers (module docstring)
    if not err <= bound:
        return f"max error {err:.3g} over the bound {bound:.3g} (logit scale {scale:.3g})"
    cos = float((fast * exact).sum() / np.sqrt((fast * fast).sum() * (exact * exact).sum()))
    if cos < 0.999:
        return f"cosine similarity {cos:.5f} < 0.999"
    return None


@pytest.mark.parametrize("ftype", TYPES)
def test_forward_matches_the_reference(small_model, ftype):
    """Every weight type, ragged batches (prefill chunks, decode and verify segments of several
    slots in one step), all rows' logits."""
    m = small_model(ftype)
    p = Pair(m)
    rng = np.random.default_rng(0)
    for i, segs in enumerate(ragged_steps(m.config.vocab_size, rng)):
        fast, exact = p.both(segs, all_logits=True)
        assert fast.shape == exact.shape
        problem = close_enough(fast, exact, ftype)
        assert problem is None, f"{ftype} step {i}: {problem}"


def test_last_rows_layers_and_f16_cache(small_model):
    """Each segment's last row only; a prefix of the layers (a self-draft); an F16 KV cache."""
    m = small_model("f32")
    p = Pair(m, kv_dtype="f16")
    rng = np.random.default_rng(1)
    for segs in ragged_steps(m.config.vocab_size, rng):
        fast, exact = p.both(segs)
        assert fast.shape == (len(segs), m.config.vocab_size)
        assert close_enough(fast, exact, "f32") is None
        fast, exact = p.both([Segment(3, int(p.kv.lengths[3]), rng.integers(0, 100, 2))], layers=[0])
        p.kv.lengths[3] += 2
        assert close_enough(fast, exact, "f32") is None


def test_threads_do_not_change_the_sums(small_model):
    """Work is split by output columns and (row, KV head): any thread count gives the same bits."""
    m = small_model("q4_k")
    one, many = Pair(m, threads=1), Pair(m, threads=3)
    rng = np.random.default_rng(2)
    for segs in ragged_steps(m.config.vocab_size, rng):
        a = one.steps.run(Batch.of(segs), all_logits=True)
        b = many.steps.run(Batch.of(segs), all_logits=True)
        assert np.array_equal(a, b)


def test_one_recording_serves_every_batch_shape(small_model):
    m = small_model("q8_0")
    p = Pair(m)
    rng = np.random.default_rng(3)
    for segs in ragged_steps(m.config.vocab_size, rng):
        p.both(segs)
    assert len(p.steps.tapes) == 1


def test_top_equals_the_host_reference():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((5, 3000)).astype(np.float32)
    x[1, 7] = x[1, 9] = 50.0  # a tie: the lower id first
    x[2, :100] = np.nan
    x[3, :] = -np.inf
    lib = native.load()
    for n in (1, 7, 40, 300):
        got, want = host.top_rows(lib, x, n, threads=2), TopLogits.of(x, n)
        assert np.array_equal(got.ids, want.ids) and np.array_equal(got.vals, want.vals)
        assert np.array_equal(got.nan, want.nan)


@pytest.mark.parametrize("variant", [v.name for v in native.VARIANTS])
def test_every_instruction_set_variant(small_model, variant, monkeypatch):
    """Each build variant this CPU can run gives the reference's logits (the portable one always runs)."""
    v = next(x for x in native.VARIANTS if x.name == variant)
    if not all(f in native.cpu_flags() for f in v.needs):
        pytest.skip(f"this CPU lacks {variant}")
    lib = native.load(variant)
    assert lib.isa().decode() == variant
    m = small_model("q4_1")
    ops, w = host.load(m)
    ops.lib = lib
    kv = host.kv_cache(m.config, n_slots=4, max_ctx=64, dtype="f32")
    steps = host.HostSteps(ops, w, kv)
    rops, rw = ref.load(m)
    rkv = ref.kv_cache(m.config, n_slots=4, max_ctx=64, dtype="f32")
    rng = np.random.default_rng(5)
    for segs in ragged_steps(m.config.vocab_size, rng):
        b = Batch.of(segs)
        assert close_enough(steps.run(b), forward(rops, m.config, rw, rkv, b), "q4_1") is None


def test_the_cpu_kernels_setting_picks_the_build(small_model):
    """cpu_kernels pins the variant an engine's steps and embedding run, whatever the CPU's best."""
    engine = Engine(small_model("q4_1"), config=EngineConfig(backend="cpu", max_ctx=32, max_batch=2,
                                                             cpu_kernels="generic"))
    assert engine.ops.lib.isa() == b"generic" and engine.weights.lib is engine.ops.lib
    assert engine.steps.lib is engine.ops.lib
    auto = Engine(small_model("q4_1"), config=EngineConfig(backend="cpu", max_ctx=32, max_batch=2))
    assert auto.ops.lib.variant == native.best_variant()


AVX2_ONLY = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"})


def test_a_variant_the_cpu_cannot_run_is_refused_naming_the_flags_it_lacks(small_model, monkeypatch, capsys):
    with pytest.raises(native.UnsupportedVariant, match="lacks avx512f avx512bw avx512vl avx512_vnni, which the "
                                                        r"avx512 kernels need: use auto \(avx2 here\)"):
        native.choose("avx512", AVX2_ONLY)
    assert native.choose("avx2", AVX2_ONLY).name == native.choose("auto", AVX2_ONLY).name == "avx2"
    assert native.choose("generic", frozenset()).name == "generic"
    with pytest.raises(ValueError, match="'sse' is not one of avx512, avx2, generic"):
        native.choose("sse")
    # at load, named as the program names the setting; nothing is built or loaded
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset())
    monkeypatch.setattr(native, "build", lambda v, **kw: pytest.fail(f"built {v.name}"))
    with pytest.raises(SettingError) as e:
        host.load(small_model("q4_1"), cpu_kernels="avx2")
    assert str(e.value).startswith("cpu_kernels = 'avx2': this CPU lacks avx2 fma f16c bmi2, which the avx2 "), e.value
    path = small_model("q4_1").path
    assert ntx_model.main(["run", path, "--backend", "cpu", "--cpu-kernels", "avx2", "--prompt", "hi"]) == 2
    assert capsys.readouterr().err.startswith("ntx-model: error: --cpu-kernels avx2: this CPU lacks avx2 fma ")


def test_pieces_compose_to_the_whole_pass(small_model):
    """The host's share of a multi-device step: embed and layer 0 handing hidden states out,
    then layer 1 and the head from them, gives the whole pass's bits (the hand-off buffer is
    poisoned between the pieces)."""
    m = small_model("q8_0")
    whole, split = Pair(m), Pair(m)
    rng = np.random.default_rng(6)
    for segs in ragged_steps(m.config.vocab_size, rng):
        b = Batch.of(segs)
        want = whole.steps.run(b, all_logits=True)
        hand = np.full((len(b.tokens), m.config.d_model), np.nan, np.float32)
        split.steps.run(b, layers=[0], head=False, out=hand)
        x = hand.copy()
        hand[:] = np.nan
        got = split.steps.run(b, x=x, layers=[1], all_logits=True)
        assert np.array_equal(got, want)


GOLDEN = os.path.join(os.path.dirname(__file__), "..", "golden")


@pytest.fixture(scope="module")
def fast_engine(default_model):
    from ntransformerd.engine.runtime.engine import Engine, EngineConfig
    return Engine(default_model, config=EngineConfig(backend="cpu", max_batch=4, max_ctx=1024))


def test_perplexity_within_a_percent_of_the_exact_run(fast_engine):
    """The default model on the GPL-3 text, ctx 512, the golden's first chunks: the exact run
    (llama.cpp on the all-F32 copy, which our float32 reference equals to 1e-6) against the
    fast backend's 8-bit activations. Those make the figure chaotic: a change of the attention's
    float rounding alone (1e-7 of its output) moves one 255-token chunk by up to a percent either
    way (bench/RESULTS.md), so two chunks are held to 1% (a wrong kernel is off by far more)."""
    import json
    import math

    from ntransformerd.engine.calibration.perplexity import perplexity
    with open(os.path.join(GOLDEN, "perplexity_smollm2.json")) as f:
        g = json.load(f)
    if not os.path.exists(g["text"]):
        pytest.skip(f"{g['text']} is missing")
    chunks = 2
    exact = math.exp(sum(c["nll_sum"] for c in g["chunks"][:chunks]) / sum(c["tokens"] for c in g["chunks"][:chunks]))
    p = perplexity(fast_engine, g["ids"], ctx=g["ctx"], max_chunks=chunks)
    assert abs(p.perplexity / exact - 1) < 0.01, f"fast {p.perplexity:.4f}, exact {exact:.4f}"


def test_greedy_matches_llama_cpp_q4_1_where_it_is_decisive(fast_engine):
    """llama.cpp on the Q4_1 file also multiplies 8-bit activations: wherever its top-2 margin
    is above 1.0 the fast backend picks the same token (up to its first close call)."""
    import json
    with open(os.path.join(GOLDEN, "forward_smollm2.json")) as f:
        g = json.load(f)
    e, compared = fast_engine, []
    for p in g["prompts"]:
        slot = e.open()
        try:
            logits, cont = e.prefill(slot, p["prompt_ids"]), []
            n = next((i for i, m in enumerate(p["q4_1_margins"]) if m <= 1.0), len(p["q4_1_margins"]))
            for _ in range(n):
                cont.append(int(np.argmax(logits)))
                logits = e.step([(slot, [cont[-1]])])[0]
        finally:
            e.close(slot)
        assert cont == p["q4_1_continuation"][:n], (p["name"], cont, p["q4_1_continuation"][:n])
        compared.append(n)
    assert max(compared) >= 16, f"too few decisive steps to compare: {compared}"


@pytest.mark.parametrize("ftype", ["q4_1", "q8_0", "q4_k", "q6_k", "f16"])
def test_a_row_gives_the_same_bits_in_any_batch(small_model, ftype):
    """A row's logits do not depend on the other rows of its step (tiles of rows, remainders):
    what makes a k-token verify step agree with k one-token steps, and batched decode with solo."""
    m = small_model(ftype)
    solo, batched = Pair(m), Pair(m)
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, m.config.vocab_size, 9)
    solo.steps.run(Batch.of([Segment(0, 0, prompt)]))
    batched.steps.run(Batch.of([Segment(0, 0, prompt)]))
    others = [Segment(s, 0, rng.integers(0, m.config.vocab_size, n)) for s, n in ((1, 3), (2, 5), (3, 2))]
    for step in range(3):
        tok = rng.integers(0, m.config.vocab_size, 1)
        a = solo.steps.run(Batch.of([Segment(0, 9 + step, tok)]))
        b = batched.steps.run(Batch.of([Segment(0, 9 + step, tok)] + others))
        assert np.array_equal(a[0], b[0]), (ftype, step)
        others = [Segment(s.slot, s.start + len(s.tokens), rng.integers(0, m.config.vocab_size, 1 + step))
                  for s in others]


def test_long_context_rows_give_one_answer(small_model):
    """Past 1024 positions a row's attention runs in splits of 1024 keys merged in order
    (kernels/cpu/attention.h), over a step's threads, or each head's splits in one item where
    the step's room for partials is spent: a row's bits still follow from its own position and
    data. One sequence prefilled to 2500 in chunks of 500 alone on one thread, and in chunks of
    384 beside another sequence's prefill on three threads, then decoded alone and beside a
    decode row: the same logits, and within the 8-bit bound of the float reference."""
    m = small_model("q8_0")
    vocab = m.config.vocab_size
    alone = Pair(m, kv_dtype="f16", threads=1, max_ctx=2600)
    beside = Pair(m, kv_dtype="f16", threads=3, max_ctx=2600).steps
    rng = np.random.default_rng(9)
    prompt, other = rng.integers(0, vocab, 2500), rng.integers(0, vocab, 1400)
    for p0 in range(0, 2500, 500):
        a, exact = alone.both([Segment(0, p0, prompt[p0:p0 + 500])])
    for i, p0 in enumerate(range(0, 2500, 384)):
        b = beside.run(Batch.of([Segment(0, p0, prompt[p0:p0 + 384]), Segment(1, 200 * i, other[200 * i:200 * i + 200])]))
    assert np.array_equal(a[0], b[0]) and close_enough(a, exact, "q8_0") is None
    for step in range(3):
        tok, tok1 = rng.integers(0, vocab, 1), rng.integers(0, vocab, 1)
        a, exact = alone.both([Segment(0, 2500 + step, tok)])
        b = beside.run(Batch.of([Segment(1, 1400 + step, tok1), Segment(0, 2500 + step, tok)]))
        assert np.array_equal(a[0], b[1]), step
        assert close_enough(a, exact, "q8_0") is None, step


def test_the_host_as_two_devices_gives_one_devices_bits(small_model):
    """The host-as-device path: layer 0 on one host device, layer 1 and the head on another,
    each running its pieces as recorded steps, the activation handed over (and the old buffer
    poisoned) between them; every step's logits are the one-device engine's bits."""
    from ntransformerd.engine.runtime.engine import Engine, EngineConfig
    from ntransformerd.engine.tiers.multi import MultiPlan
    from ntransformerd.engine.tiers.planner import VRAM, Plan

    m = small_model("q4_1")
    cfg = dict(backend="cpu", max_batch=4, max_ctx=64, prefill_chunk=16)
    one = Engine(m, config=EngineConfig(**cfg))
    lb = [m.layer_bytes(i) for i in range(2)]
    plans = tuple(Plan((VRAM,), (b,), 0, 0, 0, 0, 0, -1, -1) for b in lb)
    two = Engine(m, config=EngineConfig(**cfg), plan=MultiPlan(plans, (0, 1), (55e9, 55e9), -1), poison=True)
    assert [st.recorded for st in two.pipeline.stages] == [True, True]
    rng = np.random.default_rng(8)
    for e in (one, two):
        e.open(), e.open()
    for step in range(4):
        items = [(0, rng.integers(0, 2048, 5 if step == 0 else 1)), (1, rng.integers(0, 2048, 3 if step == 0 else 2))]
        a, b = one.step(items, all_logits=True), two.step(items, all_logits=True)
        assert np.array_equal(a, b), step
    assert two.pipeline.handoff.stats["copies"] == 4
