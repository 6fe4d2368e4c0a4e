"""The CUDA backend's tuning knobs, read once into one keyword-only object that is passed down.

Every default is the measured best on an H200 (bench/RESULTS.md has the runs and commands);
the environment overrides exist for same-run A/B benchmarks (bench/ab_decode.py):

| variable | field | meaning |
|---|---|---|
| NTX_F16_MMA=0 | f16_mma | batch buckets ≥ 4 stay on the int8 tensor-core matvecs instead of f16 ones |
| NTX_MMA_ONE_TILE_ROWS=N | mma_one_tile_rows | up to N rows the int8 mma kernels take 16 rows a block |
| NTX_MVQ_WIDE_MAX_N=N | mvq_wide_max_n | one bound for every type: one-row matvecs of ≤ N rows take 4 rows a warp |
| NTX_SPLIT_K_WARPS=N | split_k_warps | dp4a matvecs of fewer warps split K over a block's warps (0: never) |
| NTX_MVQ_MIN_BLOCKS=N | mvq_min_blocks | blocks per SM the one-row dp4a matvecs are compiled to allow |
| NTX_MVQ_PERSISTENT=0 | mvq_persistent | the Q8_0 dp4a matvec launches a block per row group |
| NTX_ATTN_ONE_LAUNCH=0 | attn_one_launch_max_bucket | decode attention as three launches at every bucket |
| NTX_PDL=0 | pdl | captured steps without programmatic dependent launch |
"""

from __future__ import annotations

import dataclasses
import os

from gguf import GGMLQuantizationType as Q


def _per_type(q8_0: int, q4_k: int, q6_k: int) -> dict:
    return {Q.Q8_0: q8_0, Q.Q4_K: q4_k, Q.Q6_K: q6_k}


@dataclasses.dataclass(frozen=True, kw_only=True)
class CudaSettings:
    # From bucket 4, rows of whole 256-element blocks dequantize to f16 in registers for f16
    # tensor-core products (mmh_*): prefill's precision (about 2^-11) instead of int8's 2^-15,
    # and faster at batch 16 for every type.
    f16_mma: bool = True
    # Up to this many rows the int8 mma kernels take 16 rows per block (else 32), so every SM gets work.
    mma_one_tile_rows: int = 8192
    # One-row matvecs of at most this many output rows (per type) take 4 rows per warp instead of
    # 2: half the blocks, so the 8B shape's 4096-row matrices run in one wave, each warp's loads
    # for all its rows issued together. Q4_K's gate_up (28672 rows) was slower with 4.
    mvq_wide_max_n: dict = dataclasses.field(default_factory=lambda: _per_type(1 << 30, 8192, 1 << 30))
    # A dp4a matvec of fewer warps than this (the H200 holds 8448 at once) splits K over its
    # block's four warps, so few-row matrices still keep every SM's loads in flight.
    split_k_warps: int = 4096
    # Blocks per SM the one-row dp4a matvecs are compiled to allow: their registers then fit
    # (Q8_0 in 64 without spills, the K-quants in 80); occupancy, not issue, held them back.
    mvq_min_blocks: dict = dataclasses.field(default_factory=lambda: _per_type(8, 6, 6))
    # The Q8_0 dp4a matvec launches only as many blocks as the SMs hold, each looping over row
    # groups (no tail wave, no block start per group).
    mvq_persistent: bool = True
    # Up to this batch bucket the decode step's attention (one token per row) is one launch
    # (attn_decode: RoPE, cache append, split attention, merge) instead of three.
    attn_one_launch_max_bucket: int = 32
    # Captured steps use programmatic dependent launch (each kernel may start while the previous
    # one drains; attn_decode loads the cache then) up to this many rows.
    pdl: bool = True
    pdl_max_bucket: int = 32
    # Attention splits per (row, head) in buckets of more than 2 rows: the one-launch attention's
    # grid is sized for the longest context, so with many rows fewer splits waste fewer blocks.
    batched_splits: int = 16

    @classmethod
    def from_env(cls, environ=os.environ) -> "CudaSettings":
        """The defaults with the NTX_* overrides of the table above."""
        kw = {}
        if environ.get("NTX_F16_MMA", "1") == "0":
            kw["f16_mma"] = False
        if environ.get("NTX_MMA_ONE_TILE_ROWS"):
            kw["mma_one_tile_rows"] = int(environ["NTX_MMA_ONE_TILE_ROWS"])
        if environ.get("NTX_MVQ_WIDE_MAX_N"):
            n = int(environ["NTX_MVQ_WIDE_MAX_N"])
            kw["mvq_wide_max_n"] = _per_type(n, n, n)
        if environ.get("NTX_SPLIT_K_WARPS"):
            kw["split_k_warps"] = int(environ["NTX_SPLIT_K_WARPS"])
        if environ.get("NTX_MVQ_MIN_BLOCKS"):
            n = int(environ["NTX_MVQ_MIN_BLOCKS"])
            kw["mvq_min_blocks"] = _per_type(n, n, n)
        if environ.get("NTX_MVQ_PERSISTENT", "1") == "0":
            kw["mvq_persistent"] = False
        if environ.get("NTX_ATTN_ONE_LAUNCH", "1") == "0":
            kw["attn_one_launch_max_bucket"] = 0
        if environ.get("NTX_PDL", "1") == "0":
            kw["pdl"] = False
        return cls(**kw)

    def replace(self, **kw) -> "CudaSettings":
        return dataclasses.replace(self, **kw)


DEFAULT = CudaSettings()
