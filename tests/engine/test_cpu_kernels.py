"""The CPU backend's quantized kernels (kernels/cpu/quant*.c) against gguf.quants and float64.

Every weight type runs in every build variant this CPU can execute (generic C, x86-64-v3 AVX2,
x86-64-v4 with AVX-512 VNNI), each compiled by the host backend's build module (native.build,
the daemon's own flags) into a temporary directory once per session.

Matmul error bound. ntx_quantize_act stores each activation block as q = round(x / d_a) with
d_a = amax / 127, so |x_i − d_a q_i| ≤ (d_a / 2)(1 + 2^-10) (the 2^-10 covers the float
rounding of the scale and of x · 127/amax, at most 4 · 127 ulp of 1). Against the exact float
activations x, output (r, j) is then within

    B_int8 = Σ_blocks (d_a / 2)(1 + 2^-10) Σ_{i in block} |w_i|          (int8 activations)
  + B_fp   = γ Σ_i (|w_i| + 2 o_i)(|x_i| + d_a)                         (float32 arithmetic)

of Σ_i w_i x_i, w the float32 weights gguf.quants dequantizes. The kernels sum each block (or
K super-block) exactly in integers and round only when scaling and adding blocks, so with
u = 2^-24 every rounding is relative to at most the sum of |terms| above, and
γ = (number of blocks + 10) · 2u. o_i is the offset a kernel factors out of the weight
(w = scale part + offset, e.g. Q4_0's −8d, Q4_1's m, Q6_K's −32 d·sc, Q8_0's −128d on the VNNI
path): |scale part| ≤ |w| + |o|. The tests check the output against both the exact x (B_int8 +
B_fp) and against the activations exactly as quantized (d_a q, parsed from the buffer; B_fp
alone, which is tight enough to catch any wrong element).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants as gguf_quants

from ntransformerd.engine.quants import BLOCK_DTYPES, QUANT_BLOCKS, SUPPORTED_TYPES

from ntransformerd.engine.backends.host import native
from ntransformerd.engine.backends.host.attention import AttentionProbe
from ntransformerd.engine.gguf_file import LlamaConfig
from ntransformerd.engine.quants import BLOCK_DTYPES, QUANT_BLOCKS, SUPPORTED_TYPES

FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
K_TYPES = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
ACT32 = np.dtype([("d", np.float32), ("s", np.float32), ("q", np.int8, 32)])
ACT256 = np.dtype([("d", np.float32), ("bsums", np.int16, 16), ("q", np.int8, 256)])
ACT16 = 0x100  # ntx_cpu.h's NTX_ACT16: a block-32 type against 16-bit activation blocks
ACT16_32 = np.dtype([("d", np.float32), ("s", np.float32), ("q", np.int16, 32)])
LEGACY = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)


@pytest.fixture(scope="session")
def kernels(tmp_path_factory) -> dict[str, native.Library]:
    """Every variant this CPU runs, built from this tree into a fresh directory."""
    if not native.available():
        pytest.skip("no C compiler (apt install gcc)")
    out_dir, flags = str(tmp_path_factory.mktemp("ntx_cpu")), native.cpu_flags()
    return {v.name: native.Library(native.build(v, out_dir=out_dir, quiet=True), v)
            for v in native.VARIANTS if all(f in flags for f in v.needs)}


@pytest.fixture(params=[v.name for v in native.VARIANTS])
def lib(request, kernels) -> native.Library:
    if request.param not in kernels:
        pytest.skip(f"this CPU cannot run the {request.param} variant")
    return kernels[request.param]


# ---- calling the library -------------------------------------------------------------------

def ptr(a: np.ndarray | None) -> int | None:
    return None if a is None else a.ctypes.data


def quantize_act(lib, qtype: Q, x: np.ndarray) -> np.ndarray:
    nr, n = x.shape
    arb = lib.act_row_bytes(int(qtype), n)
    assert arb > 0
    act = np.empty((nr, arb), np.uint8)
    lib.quantize_act(int(qtype), ptr(x), nr, n, x.strides[0] // 4, ptr(act))
    return act


def gemm(lib, qtype: Q, w: np.ndarray, n: int, act: np.ndarray, j0: int = 0, j1: int | None = None,
         out: np.ndarray | None = None, res: np.ndarray | None = None) -> np.ndarray:
    """out (nr, ldo) = act @ w[j0:j1].T (+ res); out defaults to a NaN-poisoned (nr, rows)."""
    rows = w.shape[0]
    j1 = rows if j1 is None else j1
    if out is None:
        out = np.full((act.shape[0], rows), np.nan, np.float32)
    lib.gemm(int(qtype), ptr(w), w.shape[1], n, j0, j1, ptr(act), act.shape[0], ptr(out),
                 out.strides[0] // 4, ptr(res))
    return out


def dequantize_rows(lib, qtype: Q, w: np.ndarray, n: int, ids: np.ndarray) -> np.ndarray:
    ids = np.ascontiguousarray(ids, np.int64)
    out = np.full((ids.size, n), np.nan, np.float32)
    lib.dequantize_rows(int(qtype), ptr(w), w.shape[1], n, ptr(ids), ids.size, ptr(out))
    return out


# ---- inputs and references -----------------------------------------------------------------

def random_weights(qtype: Q, rows: int, n: int, rng: np.random.Generator, outliers: bool = False) -> np.ndarray:
    """(rows, row_bytes) random blocks: random quant bits, finite scales (some near the f16
    limit where `outliers`), a few all-zero blocks."""
    block_elems, block_bytes = QUANT_BLOCKS[qtype]
    if qtype in FLOAT_TYPES:
        x = rng.standard_normal(rows * n).astype(np.float32)
        if outliers:
            x[::97] *= 1e4
        x[:7] = 0.0
        raw = (x.view(np.uint8) if qtype == Q.F32 else x.astype(np.float16).view(np.uint8) if qtype == Q.F16
               else (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8))
        return raw.reshape(rows, -1)
    nblk = rows * n // block_elems
    raw = rng.integers(0, 256, nblk * block_bytes, dtype=np.uint8)
    blocks = raw.view(BLOCK_DTYPES[qtype])
    for field in ("d", "dmin", "m"):
        if field in blocks.dtype.names:
            v = (rng.standard_normal(nblk) * 0.01).astype(np.float16)
            if outliers:
                v[::13] = np.float16(60000.0)
            blocks[field] = v
    raw.reshape(nblk, block_bytes)[:2] = 0
    return raw.reshape(rows, -1)


def reference_dequant(qtype: Q, w: np.ndarray, n: int) -> np.ndarray:
    return gguf_quants.dequantize(w.reshape(-1).copy(), qtype).astype(np.float32).reshape(w.shape[0], n)


def offsets(qtype: Q, w: np.ndarray, n: int) -> np.ndarray:
    """|o_i| per weight element: the weights with every quant code set to the one whose value is
    the block's offset (0, or -128 for Q8_0), dequantized by gguf.quants."""
    if qtype in FLOAT_TYPES:
        return np.zeros((w.shape[0], n))
    z = w.reshape(-1).copy()
    blocks = z.view(BLOCK_DTYPES[qtype])
    for field in ("qs", "qh", "ql", "hmask"):
        if field in blocks.dtype.names:
            blocks[field] = -128 if qtype == Q.Q8_0 else 0
    return np.abs(reference_dequant(qtype, z.reshape(w.shape), n).astype(np.float64))


def parse_act(qtype: Q, act: np.ndarray, n: int, act16: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(activations as quantized, d_a per element), both (nr, n) float64."""
    if qtype in FLOAT_TYPES:
        x = act.view(np.float32).astype(np.float64)
        return x, np.zeros_like(x)
    dt = ACT16_32 if act16 else ACT256 if qtype in K_TYPES else ACT32
    blocks = act.reshape(-1).view(dt).reshape(act.shape[0], -1)
    per = dt["q"].shape[0]
    d = np.repeat(blocks["d"].astype(np.float64), per, axis=1)
    return blocks["q"].reshape(act.shape[0], n).astype(np.float64) * d, d


# |x - d_a q| ≤ (d_a / 2)(1 + slack): the float rounding of x · qmax/amax is at most ~2 ulp of
# qmax, 4·127 ulp of 1 for int8 (2^-10 covers it) and 4·32767 ulp for int16 (2^-6 does)
SLACK8, SLACK16 = 2.0 ** -10, 2.0 ** -6


def bounds(qtype: Q, w: np.ndarray, wf: np.ndarray, x: np.ndarray, d_a: np.ndarray,
           slack: float = SLACK8) -> tuple[np.ndarray, np.ndarray]:
    """(B_int8, B_fp) per output (nr, rows): see the module docstring."""
    n = wf.shape[1]
    nblocks = n if qtype in FLOAT_TYPES else n // QUANT_BLOCKS[qtype][0]
    gamma = (nblocks + 10) * 2.0 ** -23
    aw = np.abs(wf.astype(np.float64))
    b_int8 = (d_a / 2 * (1 + slack)) @ aw.T
    b_fp = gamma * ((np.abs(x) + d_a) @ (aw + 2 * offsets(qtype, w, n)).T)
    return b_int8, b_fp


def worst(err: np.ndarray, bound: np.ndarray, got: np.ndarray, ref: np.ndarray) -> str:
    r, j = np.unravel_index(np.argmax(err / np.maximum(bound, 1e-300)), err.shape)
    return (f"worst at (act row {r}, weight row {j}): got {got[r, j]!r}, reference {ref[r, j]!r}, "
            f"|err| {err[r, j]:.3g} > bound {bound[r, j]:.3g}")


def check_gemm(lib, qtype: Q, w: np.ndarray, n: int, x: np.ndarray, act16: bool = False) -> np.ndarray:
    """Run ntx_gemm on x and assert both bounds; returns the output. act16: against 16-bit
    activation blocks (the same bounds with their d_a)."""
    kind = int(qtype) | (ACT16 if act16 else 0)
    act = quantize_act(lib, kind, x)
    out = gemm(lib, kind, w, n, act)
    wf = reference_dequant(qtype, w, n).astype(np.float64)
    xq, d_a = parse_act(qtype, act, n, act16)
    b_int8, b_fp = bounds(qtype, w, wf, x.astype(np.float64), d_a, SLACK16 if act16 else SLACK8)
    assert np.isfinite(out).all(), f"non-finite output at {np.argwhere(~np.isfinite(out))[:3].tolist()}"
    exact = x.astype(np.float64) @ wf.T
    as_quantized = xq @ wf.T
    err = np.abs(out - as_quantized)
    assert (err <= b_fp).all(), "against the quantized activations: " + worst(err, b_fp, out, as_quantized)
    err = np.abs(out - exact)
    assert (err <= b_int8 + b_fp).all(), "against the float activations: " + worst(err, b_int8 + b_fp, out, exact)
    # neither bound is vacuous: each is well under the size of the products it bounds (the int8
    # one over all outputs together: one output whose weights sit on an activation block's small
    # values can come near its size, by the draw)
    size = np.abs(x.astype(np.float64)) @ np.abs(wf).T
    assert (b_fp <= 1e-3 * size).all() and b_int8.sum() <= 0.5 * size.sum()
    return out


def activations(nr: int, n: int, rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal((nr, n)).astype(np.float32)
    x[:, ::53] *= 20.0  # outlier channels, as real hidden states have
    if nr > 1:
        x[1, : min(n, 64)] = 0.0  # an all-zero block
    return x


# ---- tests ---------------------------------------------------------------------------------

def test_variant_reports_its_isa(kernels):
    assert kernels, "no variant was built"
    for name, lib in kernels.items():
        assert lib.isa().decode() == name


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda q: q.name)
def test_dequantize_rows_bit_exact(lib, qtype):
    rng = np.random.default_rng()
    block_elems, _ = QUANT_BLOCKS[qtype]
    for rows, blocks_per_row in ((7, 3), (83, 1), (5, 11)):
        n = blocks_per_row * block_elems if block_elems > 1 else 83 * blocks_per_row
        w = random_weights(qtype, rows, n, rng, outliers=True)
        ref = reference_dequant(qtype, w, n)
        ids = np.concatenate([[rows - 1, 0], rng.integers(0, rows, 9), [rows - 1]])
        got = dequantize_rows(lib, qtype, w, n, ids)
        same = (got.view(np.uint32) == ref[ids].view(np.uint32))
        if not same.all():
            r, i = np.argwhere(~same)[0]
            pytest.fail(f"{rows}×{n}: row {ids[r]} element {i} (block {i // block_elems}): "
                        f"got {got[r, i]!r}, gguf.quants {ref[ids[r], i]!r}")


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda q: q.name)
def test_quantize_act_format(lib, qtype, kernels):
    """Every activation block as ntx_cpu.h documents it, identical bytes in every variant."""
    rng = np.random.default_rng()
    n = 768 if qtype not in FLOAT_TYPES else 83
    x = np.zeros((5, n + 9), np.float32)  # row stride ldx > n
    x[:, :n] = activations(5, n, rng)
    x = x[:, :n]
    act = quantize_act(lib, qtype, x)
    if qtype in FLOAT_TYPES:
        assert np.array_equal(act.view(np.float32), x)
        return
    dt, per = (ACT256, 256) if qtype in K_TYPES else (ACT32, 32)
    blocks = act.reshape(-1).view(dt).reshape(5, -1)
    xb = x.reshape(5, -1, per)
    amax = np.abs(xb).max(axis=-1)
    assert np.array_equal(blocks["d"], (amax / np.float32(127)).astype(np.float32))
    q = blocks["q"].astype(np.float64)
    err = np.abs(xb - q * blocks["d"][..., None].astype(np.float64))
    assert (err <= blocks["d"][..., None] / 2 * (1 + 2.0 ** -10)).all()
    if per == 32:
        assert np.array_equal(blocks["s"], blocks["d"] * blocks["q"].astype(np.int32).sum(-1).astype(np.float32))
    else:
        assert np.array_equal(blocks["bsums"], blocks["q"].reshape(5, -1, 16, 16).astype(np.int32).sum(-1))
    for other in kernels.values():
        assert np.array_equal(quantize_act(other, qtype, x), act), other.variant.name


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda q: q.name)
def test_gemm_random_within_bound(lib, qtype):
    rng = np.random.default_rng()
    block_elems, _ = QUANT_BLOCKS[qtype]
    if qtype in FLOAT_TYPES:
        widths = (83, 769)
    elif qtype in K_TYPES:
        widths = (256, 768)
    else:
        widths = (32, 736)
    shapes = [(widths[0], 7, 1), (widths[1], 83, 3), (widths[1], 769, 1), (widths[0], 83, 8),
              (widths[1], 7, 17), (widths[1], 83, 512)]
    for n, rows, nr in shapes:
        w = random_weights(qtype, rows, n, rng)
        check_gemm(lib, qtype, w, n, activations(nr, n, rng))


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda q: q.name)
def test_gemm_res_and_ranges(lib, qtype):
    """res adds exactly; res may be out; a [j0, j1) call writes those columns only and gives each
    output the bits a full call gives it (results do not depend on how threads split rows)."""
    rng = np.random.default_rng()
    n = 512 if qtype in K_TYPES else 96
    rows = 37
    w = random_weights(qtype, rows, n, rng)
    for nr in (1, 9):  # decode and prefill tiles
        act = quantize_act(lib, qtype, activations(nr, n, rng))
        full = gemm(lib, qtype, w, n, act)
        res = rng.standard_normal((nr, rows)).astype(np.float32)
        assert np.array_equal(gemm(lib, qtype, w, n, act, res=res), full + res)
        inplace = res.copy()
        gemm(lib, qtype, w, n, act, out=inplace, res=inplace)
        assert np.array_equal(inplace, full + res)
        padded = np.full((nr, rows + 5), np.nan, np.float32)  # ldo > rows
        for j0, j1 in ((5, 34), (0, 1), (36, 37), (11, 11), (2, 5)):
            padded[:] = np.nan
            gemm(lib, qtype, w, n, act, j0=j0, j1=j1, out=padded)
            assert np.array_equal(padded[:, j0:j1], full[:, j0:j1]), (nr, j0, j1)
            outside = np.ones(rows + 5, bool)
            outside[j0:j1] = False
            assert np.isnan(padded[:, outside]).all(), f"nr {nr}: [{j0}, {j1}) wrote outside its range"


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16], ids=lambda q: q.name)
def test_gemm_converts_every_finite_half(lib, qtype):
    """Against one-hot activation rows a float-weight matmul returns each weight itself: every
    finite F16 / BF16 bit pattern (subnormals included) converts exactly in every variant."""
    bits = np.arange(1 << 16, dtype=np.uint32)
    exp_mask = 0x7C00 if qtype == Q.F16 else 0x7F80
    bits = bits[(bits & exp_mask) != exp_mask].astype(np.uint16)  # drop inf / NaN
    n = 16
    w = bits[: bits.size // n * n].reshape(-1, n)
    ref = (w.view(np.float16).astype(np.float32) if qtype == Q.F16
           else (w.astype(np.uint32) << 16).view(np.float32))
    x = np.eye(n, dtype=np.float32)
    out = gemm(lib, qtype, w.view(np.uint8), n, quantize_act(lib, qtype, x))
    assert np.array_equal(out, ref.T), f"{np.count_nonzero(out != ref.T)} weights converted wrongly"


@pytest.mark.parametrize("qtype", LEGACY, ids=lambda q: q.name)
def test_quantize_act16_format(lib, qtype, kernels):
    """ntx_q16_32 blocks as ntx_cpu.h documents them, identical bytes in every variant."""
    rng = np.random.default_rng()
    x = activations(5, 768, rng)
    act = quantize_act(lib, int(qtype) | ACT16, x)
    blocks = act.reshape(-1).view(ACT16_32).reshape(5, -1)
    xb = x.reshape(5, -1, 32)
    amax = np.abs(xb).max(axis=-1)
    assert np.array_equal(blocks["d"], (amax / np.float32(32767)).astype(np.float32))
    q = blocks["q"].astype(np.float64)
    err = np.abs(xb - q * blocks["d"][..., None].astype(np.float64))
    assert (err <= blocks["d"][..., None] / 2 * (1 + SLACK16)).all()
    assert np.array_equal(blocks["s"], blocks["d"] * blocks["q"].astype(np.int32).sum(-1).astype(np.float32))
    for other in kernels.values():
        assert np.array_equal(quantize_act(other, int(qtype) | ACT16, x), act), other.variant.name


@pytest.mark.parametrize("qtype", LEGACY, ids=lambda q: q.name)
def test_gemm_act16_within_bound_and_finer(lib, qtype):
    """Against 16-bit activations: within the same bounds (with the 16-bit scales), at least 10
    times closer to the float activations' product than the 8-bit path over the same inputs."""
    rng = np.random.default_rng()
    err16 = err8 = 0.0
    for n, rows, nr in ((32, 7, 1), (736, 83, 3), (736, 769, 1), (32, 83, 8), (736, 7, 17), (736, 83, 512)):
        w = random_weights(qtype, rows, n, rng)
        x = activations(nr, n, rng)
        exact = x.astype(np.float64) @ reference_dequant(qtype, w, n).astype(np.float64).T
        err16 += np.abs(check_gemm(lib, qtype, w, n, x, act16=True) - exact).sum()
        err8 += np.abs(check_gemm(lib, qtype, w, n, x) - exact).sum()
    assert err16 * 10 < err8, (err16, err8)


def test_act16_is_refused_for_other_types(lib):
    for qtype in (Q.F32, Q.Q4_K, Q.Q6_K):
        assert lib.act_row_bytes(int(qtype) | ACT16, 256) == 0, qtype.name


def test_bad_calls_are_visible(lib):
    assert lib.act_row_bytes(int(Q.Q4_K), 300) == 0  # not a whole super-block
    assert lib.act_row_bytes(99, 256) == 0  # no such type
    w = np.zeros((4, 18), np.uint8)
    act = np.zeros((1, 40), np.uint8)
    out = np.zeros((1, 4), np.float32)
    lib.gemm(99, ptr(w), 18, 32, 0, 4, ptr(act), 1, ptr(out), 4, None)
    assert np.isnan(out).all()


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.0.ffn_down.weight", "token_embd.weight"])
def test_gemm_real_weights(lib, default_model, name):
    """The default model's tensors (Q4_1 projections, the Q8_0 embedding/output table)."""
    t = default_model.tensor(name)
    rows, n = t.shape
    w = np.ascontiguousarray(np.asarray(t.data).reshape(rows, t.row_bytes))
    rng = np.random.default_rng()
    if rows > 4096:  # the output head: a strided sample of rows keeps the float64 reference quick
        w = np.ascontiguousarray(w[rng.integers(0, rows, 769)])
    for nr in (1, 17):
        check_gemm(lib, t.qtype, w, n, activations(nr, n, rng))
        check_gemm(lib, t.qtype, w, n, activations(nr, n, rng), act16=True)
    assert t.qtype in (Q.Q4_1, Q.Q8_0)
    got = dequantize_rows(lib, t.qtype, w, n, np.arange(w.shape[0]))
    assert np.array_equal(got.view(np.uint32), reference_dequant(t.qtype, w, n).view(np.uint32))


# ---- attention (kernels/cpu/attention.c) ----------------------------------------------------------

def _attn_cfg(n_heads: int, n_kv_heads: int, head_dim: int) -> LlamaConfig:
    return LlamaConfig(n_layers=1, d_model=n_heads * head_dim, d_ff=64, n_heads=n_heads, n_kv_heads=n_kv_heads,
                       head_dim=head_dim, vocab_size=64, context_length=1 << 16, rms_eps=1e-5, rope_base=1e4,
                       rope_dim=head_dim, rope_neox=False, rope_scale=1.0, tied_output=False)


SPLIT = 1024  # attention.h NTX_ATTN_SPLIT: positions per split


def assert_same_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert bad.size == 0, (f"{what}: {bad.size} of {got.size} differ; first at {bad[0]}: "
                           f"{got.flat[bad[0]]!r} vs {want.flat[bad[0]]!r}")


def exact_attention(probe: AttentionProbe) -> tuple[np.ndarray, float]:
    """(float64 attention of every query row over the keys and values its cache reads back,
    the largest |value| any row reads)."""
    c = probe.cfg
    hd, g = c.head_dim, c.n_heads // c.n_kv_heads
    scale = float(np.float32(1 / np.sqrt(hd)))  # the kernels' attn_scale
    out, vmax = np.zeros(probe.q.shape), 0.0
    for r, (pos, slot) in enumerate(zip(probe.positions, probe.slots)):
        k, v = (a.astype(np.float64) for a in probe.cache.layer(0).read(int(slot), int(pos) + 1))
        vmax = max(vmax, float(np.abs(v).max()))
        for j in range(c.n_heads):
            s = k[:, j // g] @ probe.q[r, j * hd:(j + 1) * hd].astype(np.float64) * scale
            p = np.exp(s - s.max())
            out[r, j * hd:(j + 1) * hd] = p / p.sum() @ v[:, j // g]
    return out, vmax


@pytest.mark.parametrize("dtype", ["f16", "q8_0", "f32"])
@pytest.mark.parametrize("heads, positions, rows, chunk", [
    ((32, 8, 128), 1, 1, 1), ((32, 8, 128), 17, 2, 1), ((32, 8, 128), 1000, 1, 1), ((32, 8, 128), 83, 1, 16),
    ((8, 8, 64), 300, 3, 1), ((12, 2, 96), 129, 2, 5), ((16, 1, 32), 769, 1, 3), ((4, 4, 256), 40, 1, 20),
    ((9, 3, 64), SPLIT, 2, 16)])
def test_attention_is_the_reference_bit_for_bit(lib, dtype, heads, positions, rows, chunk):
    """The kernel the steps run (scores across keys) gives the bits of the reference (scores
    across query vectors) on fresh random caches: GQA ratios 1 to 16, head_dim 32 to 256,
    decode rows and groups of up to 16 rows (a chunk of 20 is two groups), one thread or two.
    Every row here sees one split of keys at most (the last, all 1024 of the first): it runs whole."""
    probe = AttentionProbe(_attn_cfg(*heads), dtype=dtype, positions=positions, rows=rows, chunk=chunk,
                           seed=positions * 7 + rows, lib=lib)
    ref = probe.run(kernel="ref")
    assert np.isfinite(ref).all()
    for threads in (1, 2):
        assert_same_bits(probe.run(threads=threads), ref, f"threads {threads}")


@pytest.mark.parametrize("dtype", ["f16", "q8_0", "f32"])
@pytest.mark.parametrize("heads", [(32, 8, 128), (9, 3, 64)])  # 4:1 (an 8B), 3:1 (the default model)
def test_attention_splits_give_one_answer(lib, dtype, heads):
    """Past NTX_ATTN_SPLIT positions a row's keys are cut into splits at multiples of 1024 and
    the partials merged in split order, so a row's bits follow from its own position and data:
    the same at 1, 2 and 3 threads, with the partials folded by the last split item or each head's
    splits run in turn (a step with no room left for partials), alone or beside other
    sequences' rows (which here also change which groups get that room), and within its group of
    a prefill chunk or alone. Each stays within 1e-5 · max|v| of float64 (the error of float32
    sums in another order, as KERNEL_TOL's f32 row), as the kernel before splits does."""
    cfg = _attn_cfg(*heads)
    alone = AttentionProbe(cfg, dtype=dtype, positions=3000, chunk=20, seed=11, lib=lib)
    beside = AttentionProbe(cfg, dtype=dtype, positions=[3000, 2100, 1100, 20], chunk=20, seed=11, lib=lib)
    beside.q[:20] = alone.q  # sequence 0 has the same cache in both (the first one filled)
    one = alone.run(threads=1)
    for threads in (2, 3):
        assert_same_bits(alone.run(threads=threads), one, f"threads {threads}")
    assert_same_bits(alone.run(threads=2, kernel="serial"), one, "the splits of each head in one item")
    for threads in (1, 3):
        assert_same_bits(beside.run(threads=threads)[:20], one, f"beside other sequences, threads {threads}")
    last = AttentionProbe(cfg, dtype=dtype, positions=3000, chunk=1, seed=11, lib=lib)
    last.q[:] = alone.q[-1:]
    assert_same_bits(last.run(threads=2), one[-1:], "the chunk's last row alone")

    for probe in (alone, beside):
        exact, vmax = exact_attention(probe)
        for kernel in ("step", "whole"):
            err = float(np.abs(probe.run(threads=2, kernel=kernel) - exact).max())
            assert err <= 1e-5 * vmax, f"{kernel}: error {err:.3g} over {1e-5 * vmax:.3g}"


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
def test_rows_below_the_split_keep_their_bits_in_a_group_past_it(lib, dtype):
    """A prefill chunk across position 1024: its rows below 1024 give the whole kernel's bits
    (the later split adds nothing to them, exactly), the rows past it differ only in rounding."""
    probe = AttentionProbe(_attn_cfg(32, 8, 128), dtype=dtype, positions=SPLIT + 6, chunk=16, seed=5, lib=lib)
    step, whole = probe.run(threads=2), probe.run(threads=2, kernel="whole")
    below = SPLIT - (SPLIT + 6 - 16)  # rows at positions 1014 … 1023
    assert_same_bits(step[:below], whole[:below], "rows below the split")
    assert_same_bits(whole, probe.run(kernel="ref"), "the whole kernel against the reference")
    exact, vmax = exact_attention(probe)
    assert not np.array_equal(step[below:], whole[below:]) and float(np.abs(step - exact).max()) <= 1e-5 * vmax
