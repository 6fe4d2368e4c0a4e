"""The CUDA backend's tuning knobs, read once into one keyword-only object that is passed down.

Every default is the measured best on an H200 (bench/RESULTS.md has the runs and commands).
The knobs are settings of ntransformerd/settings.py, set only by their environment variables
(for same-run A/B benchmarks, bench/ab_decode.py: `--env '' 'NTX_PDL=0'`); their rows give the
names, the variables, the defaults and the limits (`python -m ntransformerd.settings readme`
lists them). Two take one value for every quant type where the default is a table per type:
mvq_wide_max_n and mvq_min_blocks.
"""

from __future__ import annotations

import dataclasses
import os

from gguf import GGMLQuantizationType as Q

from ntransformerd.settings import SETTINGS, from_environment


def _per_type(q8_0: int, q4_k: int, q6_k: int) -> dict:
    return {Q.Q8_0: q8_0, Q.Q4_K: q4_k, Q.Q6_K: q6_k}


@dataclasses.dataclass(frozen=True, kw_only=True)
class CudaSettings:
    # From bucket 4, rows of whole 256-element blocks dequantize to f16 in registers for f16
    # tensor-core products (mmh_*): prefill's precision (about 2^-11) instead of int8's 2^-15,
    # and faster at batch 16 for every type.
    f16_mma: bool = SETTINGS["f16_mma"].default
    # The same f16 tensor-core products for Q4_1 (mmh_q4_1: 32-element blocks, so any K, the last
    # 256-block partial), where only the f32 generic kernel served them: the default model's
    # type. Off until a device round has timed it against the generic kernel (bench/RESULTS.md).
    f16_legacy: bool = SETTINGS["f16_legacy"].default
    # Up to this many rows the int8 mma kernels take 16 rows per block (else 32), so every SM gets work.
    mma_one_tile_rows: int = SETTINGS["mma_one_tile_rows"].default
    # One-row matvecs of at most this many output rows (per type) take 4 rows per warp instead of
    # 2: half the blocks, so the 8B shape's 4096-row matrices run in one wave, each warp's loads
    # for all its rows issued together. Q4_K's gate_up (28672 rows) was slower with 4.
    mvq_wide_max_n: dict = dataclasses.field(default_factory=lambda: _per_type(1 << 30, 8192, 1 << 30))
    # A dp4a matvec of fewer warps than this (the H200 holds 8448 at once) splits K over its
    # block's four warps, so few-row matrices still keep every SM's loads in flight.
    split_k_warps: int = SETTINGS["split_k_warps"].default
    # Blocks per SM the one-row dp4a matvecs are compiled to allow: their registers then fit
    # (Q8_0 in 64 without spills, the K-quants in 80); occupancy, not issue, held them back.
    mvq_min_blocks: dict = dataclasses.field(default_factory=lambda: _per_type(8, 6, 6))
    # The Q8_0 dp4a matvec launches only as many blocks as the SMs hold, each looping over row
    # groups (no tail wave, no block start per group).
    mvq_persistent: bool = SETTINGS["mvq_persistent"].default
    # Up to this batch bucket the decode step's attention (one token per row) is one launch
    # (attn_decode fused: RoPE, cache append, split attention, merge) instead of two or three;
    # both give the same bits.
    attn_one_launch_max_bucket: int = SETTINGS["attn_one_launch_max_bucket"].default
    # Captured steps use programmatic dependent launch (each kernel may start while the previous
    # one drains; attn_decode loads the cache then) up to this many rows.
    pdl: bool = SETTINGS["pdl"].default
    pdl_max_bucket: int = 32

    # Every row's matvecs on one kernel family whose sum order follows the weight's shape alone
    # (launch.choose), prefill chunks too: a request's output does not depend on the rows that
    # share its steps. The engine's `deterministic` setting (EngineConfig), not an environment knob.
    deterministic: bool = SETTINGS["deterministic"].default

    @classmethod
    def from_env(cls, environ=os.environ) -> "CudaSettings":
        """The defaults with the overrides of the rows' environment variables (NTX_PDL=0, ...)."""
        kw = from_environment(ENV_SETTINGS, environ)
        for name in ("mvq_wide_max_n", "mvq_min_blocks"):  # one value for every type
            if name in kw:
                kw[name] = _per_type(kw[name], kw[name], kw[name])
        return cls(**kw)

    def replace(self, **kw) -> "CudaSettings":
        return dataclasses.replace(self, **kw)


ENV_SETTINGS = ("f16_mma", "f16_legacy", "mma_one_tile_rows", "mvq_wide_max_n", "split_k_warps", "mvq_min_blocks",
                "mvq_persistent", "attn_one_launch_max_bucket", "pdl")
assert all(SETTINGS[n].env for n in ENV_SETTINGS) and set(ENV_SETTINGS) <= set(CudaSettings.__dataclass_fields__)
DEFAULT = CudaSettings()
