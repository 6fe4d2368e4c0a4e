"""The rates a hybrid plan is placed from, measured at load (tiers/placement.py: Figures).

    figures = measured_figures(model, plan, backend, kv_dtype="f16")   # cached per model, plan and machine

Five figures, each over this model's own layers: the link (pinned host memory → device, a few
layers' bytes copied), the host's rate per step shape (the cpu backend's recorded piece of a
stretch of layers, `HostSteps.run(batch, x=..., layers=..., head=False)`, at rows 1, 4, 16, 64),
the GPU's (one resident layer through the backend's ops at the same rows), one hand-off of
the activation (device → host → device), and the host's attention per position (one layer's
decode attention over ATTN_POSITIONS positions of the KV dtype, backends/host/attention.py: what
each position a row attends to adds to a host layer). Rates are the median of a few runs after a warm-up,
in bytes of layer weights per second. The host's stretch is the plan's streamed layers (what
the host may compute) up to HOST_SAMPLE_BYTES: one layer run again and again stays in a large
last-level cache and times the cache, not RAM, while the host's real share of a step is read
again each step, from the cache only where all of it fits there. The host's two figures are
timed on the build of its kernels that its steps run (the cpu_kernels setting: each build has
its own rates).
They go to a small cache file (tiers.placement.save_figures) so a restart of the same model on
the same machine with the same settings does not measure again.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np

from ntransformerd import dirs
from ntransformerd.engine import backends
from ntransformerd.engine.gguf_file import GGUFModel
from ntransformerd.engine.runtime.model import Batch, Segment, run_layers
from ntransformerd.engine.tiers.placement import Figures, load_figures, save_figures
from ntransformerd.engine.tiers.planner import ASSUMED_H2D_BPS, SKIP, VRAM, Plan
from ntransformerd.engine.tiers.step_pipeline import HomeKV

log = logging.getLogger(__name__)

MEASURE_ROWS = (1, 4, 16, 64)  # decode at batch 1, 4, 16; a verify step or chunk of 64 rows
REPEATS = 3  # a first guess: the steps correct it (placement.Steering), so a quick one
HOST_SAMPLE_BYTES = 1 << 30  # the host's timed stretch of layers at most: past any CPU's last-level cache
ATTN_POSITIONS = 2048  # the host's attention is timed over this many positions of one sequence
VERSION = 3  # of what the figures measure: cached figures of another version are measured again


def median_seconds(fn: Callable[[], object], repeats: int = REPEATS, sync: Callable[[], object] | None = None) -> float:
    """The median time of fn() over `repeats` runs after one warm-up (sync: waits for the device)."""
    fn()
    if sync is not None:
        sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def decode_batch(rows: int) -> Batch:
    """A decode step of `rows` sequences (slots 0..rows-1), one token each at position 0."""
    return Batch.of([Segment(s, 0, np.zeros(1, np.int64)) for s in range(rows)])


def _layer(model: GGUFModel, plan: Plan | None) -> int:
    """The layer to time: the plan's first streamed one (what the host would compute), else 0."""
    streamed = plan.streamed if plan is not None else []
    return streamed[0] if streamed else 0


def host_sample(model: GGUFModel, plan: Plan | None, nbytes: int = HOST_SAMPLE_BYTES) -> list[int]:
    """The layers the host's rate is timed over: the plan's streamed ones (what the host may
    compute) until they hold `nbytes`; without streamed layers, the model's from the first."""
    streamed = list(plan.streamed) if plan is not None else []
    order = streamed or list(range(model.config.n_layers))
    out, total = [], 0
    for i in order:
        if total >= nbytes:
            break
        out.append(i)
        total += model.layer_bytes(i)
    return sorted(out)


def _kv(backend, model: GGUFModel, layers: Sequence[int], rows: int, device: int = 0):
    cfg = dataclasses.replace(model.config, n_layers=len(layers))
    kv = backend.kv_cache(cfg, n_slots=rows, max_ctx=16, dtype=backend.kv_dtypes[0], device=device)
    return HomeKV(kv, list(layers))


def host_rates(model: GGUFModel, *, layers: Sequence[int] = (0,), threads: int | None = None,
               cpu_kernels: str = "auto", rows: Sequence[int] = MEASURE_ROWS,
               repeats: int = REPEATS) -> dict[int, float]:
    """The host's rate (layer bytes per second) at each step shape, from the cpu backend's
    recorded piece over `layers` (host_sample: more bytes than the caches hold) on the kernels
    of `cpu_kernels`, as a hybrid step runs it."""
    layers = sorted(layers)
    host = backends.resolve("cpu")
    share = dataclasses.replace(_plan_of(model), tiers=tuple(VRAM if i in set(layers) else SKIP
                                                              for i in range(model.config.n_layers)))
    ops, weights = host.load(model, share, cpu_kernels=cpu_kernels)
    steps = host.capture(ops, weights, _kv(host, model, layers, max(rows)), threads=threads)
    nbytes = sum(model.layer_bytes(i) for i in layers)
    out = {}
    for r in sorted(set(rows)):
        batch = decode_batch(r)
        x = np.random.default_rng(r).standard_normal((r, model.config.d_model), dtype=np.float32)
        out[r] = nbytes / median_seconds(lambda: steps.run(batch, x=x, layers=layers, head=False), repeats)
    return out


def host_attention_seconds(cfg, *, kv_dtype: str, threads: int | None = None, cpu_kernels: str = "auto",
                           positions: int = ATTN_POSITIONS, repeats: int = REPEATS) -> float:
    """Seconds one layer's decode attention on the host adds per position a row attends to: one
    row over `positions` positions of `kv_dtype`, every KV head, on the steps' thread count and
    the kernels of `cpu_kernels` (80-150 ms on a 2-core VM, most of it filling the probe's
    random cache; cached with the other figures)."""
    host = backends.resolve("cpu").module
    threads = threads or host.default_threads()
    probe = host.AttentionProbe(cfg, dtype=kv_dtype, positions=positions, lib=host.library(cpu_kernels))
    return probe.seconds(threads=threads, repeats=repeats) / positions


def _plan_of(model: GGUFModel) -> Plan:
    sizes = tuple(model.layer_bytes(i) for i in range(model.config.n_layers))
    return Plan((VRAM,) * len(sizes), sizes, 0, 0, 0, 0, 0, -1, -1)


# ---- on a GPU (the cuda backend; run by the lead on the H200 machine) ------------------------------

def link_rate(cp, nbytes: int, repeats: int = REPEATS) -> float:
    """Pinned host memory → device, bytes per second: one copy of `nbytes` (a few layers)."""
    host = np.frombuffer(cp.cuda.alloc_pinned_memory(nbytes), np.uint8, nbytes)
    host.fill(1)
    dev = cp.empty(nbytes, np.uint8)
    stream = cp.cuda.Stream(non_blocking=True)

    def copy():
        cp.cuda.runtime.memcpyAsync(dev.data.ptr, host.ctypes.data, nbytes, cp.cuda.runtime.memcpyHostToDevice,
                                    stream.ptr)
    rate = nbytes / median_seconds(copy, repeats, sync=stream.synchronize)
    del dev, host
    _free(cp)
    return rate


def handoff_seconds(cp, d_model: int, rows: int = 1, repeats: int = 20) -> float:
    """One hand-off of a step's activation (rows, d_model) float32: device → host → device."""
    x = cp.zeros((rows, d_model), cp.float32)

    def there_and_back():
        cp.array(cp.asnumpy(x), copy=True)
    return median_seconds(there_and_back, repeats, sync=cp.cuda.get_current_stream().synchronize)


def _free(cp) -> None:
    """Give what a measurement allocated back to the device and the host (the plan was made
    from the free memory before it)."""
    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()
    cp.get_default_pinned_memory_pool().free_all_blocks()


def gpu_rates(backend, model: GGUFModel, *, layer: int = 0, rows: Sequence[int] = MEASURE_ROWS,
              repeats: int = REPEATS) -> dict[int, float]:
    """The GPU's rate at each step shape: one resident layer through the backend's ops."""
    cp = backend.module.cp
    share = dataclasses.replace(_plan_of(model), tiers=tuple(VRAM if i == layer else SKIP
                                                              for i in range(model.config.n_layers)),
                                layer_bytes=tuple(backend.layer_bytes(model, i) for i in range(model.config.n_layers)))
    nbytes = share.layer_bytes[layer]
    out = {}
    with backend.context(0):
        ops, weights = backend.load(model, share)
        kv = _kv(backend, model, [layer], max(rows))
        for r in sorted(set(rows)):
            batch = decode_batch(r)
            x = backend.to_device(np.random.default_rng(r).standard_normal((r, model.config.d_model), dtype=np.float32))

            def run():
                with ops.step_context(batch):
                    run_layers(ops, model.config, weights, kv, batch, x, [layer])
            out[r] = nbytes / median_seconds(run, repeats, sync=cp.cuda.get_current_stream().synchronize)
        del ops, weights, kv, x, run
        _free(cp)
    return out


# ---- the cache ---------------------------------------------------------------------------------

def cache_dir() -> str:
    """Where figures are kept: figures/ of the state directory (dirs.state_dir)."""
    return os.path.join(dirs.state_dir(), "figures")


def machine() -> str:
    """The machine the figures were measured on: its name, its CPU, its CPU count."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{platform.node()}|{cpu}|{os.cpu_count()}"


def cache_key(model: GGUFModel, plan: Plan | None, *, gpu: str, threads: int | None, link_cap: float | None,
              kv_dtype: str, cpu_kernels: str) -> str:
    """What the figures depend on: the model file, the plan, the machine, the GPU, and the
    settings they were measured under (cpu_kernels as set: each build has its own rates)."""
    st = os.stat(model.path)
    parts = [VERSION, os.path.abspath(model.path), st.st_size, int(st.st_mtime), plan.tiers if plan else None,
             plan.layer_bytes if plan else None, machine(), gpu, threads, link_cap, kv_dtype, cpu_kernels]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:32]


def gpu_name(backend) -> str:
    return "" if backend.is_host else str(backend.module.cp.cuda.runtime.getDeviceProperties(0)["name"])


def cache_path(model: GGUFModel, plan: Plan | None, *, gpu: str, threads: int | None, link_cap: float | None,
               kv_dtype: str, cpu_kernels: str) -> str:
    """Where the figures of `plan` on this machine are kept (the steps' corrections too)."""
    return os.path.join(cache_dir(), cache_key(model, plan, gpu=gpu, threads=threads, link_cap=link_cap,
                                               kv_dtype=kv_dtype, cpu_kernels=cpu_kernels) + ".json")


def measured_figures(model: GGUFModel, plan: Plan | None, backend, *, kv_dtype: str, threads: int | None = None,
                     link_cap: float | None = None, cpu_kernels: str = "auto", use_cache: bool = True) -> Figures:
    """The figures of `plan` on this machine with the KV cache stored as `kv_dtype` and the
    host's kernels of `cpu_kernels` (the build its steps will run): from the cache, else
    measured (and cached). On a host backend there is no link: the host's rates only, the link
    assumed."""
    gpu = gpu_name(backend)
    path = cache_path(model, plan, gpu=gpu, threads=threads, link_cap=link_cap, kv_dtype=kv_dtype,
                      cpu_kernels=cpu_kernels)
    if use_cache:
        cached = load_figures(path)
        if cached is not None:
            return cached
    layer = _layer(model, plan)
    t0 = time.perf_counter()
    log.info("measuring the host's and the link's rates for this plan (seconds; kept in %s, corrected by the "
             "steps that run)", path)
    host = host_rates(model, layers=host_sample(model, plan), threads=threads, cpu_kernels=cpu_kernels)
    attn = host_attention_seconds(model.config, kv_dtype=kv_dtype, threads=threads, cpu_kernels=cpu_kernels)
    handoff = 0.0
    if backend.is_host:
        link, gpu_bps = ASSUMED_H2D_BPS, {}
    else:
        try:
            cp = backend.module.cp
            with backend.context(0):
                link = link_rate(cp, min(3 * max(plan.layer_bytes if plan else [1 << 26]), 1 << 30))
                handoff = handoff_seconds(cp, model.config.d_model)
            gpu_bps = gpu_rates(backend, model, layer=layer)
        except Exception as e:  # noqa: BLE001 - the plan still loads, on the figures it can have
            log.warning("measuring the link and the GPU failed (%s: %s): the link assumed, GPU compute not "
                        "counted", type(e).__name__, e)
            return Figures(link_cap or ASSUMED_H2D_BPS, host, {}, measured=False, host_attn_s=attn)
    if link_cap is not None:
        link = min(link, link_cap)
    figures = Figures(link, host, gpu_bps, handoff_s=handoff, host_attn_s=attn)
    log.info("host compute figures measured in %.1f s: %s", time.perf_counter() - t0, figures.describe())
    if use_cache:
        try:
            save_figures(path, figures)
        except OSError as e:
            log.warning("figures not cached (%s): measured again at the next load", e)
    return figures
