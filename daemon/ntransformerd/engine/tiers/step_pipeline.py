"""One step over the devices of a plan: its layers in runs, each run on one device's ops, weights
and KV cache, the activation (rows × d_model) handed from one device to the next.

    layout = layout_of(plan, layer_bytes)           # which device holds and computes what
    pipeline = Pipeline(stages, layout, cfg)         # stages: each device's ops, weights, KV
    logits = pipeline.step(batch)                    # host logits (S, V)

A run is a stretch of consecutive layers on one device with one tier: resident (vram), streamed
into it (pinned, storage), or computed by the host (host). A step is model.forward over them:
the embedding on the device that holds it, model.run_layers for each stretch of runs on one
device, a hand-off where the device changes, the output where it is held. With one device that
is model.forward itself, nothing added. Several GPUs (tiers/multi.py), a GPU and the host
(tiers/placement.py) and, in CI, several CPU "devices" all run this same code.

Each device announces its whole share of the step to its weights before the first layer
(Weights.prefetch), so its stream keeps copying while the other devices compute. A layer's keys
and values live on each device that computes it at some step shape (the host at batch 1, the GPU
for a prefill chunk); before a step, a device that is to compute a layer for a sequence gets the
positions it lacks from the device that wrote them (`DeviceKV.sync`), so copies happen only when
the step shape moves a layer, never in a steady run of one shape.

A device with captured steps (a GPU's CUDA graphs) replays a whole step where the step runs on
it alone (a batch the link serves better than the host), and within a step over several devices
replays each stretch of its resident layers as a captured piece; the rest runs eagerly, on the
same stream as its pieces.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections.abc import Sequence

import numpy as np

from ntransformerd.engine.runtime import model as llama
from ntransformerd.engine.runtime.devices import KV, Backend, Ops, Pieces, Steps, Weights
from ntransformerd.engine.runtime.kv_cache import SlotTable
from ntransformerd.engine.runtime.model import Batch, Segment
from ntransformerd.engine.generation.sampler import TopLogits
from ntransformerd.engine.tiers.multi import MultiPlan
from ntransformerd.engine.tiers.placement import Observation
from ntransformerd.engine.tiers.planner import HOST, SKIP, VRAM, Plan, resident_plan

MAIN = "main"  # a device of the engine's backend (a GPU, or the host when it is the only kind)


@dataclasses.dataclass(frozen=True)
class Run:
    """Consecutive layers computed on one device, with one tier."""

    device: int
    tier: str
    layers: tuple[int, ...]


def runs_of(tiers: Sequence[str], device_of: Sequence[int]) -> tuple[Run, ...]:
    """The runs of per-layer tiers and devices; skipped layers belong to no run (a run goes on
    past them: the layers either side are consecutive in the pass)."""
    runs: list[Run] = []
    for i, (t, d) in enumerate(zip(tiers, device_of, strict=True)):
        if t == SKIP:
            continue
        if runs and runs[-1].device == d and runs[-1].tier == t:
            runs[-1] = Run(d, t, runs[-1].layers + (i,))
        else:
            runs.append(Run(d, t, (i,)))
    return tuple(runs)


@dataclasses.dataclass(frozen=True)
class DeviceShare:
    """What device `ordinal` of one backend kind holds: a Plan over every layer of the model
    whose tiers are this device's (skip: another device's, or skipped)."""

    kind: str  # MAIN, or HOST: the host's CPU backend beside a GPU
    ordinal: int
    plan: Plan


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where every layer is held and computed. schedule: (rows, runs) by increasing rows: a step
    of n token rows runs the first entry with rows ≥ n (the last entry: any larger step)."""

    devices: tuple[DeviceShare, ...]
    schedule: tuple[tuple[int, tuple[Run, ...]], ...]
    embed: int = 0  # the device holding the embedding
    head: int = 0  # the device holding the output and its norm

    def runs_for(self, rows: int) -> tuple[Run, ...]:
        return self.schedule[self.entry(rows)][1]

    def entry(self, rows: int) -> int:
        """The index of the schedule entry a step of `rows` rows runs."""
        for k, (limit, _) in enumerate(self.schedule):
            if rows <= limit:
                return k
        return len(self.schedule) - 1

    def homes(self) -> dict[int, tuple[int, ...]]:
        """Each layer's devices: those whose share holds it (any entry of the schedule, now or
        after the placement moves, computes it on one of them)."""
        out: dict[int, list[int]] = {}
        for d, dev in enumerate(self.devices):
            for i, t in enumerate(dev.plan.tiers):
                if t != SKIP:
                    out.setdefault(i, []).append(d)
        return {i: tuple(ds) for i, ds in sorted(out.items())}

    def steered(self, schedule) -> "Layout":
        """This layout with the placements of `schedule` (placement.Schedule, over the same
        step shapes and the same eligible layers): the host's share already holds them all."""
        return dataclasses.replace(self, schedule=_entries(schedule))


def _share(plan: Plan, tiers: Sequence[str], layer_bytes: Sequence[int]) -> Plan:
    return dataclasses.replace(plan, tiers=tuple(tiers), layer_bytes=tuple(layer_bytes), reasons=())


def layout_of(plan: Plan | MultiPlan | None, layer_bytes: Sequence[int]) -> Layout:
    """The layout of a plan. None: one device, every layer resident. A Plan: one device, and
    the host beside it where the plan's schedule (placement.Schedule) has it compute layers at
    some step shapes. A MultiPlan: one device per range of layers, the embedding on the first,
    the output on the last."""
    if plan is None:
        plan = resident_plan(layer_bytes)
    n = len(plan.tiers)
    if isinstance(plan, MultiPlan):
        devices, device_of = [], []
        for d, ((a, b), p) in enumerate(zip(plan.ranges, plan.devices)):
            tiers = [SKIP] * n
            tiers[a:b] = p.tiers
            devices.append(DeviceShare(MAIN, d, _share(p, tiers, plan.layer_bytes)))
            device_of += [d] * (b - a)
        last = len(devices) - 1
        return Layout(tuple(devices), ((0, runs_of(plan.tiers, device_of)),), 0, last)
    if plan.schedule is None:
        return Layout((DeviceShare(MAIN, 0, plan),), ((0, runs_of(plan.tiers, [0] * n)),))
    # The host holds every streamed layer (its memory map: no copy), so that the placement can
    # move any of them to it later (placement.Steering) without loading anything.
    hosted = set(plan.streamed)
    host_tiers = [HOST if i in hosted else SKIP for i in range(n)]
    host = DeviceShare(HOST, 0, Plan(tuple(host_tiers), plan.layer_bytes, 0, 0, 0, 0, 0, -1, plan.ram_limit))
    return Layout((DeviceShare(MAIN, 0, plan), host), _entries(plan.schedule))


def _entries(schedule) -> tuple[tuple[int, tuple[Run, ...]], ...]:
    """(rows, runs) of a placement.Schedule over the main device (0) and the host (1)."""
    return tuple((p.rows, runs_of(p.tiers, [1 if t == HOST else 0 for t in p.tiers])) for p in schedule.placements)


# ---- the devices of a step ----------------------------------------------------------------------

@dataclasses.dataclass
class Stage:
    """A device as a step sees it: its op set, the weights of its share, its KV cache (layer(i)
    for the layers it computes), and its backend (to make it current, to copy onto it)."""

    name: str
    ops: Ops
    weights: Weights
    kv: KV
    backend: Backend
    ordinal: int = 0
    steps: Pieces | None = None  # recorded pieces (a host device's HostSteps: run(batch, x=, layers=, head=)), or None
    graphs: Steps | None = None  # its captured whole steps (and a GPU's captured pieces), set by the Pipeline
    stream: object = None  # where its eager work runs beside its captured pieces (their stream), None: the default

    @property
    def recorded(self) -> bool:
        return self.steps is not None

    def context(self):
        if self.stream is None:
            return self.backend.context(self.ordinal)
        stack = contextlib.ExitStack()
        stack.enter_context(self.backend.context(self.ordinal))
        stack.enter_context(self.stream)
        return stack

    def to_device(self, x: np.ndarray):
        return self.backend.to_device(x, self.ordinal)


class Handoff:
    """The activation leaves one device for the next: to the host (nothing to do when it is
    there already), then a copy onto the destination, never a view of the source. `poison`
    fills the source with NaN afterwards (tests: any later read of the old buffer shows).

    Through host memory for every pair, GPUs included; a peer copy (cudaMemcpyPeerAsync on the
    receiver's stream after an event on the sender's) is the faster form for two GPUs."""

    def __init__(self, poison: bool = False):
        self.poison = poison
        self.stats = {"copies": 0, "bytes": 0}

    def copy(self, x, src: Stage, dst: Stage):
        with src.context():
            host = src.ops.to_host(x)
        with dst.context():
            y = dst.to_device(host)
        if self.poison:
            with src.context():
                x.fill(np.nan)
        self.stats["copies"] += 1
        self.stats["bytes"] += host.nbytes
        return y


class HomeKV:
    """A device's cache for the layers it computes: model layer i is entry j of `cache`, made
    with as many layers as it holds."""

    def __init__(self, cache: KV, layers: Sequence[int]):
        self.cache = cache
        self._index = {i: j for j, i in enumerate(layers)}

    def layer(self, i: int):
        return self.cache.layer(self._index[i])


class StageKV:
    """A device's cache as its captured steps see it inside a step over several devices: its
    layers by model index, the slot lengths of the engine's table."""

    def __init__(self, home: HomeKV, table: SlotTable):
        self.home, self.table = home, table

    @property
    def lengths(self) -> np.ndarray:
        return self.table.lengths

    def layer(self, i: int):
        return self.home.layer(i)

    def __getattr__(self, name: str):  # what the device's own cache says of itself (max_ctx, its scratch slot)
        return getattr(self.home.cache, name)


class DeviceKV(SlotTable):
    """The engine's KV cache over several devices: one slot table; each layer's keys and values
    on every device that computes it (Layout.homes). `valid[d, i, slot]`: how many leading
    positions of that slot device d holds for layer i; a step first brings each device the
    positions it lacks for the layers it computes (`sync`), then marks what it wrote (`wrote`).
    A slot's room is reserved, trimmed and freed on every device's cache at once. One owner
    thread (the engine's)."""

    def __init__(self, n_slots: int, stages: Sequence[Stage], homes: dict[int, tuple[int, ...]]):
        super().__init__(n_slots)
        self.stages, self.homes = list(stages), homes
        self.max_ctx = min(st.kv.cache.max_ctx for st in self.stages)
        self.valid = np.zeros((len(self.stages), max(homes, default=-1) + 1, n_slots), np.int64)
        self.stats = {"syncs": 0, "positions": 0}

    def layer(self, i: int):
        """Layer i's cache on its first home."""
        return self.stages[self.homes[i][0]].kv.layer(i)

    def alloc(self, slot: int | None = None) -> int:
        slot = super().alloc(slot)
        for st in self.stages:
            st.kv.cache.alloc(slot)
        return slot

    def park(self, slot: int) -> None:
        super().park(slot)
        for st in self.stages:
            st.kv.cache.park(slot)

    def reopen(self, slot: int) -> None:
        super().reopen(slot)
        for st in self.stages:
            st.kv.cache.reopen(slot)

    def free(self, slot: int) -> None:
        super().free(slot)
        for st in self.stages:
            st.kv.cache.free(slot)
        self.valid[:, :, slot] = 0

    def reserve(self, slot: int, n: int) -> None:
        for st in self.stages:
            # each device's cache copies a shared block before a write from the slot's length on
            # (kv_cache.KVCache.reserve): that length is this table's
            st.kv.cache.lengths[slot] = self.lengths[slot]
            st.kv.cache.reserve(slot, n)

    def trim(self, slot: int, n: int) -> None:
        for st in self.stages:
            st.kv.cache.trim(slot, n)
        self.valid[:, :, slot] = np.minimum(self.valid[:, :, slot], n)

    def kept(self, slot: int) -> int:
        return min(st.kv.cache.kept(slot) for st in self.stages)

    def blocks_for(self, n: int) -> int:
        return max(st.kv.cache.blocks_for(n) for st in self.stages)

    def available(self) -> int:
        """What the device with the fewest blocks to give could give (each holds its layers' share)."""
        return min(st.kv.cache.available() for st in self.stages)

    def copy_prefix(self, src: int, dst: int, n: int, start: int = 0) -> None:
        """Positions [start, n) of `src` into `dst` on every device; each device then holds of
        `dst` what it held of both."""
        for st in self.stages:
            with st.context():
                st.kv.cache.copy_prefix(src, dst, n, start)
        v = np.minimum(self.valid[:, :, dst], start)
        self.valid[:, :, dst] = np.where(v >= start, np.minimum(n, np.maximum(start, self.valid[:, :, src])), v)

    def sync(self, batch: Batch, groups: Sequence[tuple[int, Sequence[int]]]) -> None:
        """Before a step: positions from each segment's start on are written now, and each
        device gets the earlier positions it lacks for the layers it computes, from a device
        that holds them."""
        slots = np.array([s.slot for s in batch.segments], np.int64)
        starts = np.array([s.start for s in batch.segments], np.int64)
        self.valid[:, :, slots] = np.minimum(self.valid[:, :, slots], starts)
        pending: dict[tuple[int, int, int, int, int], list[int]] = {}
        for d, layers in groups:
            ls = np.asarray(layers, np.int64)
            have = self.valid[d][np.ix_(ls, slots)]  # (L, S)
            lack = have < starts
            if not lack.any():
                continue
            for a, b in zip(*np.nonzero(lack)):
                i, slot = int(ls[a]), int(slots[b])
                e = int(np.argmax(self.valid[:, i, slot]))
                if self.valid[e, i, slot] < starts[b]:
                    raise RuntimeError(f"layer {i}, slot {slot}: positions {int(have[a, b])}..{int(starts[b])} "
                                       "of its KV cache are on no device")
                pending.setdefault((e, d, slot, int(have[a, b]), int(starts[b])), []).append(i)
        for (e, d, slot, lo, hi), ls in pending.items():
            self._copy(e, d, slot, lo, hi, ls)
            self.valid[d, ls, slot] = hi

    def _copy(self, e: int, d: int, slot: int, lo: int, hi: int, layers: list[int]) -> None:
        """Positions [lo, hi) of `slot` for `layers` from device e to device d: one gather, one
        copy through the host, one scatter per layer."""
        src, dst = self.stages[e], self.stages[d]
        with src.context():
            parts = [x for i in layers for x in src.kv.layer(i).rows(slot, lo, hi)]  # (hi - lo, Hkv, hd) each
            rows = src.ops.to_host(np.stack(parts))  # a device's own stack (NEP 18) where they are its arrays
        with dst.context():
            got = dst.to_device(rows)
            for j, i in enumerate(layers):
                dst.kv.layer(i).write(slot, lo, got[2 * j], got[2 * j + 1])
        self.stats["syncs"] += 1
        self.stats["positions"] += (hi - lo) * len(layers)

    def wrote(self, batch: Batch, groups: Sequence[tuple[int, Sequence[int]]]) -> None:
        """After a step: each device holds its layers' positions up to each segment's end."""
        slots = np.array([s.slot for s in batch.segments], np.int64)
        ends = np.array([s.start + len(s.tokens) for s in batch.segments], np.int64)
        for d, layers in groups:
            self.valid[d][np.ix_(np.asarray(layers, np.int64), slots)] = ends


class _Announced:
    """A device's weights inside one step: the pipeline announced the device's whole share of
    the step (prefetch) before its first run, so a run does not restart the stream."""

    def __init__(self, weights: Weights):
        self.w = weights

    def prefetch(self, layers) -> None:
        pass

    def acquire(self, i: int):
        return self.w.acquire(i)

    def release(self, i: int) -> None:
        self.w.release(i)


class Pipeline:
    """model.forward over the stages of a layout. One owner thread."""

    def __init__(self, stages: Sequence[Stage], layout: Layout, cfg, handoff: Handoff | None = None, *,
                 capture: bool = True, threads: int | None = None, steering=None):
        """capture: each device that captures or records steps (Backend.capture) does so: one
        device for its whole steps, a GPU beside others for its steps alone and its pieces
        (threads: the host's recorded steps' thread count). steering: a placement.Steering that
        every step over the main device and the host reports to; where it moves the placement,
        the layout follows (and `on_steer(steering)` is called)."""
        if len(stages) != len(layout.devices):
            raise ValueError(f"{len(stages)} stages for a layout of {len(layout.devices)} devices")
        self.stages, self.layout, self.cfg = list(stages), layout, cfg
        self.handoff = handoff or Handoff()
        self.steering, self.on_steer = steering, None
        self._host_time = [0.0, 0, 0]  # the host's pieces in this step: seconds, layer bytes, layers
        self._last_start = 0.0  # the last step's start or launch (perf_counter): the steering's periods
        self.step_times = [[0, 0.0] for _ in layout.schedule]  # per schedule entry: steps, seconds
        one = len(self.stages) == 1
        self.kv = self.stages[0].kv if one else DeviceKV(self.stages[0].kv.cache.n_slots, self.stages, layout.homes())
        for st in self.stages if capture else ():
            if one:
                st.graphs = st.backend.capture(st.ops, st.weights, st.kv, threads=threads)
            elif not st.backend.is_host:  # its graphs read the engine's slot lengths; its eager work joins their stream
                st.graphs = st.backend.capture(st.ops, st.weights, StageKV(st.kv, self.kv), threads=threads)
                st.stream = getattr(st.graphs, "stream", None)

    def groups(self, rows: int, layers: Sequence[int] | None = None) -> list[tuple[int, list[int]]]:
        """(device, layers) of a step of `rows` token rows, consecutive runs on one device merged;
        layers: only these (a prefix, the plan minus skipped ones), in the plan's order."""
        wanted = None if layers is None else set(layers)
        out: list[tuple[int, list[int]]] = []
        for r in self.layout.runs_for(rows):
            ls = [i for i in r.layers if wanted is None or i in wanted]
            if not ls:
                continue
            if out and out[-1][0] == r.device:
                out[-1][1].extend(ls)
            else:
                out.append((r.device, ls))
        if wanted is not None and sum(len(ls) for _, ls in out) != len(wanted):
            missing = sorted(wanted - {i for _, ls in out for i in ls})
            raise ValueError(f"layers {missing} are in no run of the plan (skipped, or not in the model)")
        return out

    def forward(self, batch: Batch, groups: list[tuple[int, list[int]]], *, all_logits: bool = False):
        """Logits on the head device: (S, V), or (N, V) with all_logits."""
        lo = self.layout
        if lo.embed == lo.head and all(d == lo.embed for d, _ in groups):  # one device: model.forward itself
            st, ls = self.stages[lo.embed], [i for _, ls in groups for i in ls]
            with st.context():
                if st.recorded:  # a host device's ops record: its whole pass is one recorded call
                    return st.steps.run(batch, layers=ls, all_logits=all_logits)
                return llama.forward(st.ops, self.cfg, st.weights, st.kv, batch, layers=ls, all_logits=all_logits)
        for d, st in enumerate(self.stages):  # each device's stream starts on its whole share now
            mine = [i for e, ls in groups if e == d for i in ls]
            if mine:
                with st.context():
                    st.weights.prefetch(mine)
        # A recorded device (the host's cpu backend) runs each of its pieces as one recorded call
        # (embed, a group of layers, or the head) on host arrays; the others run model.forward's
        # pieces eagerly on their ops.
        cur = self.stages[lo.embed]
        with cur.context():
            x = (cur.steps.run(batch, layers=[], head=False) if cur.recorded
                 else cur.ops.embed(cur.weights, batch.tokens))  # (N, D)
        for d, ls in groups:
            st = self.stages[d]
            if st is not cur:
                x, cur = self.handoff.copy(x, cur, st), st
            t0 = time.perf_counter()
            with st.context():
                x = (st.steps.run(batch, x=x, layers=ls, head=False) if st.recorded
                     else self._layers_on(d, batch, x, ls))  # (N, D)
            if self.layout.devices[d].kind == HOST:  # the host computes on this thread: done on return
                self._host_time[0] += time.perf_counter() - t0
                self._host_time[1] += sum(self.layout.devices[d].plan.layer_bytes[i] for i in ls)
                self._host_time[2] += len(ls)
        head = self.stages[lo.head]
        if head is not cur:
            x = self.handoff.copy(x, cur, head)
        with head.context():
            if head.recorded:
                return head.steps.run(batch, x=x, layers=[], all_logits=all_logits)
            return llama.head(head.ops, self.cfg, head.weights, x, batch, all_logits=all_logits)

    def _layers_on(self, d: int, batch: Batch, x, layers: list[int]):
        """x through `layers` on device d (inside its context): each stretch of resident layers
        as a captured piece where it has them, the rest eagerly."""
        st = self.stages[d]
        g = st.graphs
        if g is None or not hasattr(g, "run_piece"):
            return llama.run_layers(st.ops, self.cfg, _Announced(st.weights), st.kv, batch, x, layers)
        tiers = self.layout.devices[d].plan.tiers
        for resident, part in itertools.groupby(layers, key=lambda i: tiers[i] == VRAM):
            part = list(part)
            if resident and g.covers_piece(batch.segments, part):
                x = g.run_piece(batch.segments, x, part)
            else:
                x = llama.run_layers(st.ops, self.cfg, _Announced(st.weights), st.kv, batch, x, part)
        return x

    def whole(self, segments: Sequence[Segment], groups, layers: Sequence[int] | None) -> Stage | None:
        """The device whose captured steps run this step whole (every layer, the embedding and
        the output on it), or None."""
        lo = self.layout
        if lo.embed != lo.head or any(d != lo.embed for d, _ in groups):
            return None
        st = self.stages[lo.embed]
        return st if st.graphs is not None and st.graphs.covers(segments, layers) else None

    def step(self, batch: Batch, *, layers: Sequence[int] | None = None, all_logits: bool = False,
             top: int | None = None, sample=None):
        """One step: host logits, or with top a TopLogits (picked on the head device, only those
        rows come to the host). Replayed whole where one device's captured steps cover it, else
        inside every device's step context over the runs. sample (sampler.SampleRows): where the
        captured steps draw on their device (their `draw`), the ids (sampler.Drawn) instead;
        elsewhere what top asks for, for the caller to draw from."""
        t0 = time.perf_counter()
        period = self._period(t0)
        groups = self.groups(len(batch.tokens), layers)
        several = isinstance(self.kv, DeviceKV)
        if several:
            self.kv.sync(batch, groups)
        st = self.whole(batch.segments, groups, layers)
        if st is not None:
            with st.context():
                out = None
                if sample is not None and not all_logits and hasattr(st.graphs, "draw"):
                    out = st.graphs.draw(batch.segments, sample, layers=layers)
                if out is None:
                    out = st.graphs.run_step(batch.segments, layers=layers, all_logits=all_logits, top=top)
            if self.steering is not None:  # the host took no part: the steering counts its silence
                self._host_time = [0.0, 0, 0]
                self._steer(batch, 0.0, 0, period)
        else:
            head = self.stages[self.layout.head]
            main = self.stages[0]
            if self.steering is not None:
                main.weights.link_busy()  # what earlier steps copied is not this step's
                self._host_time = [0.0, 0, 0]
            with contextlib.ExitStack() as stack:
                for s in self.stages:
                    stack.enter_context(s.ops.step_context(batch))
                logits = self.forward(batch, groups, all_logits=all_logits)
                with head.context():
                    out = head.ops.to_host(logits) if top is None else head.ops.top(logits, top)
            if self.steering is not None:
                self._steer(batch, *main.weights.link_busy(), period)
        if several:
            self.kv.wrote(batch, groups)
        timing = self.step_times[self.layout.entry(len(batch.tokens))]
        timing[0] += 1
        timing[1] += time.perf_counter() - t0
        return out

    def _period(self, t0: float) -> float:
        """Seconds from the last step's start or launch to this one's (t0; 0 for the first). The
        steering tells the loop's time a step from its waits for work (placement.Observation)."""
        last, self._last_start = self._last_start, t0
        return t0 - last if last else 0.0

    def _steer(self, batch: Batch, link_seconds: float, link_bytes: int, period: float = 0.0) -> None:
        """Report a step over the main device and the host; follow the placement if it moves."""
        host_seconds, host_bytes, host_layers = self._host_time
        keys = int(batch.positions.sum()) + len(batch.positions)  # row at position p attends to p + 1
        new = self.steering.observe(Observation(len(batch.tokens), host_seconds, host_bytes, link_seconds, link_bytes,
                                                keys=keys, host_layers=host_layers, period=period))
        if new is not None:
            self.layout = self.layout.steered(new)
            if self.on_steer is not None:
                self.on_steer(self.steering)

    def launch(self, batch: Batch, *, sample=None, all_logits: bool = False, top: int | None = None,
               layers: Sequence[int] | None = None, after=None, rows=None):
        """A step drawn on its device and not waited for (the captured steps' draw_async: a
        handle whose result() is the sampler.Drawn), with `after`'s draws at `rows` as tokens;
        None, running nothing, where no device's captured steps run it whole, its rows need the
        host, a row runs more than one token (a prompt chunk), or it returns logits (no sample,
        or all_logits: those steps run at once for now; `top` only says which rows a host draw
        would need)."""
        one_token = all(len(g.tokens) == 1 for g in batch.segments)
        if sample is None or all_logits or not one_token or isinstance(self.kv, DeviceKV):
            return None
        st = self.whole(batch.segments, self.groups(len(batch.tokens), layers), layers)
        if st is None or not hasattr(st.graphs, "draw_async") or not st.graphs.draws(sample):
            return None
        t0 = time.perf_counter()
        with st.context():
            handle = st.graphs.draw_async(batch.segments, sample, layers=layers, after=after, rows=rows)
        if handle is not None:
            period = self._period(t0)
            if self.steering is not None:  # a step on the GPU alone: the steering counts it too
                self._host_time = [0.0, 0, 0]
                self._steer(batch, 0.0, 0, period)
        return handle

    def close(self) -> None:
        """Stop each device's streams and close its storage source."""
        for st in self.stages:
            close = getattr(st.weights, "close", None)
            if close is not None:
                close()
