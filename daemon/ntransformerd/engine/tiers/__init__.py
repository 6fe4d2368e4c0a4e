"""Tiers: where every layer lives (VRAM, pinned RAM, storage) and where it is computed, and the
streams between them.

    plan = tiers.model_plan(model, config, backend="cuda", vram_free=free, layer_bytes=sizes)
    print(plan.explain())

planner.py decides (explainably), placement.py which streamed layers the host computes at each
step shape (from measured figures), multi.py spreads the layers over several devices, sources.py
is where bytes come from (one interface for every placement), pipeline.py is the slot ring,
cpu_stream.py the stream on a device that is host memory. Nothing here imports a backend: the
engine asks its backend (engine/devices.py: Backend) for layer sizes and free memory, hands
the plan to the backend's load, and opens the storage source the plan reads (open_storage).
"""

from __future__ import annotations

from ntransformerd.engine.tiers.multi import MultiPlan, parse_devices, plan_devices
from ntransformerd.engine.tiers.placement import STEP_ROWS, Figures, with_schedule
from ntransformerd.engine.tiers.planner import (HOST, PINNED, SKIP, STORAGE, TIERS, VRAM, Plan, PlanError, fmt_bytes,
                                                mem_available, plan_tiers, resident_plan)
from ntransformerd.engine.tiers.sources import open_source

__all__ = ["HOST", "PINNED", "SKIP", "STORAGE", "TIERS", "VRAM", "Figures", "MultiPlan", "Plan", "PlanError",
           "fmt_bytes", "mem_available", "parse_devices", "plan_devices", "plan_tiers", "resident_plan",
           "cuda_plan", "host_compute", "model_plan", "with_schedule", "STEP_ROWS", "model_plan_devices", "open_storage", "wanted"]

WORKSPACE_MIN = 256 << 20


def wanted(config) -> bool:
    """Did the configuration ask for tiers (any budget, layer cap or skipped layer)?"""
    return bool(skip_list(config)) or any(getattr(config, f, None) is not None
                                          for f in ("vram_budget", "pinned_budget", "max_vram_layers"))


def _non_layer_bytes(model) -> int:
    return sum(t.nbytes for n, t in model.tensors.items() if not n.startswith("blk."))


def _kv_work(model, config, backend: str) -> tuple[int, int]:
    """(KV cache bytes of all layers, workspace bytes) on `backend`."""
    c = model.config
    max_ctx = min(config.max_ctx, c.context_length)
    if backend == "cuda":  # F16 cache with one scratch slot; prefill dequantizes one weight to F16
        kv = 2 * c.n_layers * (config.max_batch + 1) * max_ctx * c.kv_dim * 2
        biggest = max(c.d_ff * c.d_model, c.q_dim * c.d_model)
        chunk = config.prefill_chunk
        work = WORKSPACE_MIN + (2 * biggest if chunk > 32 else 0) + chunk * (3 * c.d_ff + c.vocab_size + 4 * c.d_model) * 4
    else:
        # kv_dtype as the engine resolved it ("auto" on the host: f32, its first)
        kv = 2 * c.n_layers * config.max_batch * max_ctx * c.kv_dim * (2 if config.kv_dtype == "f16" else 4)
        work = 0
    return kv, work


def _plan_inputs(model, config, backend: str, ram_available: int | None, layer_bytes: list[int] | None):
    """(layer bytes, KV bytes, workspace bytes, available RAM) for the planners."""
    if layer_bytes is None:
        layer_bytes = [model.layer_bytes(i) for i in range(model.config.n_layers)]
    kv, work = _kv_work(model, config, backend)
    return layer_bytes, kv, work, mem_available() if ram_available is None else ram_available


def skip_list(config) -> list[int]:
    """The layers the config skips (EngineConfig.skip_layers resolved to indices), or none."""
    skip = getattr(config, "skip_layers", None)
    return [int(i) for i in skip] if skip else []


def host_compute(config) -> bool:
    """Does the config have the host compute streamed layers (EngineConfig.host_compute)?"""
    return getattr(config, "host_compute", "off") == "auto"


def model_plan(model, config, *, backend: str, vram_free: int | None = None, ram_available: int | None = None,
               layer_bytes: list[int] | None = None, figures: Figures | None = None) -> Plan:
    """The plan for `model` under `config` (EngineConfig) on `backend` ('cpu' | 'cuda'); where the
    config has the host compute, its placement at each step shape from `figures` (the measured
    rates; None: Figures.assumed)."""
    layer_bytes, kv, work, ram_available = _plan_inputs(model, config, backend, ram_available, layer_bytes)
    plan = plan_tiers(layer_bytes, skip=skip_list(config), fixed_bytes=_non_layer_bytes(model), kv_bytes=kv,
                      workspace_bytes=work, vram_free=vram_free, ram_available=ram_available,
                      vram_budget=config.vram_budget, pinned_budget=config.pinned_budget,
                      max_vram_layers=config.max_vram_layers, stream_depth=config.stream_depth)
    if host_compute(config):
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
    layer_bytes, kv, work, ram_available = _plan_inputs(model, config, backend, ram_available, layer_bytes)
    fixed = _non_layer_bytes(model)
    embd = model.tensors["token_embd.weight"].nbytes
    last = fixed - embd + (embd if c.tied_output else 0)
    return plan_devices(layer_bytes, fixed_bytes=fixed, fixed_split=(embd, last), kv_bytes=kv, workspace_bytes=work,
                        vram_free=list(vram_free), ram_available=ram_available, vram_budget=config.vram_budget,
                        pinned_budget=config.pinned_budget, max_vram_layers=config.max_vram_layers,
                        stream_depth=config.stream_depth)


def cuda_plan(module, model, config) -> Plan:
    """The plan on this GPU (module: backends.cuda, or anything answering layer_nbytes and
    vram_free): its free VRAM, the layers' device image sizes, MemAvailable, and the config's
    overrides."""
    sizes = [module.layer_nbytes(model, i) for i in range(model.config.n_layers)]
    return model_plan(model, config, backend="cuda", vram_free=module.vram_free(), layer_bytes=sizes)


def open_storage(config, model):
    """The storage source the config names (EngineConfig.storage), opened on the model's file."""
    return open_source(getattr(config, "storage", "odirect") or "odirect", model.path)
