"""The CUDA backend: CuPy arrays and our kernels from `kernels/` (one .cu per op family).

One module per concern: nvrtc (compiling and launching, programmatic dependent launch),
settings (the tuning knobs, read once), launch (one checked launcher per kernel, and which
kernel serves each matrix and batch width), attention (the attention launchers and the splits of a row's positions), weights (the device layout of a layer and the one
weights object every plan uses), kv (the paged KV cache, f16 or q8_0), ops (the op set model.forward calls,
with the arena that makes a pass capturable), graphs (model.forward captured per bucket), warm (the kernels a model needs, compiled at load).
`backends/cpu.py` is the reference every op is tested against (tests/gpu).

The names below are the backend's surface: what the engine, the tiers, the tests and the
benchmarks use.
"""

from __future__ import annotations

from ntransformerd.engine.backends.cuda.graphs import StepGraphs
from ntransformerd.engine.backends.cuda.kv import CUDA_KV_DTYPES, CudaKVCache, CudaKVLayer, DeviceTables
from ntransformerd.engine.backends.cuda.attention import (  # noqa: F401 (the backend's surface)
    ATTN_ND, CHUNK_HEAD_DIMS, CHUNK_ROWS, DECODE_ND, DECODE_ROWS, MAX_SPLITS, AttentionScratch, attention_,
    attention_chunk_, attention_decode_, attention_scratch, chunk_tiles, decode_heads, decode_kernel, decode_launch,
    group_heads, kv_append_, kv_args, max_splits, rope_kv_, scratch_bytes, split_len)
from ntransformerd.engine.backends.cuda.launch import (  # noqa: F401 (the backend's surface)
    CHUNKED_MAX_ROWS, F16_LEGACY, F16_MATVEC, FAST_MATVEC, MATVEC_BUCKETS, MATVEC_MAX_ROWS, MMA_MATVEC, MMA_MIN_BUCKET,
    MMH_PART_FLOATS, MMH_ROWS, ROWS_PER_WARP, WIDE_ROWS_PER_WARP, Choice, QAct, argmax, bucket_of, choose,
    chunked_launch, dequantize_rows, matmul, matvec, matvec_rows, mmh_chunks, mmh_grid, quantize, reads_f16, reads_qact,
    rms_norm, rope_, swiglu, top_rows, uses_cublas)
from ntransformerd.engine.backends.cuda.nvrtc import available, cp, kernel, kernel_source, pdl  # noqa: F401
from ntransformerd.engine.backends.cuda.ops import Arena, CudaOps
from ntransformerd.engine.backends.cuda.settings import CudaSettings
from ntransformerd.engine.backends.cuda import warm
from ntransformerd.engine.backends.cuda.warm import kernel_names, precompile  # noqa: F401
from ntransformerd.engine.backends.cuda.weights import (  # noqa: F401
    CudaTensor, CudaWeights, LayerLayout, Stacked, host_planes, layer_nbytes, upload)
from ntransformerd.engine.gguf_file import GGUFModel, LlamaConfig
from ntransformerd.engine.tiers.planner import VRAM, Plan


def resident_plan(model: GGUFModel) -> Plan:
    """Every layer in VRAM (what `load` uses without a plan)."""
    sizes = tuple(layer_nbytes(model, i) for i in range(model.config.n_layers))
    return Plan((VRAM,) * len(sizes), sizes, 0, 0, 0, 0, 0, -1, -1)


def load(model: GGUFModel, plan: Plan | None = None, *, source=None, poison: bool = False,
         settings: CudaSettings | None = None, link_cap: float | None = None) -> tuple[CudaOps, CudaWeights]:
    """The op set and the model's weights under `plan` (default: every layer resident)."""
    if not available():
        raise RuntimeError("the cuda backend needs CuPy and a visible NVIDIA GPU")
    warm.compile_for({int(t.qtype) for t in model.tensors.values()}, model.config)  # what it can launch, before a request
    freq = model.dequantize("rope_freqs.weight") if "rope_freqs.weight" in model.tensors else None
    ops = CudaOps(model.config, freq, settings=settings or CudaSettings.from_env())
    return ops, CudaWeights(model, plan or resident_plan(model), source=source, poison=poison, link_cap=link_cap)


def vram_free() -> int:
    """Free device memory now (what the planner may place)."""
    return cp.cuda.runtime.memGetInfo()[0]


def kv_cache(cfg: LlamaConfig, *, n_slots: int, max_ctx: int, dtype: str = "f16",
             n_blocks: int | None = None, spill: int = 0) -> CudaKVCache:
    """The paged KV cache (kv.py): n_blocks blocks of 16 positions (default: n_slots × max_ctx
    worth), f16 or q8_0, closed slots' blocks saved to `spill` bytes of host RAM when the pool
    needs them; another kv_dtype is refused, never substituted."""
    return CudaKVCache(cfg, n_slots=n_slots, max_ctx=max_ctx, dtype=dtype, n_blocks=n_blocks, spill=spill)


def graphs(ops: CudaOps, weights: CudaWeights, kv: CudaKVCache) -> StepGraphs:
    """The captured steps the engine uses for the buckets they cover (graphs.py)."""
    return StepGraphs(ops, weights, kv)


__all__ = ["Arena", "CUDA_KV_DTYPES", "CudaKVCache", "CudaKVLayer", "CudaOps", "CudaSettings", "CudaTensor", "CudaWeights", "DeviceTables",
           "LayerLayout", "Stacked", "StepGraphs", "available", "graphs", "kv_cache", "layer_nbytes", "load",
           "resident_plan", "vram_free"]
