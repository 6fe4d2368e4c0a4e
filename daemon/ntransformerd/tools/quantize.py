"""Quantize float32 matrices to ggml block formats, and requantize whole GGUF files.

`quantize(data, qtype)` turns float32 (rows, cols) into raw bytes (rows, bytes_per_row),
always uint8, for every type: F32/F16/BF16 are returned as the bytes of their little-endian
values too, so callers never branch on dtype. The legacy types (Q4_0 ... Q8_0) and F16/BF16
go through `gguf.quants.quantize`, which is ggml's reference quantizer transcribed. The
K types (Q2_K ... Q6_K) are ours: gguf-py cannot quantize them. They follow the search of
ggml-quants.c's `quantize_row_qN_K_ref` (the path llama-quantize takes without an
importance matrix), vectorized over blocks: every step below works on all blocks of a chunk
at once and loops only over the handful of candidate scales ggml tries. Block layouts come
from the one table in `engine.quants`.

`quantize_file(src, dst, ftype)` rewrites a GGUF tensor by tensor (bounded memory) and
chooses each tensor's type with llama.cpp's rules (llama-quant.cpp): 1-D tensors, norms and
rope_freqs stay F32; output.weight (or token_embd.weight when the embeddings are tied) gets
Q6_K in a quantized file (Q8_0 when its rows are not a multiple of 256, or the file is
q8_0); the `_m` mixes give Q6_K to attn_v and ffn_down of the layers `use_more_bits`
picks; a K type whose block does not divide the row falls back to Q4_0/Q5_0/Q5_1/Q8_0
(Q2_K,Q3_K/Q4_K/Q5_K/Q6_K), and to F16 when even that does not fit.
"""

from __future__ import annotations

import re
from typing import Callable

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import quants as gguf_quants

from ntransformerd.engine.quants import BLOCK_DTYPES, QUANT_BLOCKS
from ntransformerd.tools.atomic import check_input, check_output

GROUP_MAX_EPS = 1e-15  # ggml: a group whose absolute max is below this is all zero

# Blocks handled per vectorized pass: bounds the temporaries (about 40 float32 arrays
# of 16384 x 256 would be 670 MB; the K searches keep fewer than 10 alive at a time).
_CHUNK_BLOCKS = 8192

_LIBRARY_TYPES = (Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)
K_TYPES = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)


# --------------------------------------------------------------------------- helpers


def _f16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest fp16 -> float32, as GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(x))."""
    return x.astype(np.float16).astype(np.float32)


def _nearest_int(x: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: round half to even (the 1.5*2^23 trick under default rounding)."""
    return np.rint(x).astype(np.int32)


def _safe_div(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num/den where den != 0, else 0 (ggml guards every such division with a branch)."""
    out = np.zeros(np.broadcast(num, den).shape, dtype=np.float32)
    np.divide(num, den, out=out, where=den != 0)
    return out


def _make_qkx2(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float,
               nstep: int, use_mad: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric scale+min search of ggml's make_qkx2_quants, for many groups at once.

    x, w: (G, n) values and weights. Returns (scale (G,), the_min (G,) >= 0, L (G, n)) with
    x ~= scale * L - the_min. Starts from the min/max grid, then tries nstep+1 stretched
    grids, solving the weighted least-squares scale and min for each and keeping the best.
    """
    xmin = np.minimum(x.min(axis=1), 0.0)  # (G,) the min is never above 0
    xmax = x.max(axis=1)
    rng = xmax - xmin
    flat = rng == 0
    sum_w = w.sum(axis=1)
    sum_x = (w * x).sum(axis=1)

    def err(scale, mn, L):
        diff = scale[:, None] * L + mn[:, None] - x
        return (w * (np.abs(diff) if use_mad else diff * diff)).sum(axis=1)

    def grid(iscale, centre):  # ggml's L = clamp(nearest_int(iscale * (x - min)), 0, nmax)
        v = np.clip(iscale[:, None] * (x - centre[:, None]), -1.0, nmax + 1.0)
        return np.clip(np.rint(v), 0, nmax)

    iscale = _safe_div(np.float32(nmax), rng)
    scale = _safe_div(np.float32(1.0), iscale)
    mn = xmin.copy()
    best = err(scale, mn, grid(iscale, xmin))
    best_is, best_c = iscale, xmin  # the grid that made the best L, to rebuild it once at the end
    for step in range(nstep + 1):
        # ggml re-centres the grid on the best min found so far, so this step depends on it
        iscale = _safe_div(np.float32(rmin) + np.float32(rdelta) * np.float32(step) + np.float32(nmax),
                           xmax - mn)
        La = grid(iscale, mn)
        sum_l = (w * La).sum(axis=1)
        sum_l2 = (w * La * La).sum(axis=1)
        sum_xl = (w * La * x).sum(axis=1)
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = _safe_div(sum_w * sum_xl - sum_x * sum_l, D)
        this_min = _safe_div(sum_l2 * sum_x - sum_l * sum_xl, D)
        pos = this_min > 0  # a positive min is not representable: refit the scale alone
        this_min = np.where(pos, 0.0, this_min).astype(np.float32)
        this_scale = np.where(pos, _safe_div(sum_xl, sum_l2), this_scale).astype(np.float32)
        cur = err(this_scale, this_min, La)
        # ggml takes strictly smaller errors; on a tie within float noise, which grid wins
        # depends on summation order. Prefer the smaller scale then: it is the same error
        # for this group and a finer super-block scale for the other groups.
        tie = (np.abs(cur - best) <= 1e-5 * best) & (this_scale < scale)
        better = (D > 0) & ((cur < best) | tie)
        best_is = np.where(better, iscale, best_is)
        best_c = np.where(better, mn, best_c)
        best = np.where(better, cur, best)
        scale = np.where(better, this_scale, scale)
        mn = np.where(better, this_min, mn)
    scale = np.where(flat, 0.0, scale).astype(np.float32)
    L = np.where(flat[:, None], 0.0, grid(best_is, best_c))
    return scale, np.where(mn < 0, -mn, 0.0).astype(np.float32), L  # never -0.0: fp16 would keep the sign


def _make_qx(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric scale search of ggml's make_qx_quants(rmse_type=1, no weights): x^2 weights.

    x: (G, n). Returns (scale (G,), L (G, n) in [0, 2*nmax-1]) with x ~= scale * (L - nmax);
    the sign of the scale makes the largest-magnitude value land on -nmax, as in ggml. An
    all-zero group gets scale 0 and L 0, as in ggml.
    """
    idx = np.abs(x).argmax(axis=1)
    vmax = np.take_along_axis(x, idx[:, None], axis=1)[:, 0]  # (G,) signed value of max |x|
    zero = np.abs(vmax) < GROUP_MAX_EPS
    w = x * x

    wx = w * x

    def grid(iscale):
        return np.clip(np.rint(iscale[:, None] * x), -nmax, nmax - 1)

    def fit(iscale):
        L = grid(iscale)
        return (wx * L).sum(axis=1), (w * L * L).sum(axis=1)

    best_is = _safe_div(np.float32(-nmax), vmax)
    sumlx, suml2 = fit(best_is)
    scale = _safe_div(sumlx, suml2)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = _safe_div(-(np.float32(nmax) + np.float32(0.1) * np.float32(step)), vmax)
        slx, sl2 = fit(iscale)
        better = (sl2 > 0) & (slx * slx > best * sl2)
        best_is = np.where(better, iscale, best_is)
        scale = np.where(better, _safe_div(slx, sl2), scale).astype(np.float32)
        best = np.where(better, scale * slx, best)
    scale = np.where(zero, 0.0, scale).astype(np.float32)
    L = np.where(zero[:, None], 0.0, grid(best_is) + nmax)
    return scale, L


def _make_q3(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml's make_q3_quants(do_rmse=true): x^2-weighted fit refined one element at a time.

    The refinement is sequential within a group (each accepted change moves the sums the next
    element sees), so it loops over the n elements and vectorizes over the groups.
    """
    G, n = x.shape
    idx = np.abs(x).argmax(axis=1)
    vmax = np.take_along_axis(x, idx[:, None], axis=1)[:, 0]
    zero = np.abs(vmax) < GROUP_MAX_EPS
    iscale = _safe_div(np.float32(-nmax), vmax)
    L = np.clip(_nearest_int(iscale[:, None] * x), -nmax, nmax - 1).astype(np.float32)
    w = x * x
    sumlx = (w * x * L).sum(axis=1)
    suml2 = (w * L * L).sum(axis=1)
    active = ~zero
    for _ in range(5):
        changed = np.zeros(G, dtype=bool)
        for i in range(n):
            wi, xi, li = w[:, i], x[:, i], L[:, i]
            slx = sumlx - wi * xi * li
            sl2 = suml2 - wi * li * li
            new_l = np.clip(_nearest_int(_safe_div(xi * sl2, slx)), -nmax, nmax - 1).astype(np.float32)
            slx2 = slx + wi * xi * new_l
            sl22 = sl2 + wi * new_l * new_l
            take = (active & (slx > 0) & (new_l != li) & (sl22 > 0)
                    & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22))
            L[:, i] = np.where(take, new_l, li)
            sumlx = np.where(take, slx2, sumlx)
            suml2 = np.where(take, sl22, suml2)
            changed |= take
        active &= changed
        if not active.any():
            break
    scale = np.where(zero, 0.0, _safe_div(sumlx, suml2)).astype(np.float32)
    L = np.where(zero[:, None], 0.0, L + nmax)  # offset like _make_qx; all-zero groups keep 0
    return scale, L


def _pack_scale_min_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per block -> the 12 bytes Q4_K/Q5_K store (get_scale_min_k4)."""
    ls = ls.astype(np.uint8)
    lm = lm.astype(np.uint8)
    out = np.empty((ls.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    out[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    return out


def _pack_2bit(L: np.ndarray) -> np.ndarray:
    """(nb, 256) values in [0, 3] -> (nb, 64) bytes: byte 32c+l holds L[128c+32s+l] at bits 2s."""
    L = L.astype(np.uint8).reshape(-1, 2, 4, 32)  # (nb, half c, shift s, l)
    out = L[:, :, 0] | (L[:, :, 1] << 2) | (L[:, :, 2] << 4) | (L[:, :, 3] << 6)
    return out.reshape(-1, 64)


# ----------------------------------------------------------------- K-type quantizers
# Each takes (nb, 256) float32 blocks and returns a structured array of nb blocks.


def _scales_to_6bit(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(nb, 8) non-negative per-group values -> (6-bit codes, fp16 super-scale as float32)."""
    top = sc.max(axis=1)
    inv = _safe_div(np.float32(63.0), top)
    codes = np.clip(_nearest_int(inv[:, None] * sc), 0, 63)
    return codes, _f16_round(top / 63.0)


def _quantize_q45_k(x: np.ndarray, qtype: Q) -> np.ndarray:
    nmax, rmin, nstep = (15, -1.0, 20) if qtype == Q.Q4_K else (31, -0.5, 15)
    nb = x.shape[0]
    g = x.reshape(nb * 8, 32)
    av_x = np.sqrt((g * g).mean(axis=1, keepdims=True))
    scale, the_min, L = _make_qkx2(g, av_x + np.abs(g), nmax, rmin, 0.1, nstep, use_mad=False)
    ls, d = _scales_to_6bit(scale.reshape(nb, 8))
    lm, dmin = _scales_to_6bit(the_min.reshape(nb, 8))
    # requantize against the scales as stored (6-bit codes times fp16 super-scales)
    dl = (d[:, None] * ls).reshape(-1, 1).astype(np.float32)
    ml = (dmin[:, None] * lm).reshape(-1, 1).astype(np.float32)
    Lr = np.clip(_nearest_int(_safe_div(g + ml, dl)), 0, nmax).astype(np.float32)
    L = np.where(dl != 0, Lr, L).astype(np.uint8).reshape(nb, 4, 2, 32)  # (nb, chunk, half, l)

    out = np.empty(nb, dtype=BLOCK_DTYPES[qtype])
    out["d"] = d
    out["dmin"] = dmin
    out["scales"] = _pack_scale_min_k4(ls, lm)
    lo = L & 0xF
    out["qs"] = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(nb, 128)
    if qtype == Q.Q5_K:
        hi = (L >> 4).transpose(0, 3, 1, 2).reshape(nb, 32, 8)  # bit 2c+h of qh[l]
        out["qh"] = (hi << np.arange(8, dtype=np.uint8)).sum(axis=2, dtype=np.uint8)
    return out


def _quantize_q6_k(x: np.ndarray) -> np.ndarray:
    nb = x.shape[0]
    g = x.reshape(nb * 16, 16)
    scale, L = _make_qx(g, 32)
    scale = scale.reshape(nb, 16)
    idx = np.abs(scale).argmax(axis=1)
    max_scale = np.take_along_axis(scale, idx[:, None], axis=1)[:, 0]
    zero = np.abs(max_scale) < GROUP_MAX_EPS
    iscale = _safe_div(np.float32(-128.0), max_scale)
    d = _f16_round(_safe_div(np.float32(1.0), iscale))
    sc = np.minimum(127, _nearest_int(iscale[:, None] * scale)).astype(np.int8)
    dl = (d[:, None] * sc).reshape(-1, 1).astype(np.float32)
    Lr = np.clip(_nearest_int(_safe_div(g, dl)), -32, 31).astype(np.float32) + 32
    L = np.where(dl != 0, Lr, L).astype(np.uint8).reshape(nb, 2, 4, 32)  # (nb, half, quarter, l)
    L[zero] = 0
    sc[zero] = 0

    out = np.empty(nb, dtype=BLOCK_DTYPES[Q.Q6_K])
    lo = L & 0xF
    out["ql"] = (lo[:, :, 0:2] | (lo[:, :, 2:4] << 4)).reshape(nb, 128)  # ql[64h+32s+l]
    hi = L >> 4
    out["qh"] = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(nb, 64)
    out["scales"] = sc
    out["d"] = d
    return out


def _quantize_q2_k(x: np.ndarray) -> np.ndarray:
    nb = x.shape[0]
    g = x.reshape(nb * 16, 16)
    scale, the_min, L = _make_qkx2(g, np.abs(g), 3, -0.5, 0.1, 15, use_mad=True)
    scale, the_min = scale.reshape(nb, 16), the_min.reshape(nb, 16)
    codes, dd = [], []
    for v in (scale, the_min):  # 4-bit codes against a fp16 super-scale each
        top = v.max(axis=1)
        codes.append(np.clip(_nearest_int(_safe_div(np.float32(15.0), top)[:, None] * v), 0, 15))
        dd.append(_f16_round(top / 15.0))
    (ls, lm), (d, dmin) = codes, dd
    dl = (d[:, None] * ls).reshape(-1, 1).astype(np.float32)
    ml = (dmin[:, None] * lm).reshape(-1, 1).astype(np.float32)
    Lr = np.clip(_nearest_int(_safe_div(g + ml, dl)), 0, 3).astype(np.float32)
    L = np.where(dl != 0, Lr, L).reshape(nb, 256)

    out = np.empty(nb, dtype=BLOCK_DTYPES[Q.Q2_K])
    out["scales"] = (ls | (lm << 4)).astype(np.uint8)
    out["qs"] = _pack_2bit(L)
    out["d"] = d
    out["dmin"] = dmin
    return out


def _quantize_q3_k(x: np.ndarray) -> np.ndarray:
    nb = x.shape[0]
    g = x.reshape(nb * 16, 16)
    scale, L = _make_q3(g, 4)
    scale = scale.reshape(nb, 16)
    idx = np.abs(scale).argmax(axis=1)
    max_scale = np.take_along_axis(scale, idx[:, None], axis=1)[:, 0]
    iscale = _safe_div(np.float32(-32.0), max_scale)
    codes = (np.clip(_nearest_int(iscale[:, None] * scale), -32, 31) + 32).astype(np.uint8)  # (nb, 16)
    codes[max_scale == 0] = 0  # ggml leaves all scale bytes zero then
    d = _f16_round(_safe_div(np.float32(1.0), iscale))
    dl = (d[:, None] * (codes.astype(np.float32) - 32)).reshape(-1, 1)
    Lr = np.clip(_nearest_int(_safe_div(g, dl)), -4, 3).astype(np.float32) + 4
    L = np.where(dl != 0, Lr, L).astype(np.uint8).reshape(nb, 256)

    out = np.empty(nb, dtype=BLOCK_DTYPES[Q.Q3_K])
    high = (L > 3).reshape(nb, 8, 32)  # element 32b+m -> bit b of hmask[m]
    out["hmask"] = (high.astype(np.uint8) << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=1, dtype=np.uint8)
    out["qs"] = _pack_2bit(L & 3)
    sc = np.empty((nb, 12), dtype=np.uint8)
    sc[:, 0:8] = (codes[:, 0:8] & 0xF) | ((codes[:, 8:16] & 0xF) << 4)
    top = (codes >> 4).reshape(nb, 4, 4)  # (nb, j//4, j%4)
    sc[:, 8:12] = top[:, 0] | (top[:, 1] << 2) | (top[:, 2] << 4) | (top[:, 3] << 6)
    out["scales"] = sc
    out["d"] = d
    return out


_K_QUANTIZERS: dict[Q, Callable[[np.ndarray], np.ndarray]] = {
    Q.Q2_K: _quantize_q2_k,
    Q.Q3_K: _quantize_q3_k,
    Q.Q4_K: lambda x: _quantize_q45_k(x, Q.Q4_K),
    Q.Q5_K: lambda x: _quantize_q45_k(x, Q.Q5_K),
    Q.Q6_K: _quantize_q6_k,
}


# ------------------------------------------------------------------------ public API


def quantize(data: np.ndarray, qtype: Q) -> np.ndarray:
    """float32 (rows, cols) -> raw bytes (rows, bytes_per_row) as uint8, for any supported type.

    cols must be a multiple of the type's block (32, or 256 for the K types). F32/F16/BF16
    come back as the uint8 view of their little-endian values; `gguf.quants.dequantize`
    (after `.view(np.float32)` for F32) reads every result back.
    """
    data = np.asarray(data, dtype=np.float32)
    if data.ndim != 2:
        raise ValueError(f"quantize wants a 2-D (rows, cols) array, got shape {data.shape}")
    if qtype not in QUANT_BLOCKS:
        raise NotImplementedError(f"quantize: no quantizer for {qtype.name}")
    rows, cols = data.shape
    block_elems, block_bytes = QUANT_BLOCKS[qtype]
    if cols % block_elems:
        raise ValueError(f"{qtype.name} needs rows that are a multiple of {block_elems}; got {cols}")
    if qtype == Q.F32:
        return np.ascontiguousarray(data).view(np.uint8)
    if qtype in _LIBRARY_TYPES:
        return np.ascontiguousarray(gguf_quants.quantize(data, qtype)).view(np.uint8).reshape(rows, -1)

    blocks = np.ascontiguousarray(data).reshape(-1, block_elems)
    out = np.empty((blocks.shape[0], block_bytes), dtype=np.uint8)
    for lo in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        hi = min(lo + _CHUNK_BLOCKS, blocks.shape[0])
        out[lo:hi] = _K_QUANTIZERS[qtype](blocks[lo:hi]).view(np.uint8).reshape(hi - lo, block_bytes)
    return out.reshape(rows, cols // block_elems * block_bytes)


# ------------------------------------------------------------- type choice per tensor
# llama.cpp's llama-quant.cpp, for dense Llama-family models (no experts, not Falcon).

# ftype name -> (default tensor type, general.file_type value (llama_ftype), mix)
FTYPES: dict[str, tuple[Q, int, str]] = {
    "f32": (Q.F32, 0, ""),
    "f16": (Q.F16, 1, ""),
    "bf16": (Q.BF16, 32, ""),
    "q4_0": (Q.Q4_0, 2, ""),
    "q4_1": (Q.Q4_1, 3, ""),
    "q5_0": (Q.Q5_0, 8, ""),
    "q5_1": (Q.Q5_1, 9, ""),
    "q8_0": (Q.Q8_0, 7, ""),
    "q2_k": (Q.Q2_K, 10, "q2_k"),
    "q3_k": (Q.Q3_K, 11, ""),  # llama.cpp's Q3_K_S
    "q3_k_s": (Q.Q3_K, 11, ""),
    "q4_k": (Q.Q4_K, 14, "q4_k_s"),  # llama.cpp's Q4_K_S
    "q4_k_s": (Q.Q4_K, 14, "q4_k_s"),
    "q4_k_m": (Q.Q4_K, 15, "q4_k_m"),
    "q5_k": (Q.Q5_K, 16, ""),  # llama.cpp's Q5_K_S
    "q5_k_s": (Q.Q5_K, 16, ""),
    "q5_k_m": (Q.Q5_K, 17, "q5_k_m"),
    "q6_k": (Q.Q6_K, 18, ""),
}

# A K type whose 256-block does not divide the row falls back to a 32-block type.
_SHAPE_FALLBACK = {Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0, Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}

_KEEP_SUBSTRINGS = ("_norm.weight", "ffn_gate_inp.weight", "ssm_conv1d", "attn_rel_b.weight",
                    "position_embd", "token_types.weight", "rope_freqs")


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's pick of the layers that get more bits in the _M mixes."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def _quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """llama.cpp's tensor_allows_quantization: 2-D+ weights that are not norms or small tables."""
    return (len(shape) >= 2 and name.endswith("weight")
            and not any(s in name for s in _KEEP_SUBSTRINGS))


def _layer_of(name: str) -> int:
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def plan_types(tensors: list[tuple[str, tuple[int, ...]]], ftype: str, *, n_layer: int,
               n_gqa: int = 1) -> dict[str, Q]:
    """Target type of each tensor for `ftype`. tensors: (name, ggml shape ne0-first).

    Follows llama.cpp's llama_tensor_get_type for a dense Llama model: tensors that may not be
    quantized (1-D, norms, rope_freqs) are F32; the attn_v and ffn_down counters run in
    llama.cpp's order (by layer, then name), which for one tensor per layer is the layer index.
    """
    if ftype not in FTYPES:
        raise ValueError(f"unknown ftype {ftype!r}; choose one of {', '.join(FTYPES)}")
    default, _, mix = FTYPES[ftype]
    names = [n for n, _ in tensors]
    tied = "output.weight" not in names
    n_attn_v = sum(1 for n in names if "attn_v.weight" in n or "attn_qkv.weight" in n or "attn_kv_b.weight" in n)
    i_attn_v = i_ffn_down = 0
    out: dict[str, Q] = {}
    for name, shape in sorted(tensors, key=lambda t: (_layer_of(t[0]), t[0])):
        if not _quantizable(name, shape):
            out[name] = Q.F32
            continue
        new = default
        if default in (Q.F32, Q.F16, Q.BF16):
            out[name] = new
            continue
        ncols = shape[0]
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            if ncols % QUANT_BLOCKS[new][0] != 0:
                new = Q.Q8_0
            elif new != Q.Q8_0:
                new = Q.Q6_K
        elif "attn_v.weight" in name or "attn_qkv.weight" in name or "attn_kv_b.weight" in name:
            if mix == "q2_k":
                new = Q.Q4_K if n_gqa >= 4 else Q.Q3_K
            elif mix in ("q4_k_m", "q5_k_m") and _use_more_bits(i_attn_v, n_attn_v):
                new = Q.Q6_K
            elif mix == "q4_k_s" and i_attn_v < 4:
                new = Q.Q5_K
            if n_layer == 80 and new in (Q.Q3_K, Q.Q4_K):  # llama.cpp's 70B rule (8 heads share attn_v)
                new = Q.Q5_K
            i_attn_v += 1
        elif "ffn_down" in name:
            if mix == "q2_k":
                new = Q.Q3_K
            elif mix in ("q4_k_m", "q5_k_m") and _use_more_bits(i_ffn_down, n_layer):
                new = Q.Q6_K
            elif mix == "q4_k_s" and i_ffn_down < n_layer // 8:
                new = Q.Q5_K
            i_ffn_down += 1
        elif "attn_output.weight" in name and mix == "q2_k":
            new = Q.Q3_K
        if ncols % QUANT_BLOCKS[new][0] != 0:
            new = _SHAPE_FALLBACK.get(new, Q.F16)
            if ncols % QUANT_BLOCKS[new][0] != 0:
                new = Q.F16
        out[name] = new
    return out


# ------------------------------------------------------------------ whole-file rewrite

SLAB_ELEMS = 1 << 24  # float32 elements dequantized per pass (64 MB)
_SKIP_KEYS = ("general.architecture", "general.file_type", "general.quantization_version",
              "split.no", "split.count", "split.tensors.count")


_FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)


def _file_plan(reader, ftype: str, n_layers: int | None):
    """(arch, n_layer, kept tensors, {name: target type}) of rewriting `reader` as `ftype`."""
    if ftype not in FTYPES:
        raise ValueError(f"unknown ftype {ftype!r}; choose one of {', '.join(FTYPES)}")
    arch_field = reader.fields.get("general.architecture")
    arch = arch_field.contents() if arch_field is not None else "llama"

    def field(key, default):
        f = reader.fields.get(key)
        return f.contents() if f is not None else default

    n_layer = int(field(f"{arch}.block_count", 0))
    tensors = list(reader.tensors)
    if n_layers is not None:
        if not 1 <= n_layers <= n_layer:
            raise ValueError(f"cannot keep {n_layers} layers of a {n_layer}-layer model")
        tensors = [t for t in tensors if not t.name.startswith("blk.") or _layer_of(t.name) < n_layers]
        n_layer = n_layers
    n_head = int(field(f"{arch}.attention.head_count", 1))
    n_head_kv = int(field(f"{arch}.attention.head_count_kv", n_head)) or n_head
    plan = plan_types([(t.name, _ggml_shape(t)) for t in tensors], ftype,
                      n_layer=n_layer, n_gqa=n_head // n_head_kv)
    return arch, n_layer, tensors, plan


def _ggml_shape(t) -> tuple[int, ...]:
    return tuple(int(v) for v in t.shape)  # ne0 first


def requantized(src: str, ftype: str, *, n_layers: int | None = None) -> dict[str, tuple[Q, Q]]:
    """Tensors that writing `src` as `ftype` would requantize: {name: (from, to)}, where an
    already quantized tensor would get another quantized type. Each such round trip adds the
    new type's error to the old one's (llama.cpp refuses them without --allow-requantize);
    dequantizing to F32/F16/BF16 and copying a tensor of its own type lose nothing more."""
    check_input(src)
    _, _, tensors, plan = _file_plan(gguf.GGUFReader(src), ftype, n_layers)
    return {t.name: (t.tensor_type, plan[t.name]) for t in tensors
            if t.tensor_type not in _FLOAT_TYPES and plan[t.name] not in _FLOAT_TYPES
            and plan[t.name] != t.tensor_type}


def quantize_file(src: str, dst: str, ftype: str, *, progress: Callable[[int, int, str], None] | None = None,
                  n_layers: int | None = None, slab_elems: int = SLAB_ELEMS) -> None:
    """Requantize the GGUF at `src` to `ftype` (see FTYPES), writing `dst`.

    Metadata is copied (general.file_type and general.quantization_version updated); each
    tensor's type comes from `plan_types`. A tensor already of its target type is copied
    byte for byte; others are dequantized with gguf.quants and requantized, a slab of rows at
    a time (about `slab_elems` float32 elements), so memory stays near one slab whatever the
    model size. `progress(done_bytes, total_bytes, tensor_name)` is called after each slab with
    bytes written to `dst`.
    `n_layers` keeps only the first n blocks (a slice of a real model small enough to carry
    to a test machine; the rest of the model is unchanged). `dst` is written in place: the
    ntx-model commands write into a temporary file and rename it (tools.atomic).
    """
    if ftype not in FTYPES:
        raise ValueError(f"unknown ftype {ftype!r}; choose one of {', '.join(FTYPES)}")
    check_input(src)
    # the writer truncates dst before the reader has read src: the model would be lost
    check_output(dst, src)
    reader = gguf.GGUFReader(src)
    arch, n_layer, tensors, plan = _file_plan(reader, ftype, n_layers)

    def field(key, default):
        f = reader.fields.get(key)
        return f.contents() if f is not None else default

    writer = gguf.GGUFWriter(dst, arch)
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key in _SKIP_KEYS or key == f"{arch}.block_count":
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, f.contents(), vtype, sub_type=sub)
    if n_layers is not None or f"{arch}.block_count" in reader.fields:
        writer.add_block_count(n_layer)
    writer.add_file_type(FTYPES[ftype][1])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if "general.alignment" in reader.fields:
        writer.data_alignment = int(field("general.alignment", writer.data_alignment))

    jobs = []  # (reader tensor, target type, rows, cols, out row bytes)
    for t in tensors:
        qtype = plan[t.name]
        shape = _ggml_shape(t)
        cols = shape[0]
        rows = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
        rb = cols // QUANT_BLOCKS[qtype][0] * QUANT_BLOCKS[qtype][1]
        numpy_shape = (*reversed(shape[1:]), rb)
        writer.add_tensor_info(t.name, numpy_shape, np.dtype(np.uint8), rows * rb, raw_dtype=qtype)
        jobs.append((t, qtype, rows, cols, rb))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    align = writer.data_alignment
    writer.close()

    total = sum(rows * rb for _, _, rows, _, rb in jobs)
    done = 0
    with open(dst, "ab") as fout:
        for t, qtype, rows, cols, rb in jobs:
            fout.write(b"\0" * (-fout.tell() % align))
            raw = t.data.reshape(rows, -1)  # memory-mapped source rows
            if t.tensor_type == qtype:
                step = max(1, (slab_elems * 4) // max(1, raw.shape[1]))
            else:
                step = max(1, slab_elems // cols)
            for r0 in range(0, rows, step):
                part = raw[r0:r0 + step]
                if t.tensor_type == qtype:
                    out = np.ascontiguousarray(part).view(np.uint8)
                else:
                    f32 = gguf_quants.dequantize(np.ascontiguousarray(part), t.tensor_type)
                    out = quantize(np.asarray(f32, dtype=np.float32).reshape(-1, cols), qtype)
                out.tofile(fout)
                done += out.nbytes
                if progress is not None:
                    progress(done, total, t.name)
        fout.write(b"\0" * (-fout.tell() % align))
