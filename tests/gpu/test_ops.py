"""Norm, RoPE, SwiGLU, attention, argmax launchers against the CPU backend (the reference)."""

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from ntransformerd.engine.backends import cpu, cuda  # noqa: E402
from ntransformerd.engine.gguf_file import LlamaConfig  # noqa: E402
from ntransformerd.engine.runtime.kv_cache import KVCache  # noqa: E402
from ntransformerd.engine.runtime.model import Batch, Segment  # noqa: E402

SIZES = (7, 83, 769, 5125, 576, 1536, 4096, 14336)


def config(**kw):
    base = dict(n_layers=1, d_model=256, d_ff=512, n_heads=8, n_kv_heads=2, head_dim=64, vocab_size=100,
                context_length=4096, rms_eps=1e-5, rope_base=10000.0, rope_dim=64, rope_neox=False,
                rope_scale=1.0, tied_output=True)
    base.update(kw)
    return LlamaConfig(**base)


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("d", SIZES)
def test_rms_norm(d):
    rng = np.random.default_rng()
    x = rng.standard_normal((5, d)).astype(np.float32) * 3
    w = rng.standard_normal(d).astype(np.float32)
    ref = cpu.CpuOps.rms_norm(x, w, 1e-5)
    out = cp.full((5, d), np.nan, cp.float32)
    got = cuda.rms_norm(cp.asarray(x), cp.asarray(w), 1e-5, out=out).get()
    assert rel(got, ref) < 1e-6


@pytest.mark.parametrize("f", SIZES)
def test_swiglu(f):
    rng = np.random.default_rng()
    g = rng.standard_normal((3, f)).astype(np.float32) * 4
    u = rng.standard_normal((3, f)).astype(np.float32)
    out = cp.full((3, f), np.nan, cp.float32)
    got = cuda.swiglu(cp.asarray(g), cp.asarray(u), out=out).get()
    assert rel(got, cpu.CpuOps.swiglu(g, u)) < 1e-6


def same_qact(a, b):
    return all((x.get() == y.get()).all() for x, y in zip(a.args(), b.args()))


@pytest.mark.parametrize("d", (96, 576, 4096, 14336))
def test_rms_norm_quantized(d):
    """The fused quantized output is bit-identical to quantizing the plain output."""
    rng = np.random.default_rng()
    x = cp.asarray(rng.standard_normal((5, d)).astype(np.float32) * 3)
    w = cp.asarray(rng.standard_normal(d).astype(np.float32))
    q = cuda.QAct(5, d)
    out = cuda.rms_norm(x, w, 1e-5, out=cp.full((5, d), np.nan, cp.float32), q=q)
    assert rel(out.get(), cpu.CpuOps.rms_norm(x.get(), w.get(), 1e-5)) < 1e-6
    assert same_qact(q, cuda.quantize(out, cuda.QAct(5, d)))


@pytest.mark.parametrize("f", (96, 1536, 14336))
def test_swiglu_quantized(f):
    rng = np.random.default_rng()
    g = cp.asarray(rng.standard_normal((3, f)).astype(np.float32) * 4)
    u = cp.asarray(rng.standard_normal((3, f)).astype(np.float32))
    q = cuda.QAct(3, f)
    out = cuda.swiglu(g, u, out=cp.full((3, f), np.nan, cp.float32), q=q)
    assert rel(out.get(), cpu.CpuOps.swiglu(g.get(), u.get())) < 1e-6
    assert same_qact(q, cuda.quantize(out, cuda.QAct(3, f)))


@pytest.mark.parametrize("neox", (False, True))
@pytest.mark.parametrize("factors", (False, True))
@pytest.mark.parametrize("head_dim,rope_dim", ((64, 64), (128, 128), (128, 64)))
def test_rope(neox, factors, head_dim, rope_dim):
    rng = np.random.default_rng()
    cfg = config(head_dim=head_dim, rope_dim=rope_dim, rope_neox=neox, rope_base=500000.0, rope_scale=1.0)
    ff = rng.uniform(1, 8, rope_dim // 2).astype(np.float32) if factors else None
    ref_ops, ops = cpu.CpuOps(cfg, ff), cuda.CudaOps(cfg, ff)
    pos = rng.integers(0, 8000, 83)
    x = rng.standard_normal((83, 8 * head_dim)).astype(np.float32)
    ref = ref_ops.rope(x, ref_ops.rope_table(pos), 8)
    got = ops.rope(cp.asarray(x), ops.rope_table(pos), 8).get()
    assert rel(got, ref) < 1e-6


@pytest.mark.parametrize("rows", (7, 83, 5125))
def test_argmax(rows):
    rng = np.random.default_rng()
    v = 49152 if rows < 100 else 769
    logits = rng.standard_normal((rows, v)).astype(np.float32)
    logits[0, 5] = logits[0, 9] = 100  # ties go to the lower index
    out = cp.full((rows,), -1, cp.int32)
    np.testing.assert_array_equal(cuda.argmax(cp.asarray(logits), out=out).get(), logits.argmax(-1))


def whole_slots(layer, n_slots: int, end: int) -> tuple[np.ndarray, np.ndarray]:
    """A cache layer's keys and values (host or GPU, through its block tables) slot by slot:
    (n_slots, end, Hkv, hd) float32 each, zeros where a slot holds nothing."""
    pairs = [layer.read(s, end) for s in range(n_slots)]
    return np.stack([k for k, _ in pairs]), np.stack([v for _, v in pairs])


def history(kv, ref_kv, lens, rng, first: int = 0):
    """Each slot's positions before its segment (lens: (start, n) per slot from `first`), the
    same values written into both caches (each rounds them to its storage type)."""
    n_kv, head_dim = ref_kv.layer(0).k.shape[1], ref_kv.layer(0).head_dim
    for s, (start, _) in enumerate(lens, first):
        hk = rng.standard_normal((start, n_kv, head_dim)).astype(np.float16)
        hv = rng.standard_normal((start, n_kv, head_dim)).astype(np.float16)
        ref_kv.layer(0).write(s, 0, hk, hv)
        kv.layer(0).write(s, 0, hk, hv)


@pytest.mark.parametrize("dtype", ("f16", "q8_0"))
@pytest.mark.parametrize("head_dim,n_heads,n_kv", ((64, 8, 2), (128, 32, 8), (64, 4, 4)))
@pytest.mark.parametrize("lens", ([(0, 83)], [(0, 7), (5, 1), (769, 1), (0, 1)], [(100, 1)] * 3, [(4000, 1)]))
def test_attention(head_dim, n_heads, n_kv, lens, dtype):
    """Prefill chunks and decode tokens in one ragged batch, over a paged f16 or q8_0 cache with
    history, against the CPU reference over its own cache of that type: the same output, and the
    same cache contents bit for bit (k and v are not rotated here: both sides round the same f32)."""
    rng = np.random.default_rng()
    cfg = config(head_dim=head_dim, n_heads=n_heads, n_kv_heads=n_kv, d_model=head_dim * n_heads,
                 rope_dim=head_dim)
    n_slots = len(lens)
    ref_kv = KVCache(cfg, n_slots=n_slots, max_ctx=4096 + 8, dtype=dtype)
    kv = cuda.CudaKVCache(cfg, n_slots=n_slots, max_ctx=4096 + 8, dtype=dtype)
    history(kv, ref_kv, lens, rng)
    batch = Batch.of([Segment(s, start, rng.integers(0, 100, n)) for s, (start, n) in enumerate(lens)])
    n = len(batch.tokens)
    q = rng.standard_normal((n, cfg.q_dim)).astype(np.float32)
    k = rng.standard_normal((n, cfg.kv_dim)).astype(np.float32)
    v = rng.standard_normal((n, cfg.kv_dim)).astype(np.float32)
    ref = cpu.CpuOps(cfg).attention(q, k, v, ref_kv.layer(0), batch)
    got = cuda.CudaOps(cfg).attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), kv.layer(0), batch).get()
    # A batch with a prefill chunk runs attn_chunk (f16 q and P on tensor cores): CHUNK_TOL.
    chunk = max(m for _, m in lens) >= cuda.CHUNK_ROWS and head_dim in cuda.CHUNK_HEAD_DIMS
    assert rel(got, ref) < (CHUNK_TOL if chunk else 1e-4)
    end = max(st + m for st, m in lens)
    for got_kv, ref_kv_ in zip(whole_slots(kv.layer(0), n_slots, end), whole_slots(ref_kv.layer(0), n_slots, end)):
        np.testing.assert_array_equal(got_kv, ref_kv_)


@pytest.mark.parametrize("one_launch", (True, False))
@pytest.mark.parametrize("n_splits", (1, 7, 64))
@pytest.mark.parametrize("head_dim,n_heads,n_kv,rope_dim,neox", ((64, 8, 2, 64, False), (128, 32, 8, 128, False),
                                                                 (128, 4, 4, 64, True), (32, 2, 1, 32, True),
                                                                 (256, 6, 2, 96, False), (96, 9, 3, 96, True)))
@pytest.mark.parametrize("dtype", ("f16", "q8_0"))
def test_decode_attention_fused(head_dim, n_heads, n_kv, rope_dim, neox, n_splits, one_launch, dtype):
    """The captured step's path on a stacked q|k|v buffer: attention_decode_ (RoPE, cache append,
    attention and the merge of the splits in one launch), or RoPE + append (rope_kv_) then
    attention_; over any number of splits, writing the output quantized too. Against the CPU
    reference's rope + attention, and the quantized output against quantizing it; the one-launch
    kernel run twice (its split counters must come back to zero) gives the same output. A q8_0
    cache: v (not rotated) stored bit for bit as the host rounds it; k within a quant step (the
    two sides' f32 RoPE may differ by an ulp before rounding)."""
    rng = np.random.default_rng()
    cfg = config(head_dim=head_dim, n_heads=n_heads, n_kv_heads=n_kv, d_model=head_dim * n_heads,
                 rope_dim=rope_dim, rope_neox=neox, rope_base=500000.0)
    lens = [(0, 1), (5, 1), (769, 1), (3000, 1)]  # history, one new token each
    n_slots = len(lens)
    if dtype == "q8_0" and head_dim // 32 not in cuda.ATTN_ND:  # a lane's values would straddle two blocks
        with pytest.raises(ValueError, match="kv_dtype"):
            cuda.CudaKVCache(cfg, n_slots=n_slots, max_ctx=64, dtype=dtype)
        return
    ref_kv = KVCache(cfg, n_slots=n_slots, max_ctx=3008, dtype=dtype)
    kv = cuda.CudaKVCache(cfg, n_slots=n_slots, max_ctx=3008, dtype=dtype)
    history(kv, ref_kv, lens, rng)
    for s, (start, _) in enumerate(lens):  # the launchers below are called directly: the engine's reserve
        kv.reserve(s, start + 1)
    kv.tables.refresh()
    batch = Batch.of([Segment(s, start, rng.integers(0, 100, 1)) for s, (start, _) in enumerate(lens)])
    n = len(lens)
    qkv = rng.standard_normal((n, cfg.q_dim + 2 * cfg.kv_dim)).astype(np.float32)
    q, k, v = np.split(qkv, [cfg.q_dim, cfg.q_dim + cfg.kv_dim], axis=1)
    ref_ops = cpu.CpuOps(cfg)
    table = ref_ops.rope_table(batch.positions)
    ref = ref_ops.attention(ref_ops.rope(q, table, n_heads), ref_ops.rope(k, table, n_kv), v, ref_kv.layer(0), batch)

    ops = cuda.CudaOps(cfg)
    dq = cp.asarray(qkv)
    slots = cp.arange(n, dtype=cp.int32)
    pos = cp.asarray(batch.positions.astype(np.int32))
    ld = qkv.shape[1]
    out = cp.full((n, cfg.q_dim), np.nan, cp.float32)
    qa = cuda.QAct(n, cfg.q_dim)
    scratch = cuda.attention_scratch(n, cfg, n_splits, counters=one_launch)
    if one_launch:
        for _ in range(2):
            first = out.copy()
            out.fill(np.nan)
            cuda.attention_decode_(dq, dq[:, cfg.q_dim + cfg.kv_dim:], kv.layer(0), slots, pos, ops.freqs, cfg, n=n,
                                   n_splits=n_splits, ld=ld, ldv=ld, out=out, scratch=scratch, q_out=qa)
        cp.testing.assert_array_equal(out, first)
        assert not scratch[3].any()
        np.testing.assert_array_equal(dq.get(), qkv)  # q and k rotated in registers only
    else:
        cuda.rope_kv_(dq, dq[:, cfg.q_dim + cfg.kv_dim:], pos, slots, ops.freqs, kv.layer(0), cfg, n=n, ld=ld, ldv=ld)
        cuda.attention_(dq, dq[:, cfg.q_dim:], dq[:, cfg.q_dim + cfg.kv_dim:], kv.layer(0), slots, pos, cfg, n=n,
                        n_splits=n_splits, ldq=ld, ldk=ld, ldv=ld, out=out, scratch=scratch, append=False, q_out=qa)
        assert rel(dq[:, :cfg.q_dim].get(), ref_ops.rope(q, table, n_heads)) < 1e-6
    # per (row, head): a short row's outputs must not hide a long row's error
    got = out.get().reshape(n, n_heads, head_dim)
    want = ref.reshape(n, n_heads, head_dim)
    tol = 1e-4 if dtype == "f16" else 2e-3  # q8_0: a k quant flipped by the RoPE's last ulp now and then
    for r in range(n):
        for h in range(n_heads):
            assert rel(got[r, h], want[r, h]) < tol, (r, h)
    end = max(st + m for st, m in lens)
    # k is rotated on both sides (f32 arithmetic may round differently before the f16 store)
    ref_k, ref_v = whole_slots(ref_kv.layer(0), n_slots, end)
    got_k, got_v = whole_slots(kv.layer(0), n_slots, end)
    assert rel(got_k, ref_k) < (1e-2 if dtype == "q8_0" else 1e-3)
    np.testing.assert_array_equal(got_v, ref_v)
    assert same_qact(qa, cuda.quantize(out, cuda.QAct(n, cfg.q_dim)))


# attn_chunk rounds q (scaled) and the softmax weights P to f16 (2^-11 relative each) before its
# tensor-core products, as prefill's matmuls round their inputs; over random N(0, 1) q, k, v the
# output's relative error is a few 1e-4. A wrong fragment, mask or rescale gives O(1).
CHUNK_TOL = 2e-3


@pytest.mark.parametrize("head_dim", cuda.CHUNK_HEAD_DIMS)
@pytest.mark.parametrize("n_heads,n_kv", ((8, 2), (32, 8), (9, 3), (4, 4), (16, 2)))
@pytest.mark.parametrize("lens", ([(0, 83)], [(0, 16), (37, 40), (5, 1)], [(700, 33), (0, 7)], [(0, 300)]))
@pytest.mark.parametrize("dtype", ("f16", "q8_0"))
def test_attention_chunk(head_dim, n_heads, n_kv, lens, dtype):
    """Prefill chunks (ragged, with history, tiles of every fill) on tensor cores against the CPU
    reference; every output row written (poisoned before), the cache left as the reference's."""
    rng = np.random.default_rng()
    cfg = config(head_dim=head_dim, n_heads=n_heads, n_kv_heads=n_kv, d_model=head_dim * n_heads,
                 rope_dim=head_dim)
    n_slots = len(lens) + 1  # slot 0 unused: tiles must address their own slot
    ref_kv = KVCache(cfg, n_slots=n_slots, max_ctx=1024, dtype=dtype)
    kv = cuda.CudaKVCache(cfg, n_slots=n_slots, max_ctx=1024, dtype=dtype)
    for a in (kv.layer(0).k, kv.layer(0).v):  # stale contents past the history must never reach the output
        a.fill(cp.nan if dtype == "f16" else 255)  # q8_0: scales of 0xFFFF, f16 NaN
    history(kv, ref_kv, lens, rng, first=1)
    for s, (start, m) in enumerate(lens, 1):  # the launchers below are called directly: the engine's reserve
        kv.reserve(s, start + m)
    kv.tables.refresh()
    batch = Batch.of([Segment(s, start, rng.integers(0, 100, n)) for s, (start, n) in enumerate(lens, 1)])
    n = len(batch.tokens)
    q = rng.standard_normal((n, cfg.q_dim)).astype(np.float32)
    k = rng.standard_normal((n, cfg.kv_dim)).astype(np.float32)
    v = rng.standard_normal((n, cfg.kv_dim)).astype(np.float32)
    ref = cpu.CpuOps(cfg).attention(q, k, v, ref_kv.layer(0), batch)
    slots = cp.asarray(np.repeat([s.slot for s in batch.segments], np.diff(batch.offsets)).astype(np.int32))
    pos = cp.asarray(batch.positions.astype(np.int32))
    cuda.kv_append_(cp.asarray(k), cp.asarray(v), kv.layer(0), slots, pos, cfg, n=n, ldk=cfg.kv_dim, ldv=cfg.kv_dim)
    tiles = cuda.chunk_tiles(batch.offsets, batch.positions)
    assert tiles[1].sum() == n and tiles[1].max() <= cuda.CHUNK_ROWS
    out = cp.full((n, cfg.q_dim), cp.nan, cp.float32)
    got = cuda.attention_chunk_(cp.asarray(q), kv.layer(0), slots, pos, cp.asarray(tiles), cfg, ldq=cfg.q_dim,
                                out=out).get()
    assert np.isfinite(got).all()
    assert rel(got, ref) < CHUNK_TOL
    per_row = np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)
    assert per_row.max() < 5 * CHUNK_TOL  # one wrong tile must not hide in the whole's norm
