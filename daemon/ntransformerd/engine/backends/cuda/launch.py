"""Launchers: one thin function per kernel, checking dtype and shape before it launches, and
the choice of kernel for each matrix and batch width. `backends/cpu.py` is the reference every
launcher is tested against (tests/gpu).

Weights stay quantized on the device (Q8_0 and Q6_K repacked at load into planes that 16-byte
loads can read; the other types as their GGUF blocks, see weights.host_planes) and `matvec`
dequantizes inside the multiply for up to 32 rows; longer chunks (prefill) dequantize the
weight to f16 and multiply with cuBLAS. For Q8_0, Q4_K and Q6_K the fused multiply of 1-2 rows
reads the activations quantized (QAct: two int8 levels per element and a scale per 32, about
2^-15 of each group's largest value, see kernels/quant_act.cuh) and multiplies with int8 dot
products (dp4a); from 4 rows, rows of whole 256-blocks are dequantized to f16 in registers and
multiplied on f16 tensor cores (mmh_*), at prefill's precision; other widths use int8
tensor-core mma.sync on QAct. Q4_1 (the default model's type: 576-wide rows, not whole 256-blocks)
has no int8 kernel; with settings.f16_legacy (the default) its batches of 4+ rows take mmh_q4_1, the
same f16 tensor-core loop over 32-element blocks (any K), instead of the generic f32 kernel. Prefill
attention runs on tensor cores too (attn_chunk).

`choose` picks the kernel of each launch from the weight's type and shape and the launch's row
count. With settings.deterministic a row's arithmetic does not depend on how many rows share
its step: the batched family (mmh, or mma without f16_mma) serves every bucket from 1 row,
chunks of 32 rows serve any count (prefill too: no cuBLAS, whose algorithm follows the row
count), and a row's sum order is fixed by the weight's (n, k) alone (mmh's K splits from
mmh_grid, mma's tile rows from n, the generic kernel's lane order), never by the batch width:
inside a launch each output element accumulates from its own row's activations only (an mma's
element (i, j) reads row i of A and column j of B; the generic kernel keeps one accumulator per
row), and split-K partial sums meet in split order. The cost is the one-row matvec's speed
(mvq's dp4a is the fastest at 1-2 rows) and long prefills (32 rows per weight pass):
bench/RESULTS.md has the measured figures (bench/ab_decode.py --deterministic).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from gguf import GGMLQuantizationType as Q

from ntransformerd.engine.backends.cuda.nvrtc import check_array, cp, device_alloc, kernel, n_blocks
from ntransformerd.engine.backends.cuda.settings import DEFAULT, CudaSettings
from ntransformerd.engine.gguf_file import LlamaConfig

MATVEC_MAX_ROWS = 32  # up to this many rows a matvec launch is the fused dequant-multiply
CHUNKED_MAX_ROWS = 128  # up to this many rows a matmul runs as fused matvecs of ≤ 32 rows each (decode)
MATVEC_BUCKETS = (1, 2, 4, 8, 16, 32)  # compiled batch widths of the fused kernels
FAST_MATVEC = {Q.Q8_0: "mvq_q8_0", Q.Q4_K: "mvq_q4_k", Q.Q6_K: "mvq_q6_k"}  # on QAct activations
MMA_MATVEC = {Q.Q8_0: "mma_q8_0", Q.Q4_K: "mma_q4_k", Q.Q6_K: "mma_q6_k"}  # the same, tensor cores
F16_MATVEC = {Q.Q8_0: "mmh_q8_0", Q.Q4_K: "mmh_q4_k", Q.Q6_K: "mmh_q6_k"}  # f16 tensor cores (settings.f16_mma)
F16_LEGACY = {Q.Q4_1: "mmh_q4_1"}  # the same for 32-element blocks of no int8 kernel, any K (settings.f16_legacy)
MMH_ROWS = 128  # rows per mmh block
MMH_PART_FLOATS = 32 * 131072  # split-K partial sums: batch rows × (splits × N), 16 MB per stream
MMA_MIN_BUCKET = 4  # from this batch bucket on, the FAST_MATVEC types multiply on tensor cores
ROWS_PER_WARP = {1: 2, 2: 2, 4: 4, 8: 4, 16: 4, 32: 2}  # per batch bucket: x reuse vs registers
WIDE_ROWS_PER_WARP = 4  # one-row matvecs of at most settings.mvq_wide_max_n rows


def bucket_of(rows: int) -> int:
    """The compiled batch width a matvec of `rows` rows runs at (1..MATVEC_MAX_ROWS)."""
    for m in MATVEC_BUCKETS:
        if m >= rows:
            return m
    raise ValueError(f"{rows} rows: the fused kernels take at most {MATVEC_MAX_ROWS}")


def dequantize_rows(w, rows=None, *, half: bool = False, out=None):
    """W[rows] (or all of W) as float32, or f16 with half=True: (len(rows), K)."""
    n, k = w.shape
    if rows is not None:
        check_array(rows, cp.int32, 1, "dequantize_rows rows")
    m = n if rows is None else len(rows)
    dtype = cp.float16 if half else cp.float32
    if out is None:
        out = cp.empty((m, k), dtype)
    check_array(out, dtype, 2, "dequantize_rows out")
    if out.shape != (m, k):
        raise ValueError(f"dequantize_rows: out {out.shape}, expected {(m, k)}")
    fn = kernel("quant", f"dequant_rows<{int(w.qtype)},{'true' if half else 'false'}>")
    subs = m * (k // 32)
    fn((n_blocks(subs, 128),), (128,), (*w.ptrs(), rows if rows is not None else out, np.int32(rows is not None),
                                       np.int32(m), np.int32(k), out))
    return out


class QAct:
    """Activation rows (rows, K) quantized for the int8 matvecs: hi, lo (rows, K) int8 and
    d, s (rows, K/32) float32 in one device buffer (layout in kernels/quant_act.cuh)."""

    def __init__(self, rows: int, k: int):
        if k % 32:
            raise ValueError(f"QAct: K {k} is not a multiple of 32")
        self.rows, self.k = rows, k
        n, g = rows * k, rows * k // 32
        self.buf = cp.empty(2 * n + 8 * g, cp.uint8)
        self.hi, self.lo = self.buf[:n].view(cp.int8), self.buf[n:2 * n].view(cp.int8)
        self.d, self.s = self.buf[2 * n:2 * n + 4 * g].view(cp.float32), self.buf[2 * n + 4 * g:].view(cp.float32)

    def args(self) -> tuple:
        return (self.hi, self.lo, self.d, self.s)

    def part(self, a: int, b: int) -> QAct:
        """Rows [a, b) as a QAct of their own (views of this one's buffer)."""
        if not 0 <= a < b <= self.rows:
            raise ValueError(f"QAct.part: rows [{a}, {b}) of {self.rows}")
        q = QAct.__new__(QAct)
        k, g = self.k, self.k // 32
        q.rows, q.k, q.buf = b - a, k, self.buf
        q.hi, q.lo = self.hi[a * k:b * k], self.lo[a * k:b * k]
        q.d, q.s = self.d[a * g:b * g], self.s[a * g:b * g]
        return q


_qscratch: dict[tuple, QAct] = {}


def _scratch_qact(rows: int, k: int) -> QAct:
    key = (cp.cuda.Device().id, rows, k)
    if key not in _qscratch:
        _qscratch[key] = QAct(rows, k)
    return _qscratch[key]


def quantize(x, q: QAct, *, n: int | None = None, ld: int | None = None) -> QAct:
    """q = the first n rows of x (row stride ld, q.k columns) quantized."""
    n = x.shape[0] if n is None else n
    ld = x.shape[1] if ld is None else ld
    if n > q.rows:
        raise ValueError(f"quantize: {n} rows into a QAct of {q.rows}")
    groups = n * (q.k // 32)
    kernel("quant", "quantize_rows")((n_blocks(groups, 8),), (256,), (x, np.int32(ld), np.int32(n), np.int32(q.k),
                                                                    *q.args()))
    return q


def matvec(x, w, *, out=None, res=None, nb: int | None = None, xq: QAct | None = None,
           s: CudaSettings = DEFAULT):
    """out = x @ W.T (+ res) for x (B ≤ 32, K) float32: the fused
    dequantize-multiply. For the int8 kernels x is quantized first, unless xq already holds x
    quantized; the f16 ones (F16_MATVEC, from bucket 4, or 1 with settings.deterministic) read x
    itself and ignore xq. The kernel: `choose`."""
    n, k = w.shape
    check_array(x, cp.float32, 2, "matvec x")
    b = x.shape[0] if nb is None else nb
    if x.shape[1] != k or not 1 <= b <= MATVEC_MAX_ROWS or b > x.shape[0]:
        raise ValueError(f"matvec: x {x.shape} (rows {b}) against W {w.shape}")
    if out is None:
        out = cp.empty((b, n), cp.float32)
    check_array(out, cp.float32, 2, "matvec out")
    if out.shape[1] != n or out.shape[0] < b:
        raise ValueError(f"matvec: out {out.shape}, expected ({b}, {n})")
    if res is not None:
        check_array(res, cp.float32, 2, "matvec res")
        if res.shape[1] != n or res.shape[0] < b:
            raise ValueError(f"matvec: res {res.shape}, expected ({b}, {n})")
    c = choose(w.qtype, n, k, b, s, sm_count() if w.qtype in F16_MATVEC or w.qtype in F16_LEGACY else 0)
    res_args = (res if res is not None else out, np.int32(res is not None), out, np.int32(n), np.int32(k), np.int32(b))
    fn = kernel("quant", c.instance)
    if c.family == "generic":
        fn(c.grid, (128,), (*w.ptrs(), x, *res_args))
        return out
    if c.family == "mmh":  # reads x itself, not xq
        part, cnt = mmh_scratch()
        fn(c.grid, (256,), (*w.ptrs(), x, *res_args, part, cnt))
        return out
    if xq is None:
        xq = quantize(x, _scratch_qact(bucket_of(b), k), n=b)
    elif xq.k != k or xq.rows < b:
        raise ValueError(f"matvec: xq ({xq.rows}, {xq.k}) for {b} rows of K {k}")
    if c.family == "mma":
        fn(c.grid, (256,), (*w.ptrs(), *xq.args(), *res_args))
        return out
    grid = c.grid
    if s.mvq_persistent and w.qtype == Q.Q8_0:  # mvq_q8_0 takes row groups grid-stride
        grid = (min(grid[0], fn.blocks_per_sm(128) * sm_count()),)
    fn(grid, (128,), (*w.ptrs(), *xq.args(), *res_args))
    return out


@dataclasses.dataclass(frozen=True)
class Choice:
    """The kernel of one matvec launch. family: mvq (int8 dp4a on QAct), mma (int8 tensor cores
    on QAct), mmh (f16 tensor cores on x) or generic (f32, any type); instance: the compiled
    kernel's name; grid: its launch grid (mvq_q8_0's persistent grid is clamped at launch);
    order: what fixes the order and precision of a row's sums (family, rows per warp or tile, K
    splits): everything but the batch width, which no row's arithmetic reads."""

    family: str
    instance: str
    grid: tuple[int, ...]
    order: tuple


def choose(qtype, n: int, k: int, rows: int, s: CudaSettings = DEFAULT, sms: int = 0) -> Choice:
    """The kernel of a matvec of `rows` rows (≤ MATVEC_MAX_ROWS) against an (n, k) weight of
    type qtype; sms: the device's SM count (mmh's K splits). Pure: tests enumerate it."""
    bucket = bucket_of(rows)
    batched = s.deterministic or bucket >= MMA_MIN_BUCKET
    if qtype in F16_LEGACY and batched and s.f16_mma and s.f16_legacy:
        tiles, ks = mmh_grid(n, k, sms)
        return Choice("mmh", f"{F16_LEGACY[qtype]}<{bucket // 8 or 1}>", (tiles, ks), ("mmh", ks))
    if qtype not in FAST_MATVEC:
        return Choice("generic", f"matvec_generic<{int(qtype)},{bucket}>", (n_blocks(n, 4),), ("generic",))
    if batched and s.f16_mma and k % 256 == 0:
        tiles, ks = mmh_grid(n, k, sms)
        return Choice("mmh", f"{F16_MATVEC[qtype]}<{bucket // 8 or 1}>", (tiles, ks), ("mmh", ks))
    if batched:  # 16 or 32 rows per 256-thread block, ceil(bucket / 8) tiles of 8 batch rows
        mt = 1 if n <= s.mma_one_tile_rows else 2
        return Choice("mma", f"{MMA_MATVEC[qtype]}<{bucket // 8 or 1},{mt}>", (n_blocks(n, 16 * mt),), ("mma", mt))
    r = WIDE_ROWS_PER_WARP if bucket == 1 and n <= s.mvq_wide_max_n[qtype] else ROWS_PER_WARP[bucket]
    ks = 4 if n_blocks(n, r) < s.split_k_warps else 1
    mb = s.mvq_min_blocks[qtype] if bucket == 1 else 1
    return Choice("mvq", f"{FAST_MATVEC[qtype]}<{r},{bucket},{ks},{mb}>", (n_blocks(n, r * 4 // ks),), ("mvq", r, ks))


def reads_f16(w, bucket: int, s: CudaSettings = DEFAULT) -> bool:
    """Whether a matvec of w at this batch bucket runs on the f16 tensor cores (mmh_*)."""
    return choose(w.qtype, *w.shape, bucket, s).family == "mmh"


def reads_qact(weights, bucket: int, s: CudaSettings = DEFAULT) -> bool:
    """Whether a matvec of any of these weights at this batch bucket reads quantized (QAct)
    activations: the int8 kernels do, the f16 ones (F16_MATVEC) and the generic ones do not."""
    return any(t.qtype in FAST_MATVEC and not reads_f16(t, bucket, s) for t in weights)


def mmh_grid(n: int, k: int, sm_count: int) -> tuple[int, int]:
    """(row tiles, K splits) of an mmh launch for an (n, k) weight: about two blocks per SM where
    K allows, at most 8 splits, and never more partial sums (32 batch rows) than the scratch holds.
    K blocks are of 256 elements, the last one partial where k is not a multiple (mmh_q4_1)."""
    tiles = -(-n // MMH_ROWS)
    ks = max(1, min(8, -(-k // 256), -(-2 * sm_count // tiles), MMH_PART_FLOATS // (32 * n)))
    return tiles, ks


_sm_counts: dict[int, int] = {}
_mmh: dict[tuple[int, int], tuple] = {}


def sm_count() -> int:
    dev = cp.cuda.Device()
    if dev.id not in _sm_counts:
        _sm_counts[dev.id] = dev.attributes["MultiProcessorCount"]
    return _sm_counts[dev.id]


def mmh_scratch() -> tuple:
    """Split-K partial sums and per-tile counters (zeroed; each launch leaves them zero) of the
    mmh kernels, one set per stream, so that launches on different streams never share them.
    Fixed once made: captured graphs hold their addresses."""
    key = (cp.cuda.Device().id, cp.cuda.get_current_stream().ptr)
    if key not in _mmh:
        _mmh[key] = (device_alloc((MMH_PART_FLOATS,), cp.float32, "matvec split-K scratch"),
                     cp.zeros((MMH_PART_FLOATS // MMH_ROWS,), cp.int32))
    return _mmh[key]


def uses_cublas(rows: int, s: CudaSettings = DEFAULT) -> bool:
    """Whether a matmul of this many rows dequantizes the weight to f16 and multiplies with
    cuBLAS (prefill chunks of more than CHUNKED_MAX_ROWS rows), not the fused matvecs: never
    with settings.deterministic, as cuBLAS picks its algorithm (and a row's sum order) by the
    row count."""
    return rows > CHUNKED_MAX_ROWS and not s.deterministic


def mmh_chunks(rows: int, n: int, k: int, tiles: int, ks: int) -> int:
    """How many chunks of MATVEC_MAX_ROWS rows one mmh launch of an (n, k) weight on (tiles, ks)
    takes for a step of `rows` rows (gridDim.z; each chunk the arithmetic of a launch of its
    own), or 0 where the split-K scratch cannot hold every chunk's partial sums (then a launch
    per chunk, the same sums). Pure: tests enumerate it."""
    z = -(-rows // MATVEC_MAX_ROWS)
    if rows <= MATVEC_MAX_ROWS or rows > CHUNKED_MAX_ROWS:
        return 0
    if ks > 1 and (z * ks * MATVEC_MAX_ROWS * n > MMH_PART_FLOATS or z * tiles > MMH_PART_FLOATS // MMH_ROWS):
        return 0
    return z


def chunked_launch(qtype, rows: int, n: int, k: int, s: CudaSettings = DEFAULT, sms: int = 0) -> tuple[Choice, int, int]:
    """(the 32-row chunks' kernel, gridDim.z, the rows it covers) of one launch for a step of
    `rows` rows (> MATVEC_MAX_ROWS) against an (n, k) weight; z = 0: a launch per chunk. A last,
    partial chunk joins the launch only where a launch of its own sums its rows the same way
    (Choice.order): 1-2 rows run the 1-row kernels unless deterministic, so a 65-row step is one
    launch of 64 rows and one of 1. Pure: tests enumerate it."""
    c = choose(qtype, n, k, MATVEC_MAX_ROWS, s, sms)
    if c.family != "mmh":
        return c, 0, 0
    rem = rows % MATVEC_MAX_ROWS
    one = rows if rem == 0 or choose(qtype, n, k, rem, s, sms).order == c.order else rows - rem
    z = mmh_chunks(one, n, k, *c.grid)
    return c, z, one if z else 0


def matvec_rows(x, w, *, out=None, res=None, xq: QAct | None = None, s: CudaSettings = DEFAULT):
    """matvec for any number of rows up to CHUNKED_MAX_ROWS (any number with
    settings.deterministic): chunks of ≤ MATVEC_MAX_ROWS rows, each the fused kernel at its
    bucket, into the rows of one out (+ res). On the f16 tensor cores (mmh) the chunks are one
    launch (mmh_chunks): a 64-row step of a small model launched half as many kernels."""
    n = x.shape[0]
    if n <= MATVEC_MAX_ROWS:
        return matvec(x, w, out=out, res=res, xq=xq, s=s)
    if uses_cublas(n, s):
        raise ValueError(f"matvec_rows: {n} rows, at most {CHUNKED_MAX_ROWS}")
    if out is None:
        out = cp.empty((n, w.shape[0]), cp.float32)
    if xq is not None and (xq.k != w.shape[1] or xq.rows < n):
        raise ValueError(f"matvec_rows: xq ({xq.rows}, {xq.k}) for {n} rows of K {w.shape[1]}")
    nw, kw = w.shape
    c, z, one = chunked_launch(w.qtype, n, nw, kw, s, sm_count() if w.qtype in F16_MATVEC or w.qtype in F16_LEGACY
                               else 0)
    a0 = 0
    if z and _rows_contiguous(x, kw) and _rows_contiguous(out, nw) and (res is None or _rows_contiguous(res, nw)):
        check_array(x, cp.float32, 2, "matvec_rows x")
        check_array(out, cp.float32, 2, "matvec_rows out")
        if out.shape[0] < n or (res is not None and res.shape[0] < n):  # widths: _rows_contiguous
            raise ValueError(f"matvec_rows: x {x.shape}, out {out.shape} against W {w.shape}")
        part, cnt = mmh_scratch()
        kernel("quant", c.instance)((*c.grid, z), (256,), (
            *w.ptrs(), x, res if res is not None else out, np.int32(res is not None), out, np.int32(nw),
            np.int32(kw), np.int32(one), part, cnt))
        a0 = one
    for a in range(a0, n, MATVEC_MAX_ROWS):
        b = min(n, a + MATVEC_MAX_ROWS)
        matvec(x[a:b], w, out=out[a:b], res=None if res is None else res[a:b],
               xq=None if xq is None else xq.part(a, b), s=s)
    return out


def _rows_contiguous(a, k: int) -> bool:
    """Rows of k float32s back to back (what one chunked launch indexes as row * k)."""
    return a.ndim == 2 and a.shape[1] == k and a.strides == (4 * k, 4)


def matmul(x, w, s: CudaSettings = DEFAULT):
    """x @ W.T: fused for ≤ CHUNKED_MAX_ROWS rows (chunks of ≤ 32) and for any count with
    settings.deterministic, else f16 dequantization and cuBLAS (f32 accumulation)."""
    check_array(x, cp.float32, 2, "matmul x")
    if not uses_cublas(x.shape[0], s):
        return matvec_rows(x, w, s=s)
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"matmul: x {x.shape} against W {w.shape}")
    w16 = dequantize_rows(w, half=True)  # (N, K) f16 scratch from the pool
    return cp.matmul(x.astype(cp.float16), w16.T).astype(cp.float32)


def qact_args(q: QAct | None, n: int, k: int, what: str) -> tuple:
    if q is None:
        return (np.intp(0),) * 4 + (np.int32(0),)
    if q.k != k or q.rows < n:
        raise ValueError(f"{what}: QAct ({q.rows}, {q.k}) for ({n}, {k})")
    return (*q.args(), np.int32(1))


def rms_norm(x, w, eps: float, *, out=None, q: QAct | None = None):
    """RMSNorm of x's rows; with q, the result is also quantized into q (for the int8 matvecs)."""
    check_array(x, cp.float32, 2, "rms_norm x")
    check_array(w, cp.float32, 1, "rms_norm w")
    if w.shape[0] != x.shape[1]:
        raise ValueError(f"rms_norm: x {x.shape}, w {w.shape}")
    out = cp.empty_like(x) if out is None else out
    kernel("norm", "rms_norm")((n_blocks(x.shape[1], 1024), x.shape[0]), (1024,), (
        x, w, out, np.int32(x.shape[1]), np.float32(eps), *qact_args(q, x.shape[0], x.shape[1], "rms_norm")))
    return out


def swiglu(g, u, *, out=None, n: int | None = None, ld: int | None = None, f: int | None = None,
           q: QAct | None = None):
    """silu(g) * u. g, u are (N, F) arrays, or pointers into buffers with row stride ld (then
    n and f say the shape). With q, the result is also quantized into q."""
    if ld is None:
        check_array(g, cp.float32, 2, "swiglu g")
        check_array(u, cp.float32, 2, "swiglu u")
        if g.shape != u.shape:
            raise ValueError(f"swiglu: g {g.shape}, u {u.shape}")
        n, f, ld = g.shape[0], g.shape[1], g.shape[1]
    elif n is None or f is None:
        raise ValueError("swiglu: with ld, give n and f")
    out = cp.empty((n, f), cp.float32) if out is None else out
    check_array(out, cp.float32, 2, "swiglu out")
    if out.shape != (n, f):
        raise ValueError(f"swiglu: out {out.shape}, expected {(n, f)}")
    kernel("activation", "swiglu")((n_blocks(n * f, 256),), (256,), (g, u, out, np.int32(n), np.int32(f), np.int32(ld),
                                                                   *qact_args(q, n, f, "swiglu")))
    return out


def rope_(x, pos, freqs, cfg: LlamaConfig, n_heads: int, *, n: int | None = None, ld: int | None = None):
    """RoPE in place on rows of x (row stride ld) at positions pos (int32)."""
    check_array(pos, cp.int32, 1, "rope positions")
    n = x.shape[0] if n is None else n
    ld = x.shape[1] if ld is None else ld
    pairs = n * n_heads * (cfg.rope_dim // 2)
    kernel("rope", "rope")((n_blocks(pairs, 256),), (256,), (
        x, pos, freqs, np.int32(n), np.int32(n_heads), np.int32(cfg.head_dim), np.int32(cfg.rope_dim),
        np.int32(ld), np.int32(cfg.rope_neox)))
    return x


def argmax(logits, *, out=None):
    check_array(logits, cp.float32, 2, "argmax logits")
    out = cp.empty((logits.shape[0],), cp.int32) if out is None else out
    kernel("sample", "argmax_rows")((logits.shape[0],), (1024,), (logits, out, np.int32(logits.shape[1])))
    return out


def top_rows(logits, n: int, *, stream=None, out=None):
    """The n largest logits of each row (B, V) and their ids, ties at the n-th resolved to the
    lowest ids, and each row's NaN count (kernels/sample.cu): host arrays (ids, vals, nan), the
    ids of a row in no particular order (sampler.TopLogits sorts them). One copy to the host;
    out: the device buffer for it, int32 (B, 2n + 1)."""
    check_array(logits, cp.float32, 2, "top_rows logits")
    b, v = logits.shape
    if not 1 <= n <= v:
        raise ValueError(f"top_rows: n {n} for rows of {v}")
    res = cp.empty((b, 2 * n + 1), cp.int32) if out is None else out
    check_array(res, cp.int32, 2, "top_rows out")
    if res.shape != (b, 2 * n + 1):
        raise ValueError(f"top_rows: out {res.shape}, expected {(b, 2 * n + 1)}")
    kernel("sample", "top_rows")((b,), (1024,), (logits, np.int32(v), np.int32(n), res))
    h = res.get(stream=stream)
    return h[:, :n], h[:, n:2 * n].view(np.float32), h[:, 2 * n]


def matvec_kernel_names(s: CudaSettings = DEFAULT) -> list[tuple[str, str]]:
    """The instances of this module's launchers under settings s (warm.kernel_names adds attention's)."""
    types = (0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 30)
    names = [("quant", f"dequant_rows<{t},{h}>") for t in types for h in ("true", "false")]
    for b in MATVEC_BUCKETS:
        if b >= MMA_MIN_BUCKET:
            names += [("quant", f"{n}<{b // 8 or 1},{mt}>") for n in MMA_MATVEC.values() for mt in (1, 2)]
            names += [("quant", f"{n}<{b // 8 or 1}>") for n in F16_MATVEC.values() if s.f16_mma]
            # (buckets 1-2 in the deterministic mode take the same <1> instances)
            names += [("quant", f"{n}<{b // 8 or 1}>") for n in F16_LEGACY.values() if s.f16_mma and s.f16_legacy]
        else:
            rows = (ROWS_PER_WARP[b], WIDE_ROWS_PER_WARP) if b == 1 else (ROWS_PER_WARP[b],)
            names += [("quant", f"{n}<{r},{b},{ks},{s.mvq_min_blocks[t] if b == 1 else 1}>")
                      for t, n in FAST_MATVEC.items() for ks in (1, 4) for r in rows]
        names += [("quant", f"matvec_generic<{t},{b}>") for t in types if t not in (8, 12, 14)]
    names += [("quant", "quantize_rows"), ("norm", "rms_norm"), ("rope", "rope"), ("activation", "swiglu"),
              ("sample", "argmax_rows"), ("sample", "top_rows")]
    return names
