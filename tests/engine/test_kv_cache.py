"""The paged KV cache (engine/runtime/kv_cache.py) and the host kernels that read it (kernels/cpu/attention.c):
blocks from one pool, block tables, quantized rows (q8_0, q4_0), and greedy ids on the real model
against the contiguous slots × max_ctx cache this one replaced (tests/golden/make_kv_golden.py)."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants as gguf_quants

from ntransformerd.engine.backends import cpu as ref
from ntransformerd.engine.backends import host
from ntransformerd.engine.backends.host import native
from ntransformerd.engine.runtime.engine import Engine, EngineConfig
from ntransformerd.engine.gguf_file import GGUFModel, LlamaConfig
from ntransformerd.engine.runtime.kv_cache import (BLOCK_SIZE, KV_TYPES, BlockTable, KVCache, KVLayer, KVPoolFull,
                                                   bytes_per_token)
from ntransformerd.engine.runtime.model import Batch, Segment, forward
from ntransformerd.tools.synth import Shape, synthesize

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "golden")
LICENSES = "/usr/share/common-licenses"
needs_host = pytest.mark.skipif(not host.available(), reason="no C compiler for the CPU kernels")

SMALL = Shape(n_layers=2, d_model=384, d_ff=512, n_heads=6, n_kv_heads=2, vocab=2048)  # g = 3, hd = 64


@pytest.fixture(scope="module")
def f32_model(tmp_path_factory) -> GGUFModel:
    """Float weights: the fast backend computes what the reference computes, up to float rounding."""
    path = os.path.join(tmp_path_factory.mktemp("kv"), "small-f32.gguf")
    synthesize(path, shape=SMALL, ftype="f32", seed=11)
    return GGUFModel(path)


# ---- the block table --------------------------------------------------------------------------

def test_a_sequence_grows_block_by_block():
    t = BlockTable(n_slots=3, max_ctx=100, n_blocks=10, block_size=16)
    assert t.max_blocks == 7 and t.free_blocks == 10
    t.reserve(0, 1)
    assert t.held[0] == 1 and t.kept(0) == 16
    t.reserve(0, 16)  # the block's last position: no new block
    assert t.held[0] == 1
    t.reserve(0, 17)  # one past the boundary: the next block
    assert t.held[0] == 2 and t.free_blocks == 8
    t.reserve(1, 40)
    assert list(t.tables[1, :3]) == [2, 3, 4] and t.tables[1, 3] == -1
    blocks, offsets = t.locate(1, 14, 18)
    assert list(blocks) == [2, 2, 3, 3] and list(offsets) == [14, 15, 0, 1]
    t.release(1, 17)  # positions ≥ 17 forgotten: block 4 back
    assert t.held[1] == 2 and t.free_blocks == 6 and t.tables[1, 2] == -1
    t.reserve(2, 16)
    assert t.tables[2, 0] == 4  # the lowest free block first: touched memory stays compact
    with pytest.raises(ValueError, match="exceed the context of 100"):
        t.reserve(2, 101)
    with pytest.raises(ValueError, match="out of range"):
        t.reserve(3, 1)
    with pytest.raises(ValueError, match="holds 16 positions, not 20"):
        t.locate(2, 0, 20)


def test_closed_slots_keep_their_blocks_until_the_pool_needs_them():
    t = BlockTable(n_slots=3, max_ctx=64, n_blocks=6, block_size=16)
    t.reserve(0, 32)
    t.reserve(1, 32)
    t.closed(0)
    t.closed(1)  # 0 closed first: it gives its blocks back first
    assert t.kept(0) == t.kept(1) == 32
    t.reserve(2, 48)  # 2 free, 3 needed: slot 0's go back (both of them), slot 1 keeps its own
    assert t.kept(0) == 0 and t.kept(1) == 32 and t.held[2] == 3
    t.opened(1)  # reopened: no longer the pool's to take
    t.reserve(1, 48)  # the last free block
    with pytest.raises(KVPoolFull, match=r"slot 2 needs 1 more blocks .* 0 of 6 are free \(6 held by live .*kv_blocks"):
        t.reserve(2, 64)
    assert t.held[2] == 3


def test_kv_cache_checks_its_arguments():
    cfg = LlamaConfig(n_layers=1, d_model=96, d_ff=64, n_heads=2, n_kv_heads=1, head_dim=48, vocab_size=10,
                      context_length=64, rms_eps=1e-5, rope_base=1e4, rope_dim=48, rope_neox=False, rope_scale=1.0,
                      tied_output=True)
    with pytest.raises(ValueError, match="not one of f32, f16, q8_0, q4_0"):
        KVCache(cfg, n_slots=1, max_ctx=8, dtype="q8")
    with pytest.raises(ValueError, match="head_dim 48 is not a multiple: use kv_dtype f16"):
        KVCache(cfg, n_slots=1, max_ctx=8, dtype="q8_0")
    c = KVCache(cfg, n_slots=2, max_ctx=40)
    assert c.blocks.n_blocks == 2 * 3  # default: every slot can reach max_ctx
    assert bytes_per_token(cfg, "f16") == 2 * 1 * 1 * 48 * 2


# ---- rows -------------------------------------------------------------------------------------

KV_CODES = {"f32": 0, "f16": 1, "q8_0": 8, "q4_0": 2}


@needs_host
@pytest.mark.parametrize("dtype", ["f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("hd", [32, 64, 96, 128, 256])
def test_kernel_rows_equal_gguf_quants(dtype, hd):
    """The kernels' stores are gguf.quants.quantize and their loads its dequantize, bit for bit,
    over rows of every scale, zeros, exact ties and halves of the grid."""
    rng = np.random.default_rng(hd)
    n = 301
    x = (rng.standard_normal((n, hd)) * rng.uniform(1e-3, 1e3, (n, 1))).astype(np.float32)
    x[0] = 0
    x[1, :8] = x[1, 8:16] = -4.0  # ties of the largest magnitude, negative
    x[2] = np.round(x[2] * 2) / 2  # values on halves
    qtype = KV_TYPES[dtype][0]
    want = gguf_quants.quantize(x, qtype).view(np.uint8).reshape(n, -1)
    got = np.full_like(want, 0xAB)
    lib = native.load()
    lib.kv_store_rows(KV_CODES[dtype], x.ctypes.data, n, hd, got.ctypes.data)
    bad = np.nonzero((got != want).any(axis=1))[0]
    assert bad.size == 0, f"{dtype} hd {hd}: {bad.size} rows differ, first {bad[0]}: {got[bad[0]]} vs {want[bad[0]]}"
    back = np.full((n, hd), np.nan, np.float32)
    lib.kv_load_rows(KV_CODES[dtype], got.ctypes.data, n, hd, back.ctypes.data)
    exact = gguf_quants.dequantize(want, qtype).reshape(n, hd).astype(np.float32)
    assert np.array_equal(back, exact), f"worst row {int(np.abs(back - exact).max(axis=1).argmax())}"


@pytest.mark.parametrize("dtype", ["f32", "f16", "q8_0", "q4_0"])
def test_reference_layer_reads_back_what_gguf_rounds(dtype, f32_model):
    """KVLayer writes through the table, across a block boundary, and reads the rows gguf.quants
    rounds them to; positions past what a slot holds read as zeros."""
    cfg = f32_model.config
    kv = ref.kv_cache(cfg, n_slots=3, max_ctx=80, dtype=dtype)
    rng = np.random.default_rng(1)
    k = rng.standard_normal((40, cfg.n_kv_heads, cfg.head_dim)).astype(np.float32)
    v = rng.standard_normal((40, cfg.n_kv_heads, cfg.head_dim)).astype(np.float32)
    layer = kv.layer(0)
    layer.write(2, 0, k[:10], v[:10])
    layer.write(1, 0, k[:3], v[:3])  # slot 1's block between slot 2's
    layer.write(2, 10, k[10:], v[10:])
    qtype = KV_TYPES[dtype][0]
    rounded = gguf_quants.dequantize(gguf_quants.quantize(k, qtype), qtype).reshape(k.shape)
    got_k, got_v = layer.read(2, 50)
    assert np.array_equal(got_k[:40], rounded.astype(np.float32)) and not got_k[48:].any()
    assert kv.kept(2) == 48 and list(kv.blocks.tables[2, :3]) == [0, 2, 3]


# ---- attention --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["q8_0", "q4_0"])
def test_quantized_attention_within_its_bound(f32_model, dtype):
    """The reference's attention over a quantized cache against the same over an f32 one.

    With every score off by at most δ = scale · Σ|q_i| |Δk_i| and every value by at most ε (the
    rows' own rounding, read back from the cache), each softmax weight moves by a factor within
    e^{±2δ}, so each output element moves by at most ε + (e^{2δ} − 1) · max|v|. Checked for every
    query head of a row that sees 200 positions (13 blocks).
    """
    cfg = f32_model.config
    hd, g, L = cfg.head_dim, cfg.n_heads // cfg.n_kv_heads, 200
    rng = np.random.default_rng(7)
    hk = rng.standard_normal((L - 1, cfg.n_kv_heads, hd)).astype(np.float32)
    hv = rng.standard_normal((L - 1, cfg.n_kv_heads, hd)).astype(np.float32)
    q = (rng.standard_normal((1, cfg.n_heads * hd)) * 3).astype(np.float32)
    k, v = (rng.standard_normal((1, cfg.n_kv_heads * hd)).astype(np.float32) for _ in range(2))
    batch = Batch.of([Segment(0, L - 1, np.zeros(1, np.int64))])
    ops, out, rows = ref.CpuOps(cfg), {}, {}
    for d in ("f32", dtype):
        c = KVCache(cfg, n_slots=1, max_ctx=256, dtype=d)
        c.layer(0).write(0, 0, hk, hv)
        out[d] = ops.attention(q, k, v, c.layer(0), batch).reshape(cfg.n_heads, hd)
        rows[d] = c.layer(0).read(0, L)
    (keys, values), (kq, vq) = rows["f32"], rows[dtype]
    scale = 1 / math.sqrt(hd)
    for j in range(cfg.n_heads):
        kh = j // g
        qj = np.abs(q[0, j * hd:(j + 1) * hd])
        delta = scale * float((qj[None, :] * np.abs(kq[:, kh] - keys[:, kh])).sum(axis=1).max())
        eps = float(np.abs(vq[:, kh] - values[:, kh]).max())
        bound = eps + math.expm1(2 * delta) * float(np.abs(values[:, kh]).max())
        err = float(np.abs(out[dtype][j] - out["f32"][j]).max())
        assert 0 < err <= bound, f"{dtype} head {j}: error {err:.3g}, bound {bound:.3g}"


def _pair(model: GGUFModel, dtype: str, *, block_size: int = BLOCK_SIZE, max_ctx: int = 160):
    cfg = model.config
    ops, w = host.load(model)
    kv = KVCache(cfg, n_slots=4, max_ctx=max_ctx, dtype=dtype, block_size=block_size)
    rops, rw = ref.load(model)
    rkv = KVCache(cfg, n_slots=4, max_ctx=max_ctx, dtype=dtype, block_size=block_size)
    return host.HostSteps(ops, w, kv), (rops, rw, rkv)


def _long_steps(vocab: int, rng):
    """Prefill past several blocks, a chunk with history, decode beside a prefill, a verify segment."""
    yield [Segment(0, 0, rng.integers(0, vocab, 37))]
    yield [Segment(1, 0, rng.integers(0, vocab, 20)), Segment(0, 37, rng.integers(0, vocab, 30))]
    yield [Segment(0, 67, rng.integers(0, vocab, 1)), Segment(1, 20, rng.integers(0, vocab, 1)),
           Segment(2, 0, rng.integers(0, vocab, 18))]
    yield [Segment(0, 68, rng.integers(0, vocab, 5)), Segment(2, 18, rng.integers(0, vocab, 1))]


# Logits of the kernels against the reference on float weights: the same sums in another order
# (f32), and for a rounded cache the keys and values the two store come from projections that
# differ in their last bits, so now and then one rounds to the neighbouring grid point: 2^-11 of
# it (f16), amax/127 of its block (q8_0), amax/8 (q4_0).
KERNEL_TOL = {"f32": 1e-5, "f16": 3e-4, "q8_0": 1e-3, "q4_0": 1e-2}


# A block's largest element stores grid index ±127 (q8_0: d = amax / 127) or -8 (q4_0:
# d = max / -8), so a block read back gives its scale as amax / GRID_MAX, and each value over
# that scale gives its grid index exactly (index × scale is exact in float32).
GRID_MAX = {"q8_0": 127, "q4_0": 8}


def _grid(rows: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(scale (B, 1), grid index (B, 32)) of each block of 32 of rows read back from a cache."""
    blocks = rows.reshape(-1, 32)
    d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(GRID_MAX[dtype])
    return d, blocks / np.where(d > 0, d, 1)


@needs_host
@pytest.mark.parametrize("dtype", ["f32", "f16", "q8_0", "q4_0"])
def test_host_kernels_read_the_blocks_as_the_reference(f32_model, dtype):
    """The kernels quantize as they write and read the blocks in place; the reference quantizes
    with gguf.quants and reads dequantized rows. Ragged steps past several blocks: every row's
    logits within KERNEL_TOL. And the rows both stored the same blocks up to rounding: the keys
    and values they quantize differ in their last bits (past the first layer also by what the
    other layer's rounding did to attention), so a block's amax, and with it its f16 scale,
    may land on a neighbouring f16 (then every element of the block differs, by at most 127
    such steps), and an element near a half-step may round the other way (one grid step).

    Measured on 40 input seeds with the avx2 and the generic kernels: scales at most 1.7e-3
    apart (relative) and differing in at most 5.1% of the blocks (mean 0.6%); grid indices at
    most 1 apart and differing in at most 0.45% of the elements (mean 0.05%). The bounds are
    about twice those: 2^-8, 10%, 1%. A wrong row, scale or rounding rule breaks one of them."""
    steps, (rops, rw, rkv) = _pair(f32_model, dtype)
    rng = np.random.default_rng(3)
    for i, segs in enumerate(_long_steps(f32_model.config.vocab_size, rng)):
        b = Batch.of(segs)
        fast = steps.run(b, all_logits=True)
        exact = forward(rops, f32_model.config, rw, rkv, b, all_logits=True)
        err, scale = float(np.abs(fast - exact).max()), float(np.abs(exact).max())
        assert err <= KERNEL_TOL[dtype] * scale, f"{dtype} step {i}: {err:.3g} of {scale:.3g}"
    if dtype not in GRID_MAX:
        return
    blocks = rescaled = elements = moved = 0
    for layer in range(f32_model.config.n_layers):
        for slot, n in ((0, 73), (1, 21), (2, 19)):
            mine, theirs = steps.cache.layer(layer).read(slot, n), rkv.layer(layer).read(slot, n)
            for name, a, b in zip("kv", mine, theirs):
                (da, qa), (db, qb) = _grid(a, dtype), _grid(b, dtype)
                where = f"{dtype} layer {layer} slot {slot} {name}"
                rel = (np.abs(da - db) / np.maximum(np.maximum(da, db), np.finfo(np.float32).tiny))[:, 0]
                j = int(rel.argmax())
                assert rel[j] <= 2 ** -8, f"{where}: block {j} scale {da[j, 0]} vs the reference's {db[j, 0]}"
                step = np.abs(qa - qb).max(axis=1)
                j = int(step.argmax())
                assert step[j] <= 1, f"{where}: block {j} grid indices {qa[j]} vs the reference's {qb[j]}"
                blocks, rescaled = blocks + da.size, rescaled + int((da != db).sum())
                elements, moved = elements + qa.size, moved + int((qa != qb).sum())
    assert rescaled <= 0.10 * blocks, f"{dtype}: {rescaled} of {blocks} blocks stored another scale"
    assert moved <= 0.01 * elements, f"{dtype}: {moved} of {elements} elements stored another grid point"


@needs_host
@pytest.mark.parametrize("dtype", ["f32", "q8_0"])
def test_the_layout_does_not_change_the_bits(f32_model, dtype):
    """Blocks of 1, 5, 16 or max_ctx positions, a sequence's blocks interleaved with another's or
    in order: the same logits, bit for bit, on both backends (the kernels walk keys in their own
    tiles whatever the blocks; the reference gathers the same rows)."""
    vocab = f32_model.config.vocab_size
    runs = {}
    for bs in (1, 5, BLOCK_SIZE, 160):
        steps, (rops, rw, rkv) = _pair(f32_model, dtype, block_size=bs)
        rng = np.random.default_rng(4)
        out = []
        for segs in _long_steps(vocab, rng):
            b = Batch.of(segs)
            out.append((steps.run(b, all_logits=True), forward(rops, f32_model.config, rw, rkv, b, all_logits=True)))
        runs[bs] = out
        if bs == BLOCK_SIZE:
            assert list(steps.cache.blocks.tables[0, :5]) == [0, 1, 2, 5, 6]  # slot 1's blocks between slot 0's
    for bs, out in runs.items():
        for i, ((fast, exact), (fast0, exact0)) in enumerate(zip(out, runs[160])):
            assert np.array_equal(fast, fast0), (dtype, bs, i)
            assert np.array_equal(exact, exact0), (dtype, bs, i)


@needs_host
def test_a_verify_step_equals_its_one_token_steps(tmp_path):
    """Rows that attend together as a group (a prefill chunk, a k-token verify segment) get the
    bits they get one step at a time, q8_0 cache included: speculation's greedy output stays exact.
    (Quantized weights: a row's matmul does not depend on the other rows of the step.)"""
    path = str(tmp_path / "small-q8_0.gguf")
    synthesize(path, shape=SMALL, ftype="q8_0", seed=11)
    model = GGUFModel(path)
    vocab = model.config.vocab_size
    rng = np.random.default_rng(5)
    prompt, tail = rng.integers(0, vocab, 21), rng.integers(0, vocab, 19)
    for dtype in ("f32", "q8_0"):
        (a, _), (b, _) = _pair(model, dtype), _pair(model, dtype)
        a.run(Batch.of([Segment(0, 0, prompt)]))
        b.run(Batch.of([Segment(0, 0, prompt)]))
        together = a.run(Batch.of([Segment(0, 21, tail), Segment(1, 0, tail[:3])]), all_logits=True)
        for j, t in enumerate(tail):
            one = b.run(Batch.of([Segment(0, 21 + j, [t])]))
            assert np.array_equal(one[0], together[j]), (dtype, j)


# ---- the engine: pool size, prefix reuse -----------------------------------------------------

@pytest.fixture(scope="module")
def tiny_engine_path(synth_model):
    return synth_model("tiny", "q8_0")


@pytest.mark.parametrize("backend", ["cpu", "cpu-ref"])
def test_pool_exhaustion_is_a_clear_error(tiny_engine_path, backend):
    """A pool of 4 blocks (64 positions) for 2 sequences of up to 128: the one that would take a
    fifth block fails before any device computes, naming the key; nothing it held changes."""
    if backend == "cpu" and not host.available():
        pytest.skip("no C compiler for the CPU kernels")
    e = Engine(GGUFModel(tiny_engine_path), config=EngineConfig(backend=backend, max_batch=2, max_ctx=128, kv_blocks=4))
    a, b = e.open(), e.open()
    e.prefill(a, list(range(1, 40)))  # 3 blocks
    e.prefill(b, list(range(1, 10)))  # the 4th
    with pytest.raises(KVPoolFull, match=r"KV pool full: slot 1 needs 1 more blocks .*more blocks \(kv_blocks\)"):
        e.step([(b, list(range(20)))])
    assert e.length(b) == 9
    e.step([(b, list(range(7)))])  # 16 positions: still its one block
    e.park(a)  # a parked sequence's blocks go back when the pool needs them
    e.step([(b, list(range(30)))])
    assert e.kv.kept(a) == 0
    with pytest.raises(ValueError, match="cannot keep 20 positions of slot 0: it holds 0"):
        e.reopen(a, keep=20)
    with pytest.raises(ValueError, match=r"kv_blocks = -1: must be an integer in 0\.\.1073741824"):
        Engine(GGUFModel(tiny_engine_path), config=EngineConfig(backend=backend, kv_blocks=-1))  # 0: the plan's


@pytest.mark.parametrize("dtype", ["f32", "q8_0"])
def test_reopened_and_copied_prefixes_continue_exactly(tiny_engine_path, dtype):
    """The prefix cache's calls on the paged cache: a parked slot reopened keeping its positions,
    and a copy of them into another slot, continue as a sequence that never stopped; truncation
    gives back the blocks past the new end."""
    e = Engine(GGUFModel(tiny_engine_path), config=EngineConfig(backend="cpu", max_batch=3, max_ctx=128, kv_dtype=dtype))
    prompt, more = list(range(3, 40)), [5, 9, 11, 2, 7, 1, 1, 4, 8, 6, 3, 12]
    s = e.open()
    e.prefill(s, prompt)
    want = e.step([(s, more)])
    e.truncate(s, len(prompt))
    assert e.kv.kept(s) == 48  # 37 positions: three blocks, the fourth (positions 48, 49) given back
    e.park(s)
    t = e.open()
    assert t != s  # a parked slot is never handed out
    e.copy_prefix(s, t, 30)  # from the parked slot, which keeps its blocks
    e.step([(t, prompt[30:])])
    assert np.array_equal(e.step([(t, more)]), want)
    e.reopen(s, keep=len(prompt))
    assert np.array_equal(e.step([(s, more)]), want)


# ---- the real model ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def golden():
    with open(os.path.join(GOLDEN, "kv_layout_smollm2.json")) as f:
        g = json.load(f)
    with open(os.path.join(GOLDEN, "forward_smollm2.json")) as f:
        g["prompt_ids"] = [p["prompt_ids"] for p in json.load(f)["prompts"]]
    return g


def _interleaved(e: Engine, prompts, chunk: int) -> tuple[list[int], list]:
    """Every prompt live at once, prefilled `chunk` tokens at a time in turn (as the golden was):
    their slots and each one's last logits."""
    slots, last, done = [e.open() for _ in prompts], [None] * len(prompts), [0] * len(prompts)
    while any(d < len(p) for d, p in zip(done, prompts)):
        items, who = [], []
        for i, p in enumerate(prompts):
            if done[i] < len(p):
                items.append((slots[i], p[done[i]:done[i] + chunk]))
                who.append(i)
                done[i] += len(items[-1][1])
        for i, row in zip(who, e.step(items)):
            last[i] = row
    return slots, last


@pytest.mark.slow  # ~100 s on 2 cores: the reference's 47 interleaved prefill steps and a 900-token prompt
def test_cpu_ref_greedy_ids_equal_the_contiguous_cache(default_engine, golden):
    """The float32 reference on the paged cache: the golden's greedy ids exactly (its logits are
    the contiguous cache's bits), with the sequences' blocks interleaved in the pool and one
    prompt of 900 tokens (57 blocks)."""
    e, want = default_engine, golden["runs"]["cpu-ref/f32"]
    slots, last = _interleaved(e, golden["prompt_ids"], golden["chunk"])
    try:
        got = [[] for _ in slots]
        for _ in range(golden["n_generate"]):
            toks = [int(np.argmax(row)) for row in last]
            for g_, t in zip(got, toks):
                g_.append(t)
            last = list(e.decode(slots, toks))
        assert got == [r["ids"] for r in want["batched"]]
    finally:
        for s in slots:
            e.close(s)
    s = e.open()
    try:
        logits, ids = e.prefill(s, golden["long_ids"]), []
        for _ in range(golden["n_generate"]):
            ids.append(int(np.argmax(logits)))
            logits = e.step([(s, [ids[-1]])])[0]
        assert ids == want["long"]["ids"]
    finally:
        e.close(s)


# The fast backend's logits move by up to ~0.7 when its attention's rounding changes (the 8-bit
# activations amplify it), so a top-2 margin below this may flip whichever cache it reads.
NEAR_TIE = 1.0


@needs_host
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_cpu_greedy_ids_equal_the_contiguous_cache(default_model, golden, dtype):
    """The fast backend on the paged cache, fed the golden's ids (teacher-forced, so one near-tie
    does not end the comparison): at every step whose margin in the contiguous run was above
    NEAR_TIE it picks the golden's id; every solo, interleaved and long run."""
    want = golden["runs"][f"cpu/{dtype}"]
    e = Engine(default_model, config=EngineConfig(backend="cpu", kv_dtype=dtype, max_batch=8, max_ctx=1024))
    compared, wrong = 0, []

    def check(name, row, ref, j):
        nonlocal compared
        if ref["margins"][j] > NEAR_TIE:
            compared += 1
            if int(np.argmax(row)) != ref["ids"][j]:
                wrong.append((name, j, ref["margins"][j]))

    runs = [(f"solo {i}", [p], [r]) for i, (p, r) in enumerate(zip(golden["prompt_ids"], want["solo"]))]
    runs += [("batched", golden["prompt_ids"], want["batched"]), ("long", [golden["long_ids"]], [want["long"]])]
    for name, prompts, refs in runs:
        slots, last = _interleaved(e, prompts, golden["chunk"] if len(prompts) > 1 else 512)
        try:
            for j in range(golden["n_generate"]):
                for row, r in zip(last, refs):
                    check(name, row, r, j)
                last = list(e.decode(slots, [r["ids"][j] for r in refs]))
        finally:
            for s in slots:
                e.close(s)
    assert not wrong, f"ids differ at (run, step, contiguous margin): {wrong}"
    assert compared >= 150, f"only {compared} decisive steps compared"


def _licenses_text() -> str:
    names = sorted(n for n in os.listdir(LICENSES) if not os.path.islink(os.path.join(LICENSES, n)))
    return "\n".join(open(os.path.join(LICENSES, n), encoding="utf-8").read() for n in names)


def test_q8_0_perplexity_close_to_f16(default_model):
    """The licenses text's first 512 tokens on the reference (float32 everywhere else, so the
    difference is the cache's alone; the fast backend's 8-bit activations add noise of about half
    a percent per 512-token chunk): q8_0 keys and values cost less than 0.3% of f16's perplexity.
    bench/kv_quality.py measures ctx 8192 and q4_0 on the fast backend."""
    from ntransformerd.engine.calibration.perplexity import perplexity, text_tokens

    if not os.path.isdir(LICENSES):
        pytest.skip(f"{LICENSES} is missing")
    figures = {}
    for dtype in ("f16", "q8_0"):
        e = Engine(default_model, config=EngineConfig(backend="cpu-ref", kv_dtype=dtype, max_batch=1, max_ctx=512))
        figures[dtype] = perplexity(e, text_tokens(e, _licenses_text()[:20000]), ctx=512, max_chunks=1).perplexity
    assert figures["q8_0"] != figures["f16"] and abs(figures["q8_0"] / figures["f16"] - 1) < 0.003, figures


# ---- sharing by block reference, copy on write, spilling to the host pool --------------------

class _Owner:
    """A block table's owner that records what it is asked to move."""

    def __init__(self):
        self.copies, self.saved, self.loaded = [], [], []

    def copy_blocks(self, src, dst):
        self.copies.append((list(src), list(dst)))

    def save_blocks(self, ids):
        self.saved.append(list(ids))
        return list(ids)

    def load_blocks(self, ids, saved):
        self.loaded.append((list(ids), saved))


def test_shared_blocks_are_counted_once_and_copied_before_a_write():
    t = BlockTable(n_slots=3, max_ctx=128, n_blocks=12, block_size=16)
    t.owner = _Owner()
    t.reserve(0, 37)  # blocks 0, 1, 2 (the last partial)
    assert t.share(0, 1, 37) is None
    assert list(t.tables[1, :3]) == [0, 1, 3] and list(t.refs[:4]) == [2, 2, 1, 1]
    assert t.owner.copies == [([2], [3])]  # the partial block copied, the full ones shared
    assert t.used_blocks == 4 and t.shared_blocks == 2  # 6 for two copies
    t.reserve(1, 40, start=37)  # writes in its own block 3: nothing to copy
    assert t.owner.copies == [([2], [3])]
    t.release(1, 20)  # truncated into shared block 1
    assert t.held[1] == 2 and t.refs[3] == 0 and t.used_blocks == 3
    t.reserve(1, 21, start=20)  # the write lands in block 1, which slot 0 holds too: a copy first
    assert t.owner.copies[-1] == ([1], [2 + 1]) and list(t.tables[1, :2]) == [0, 3] and t.refs[1] == 1
    assert list(t.tables[0, :3]) == [0, 1, 2]  # the source's table unchanged
    t.release(0, 0)
    assert t.refs[0] == 1 and t.used_blocks == 2  # block 0 stays for slot 1, the rest back
    assert t.share(1, 2, 20, start=0) is None and t.owner.copies[-1] == ([3], [1])
    with pytest.raises(ValueError, match="holds 32 positions, not the 40"):
        t.share(1, 2, 40)


@pytest.mark.parametrize("dtype", ["f32", "f16", "q8_0", "q4_0"])
def test_blocks_and_rows_copy_as_indexed_copies_do(dtype):
    """KVLayer.copy_blocks and copy_rows (bytes copied, so the scheduler thread keeps the GIL)
    move exactly what numpy's indexed copies move, bit for bit: every head of the blocks and
    rows named, nothing else; rows in runs of several lengths, across blocks."""
    rng = np.random.default_rng(5)
    layer = KVLayer(BlockTable(n_slots=2, max_ctx=64, n_blocks=9), dtype, 3, 64)
    for a in (layer.k, layer.v):
        a.view(np.uint8).reshape(-1)[:] = rng.integers(0, 256, a.nbytes, dtype=np.uint8)  # poison: any bits
    want = layer.k.copy(), layer.v.copy()
    src, dst = np.array([1, 5, 8], np.int32), np.array([6, 2, 0], np.int32)
    layer.copy_blocks(src, dst)
    for w in want:
        w[dst] = w[src]
    sb, so = np.array([3, 3, 3, 4, 4, 7], np.int32), np.array([13, 14, 15, 0, 1, 9])
    db, do = np.array([7, 7, 7, 0, 0, 1], np.int32), np.array([5, 6, 7, 9, 10, 15])
    layer.copy_rows((sb, so), (db, do))
    for w in want:
        w[db, :, do] = w[sb, :, so]
    for got, w in zip((layer.k, layer.v), want):
        assert np.array_equal(got.view(np.uint8), w.view(np.uint8))


def test_reserve_rows_does_what_reserve_does_row_by_row():
    """A step's reserve with its look-ups first (BlockTable.reserve_rows) leaves the tables, the pool,
    the copies and the spills as reserve row by row does, over random steps of live slots that
    grow, share prefixes, truncate, close, spill and reopen, and raises where reserve raises."""
    rng = np.random.default_rng(3)

    def table():
        t = BlockTable(n_slots=6, max_ctx=96, n_blocks=24, block_size=16)
        t.owner, t.block_bytes, t.spill_limit = _Owner(), 100, 1600
        return t

    rows, one = table(), table()
    lengths = np.zeros(6, np.int64)
    live, full = set(), 0
    for step in range(300):
        op = rng.random()
        slot = int(rng.integers(0, 6))
        for t in (rows, one):  # the same history for both tables, whatever the op
            if op < 0.1 and slot not in live:
                t.opened(slot)
            elif op < 0.15 and slot in live:
                t.closed(slot)
            elif op < 0.2 and slot in live and lengths[slot] > 1:
                t.release(slot, int(lengths[slot]) // 2)
            elif op < 0.25 and slot not in live and live:
                src = min(live)
                t.opened(slot)
                t.release(slot, 0)
                if lengths[src]:
                    t.share(src, slot, int(lengths[src]))
        if op < 0.1 and slot not in live:
            live.add(slot)
            lengths[slot] = 0
        elif op < 0.15 and slot in live:
            live.discard(slot)
        elif op < 0.2 and slot in live and lengths[slot] > 1:
            lengths[slot] //= 2
        elif op < 0.25 and slot not in live and live:
            live.add(slot)
            lengths[slot] = lengths[min(live - {slot})] if live - {slot} else 0
        if not live:
            continue
        slots = np.array(sorted(live), np.int64)
        sizes = np.where(rng.random(len(slots)) < 0.8, 1, rng.integers(1, 20, len(slots)))
        ends = np.minimum(lengths[slots] + sizes, 96)
        starts = np.minimum(lengths[slots], ends)
        errors = []
        for t, each in ((rows, False), (one, True)):
            try:
                if each:
                    for sl, e, st in zip(slots.tolist(), ends.tolist(), starts.tolist()):
                        t.reserve(sl, e, start=st)
                else:
                    t.reserve_rows(slots.tolist(), ends.tolist(), starts.tolist())
                errors.append(None)
            except KVPoolFull as e:
                errors.append(str(e))
        assert errors[0] == errors[1], step
        for name in ("tables", "held", "refs", "_closed"):
            assert np.array_equal(getattr(rows, name), getattr(one, name)), (step, name)
        assert rows._pool == one._pool and list(rows._idle) == list(one._idle), step
        assert list(rows.spilled) == list(one.spilled) and rows.stats == one.stats, step
        assert (rows.owner.copies, rows.owner.saved, rows.owner.loaded) == \
            (one.owner.copies, one.owner.saved, one.owner.loaded), step
        if errors[0] is None:
            lengths[slots] = ends
        else:  # the pool is full: a request yields (closes) its slot, as the scheduler's preemption does
            full += 1
            victim = int(slots[-1])
            for t in (rows, one):
                t.forget(victim)
            live.discard(victim)
    assert full and all(rows.stats[k] for k in ("cow", "shared", "spilled", "restored"))  # the walk met every path
    with pytest.raises(ValueError, match="out of range"):
        rows.reserve_rows([7], [1], [0])
    with pytest.raises(ValueError, match="exceed the context"):
        rows.reserve_rows([0], [97], [96])


def test_spill_moves_a_closed_slot_to_the_host_pool_now():
    """BlockTable.spill: what a short pool does to a closed slot, asked for; a live slot refuses."""
    t = BlockTable(n_slots=2, max_ctx=64, n_blocks=4, block_size=16)
    t.owner, t.block_bytes, t.spill_limit = _Owner(), 100, 250
    t.reserve(0, 20)
    with pytest.raises(ValueError, match="only a closed slot's blocks spill"):
        t.spill(0)
    t.closed(0)
    assert t.spill(0) and t.owner.saved == [[0, 1]] and t.free_blocks == 4 and t.kept(0) == 32
    t.opened(0)
    t.release(0, 20)
    assert t.owner.loaded == [([0, 1], [0, 1])] and t.held[0] == 2 and t.stats["restored"] == 2
    t.closed(0)
    t.spill_limit = 100  # two blocks do not fit: dropped
    assert not t.spill(0) and t.kept(0) == 0 and t.stats["dropped"] == 2


def test_a_closed_slot_spills_to_the_host_pool_and_comes_back():
    t = BlockTable(n_slots=3, max_ctx=64, n_blocks=4, block_size=16)
    t.owner, t.block_bytes, t.spill_limit = _Owner(), 100, 250  # room for two blocks
    t.reserve(0, 32)
    t.closed(0)
    t.reserve(1, 48)  # needs one of slot 0's: both are saved, then let go
    assert t.owner.saved == [[0, 1]] and t.held[0] == 0 and t.kept(0) == 32 and t.spill_bytes == 200
    assert t.available() == 1
    t.opened(0)
    with pytest.raises(KVPoolFull):
        t.release(0, 32)  # both back: one block free, slot 1 live
    assert t.kept(0) == 32  # still spilled
    t.release(0, 10)  # the first block back, the second forgotten
    assert t.owner.loaded == [([3], [0, 1])] and t.kept(0) == 16 and not t.spilled
    t.closed(0)
    t.closed(1)
    t.reserve(2, 64)  # slot 0's block and slot 1's three: slot 1's do not fit the host pool
    assert t.kept(0) == 16 and t.kept(1) == 0 and t.stats["dropped"] == 1 + 3


@pytest.fixture(scope="module")
def f32_engine_path(synth_model):
    return synth_model("tiny", "f32")


def _backend_ok(backend):
    if backend == "cpu" and not host.available():
        pytest.skip("no C compiler for the CPU kernels")


@pytest.mark.parametrize("backend", ["cpu", "cpu-ref"])
def test_shared_prefixes_continue_as_copies_do(tiny_engine_path, backend):
    """Two slots share a prompt's blocks with the slot that computed it: each continues with
    the logits (bit for bit) and greedy ids of the source, or of a slot given the same positions
    by copying their rows (bit for bit on the kernels, to float rounding on the numpy
    reference), while the pool holds the shared blocks once; a sharer truncated into a shared
    block and writing there copies it first, and the source reads its own keys and values
    unchanged."""
    _backend_ok(backend)
    e = Engine(GGUFModel(tiny_engine_path), config=EngineConfig(backend=backend, max_batch=5, max_ctx=128))
    prompt, more = list(range(3, 40)), [5, 9, 11, 2, 7, 1, 1, 4, 8, 6, 3, 12]

    def greedy(slot, logits, n=6):
        ids = []
        for _ in range(n):
            ids.append(int(np.argmax(logits)))
            logits = e.step([(slot, [ids[-1]])])[0]
        return ids

    s = e.open()
    e.prefill(s, prompt)
    want = e.step([(s, more)])
    want_ids = greedy(s, want[0])
    e.truncate(s, len(prompt))
    before = [e.kv.layer(i).read(s, len(prompt)) for i in range(e.cfg.n_layers)]
    used = e.kv.blocks.used_blocks
    t, u = e.open(), e.open()
    e.copy_prefix(s, t, len(prompt))  # two whole blocks shared, the partial third copied
    e.copy_prefix(s, u, 32)  # two whole blocks shared
    assert e.kv.blocks.used_blocks == used + 1 and e.kv.blocks.shared_blocks == 2
    assert list(e.kv.blocks.tables[t, :2]) == list(e.kv.blocks.tables[s, :2]) == list(e.kv.blocks.tables[u, :2])
    w = e.open()  # the copied one: rows read and written
    for i in range(e.cfg.n_layers):
        e.kv.layer(i).write(w, 0, *e.kv.layer(i).rows(s, 0, 32))
    e.kv.lengths[w] = 32
    assert e.kv.blocks.shared_blocks == 2
    got_t = e.step([(t, more)])
    e.step([(u, prompt[32:]), (w, prompt[32:])])
    got_u, got_w = e.step([(u, more)]), e.step([(w, more)])
    assert np.array_equal(got_t, want)
    if backend == "cpu":
        assert np.array_equal(got_u, got_w)
    else:
        # numpy's matmul is OpenBLAS's sgemm, whose sum for a row depends on where the row sits
        # in the batch (edge kernels, each thread's share): u's positions 32..36 ran as rows 0-4
        # of that step and w's as rows 5-9, so their keys and values, and the logits, may differ
        # in the last bits. The same sums in another order: KERNEL_TOL["f32"].
        err, scale = float(np.abs(got_u - got_w).max()), float(np.abs(got_w).max())
        assert err <= KERNEL_TOL["f32"] * scale, f"{err:.3g} of {scale:.3g}"
    assert greedy(t, got_t[0]) == want_ids and greedy(u, got_u[0]) == greedy(w, got_w[0])
    cow = e.kv.blocks.stats["cow"]
    e.truncate(u, 20)  # into the second shared block
    e.step([(u, [17, 18, 19])])  # writes positions 20..22 there: u's own copy first
    assert e.kv.blocks.stats["cow"] == cow + 1
    assert e.kv.blocks.tables[u, 1] != e.kv.blocks.tables[s, 1]
    for i, (k, v) in enumerate(before):
        k2, v2 = e.kv.layer(i).read(s, len(prompt))
        assert np.array_equal(k, k2) and np.array_equal(v, v2), i
    assert np.array_equal(e.step([(s, more)]), want)


@pytest.mark.parametrize("spill", [1 << 20, 0])
def test_a_spilled_prompt_is_restored_not_prefilled(f32_engine_path, spill):
    """A finished chat's blocks spill to the host pool when another sequence needs the pool;
    its next turn, through the prefix cache, restores them and runs only the prompt's last
    token: the same greedy ids as the first run. Without a host pool they are dropped and the
    whole prompt runs again."""
    from ntransformerd.server.prefix_cache import PrefixCache

    e = Engine(GGUFModel(f32_engine_path), config=EngineConfig(backend="cpu-ref", max_batch=2, max_ctx=96,
                                                                kv_blocks=6))
    e.kv.spill_limit = spill
    pc = PrefixCache(e, enabled=True)
    ran = []
    step = e.step
    e.step = lambda items, **kw: (ran.extend(len(t) for _, t in items), step(items, **kw))[1]
    prompt = [int(x) for x in np.random.default_rng(2).integers(1, e.cfg.vocab_size, 40)]

    def turn(p):
        slot, n = pc.open(p, [], use=True)
        logits, ids = e.prefill(slot, p[n:]), []
        for _ in range(5):
            ids.append(int(np.argmax(logits)))
            logits = e.step([(slot, [ids[-1]])])[0]
        pc.close(slot, p, keep=True)
        return n, ids

    n0, first = turn(prompt)
    assert n0 == 0
    (chat,) = pc.held
    other = e.open()
    assert other != chat
    e.prefill(other, list(range(1, 70)))  # 5 of the 6 blocks: the parked chat's 3 must go
    e.close(other)
    assert e.kv.blocks.held[chat] == 0 and e.kv.kept(chat) == (48 if spill else 0)
    ran.clear()
    n1, again = turn(prompt)
    assert again == first
    if spill:
        assert n1 == len(prompt) - 1 and sum(ran) == 1 + 5  # the last prompt token, then 5 decode steps
        assert e.kv.blocks.stats["restored"] == 3 and e.kv.blocks.stats["spilled"] >= 3
    else:
        assert n1 == 0 and sum(ran) == len(prompt) + 5 and e.kv.blocks.stats["restored"] == 0


def test_read_of_a_spilled_slot_gives_zeros_not_a_hole():
    """A parked slot whose blocks went to the host pool still counts its positions as kept (the
    prefix cache may restore them), but reading it gives zeros, as for positions it holds no
    block of, instead of meeting a table entry of -1."""
    cfg = LlamaConfig(n_layers=1, d_model=96, d_ff=64, n_heads=2, n_kv_heads=1, head_dim=48, vocab_size=10,
                      context_length=64, rms_eps=1e-5, rope_base=10000.0, rope_dim=48, rope_neox=False,
                      rope_scale=1.0, tied_output=True)
    c = KVCache(cfg, n_slots=2, max_ctx=64, n_blocks=2, spill=1 << 20)
    rng = np.random.default_rng(0)
    s = c.alloc()
    k, v = rng.standard_normal((2, 20, 1, 48)).astype(np.float32)
    c.layer(0).write(s, 0, k, v)
    c.lengths[s] = 20
    c.park(s)
    o = c.alloc()
    c.reserve(o, 32)  # both blocks: slot s's go to the host pool
    assert c.kept(s) == 32 and s in c.blocks.spilled
    rk, rv = c.layer(0).read(s, 20)
    assert not rk.any() and not rv.any()
