"""kernels/quant.cu against gguf.quants: dequantization bit-exact, fused matvec to fp32 rounding
(MATVEC_TOL for the int8 kernels, whose activations carry about 2^-15 of each group's largest
value: kernels/quant_act.cuh)."""
import numpy as np
import pytest

cp = pytest.importorskip("cupy")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import quants as gq  # noqa: E402

from ntransformerd.engine.backends import cuda  # noqa: E402
from ntransformerd.engine.quants import BLOCK_DTYPES, QUANT_BLOCKS, SUPPORTED_TYPES  # noqa: E402

ROWS = (7, 83, 769)
WIDTHS_K = (256, 1536, 4096)  # K-quant rows are whole 256-blocks
WIDTHS_LEGACY = (96, 576, 1536, 4096)


def random_tensor(rng, qtype, n, k):
    """Random GGUF bytes (n, row_bytes) with finite, varied scale fields."""
    be, bb = QUANT_BLOCKS[qtype]
    if qtype == Q.F32:
        return rng.standard_normal((n, k), dtype=np.float32).view(np.uint8)
    if qtype == Q.F16:
        return rng.standard_normal((n, k)).astype(np.float16).view(np.uint8)
    if qtype == Q.BF16:
        x = rng.standard_normal((n, k), dtype=np.float32)
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    raw = rng.integers(0, 256, (n, k // be * bb), dtype=np.uint8)
    blocks = raw.reshape(-1).view(BLOCK_DTYPES[qtype])
    for f in ("d", "dmin", "m"):
        if f in blocks.dtype.names:
            blocks[f] = (rng.standard_normal(len(blocks)) * 0.01).astype(np.float16)
    return raw


# max error / max |ref| for the int8 (QAct) matvecs; 2e-5 for the float ones. Each activation is
# off by at most 1/(127·254·2) ≈ 1.6e-5 of its group's largest value; summed over K random-sign
# products that is a few 1e-5 of the output's scale, with tails past 1e-4 on some draws (seen:
# 1.14e-4 for Q4_K, K = 1536, 7 rows), hence 2e-4.
MATVEC_TOL = 2e-4
# The f16 tensor-core matvecs (batches of 3+, rows of whole 256-blocks: cuda.F16_MATVEC) round
# each weight (after its scales, themselves rounded to f16) and activation to f16 (2^-11
# relative) before f32 sums: measured 3.3-4.5e-4 of the output norm on the H200, as prefill's
# f16 matmul (test_matmul_prefill_f16).
F16_MATVEC_TOL = 3e-3


def tol(qtype, b=1, k=256):
    """The bound for b rows of width k: F16_MATVEC_TOL where the default settings put them on the
    f16 tensor cores (K-quants' whole 256-blocks from 3 rows, and Q4_1 any K with f16_legacy, the
    default since 2026-12-05), else the int8 or float kernels' own."""
    if cuda.choose(qtype, 128, k, b).family == "mmh":
        return F16_MATVEC_TOL
    return MATVEC_TOL if qtype in cuda.FAST_MATVEC else 2e-5


def widths(qtype):
    return WIDTHS_K if QUANT_BLOCKS[qtype][0] == 256 else WIDTHS_LEGACY


def cases():
    for q in SUPPORTED_TYPES:
        for n in ROWS:
            for k in widths(q):
                if n * k <= 769 * 4096:
                    yield q, n, k


def to_device(qtype, raw, n, k):
    return cuda.CudaTensor(qtype, (n, k), tuple(cp.asarray(p) for p in cuda.host_planes(qtype, raw, (n, k))))


@pytest.mark.parametrize("qtype,n,k", list(cases()), ids=lambda v: getattr(v, "name", str(v)))
def test_dequantize_bit_exact(qtype, n, k):
    rng = np.random.default_rng()
    raw = random_tensor(rng, qtype, n, k)
    ref = gq.dequantize(raw, qtype).reshape(n, k).astype(np.float32)
    w = to_device(qtype, raw, n, k)
    out = cp.full((n, k), np.nan, cp.float32)
    got = cuda.dequantize_rows(w, out=out).get()
    bad = np.argwhere(got.view(np.uint32) != ref.view(np.uint32))
    assert len(bad) == 0, f"{len(bad)} mismatches, first at {bad[0]}: {got[tuple(bad[0])]} vs {ref[tuple(bad[0])]}"
    rows = rng.integers(0, n, 13).astype(np.int32)
    out = cp.full((13, k), np.nan, cp.float32)
    got = cuda.dequantize_rows(w, cp.asarray(rows), out=out).get()
    np.testing.assert_array_equal(got, ref[rows])
    half = cuda.dequantize_rows(w, half=True, out=cp.full((n, k), np.nan, cp.float16)).get()
    np.testing.assert_array_equal(half, ref.astype(np.float16))


@pytest.mark.parametrize("qtype,n,k", list(cases()), ids=lambda v: getattr(v, "name", str(v)))
@pytest.mark.parametrize("b", (1, 2, 3, 8, 9, 16, 32))  # dp4a for 1-2 rows, tensor cores from 3 (bucket 4)
def test_matvec(qtype, n, k, b):
    rng = np.random.default_rng()
    raw = random_tensor(rng, qtype, n, k)
    ref_w = gq.dequantize(raw, qtype).reshape(n, k).astype(np.float64)
    x = rng.standard_normal((b, k)).astype(np.float32)
    res = rng.standard_normal((b, n)).astype(np.float32)
    ref = x.astype(np.float64) @ ref_w.T + res
    w = to_device(qtype, raw, n, k)
    out = cp.full((b, n), np.nan, cp.float32)
    got = cuda.matvec(cp.asarray(x), w, out=out, res=cp.asarray(res)).get()
    err = np.abs(got - ref).max() / np.abs(ref).max()
    worst = np.unravel_index(np.abs(got - ref).argmax(), ref.shape)
    assert err < tol(qtype, b, k), f"relative error {err:.2e}, worst at {worst}: {got[worst]} vs {ref[worst]}"


@pytest.mark.parametrize("qtype", (Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.Q4_0))
@pytest.mark.parametrize("n,k", ((83, 1536), (769, 4096)))
def test_matmul_prefill_f16(qtype, n, k):
    rng = np.random.default_rng()
    raw = random_tensor(rng, qtype, n, k)
    ref_w = gq.dequantize(raw, qtype).reshape(n, k).astype(np.float64)
    x = rng.standard_normal((83, k)).astype(np.float32)
    ref = x @ ref_w.T
    got = cuda.matmul(cp.asarray(x), to_device(qtype, raw, n, k)).get()
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err < 3e-3, f"relative error {err:.2e}"


@pytest.mark.parametrize("k", (576, 4096, 14336))
def test_matvec_real_widths(k):
    """The real model widths for the three benchmark types (rows 7 and 83 keep it quick)."""
    rng = np.random.default_rng()
    for qtype in (Q.Q8_0, Q.Q4_K, Q.Q6_K):
        if k % QUANT_BLOCKS[qtype][0]:
            continue
        for n in (7, 83):
            raw = random_tensor(rng, qtype, n, k)
            ref_w = gq.dequantize(raw, qtype).reshape(n, k).astype(np.float64)
            x = rng.standard_normal((4, k)).astype(np.float32)
            got = cuda.matvec(cp.asarray(x), to_device(qtype, raw, n, k),
                              out=cp.full((4, n), np.nan, cp.float32)).get()
            ref = x @ ref_w.T
            assert np.abs(got - ref).max() / np.abs(ref).max() < tol(qtype, 4, k), (qtype.name, n, k)


@pytest.mark.parametrize("k", (32, 96, 4096, 14336))
def test_quantize_rows(k):
    """x ≈ d (hi + lo/254) within d/508 per element; s is the group's sum; a zero group is zeros."""
    rng = np.random.default_rng()
    x = (rng.standard_normal((5, k)) * rng.uniform(0.01, 100, (5, 1))).astype(np.float32)
    x[2, :32] = 0
    q = cuda.QAct(5, k)
    q.buf.fill(0x5A)  # poisoned
    cuda.quantize(cp.asarray(x), q)
    hi, lo = q.hi.get().reshape(5, k // 32, 32), q.lo.get().reshape(5, k // 32, 32)
    d, s = q.d.get().reshape(5, k // 32), q.s.get().reshape(5, k // 32)
    xr = x.reshape(5, k // 32, 32).astype(np.float64)
    back = d[..., None] * (hi + lo / 254.0)
    np.testing.assert_allclose(d, np.abs(xr).max(-1) / 127, rtol=1e-6)
    assert (np.abs(back - xr) <= d[..., None] * (1 / 508 + 2e-5)).all()  # + float rounding
    np.testing.assert_allclose(s, xr.sum(-1), rtol=1e-4, atol=1e-5 * np.abs(xr).sum(-1).max())
    assert (hi[2, 0] == 0).all() and (lo[2, 0] == 0).all() and d[2, 0] == 0


@pytest.mark.parametrize("qtype", (Q.Q8_0, Q.Q4_K, Q.Q6_K))
@pytest.mark.parametrize("b", (4, 16, 32))
def test_matvec_tall(qtype, b):
    """More rows than MMA_ONE_TILE_ROWS: the int8 tensor-core matvecs take 32 rows per block
    (Q8_0 rows of 576, not whole 256-blocks, stay on them); the f16 ones, many row tiles."""
    rng = np.random.default_rng()
    n, k = cuda.CudaSettings().mma_one_tile_rows + 83, 576 if qtype == Q.Q8_0 else 512
    raw = random_tensor(rng, qtype, n, k)
    ref_w = gq.dequantize(raw, qtype).reshape(n, k).astype(np.float64)
    x = rng.standard_normal((b, k)).astype(np.float32)
    got = cuda.matvec(cp.asarray(x), to_device(qtype, raw, n, k), out=cp.full((b, n), np.nan, cp.float32)).get()
    ref = x @ ref_w.T
    assert np.abs(got - ref).max() / np.abs(ref).max() < tol(qtype, b, k)


@pytest.mark.parametrize("qtype", (Q.Q8_0, Q.Q4_K, Q.Q6_K))
@pytest.mark.parametrize("b", (3, 16, 32))
def test_matvec_f16_split_k(qtype, b):
    """The f16 tensor-core matvec over several row tiles whose K splits meet in the scratch
    partials: right twice in a row (each launch must leave the tile counters at zero), with the
    residual added once, and the same bits both times (the splits add up in a fixed order)."""
    rng = np.random.default_rng()
    n, k = 2 * cuda.MMH_ROWS + 37, 14336  # 3 row tiles, 56 K blocks: the launcher splits K
    raw = random_tensor(rng, qtype, n, k)
    ref_w = gq.dequantize(raw, qtype).reshape(n, k).astype(np.float64)
    w = to_device(qtype, raw, n, k)
    x = rng.standard_normal((b, k)).astype(np.float32)
    res = rng.standard_normal((b, n)).astype(np.float32)
    ref = x.astype(np.float64) @ ref_w.T + res
    outs = []
    for _ in range(2):
        out = cp.full((b, n), np.nan, cp.float32)
        outs.append(cuda.matvec(cp.asarray(x), w, out=out, res=cp.asarray(res)).get())
        assert np.abs(outs[-1] - ref).max() / np.abs(ref).max() < F16_MATVEC_TOL
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("qtype", (Q.Q8_0, Q.Q4_K, Q.Q6_K))
@pytest.mark.parametrize("b", (3, 16, 32))
def test_matvec_int8_mma(qtype, b, monkeypatch):
    """With NTX_F16_MMA=0 (no f16 matvecs) batches run the int8 tensor-core kernels on QAct
    activations: MATVEC_TOL, as before the f16 path existed."""
    no_f16 = cuda.CudaSettings(f16_mma=False)
    rng = np.random.default_rng()
    n, k = 769, 4096
    raw = random_tensor(rng, qtype, n, k)
    ref_w = gq.dequantize(raw, qtype).reshape(n, k).astype(np.float64)
    x = rng.standard_normal((b, k)).astype(np.float32)
    got = cuda.matvec(cp.asarray(x), to_device(qtype, raw, n, k), out=cp.full((b, n), np.nan, cp.float32),
                      s=no_f16).get()
    ref = x @ ref_w.T
    assert np.abs(got - ref).max() / np.abs(ref).max() < MATVEC_TOL


@pytest.mark.parametrize("qtype", (Q.Q8_0, Q.Q4_K, Q.Q6_K))  # only Q8_0's grid is persistent
@pytest.mark.parametrize("b", (1, 2))
@pytest.mark.parametrize("persistent", (True, False))
@pytest.mark.parametrize("split_k", (True, False))
@pytest.mark.parametrize("wide", (True, False))
def test_matvec_row_groups_grid_stride(qtype, b, persistent, split_k, wide, monkeypatch):
    """The Q8_0 dp4a matvec hands row groups out grid-stride: with the grid cut to what one SM holds
    (as if the GPU had one SM) every block loops over many groups, with or without split-K, and
    each row is written once, right, with its residual; with a block per group
    (NTX_MVQ_PERSISTENT=0) the same; with 4 rows per warp at one row (MVQ_WIDE_MAX_N) too, 5125
    rows leaving a partial last group."""
    from ntransformerd.engine.backends.cuda import launch
    monkeypatch.setattr(launch, "sm_count", lambda: 1)
    s = cuda.CudaSettings(mvq_wide_max_n=dict.fromkeys(cuda.FAST_MATVEC, 1 << 30 if wide else 0),
                          mvq_persistent=persistent, split_k_warps=1 << 30 if split_k else 0)
    rng = np.random.default_rng()
    n, k = 5125, 1536
    raw = random_tensor(rng, qtype, n, k)
    ref_w = gq.dequantize(raw, qtype).reshape(n, k).astype(np.float64)
    x = rng.standard_normal((b, k)).astype(np.float32)
    res = rng.standard_normal((b, n)).astype(np.float32)
    ref = x.astype(np.float64) @ ref_w.T + res
    out = cp.asarray(res)  # in place, as the decode step adds to the residual: a row done twice adds twice
    got = cuda.matvec(cp.asarray(x), to_device(qtype, raw, n, k), out=out, res=out, s=s).get()
    assert np.abs(got - ref).max() / np.abs(ref).max() < MATVEC_TOL


LEGACY_F16 = cuda.CudaSettings(f16_legacy=True)


@pytest.mark.parametrize("n,k", ((7, 96), (83, 576), (192, 576), (769, 576), (83, 1536), (769, 4096)))
@pytest.mark.parametrize("b", (1, 2, 3, 4, 9, 16, 32))
def test_matvec_q4_1_f16(n, k, b):
    """settings.f16_legacy: Q4_1 batches of 3+ rows (bucket 4) on the f16 tensor cores (mmh_q4_1),
    rows of any multiple of 32 (96 and 576: the last K block partial, its missing groups zero)
    within the f16 kernels' tolerance of the float64 product, the residual added once; 1-2 rows
    on the generic kernel as before."""
    rng = np.random.default_rng()
    raw = random_tensor(rng, Q.Q4_1, n, k)
    ref_w = gq.dequantize(raw, Q.Q4_1).reshape(n, k).astype(np.float64)
    x = rng.standard_normal((b, k)).astype(np.float32)
    res = rng.standard_normal((b, n)).astype(np.float32)
    ref = x.astype(np.float64) @ ref_w.T + res
    family = cuda.choose(Q.Q4_1, n, k, b, LEGACY_F16, 132).family
    assert family == ("mmh" if b >= 3 else "generic")
    out = cp.full((b, n), np.nan, cp.float32)
    got = cuda.matvec(cp.asarray(x), to_device(Q.Q4_1, raw, n, k), out=out, res=cp.asarray(res), s=LEGACY_F16).get()
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < (F16_MATVEC_TOL if family == "mmh" else 2e-5), (family, err)


@pytest.mark.parametrize("b", (4, 32))
def test_matvec_q4_1_f16_split_k_in_place(b):
    """mmh_q4_1 over several row tiles with K split (4160 = 16 whole 256-blocks and a partial
    one): right twice in a row and the same bits (the splits meet in order, the counters left at
    zero), adding in place to the residual as the decode step does."""
    rng = np.random.default_rng()
    n, k = 2 * cuda.MMH_ROWS + 37, 4160
    assert cuda.mmh_grid(n, k, cuda.launch.sm_count())[1] > 1
    raw = random_tensor(rng, Q.Q4_1, n, k)
    ref_w = gq.dequantize(raw, Q.Q4_1).reshape(n, k).astype(np.float64)
    w = to_device(Q.Q4_1, raw, n, k)
    x = rng.standard_normal((b, k)).astype(np.float32)
    res = rng.standard_normal((b, n)).astype(np.float32)
    ref = x.astype(np.float64) @ ref_w.T + res
    outs = []
    for _ in range(2):
        out = cp.asarray(res)
        outs.append(cuda.matvec(cp.asarray(x), w, out=out, res=out, s=LEGACY_F16).get())
        assert np.abs(outs[-1] - ref).max() / np.abs(ref).max() < F16_MATVEC_TOL
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("qtype,n,k", ((Q.Q4_1, 576, 576), (Q.Q4_1, 3072, 576), (Q.Q4_1, 2 * cuda.MMH_ROWS + 37, 4160),
                                       (Q.Q4_K, 769, 4096), (Q.Q8_0, 5125, 1536)))
@pytest.mark.parametrize("rows", (33, 50, 64, 100, 128))
@pytest.mark.parametrize("deterministic", (False, True))
def test_mmh_chunks_in_one_launch_equal_a_launch_per_chunk(qtype, n, k, rows, deterministic):
    """A step of 33-128 rows on the f16 tensor cores runs as one launch of 32-row chunks
    (gridDim.z, cuda.mmh_chunks): every row's bits equal those of its chunk launched alone at the
    chunk's own batch width, with and without K splits, adding in place to the residual, twice in a
    row (the per-chunk counters left at zero); and within the f16 tolerance of the float64 product."""
    rng = np.random.default_rng()
    s = cuda.CudaSettings(deterministic=deterministic)
    tiles, ks = cuda.mmh_grid(n, k, cuda.launch.sm_count())
    assert cuda.mmh_chunks(rows, n, k, tiles, ks) == -(-rows // 32)
    raw = random_tensor(rng, qtype, n, k)
    w = to_device(qtype, raw, n, k)
    x = cp.asarray(rng.standard_normal((rows, k)).astype(np.float32))
    res = rng.standard_normal((rows, n)).astype(np.float32)
    ref = cp.asnumpy(x).astype(np.float64) @ gq.dequantize(raw, qtype).reshape(n, k).astype(np.float64).T + res
    per_chunk = cp.asarray(res)
    for a in range(0, rows, 32):  # a short last chunk alone may run another kernel (1-2 rows: the 1-row ones)
        b = min(rows, a + 32)
        cuda.matvec(x[a:b], w, out=per_chunk[a:b], res=per_chunk[a:b], s=s)
    per_chunk = per_chunk.get()
    for _ in range(2):
        out = cp.asarray(res)
        got = cuda.matvec_rows(x, w, out=out, res=out, s=s).get()
        assert np.abs(got - ref).max() / np.abs(ref).max() < F16_MATVEC_TOL
        np.testing.assert_array_equal(got, per_chunk)  # every row, the short last chunk's too
