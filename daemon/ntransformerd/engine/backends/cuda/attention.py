"""Attention launchers: the decode step's split attention (attn_partial + attn_combine, or
attn_decode in one launch), the cache append, and a prefill chunk's tensor-core attention
(attn_chunk); the choice of splits for a step. kernels/attention.cu holds the kernels.
"""

from __future__ import annotations

import math

import numpy as np

from ntransformerd.engine.backends.cuda.launch import QAct, qact_args
from ntransformerd.engine.backends.cuda.nvrtc import check_array, cp, kernel, n_blocks
from ntransformerd.engine.backends.cuda.settings import DEFAULT, CudaSettings
from ntransformerd.engine.gguf_file import LlamaConfig


ATTN_ND = (1, 2, 4, 8)  # head_dim / 32: the attn_partial instances


def attention_splits(n_rows: int, n_heads: int, max_pos: int, head_dim: int = 128) -> int:
    """How many splits a row's positions are cut into (at most 64, see attn_partial): for a few
    rows, enough that each split holds ~16 positions of the longest row; for a prefill chunk
    (rows × heads fill the GPU already) ~64 positions each, so that no warp walks a long
    history alone, within 256 MB of partial results."""
    per = 16 if n_rows * n_heads < 4096 else 64
    room = max(1, (256 << 20) // (n_rows * n_heads * (head_dim + 2) * 4))
    return max(1, min(64, -(-(max_pos + 1) // per), room))


def step_splits(n_rows: int, max_ctx: int, cfg: LlamaConfig, s: CudaSettings = DEFAULT) -> int:
    """Attention splits per (row, head) of a step of n_rows rows (not a prefill chunk's tensor-core
    attention), the same whether the step is captured or eager and whatever the rows' positions,
    so a row's sums depend on its own position alone (a verify step of k + 1 tokens gives what
    the same rows give in any step of that shape). The grid is sized for the longest context, so
    a step of many rows takes fewer; the partials' scratch caps them too (attention_splits)."""
    return min(64 if n_rows <= 2 else s.batched_splits, max_ctx,
               attention_splits(n_rows, cfg.n_heads, max_ctx - 1, cfg.head_dim))


def kv_args(kv_layer) -> tuple:
    """The cache arguments every attention kernel takes: k, v, the device block tables and
    their row length (backends/cuda/kv.py)."""
    return (kv_layer.k, kv_layer.v, kv_layer.tables.dev, np.int32(kv_layer.table.max_blocks))


def _q8(kv_layer) -> int:
    return int(kv_layer.q8)


def kv_append_(k, v, kv_layer, slots, pos, cfg: LlamaConfig | None = None, *, n: int, ldk: int, ldv: int):
    """Rows of k and v (row strides ldk, ldv) to the cache at (slot, pos), through the block
    tables, rounded to the cache's type (f16, or Q8_0 as gguf.quants rounds)."""
    per = kv_layer.n_kv * (kv_layer.head_dim // 32 if kv_layer.q8 else kv_layer.head_dim)
    kernel("attention", f"kv_append<{_q8(kv_layer)}>")((n_blocks(n * per, 256),), (256,), (
        k, np.int32(ldk), v, np.int32(ldv), *kv_args(kv_layer), slots, pos, np.int32(n), np.int32(kv_layer.n_kv),
        np.int32(kv_layer.head_dim)))


def attention_(q, k, v, kv_layer, slots, pos, cfg: LlamaConfig, *, n: int, n_splits: int,
               ldq: int, ldk: int, ldv: int, out, scratch: tuple, append: bool = True, q_out: QAct | None = None):
    """Append k, v at (slot, pos) (unless already there: append=False) then causal GQA attention
    of q's rows; writes out (n, H*hd), and with q_out that output quantized too."""
    if cfg.head_dim % 32 or cfg.head_dim > 256:
        raise ValueError(f"attention: head_dim {cfg.head_dim} must be a multiple of 32, at most 256")
    if not 1 <= n_splits <= 64:
        raise ValueError(f"attention: {n_splits} splits, expected 1 to 64")
    if append:
        kv_append_(k, v, kv_layer, slots, pos, cfg, n=n, ldk=ldk, ldv=ldv)
    pm, pl, po = scratch[:3]
    warps = n * cfg.n_heads
    kernel("attention", f"attn_partial<{cfg.head_dim // 32},{_q8(kv_layer)}>")((n_blocks(warps, 4), n_splits), (128,), (
        q, np.int32(ldq), *kv_args(kv_layer), slots, pos, pm, pl, po, np.int32(n), np.int32(cfg.n_heads),
        np.int32(cfg.n_kv_heads), np.int32(n_splits), np.float32(1.0 / math.sqrt(cfg.head_dim))))
    kernel("attention", "attn_combine")((warps,), (128,), (  # a block per (row, head)
        pm, pl, po, out, pos, np.int32(n), np.int32(cfg.n_heads), np.int32(cfg.head_dim), np.int32(n_splits),
        *qact_args(q_out, n, cfg.q_dim, "attention")))
    return out


def rope_kv_(qkv, v, pos, slots, freqs, kv_layer, cfg: LlamaConfig, *, n: int, ld: int, ldv: int):
    """The decode step's RoPE + cache append: rows of qkv (row stride ld) hold q then k; both
    are rotated in place, and k and v (rows of v, stride ldv) go to the cache (an f16 cache in
    the same launch, a Q8_0 one by kv_append after it: a block's scale needs its 32 values)."""
    check_array(pos, cp.int32, 1, "rope_kv positions")
    per_row = (cfg.n_heads + 2 * cfg.n_kv_heads) * (cfg.head_dim // 2)
    kernel("attention", "rope_kv")((n_blocks(n * per_row, 256),), (256,), (
        qkv, np.int32(ld), v, np.int32(ldv), *kv_args(kv_layer), slots, pos, freqs, np.int32(n),
        np.int32(cfg.n_heads), np.int32(cfg.n_kv_heads), np.int32(cfg.head_dim), np.int32(cfg.rope_dim),
        np.int32(cfg.rope_neox), np.int32(not kv_layer.q8)))
    if kv_layer.q8:
        k = np.intp(qkv.data.ptr + 4 * cfg.q_dim)  # the rotated k heads, right after q in each row
        kv_append_(k, v, kv_layer, slots, pos, cfg, n=n, ldk=ld, ldv=ldv)


def attention_decode_(qkv, v, kv_layer, slots, pos, freqs, cfg: LlamaConfig, *, n: int, n_splits: int, ld: int,
                      ldv: int, out, scratch: tuple, q_out: QAct | None = None):
    """The decode step's attention in one launch (attn_decode: rope_kv_ + attention_): rows of
    qkv (row stride ld) hold q then k, rows of v stride ldv; q and k are rotated in registers
    (qkv is not written), k and v go to the cache at (slot, pos), and out (n, H*hd) gets the
    attention output, with q_out quantized too. scratch: attention_scratch(n, cfg, n_splits, counters=True)."""
    if cfg.head_dim % 32 or cfg.head_dim > 256:
        raise ValueError(f"attention_decode: head_dim {cfg.head_dim} must be a multiple of 32, at most 256")
    if not 1 <= n_splits <= 64:
        raise ValueError(f"attention_decode: {n_splits} splits, expected 1 to 64")
    check_array(pos, cp.int32, 1, "attention_decode positions")
    if len(scratch) != 4:
        raise ValueError("attention_decode: the scratch needs its counters (attention_scratch(..., counters=True))")
    pm, pl, po, cnt = scratch
    warps = n * cfg.n_heads
    if cnt.size < n_blocks(warps, 4) or pm.size < warps * n_splits:
        raise ValueError(f"attention_decode: scratch too small for {n} rows, {n_splits} splits")
    kernel("attention", f"attn_decode<{cfg.head_dim // 32},{_q8(kv_layer)}>")((n_blocks(warps, 4), n_splits), (128,), (
        qkv, np.int32(ld), v, np.int32(ldv), *kv_args(kv_layer), slots, pos, freqs, pm, pl, po, cnt, out, np.int32(n),
        np.int32(cfg.n_heads), np.int32(cfg.n_kv_heads), np.int32(n_splits),
        np.float32(1.0 / math.sqrt(cfg.head_dim)), np.int32(cfg.rope_dim), np.int32(cfg.rope_neox),
        *qact_args(q_out, n, cfg.q_dim, "attention")))
    return out


CHUNK_ROWS = 16  # rows per attn_chunk tile; a segment this long makes attention a prefill chunk's
CHUNK_HEAD_DIMS = (64, 128)  # the attn_chunk instances


def chunk_heads(cfg: LlamaConfig) -> int:
    """q heads per attn_chunk block: the most (≤ 8) that share one kv head and divide its group."""
    group = cfg.n_heads // cfg.n_kv_heads
    return max(d for d in range(1, 9) if group % d == 0)


def chunk_tiles(offsets: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """(2, T) int32: first row and row count of each ≤ CHUNK_ROWS-row tile of each segment, the
    tiles with the longest histories first (they take the longest; the GPU starts them first)."""
    starts, counts, last = [], [], []
    for a, b in zip(offsets[:-1], offsets[1:]):
        for r in range(int(a), int(b), CHUNK_ROWS):
            m = min(CHUNK_ROWS, int(b) - r)
            starts.append(r)
            counts.append(m)
            last.append(int(positions[r:r + m].max()))
    order = np.argsort(-np.asarray(last), kind="stable")
    return np.stack([np.asarray(starts)[order], np.asarray(counts)[order]]).astype(np.int32)


def attention_chunk_(q, kv_layer, slots, pos, tiles, cfg: LlamaConfig, *, ldq: int, out):
    """Causal GQA attention of q's rows (their k, v already in the cache) on tensor cores, tile by
    tile (chunk_tiles); f16 q and P, f32 accumulation. Writes out (n, H*hd)."""
    if cfg.head_dim not in CHUNK_HEAD_DIMS:
        raise ValueError(f"attention_chunk: head_dim {cfg.head_dim} not in {CHUNK_HEAD_DIMS}")
    hb = chunk_heads(cfg)
    t = cp.asarray(tiles)  # (2, T) int32 (already on the device from CudaOps)
    kernel("attention", f"attn_chunk<{cfg.head_dim},{_q8(kv_layer)}>")((tiles.shape[1], cfg.n_heads // hb), (32 * hb,), (
        q, np.int32(ldq), *kv_args(kv_layer), slots, pos, t[0], t[1], out, np.int32(out.shape[1]),
        np.int32(cfg.n_heads), np.int32(cfg.n_kv_heads), np.float32(math.log2(math.e) / math.sqrt(cfg.head_dim))))
    return out


def attention_scratch(n: int, cfg: LlamaConfig, n_splits: int, *, counters: bool = False) -> tuple:
    """Split partials (max, sum, output) for n rows; with counters, also attn_decode's per-column
    counters (zero; each launch leaves them zero)."""
    s = n * cfg.n_heads * n_splits
    parts = (cp.empty((s,), cp.float32), cp.empty((s,), cp.float32), cp.empty((s, cfg.head_dim), cp.float32))
    return parts + (cp.zeros((n_blocks(n * cfg.n_heads, 4),), cp.int32),) if counters else parts


def kernel_names() -> list[tuple[str, str]]:
    """Every attention kernel instance (for precompile)."""
    names = [("attention", "kv_append<0>"), ("attention", "kv_append<1>"), ("attention", "rope_kv"),
             ("attention", "attn_combine")]
    names += [("attention", f"{k}<{nd},{q8}>") for nd in ATTN_ND for k in ("attn_partial", "attn_decode")
              for q8 in (0, 1)]
    names += [("attention", f"attn_chunk<{hd},{q8}>") for hd in CHUNK_HEAD_DIMS for q8 in (0, 1)]
    return names
