"""Tiers: where every layer lives (VRAM, pinned RAM, storage) and where it is computed, and the
streams between them.

    plan = tiers.model_plan(model, config, backend="cuda", vram_free=free, layer_bytes=sizes)
    print(plan.explain())

planner.py decides (explainably), placement.py which streamed layers the host computes at each
step shape (from measured figures), multi.py spreads the layers over several devices, sources.py
is where bytes come from (one interface for every placement), pipeline.py is the slot ring,
cpu_stream.py the stream on a device that is host memory. Nothing here imports a backend: the
engine asks its backend (engine/runtime/devices.py: Backend) for layer sizes and free memory, hands
the plan to the backend's load, and opens the storage source the plan reads (open_storage).
"""

from __future__ import annotations

import dataclasses
import math

from ntransformerd.engine.runtime import kv_cache
from ntransformerd.engine.tiers.multi import MultiPlan, parse_budgets, parse_devices, plan_devices
from ntransformerd.engine.tiers.placement import STEP_ROWS, Figures, with_schedule
from ntransformerd.engine.tiers.planner import (HOST, PINNED, SKIP, STORAGE, TIERS, VRAM, KVPool, Plan, PlanError,
                                                fmt_bytes, mem_available, plan_tiers, resident_plan)
from ntransformerd.engine.tiers.sources import open_source

__all__ = ["HOST", "PINNED", "SKIP", "STORAGE", "TIERS", "VRAM", "Figures", "KVPool", "MultiPlan", "Plan", "PlanError",
           "fmt_bytes", "mem_available", "parse_devices", "plan_devices", "plan_tiers", "resident_plan",
           "cuda_plan", "host_compute", "kv_blocks_of", "kv_pool", "model_plan", "with_schedule", "STEP_ROWS", "model_plan_devices",
           "open_storage", "wanted"]

WORKSPACE_MIN = 256 << 20


def wanted(config) -> bool:
    """Did the configuration ask for tiers (any budget, layer cap or skipped layer)?"""
    return bool(skip_list(config)) or any(getattr(config, f, None) is not None
                                          for f in ("vram_budget", "pinned_budget", "max_vram_layers"))


def _non_layer_bytes(model) -> int:
    return sum(t.nbytes for n, t in model.tensors.items() if not n.startswith("blk."))


KV_SHARE = 0.25  # of a streaming device's room the default KV pool takes (see kv_pool)


def kv_dtype_of(config, backend: str) -> str:
    """The KV type as the engine stores it: "auto" is the backend's first (f16 on a GPU, f32 on
    the host)."""
    dtype = getattr(config, "kv_dtype", "auto")
    return ("f16" if backend == "cuda" else "f32") if dtype == "auto" else dtype


def _workspace(c, config, backend: str) -> int:
    if backend != "cuda":
        return 0
    biggest = max(c.d_ff * c.d_model, c.q_dim * c.d_model)  # prefill dequantizes one weight to F16
    chunk = config.prefill_chunk
    return WORKSPACE_MIN + (2 * biggest if chunk > 32 else 0) + chunk * (3 * c.d_ff + c.vocab_size + 4 * c.d_model) * 4


def kv_pool(cfg, config, backend: str, *, layer_bytes: list[int], room: float, dtype: str | None = None) -> KVPool:
    """The KV pool of a device whose layers are `layer_bytes`, with `room` bytes (its VRAM limit
    less the fixed weights and the workspace; inf: unlimited) for layers, streaming slots and KV.

    kv_blocks, when configured, is the pool. Otherwise, with max_ctx a per-sequence limit:
      - every layer resident and every sequence able to reach max_ctx at once (max_batch ×
        max_ctx): that, so nothing waits for blocks (a host pool always: its blocks cost RAM
        only once written);
      - every layer resident with room for at least one sequence's max_ctx: every layer, and the
        KV pool what is left (sequences beyond it wait for blocks);
      - layers stream anyway: KV_SHARE of the room, but at least one sequence's max_ctx (a
        request may always reach it) and at most max_batch × max_ctx. Each layer kept resident
        saves its bytes of PCIe every token while KV past what the running sequences use saves
        nothing, so the pool stays a share: with the 70B Q4_K_M at 24 GiB, 4 sequences of
        32768, f16 KV takes one sequence's 10 GiB; q8_0 the share, 5.3 GiB (~10 more layers).
    """
    dtype = dtype or kv_dtype_of(config, backend)
    tb = kv_cache.bytes_per_token(cfg, dtype)
    max_ctx = min(config.max_ctx, cfg.context_length)
    bs = kv_cache.BLOCK_SIZE
    per_seq = -(-max_ctx // bs)
    full, least, block = config.max_batch * per_seq, per_seq, bs * tb

    def pool(blocks, why):
        return KVPool(dtype, tb, int(blocks), bs, max_ctx, config.max_batch, why)

    if getattr(config, "kv_blocks", None):
        return pool(config.kv_blocks, "kv_blocks")
    layers = sum(layer_bytes)
    if backend != "cuda" or room >= layers + full * block:
        return pool(full, "every sequence can reach max_ctx")
    if room >= layers + least * block:
        return pool((room - layers) // block, "every layer resident, the rest of the budget")
    share = int(KV_SHARE * max(room, 0) // block)
    if share < least:
        return pool(least, f"one sequence's max_ctx (more than {KV_SHARE:.0%} of the room: layers stream)")
    if share > full:
        return pool(full, f"every sequence's max_ctx (less than {KV_SHARE:.0%} of the room: layers stream)")
    return pool(share, f"{KV_SHARE:.0%} of the room for layers and KV (layers stream)")


def kv_and_workspace(model, config, backend: str) -> tuple[int, int]:
    """(KV cache bytes of all layers, workspace bytes) a plan sets aside on `backend` before any
    VRAM limit: what a budget must hold beside the layers."""
    kv, work, _ = _kv_pool_work(model, config, backend)
    return kv, work


def _kv_pool_work(model, config, backend: str, *, layer_bytes: list[int] | None = None,
                  vram_limit: float = math.inf, dtype: str | None = None) -> tuple[int, int, KVPool]:
    """(KV cache bytes of all layers, workspace bytes, the pool) on `backend` within `vram_limit`."""
    c = model.config
    if layer_bytes is None:
        layer_bytes = [model.layer_bytes(i) for i in range(c.n_layers)]
    work = _workspace(c, config, backend)
    room = vram_limit - _non_layer_bytes(model) - work
    kv = kv_pool(c, config, backend, layer_bytes=layer_bytes, room=room, dtype=dtype)
    return kv.bytes, work, kv


def _limit(vram_free, vram_budget) -> float:
    xs = [x for x in (vram_free, vram_budget) if x is not None]
    return min(xs) if xs else math.inf


def _plan_inputs(model, config, backend: str, ram_available: int | None, layer_bytes: list[int] | None,
                 vram_limit: float = math.inf):
    """(layer bytes, KV bytes, workspace bytes, available RAM, KV pool) for the planners."""
    if layer_bytes is None:
        layer_bytes = [model.layer_bytes(i) for i in range(model.config.n_layers)]
    kv, work, pool = _kv_pool_work(model, config, backend, layer_bytes=layer_bytes, vram_limit=vram_limit)
    return layer_bytes, kv, work, mem_available() if ram_available is None else ram_available, pool


def skip_list(config) -> list[int]:
    """The layers the config skips (EngineConfig.skip_layers resolved to indices), or none."""
    skip = getattr(config, "skip_layers", None)
    return [int(i) for i in skip] if skip else []


def host_compute(config) -> bool:
    """Does the config have the host compute streamed layers (EngineConfig.host_compute)?"""
    return getattr(config, "host_compute", "off") == "auto"


def host_computes(config, backend: str) -> bool:
    """Does the host compute streamed layers beside `backend` ('cpu' | 'cuda')? As the config asks,
    except beside a GPU with the `deterministic` setting: the host's kernels round differently
    from the GPU's and the placement moves with the steps and differs by step shape, so a row's
    bits would follow where its layers ran; there every layer runs on the GPU (the hybrid's gain
    is the setting's cost: bench/RESULTS.md)."""
    return host_compute(config) and not (backend == "cuda" and getattr(config, "deterministic", False))


def model_plan(model, config, *, backend: str, vram_free: int | None = None, ram_available: int | None = None,
               layer_bytes: list[int] | None = None, figures: Figures | None = None) -> Plan:
    """The plan for `model` under `config` (EngineConfig) on `backend` ('cpu' | 'cuda'); where the
    config has the host compute, its placement at each step shape from `figures` (the measured
    rates; None: Figures.assumed)."""
    budget = config.vram_budget if not isinstance(config.vram_budget, tuple) else config.vram_budget[0]
    limit = _limit(vram_free, budget)
    layer_bytes, kv, work, ram_available, pool = _plan_inputs(model, config, backend, ram_available, layer_bytes,
                                                              limit)

    def plan_with(kv_bytes):
        return plan_tiers(layer_bytes, skip=skip_list(config), fixed_bytes=_non_layer_bytes(model), kv_bytes=kv_bytes,
                          workspace_bytes=work, vram_free=vram_free, ram_available=ram_available,
                          vram_budget=config.vram_budget, pinned_budget=config.pinned_budget,
                          max_vram_layers=config.max_vram_layers, stream_depth=config.stream_depth)

    plan = plan_with(kv)
    pool = _with_trade(pool, model.config, plan, plan_with)
    pool = dataclasses.replace(pool, against=_against(model, config, backend, pool, layer_bytes, limit, plan_with))
    plan = dataclasses.replace(plan, kv=pool)
    if host_computes(config, backend):
        plan = with_schedule(plan, figures or Figures.assumed(), STEP_ROWS + (config.prefill_chunk,))
    return plan


def model_plan_devices(model, config, *, backend: str, vram_free: list[int | None], ram_available: int | None = None,
                       layer_bytes: list[int] | None = None):
    """The multi-device plan (tiers/multi.py) for `model` over len(vram_free) devices. The
    embedding lives on the first device, the output and its norm on the last."""
    c = model.config
    if skip_list(config) or host_compute(config):
        raise PlanError(f"skipped layers and host compute over {len(vram_free)} devices are not planned: use one "
                        "device, or leave skip_layers and host_compute out")
    budgets = parse_budgets(config.vram_budget, len(vram_free))
    limit = sum(_limit(f, b) for f, b in zip(vram_free, budgets))  # the pool's share on each device: its layers'
    layer_bytes, kv, work, ram_available, pool = _plan_inputs(model, config, backend, ram_available, layer_bytes,
                                                              limit - (len(vram_free) - 1) * _workspace(c, config, backend))
    fixed = _non_layer_bytes(model)
    embd = model.tensors["token_embd.weight"].nbytes
    last = fixed - embd + (embd if c.tied_output else 0)
    mp = plan_devices(layer_bytes, fixed_bytes=fixed, fixed_split=(embd, last), kv_bytes=kv, workspace_bytes=work,
                      vram_free=list(vram_free), ram_available=ram_available, vram_budget=config.vram_budget,
                      pinned_budget=config.pinned_budget, max_vram_layers=config.max_vram_layers,
                      stream_depth=config.stream_depth)
    return dataclasses.replace(mp, kv=pool)


def kv_blocks_of(plan) -> int | None:
    """The KV pool in blocks the plan counted (each device's cache is made with it), or None
    where there is no plan (every layer on the host: the cache's own default)."""
    pool = getattr(plan, "kv", None)
    return None if pool is None else pool.blocks


TRADE = ("f16", "q8_0", "q4_0")  # the KV types a plan shows the resident layers of


def _with_trade(pool: KVPool, cfg, plan: Plan, plan_with) -> KVPool:
    """`pool` with the layers resident at its size in blocks for each KV type of TRADE the
    model's head_dim allows (the plan's own first)."""
    out = [(pool.dtype, len(plan.layers(VRAM)))]
    for t in TRADE:
        if t == pool.dtype:
            continue
        try:
            tb = kv_cache.bytes_per_token(cfg, t)
            out.append((t, len(plan_with(pool.blocks * pool.block_size * tb).layers(VRAM))))
        except (ValueError, PlanError):  # a head_dim the type cannot hold, or a budget it does not fit
            continue
    return dataclasses.replace(pool, resident=tuple(out))


def _against(model, config, backend: str, pool: KVPool, layer_bytes: list[int], limit: float,
             plan_with) -> tuple[str, int | None] | None:
    """(the other KV type, the layers resident with it), planned as the config would plan that
    type (its own pool: kv_pool sizes a pool by its bytes), None for layers where it would not
    fit; f16 against any other type, q8_0 against f16. None where the model's head_dim does not
    take the other type."""
    other = "q8_0" if pool.dtype == "f16" else "f16"
    try:
        kv, _, _ = _kv_pool_work(model, config, backend, layer_bytes=layer_bytes, vram_limit=limit, dtype=other)
    except ValueError:  # a head_dim q8_0 cannot hold
        return None
    try:
        return other, len(plan_with(kv).layers(VRAM))
    except PlanError:
        return other, None


def cuda_plan(module, model, config) -> Plan:
    """The plan on this GPU (module: backends.cuda, or anything answering layer_nbytes and
    vram_free): its free VRAM, the layers' device image sizes, MemAvailable, and the config's
    overrides."""
    sizes = [module.layer_nbytes(model, i) for i in range(model.config.n_layers)]
    return model_plan(model, config, backend="cuda", vram_free=module.vram_free(), layer_bytes=sizes)


def open_storage(config, model):
    """The storage source the config names (EngineConfig.storage), opened on the model's file."""
    return open_source(getattr(config, "storage", "odirect") or "odirect", model.path)
