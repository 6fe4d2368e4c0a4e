"""Attention launchers: decode and verify rows (attn_decode: fixed position splits merged in
one launch, with RoPE and the cache append fused in or not), the cache append, and a prefill
chunk's tensor-core attention (attn_chunk). kernels/attention.cu holds the kernels.

A row of one query (a decode token, a verify row) is cut into splits of split_len(max_ctx)
positions, a function of the cache's configured context alone, and its splits merge in split
order: its bits depend on its own data and position, never on how many rows share the step,
whether the step is captured, or whether RoPE and the append ran in the same launch. Prefill
segments of at least CHUNK_ROWS tokens run attn_chunk instead, whose f16 tensor-core products
round differently: the one exemption. Which of the two a prompt's rows take follows how the
scheduler cuts the prompt into chunks (a prefix from the prefix cache, a chunk beside another
request's), so with the `deterministic` setting every row runs attn_decode (ops.CudaOps._rows):
a prompt's KV is then the same bits however it was cut, at the cost of prefill speed.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ntransformerd.engine.backends.cuda.launch import QAct, qact_args, sm_count
from ntransformerd.engine.backends.cuda.nvrtc import check_array, cp, kernel, n_blocks
from ntransformerd.engine.gguf_file import LlamaConfig


ATTN_ND = (1, 2, 4, 8)  # head_dim / 32 of the q8_0 attn_decode instances (a lane's values within one Q8_0 block)
DECODE_ND = (1, 2, 3, 4, 8)  # head_dim / 32 of the f16 ones: head_dim 32, 64, 96, 128, 256
MIN_SPLIT = 128  # positions per split up to MAX_SPLITS × MIN_SPLIT of context
MAX_SPLITS = 128  # kernels/attention.cu MAX_SPLITS: the merge's lanes hold 4 splits each
DECODE_WARPS = 8  # kernels/attention.cu DECODE_WARPS: warps of an attn_decode block, each a piece of a split
DECODE_HEADS = (1, 2, 4, 8)  # q heads per attn_decode warp (decode_heads)
DECODE_BLOCKS_PER_SM = 4  # blocks per SM an attn_decode launch aims at: ~2 rounds of the 8B's (2 fit an SM);
# more rows: each block takes more splits; fewer: the blocks past a short context leave in few rounds
DECODE_ROWS = 64  # rows of the scratch a captured step shares (graphs.MAX_DECODE_ROWS); more run in turns


def split_len(max_ctx: int) -> int:
    """Positions per attention split of a cache of max_ctx positions: MIN_SPLIT, doubled until
    at most MAX_SPLITS splits cover max_ctx (128 up to 16k, 1024 at 128k). A function of the
    configured context alone, so a row's sums never depend on the step's rows or on its position."""
    if max_ctx < 1:
        raise ValueError(f"attention: max_ctx {max_ctx} must be positive")
    sl = MIN_SPLIT
    while -(-max_ctx // sl) > MAX_SPLITS:
        sl *= 2
    return sl


def max_splits(max_ctx: int) -> int:
    """Splits of a row at the full context: the partials a (row, head) needs room for."""
    return -(-max_ctx // split_len(max_ctx))


def group_heads(cfg: LlamaConfig) -> int:
    """q heads per attn_chunk block: the most (≤ 8) that share one kv head and divide its group
    (the block stages that kv head's K and V once for all of them)."""
    group = cfg.n_heads // cfg.n_kv_heads
    return max(d for d in range(1, 9) if group % d == 0)


def decode_heads(cfg: LlamaConfig) -> int:
    """q heads per attn_decode warp: the most (a power of two ≤ 8) that share one kv head and
    divide its group; each K and V row the warp loads serves all of them."""
    group = cfg.n_heads // cfg.n_kv_heads
    return max(d for d in DECODE_HEADS if group % d == 0)


def decode_launch(n: int, cfg: LlamaConfig, max_ctx: int, sms: int) -> tuple[tuple[int, int], tuple[int]]:
    """(grid, block) of attn_decode for n rows on a GPU of `sms` SMs: a column per (row, kv
    head, decode_heads q heads), and as many blocks per column (each taking every so-many-th
    split) as make DECODE_BLOCKS_PER_SM per SM, at most a row's splits. Which block computes a
    split changes no bit of it, so the grid may follow the row count and the GPU; the splits
    themselves do not."""
    cols = n * cfg.n_heads // decode_heads(cfg)
    ys = min(max_splits(max_ctx), max(1, -(-DECODE_BLOCKS_PER_SM * sms // cols)))
    return (cols, ys), (32 * DECODE_WARPS,)


def decode_kernel(cfg: LlamaConfig, q8: bool) -> str:
    """The attn_decode instance for this head_dim, cache type and heads per warp (either mode)."""
    return f"attn_decode<{cfg.head_dim // 32},{int(q8)},{decode_heads(cfg)}>"


@dataclasses.dataclass(frozen=True)
class AttentionScratch:
    """attn_decode's split partials (max, sum, output) for `rows` rows of a cache of `splits`
    splits per row, and its per-column counters (zero; each launch leaves them zero). One serves
    every launch on its stream, one after another; a launch of more rows runs them in turns."""
    rows: int
    splits: int
    pm: object
    pl: object
    po: object
    cnt: object


def scratch_bytes(rows: int, cfg: LlamaConfig, max_ctx: int) -> int:
    """Device bytes of attention_scratch(rows, cfg, max_ctx) (the engine's: graphs.StepGraphs)."""
    return rows * cfg.n_heads * (max_splits(max_ctx) * (cfg.head_dim + 2) + 1) * 4


def attention_scratch(rows: int, cfg: LlamaConfig, max_ctx: int) -> AttentionScratch:
    """The scratch for up to `rows` rows at a time over a cache of max_ctx positions."""
    ms = max_splits(max_ctx)
    s = rows * cfg.n_heads * ms
    return AttentionScratch(rows, ms, cp.empty((s,), cp.float32), cp.empty((s,), cp.float32),
                            cp.empty((s, cfg.head_dim), cp.float32), cp.zeros((rows * cfg.n_heads,), cp.int32))


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


def _check_head_dim(cfg: LlamaConfig, what: str) -> None:
    if cfg.head_dim % 32 or cfg.head_dim // 32 not in DECODE_ND:
        raise ValueError(f"{what}: head_dim {cfg.head_dim} is not one of the kernels' "
                         f"{', '.join(str(32 * nd) for nd in DECODE_ND)}")


def _attn_decode(fused: bool, x, ld: int, v, ldv: int, kv_layer, slots, pos, freqs, cfg: LlamaConfig, *, n: int,
                 out, scratch: AttentionScratch, q_out: QAct | None, what: str):
    """attn_decode over n rows, scratch.rows at a time (a row's bits do not depend on its turn)."""
    _check_head_dim(cfg, what)
    check_array(pos, cp.int32, 1, f"{what} positions")
    max_ctx = kv_layer.table.max_ctx
    sl, ms = split_len(max_ctx), max_splits(max_ctx)
    if scratch.splits != ms or scratch.po.shape != (scratch.rows * cfg.n_heads * ms, cfg.head_dim):
        raise ValueError(f"{what}: the scratch holds {scratch.po.shape} partials, the cache's {ms} splits of "
                         f"{scratch.rows} rows need {(scratch.rows * cfg.n_heads * ms, cfg.head_dim)} "
                         "(attention_scratch(rows, cfg, max_ctx))")
    name = decode_kernel(cfg, kv_layer.q8)
    for r0 in range(0, n, scratch.rows):
        m = min(scratch.rows, n - r0)

        def part(a):  # this turn's rows
            return a if m == n else a[r0:r0 + m]

        grid, block = decode_launch(m, cfg, max_ctx, sm_count())
        kernel("attention", name)(grid, block, (
            part(x), np.int32(ld), part(v) if v is not None else np.intp(0), np.int32(ldv), *kv_args(kv_layer),
            part(slots), part(pos), freqs if freqs is not None else np.intp(0), scratch.pm, scratch.pl, scratch.po,
            scratch.cnt, part(out), np.int32(m), np.int32(cfg.n_heads), np.int32(cfg.n_kv_heads), np.int32(sl),
            np.int32(ms), np.float32(1.0 / math.sqrt(cfg.head_dim)), np.int32(cfg.rope_dim),
            np.int32(cfg.rope_neox), np.int32(fused),
            *qact_args(q_out if q_out is None or m == n else q_out.part(r0, r0 + m), m, cfg.q_dim, what)))
    return out


def attention_(q, k, v, kv_layer, slots, pos, cfg: LlamaConfig, *, n: int, ldq: int, ldk: int, ldv: int, out,
               scratch: AttentionScratch, append: bool = True, q_out: QAct | None = None):
    """Append k, v at (slot, pos) (unless already there: append=False) then causal GQA attention
    of q's rows (rotated already; one query per row); writes out (n, H*hd), and with q_out that
    output quantized too."""
    if append:
        kv_append_(k, v, kv_layer, slots, pos, cfg, n=n, ldk=ldk, ldv=ldv)
    return _attn_decode(False, q, ldq, None, 0, kv_layer, slots, pos, None, cfg, n=n, out=out, scratch=scratch,
                        q_out=q_out, what="attention")


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


def attention_decode_(qkv, v, kv_layer, slots, pos, freqs, cfg: LlamaConfig, *, n: int, ld: int, ldv: int, out,
                      scratch: AttentionScratch, q_out: QAct | None = None):
    """The decode step's attention in one launch (attn_decode fused: rope_kv_ + attention_, the
    same bits): rows of qkv (row stride ld) hold q then k, rows of v stride ldv; q and k are
    rotated in registers (qkv is not written), k and v go to the cache at (slot, pos), and out
    (n, H*hd) gets the attention output, with q_out quantized too."""
    return _attn_decode(True, qkv, ld, v, ldv, kv_layer, slots, pos, freqs, cfg, n=n, out=out, scratch=scratch,
                        q_out=q_out, what="attention_decode")


CHUNK_ROWS = 16  # rows per attn_chunk tile; a segment this long makes attention a prefill chunk's
CHUNK_HEAD_DIMS = (64, 128)  # the attn_chunk instances


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
    hb = group_heads(cfg)
    t = cp.asarray(tiles)  # (2, T) int32 (already on the device from CudaOps)
    kernel("attention", f"attn_chunk<{cfg.head_dim},{_q8(kv_layer)}>")((tiles.shape[1], cfg.n_heads // hb), (32 * hb,), (
        q, np.int32(ldq), *kv_args(kv_layer), slots, pos, t[0], t[1], out, np.int32(out.shape[1]),
        np.int32(cfg.n_heads), np.int32(cfg.n_kv_heads), np.float32(math.log2(math.e) / math.sqrt(cfg.head_dim))))
    return out


def kernel_names() -> list[tuple[str, str]]:
    """Every attention kernel instance a launcher here can pick (for precompile)."""
    names = [("attention", "kv_append<0>"), ("attention", "kv_append<1>"), ("attention", "rope_kv")]
    names += [("attention", f"attn_decode<{nd},{q8},{hb}>") for nd in DECODE_ND for q8 in (0, 1) for hb in DECODE_HEADS
              if not q8 or nd in ATTN_ND]
    names += [("attention", f"attn_chunk<{hd},{q8}>") for hd in CHUNK_HEAD_DIMS for q8 in (0, 1)]
    return names
