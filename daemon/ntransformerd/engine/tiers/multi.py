"""Several GPUs in one host: the resident layers spread over them, each streaming its own share.

    mp = plan_devices(layer_bytes, vram_free=[free0, free1], vram_budget="24GiB", ...)
    print(mp.explain())

Pipeline parallelism. Device d runs one contiguous range of layers [start_d, stop_d): first its
resident layers, then its streamed ones, which it copies over its own PCIe link through its own
slot ring (tiers/layer_stream.py, one LayerStream per device). After its range the activation (rows
x d_model floats: 8 KiB per token for a 70B) is handed to device d+1 (tiers/step_pipeline.py: Handoff,
the one device-to-device step); the embedding lives on the first device, the output on the last.
Budgets apply per device (`vram_budget` one size for every device, or a list). Resident layers
fill each device in turn (so uneven sizes get shares proportional to what they can hold); the
streamed layers are then split so each link carries its share in proportion to its bandwidth
(equal links: equal shares). With one device the plan is exactly `plan_tiers`' plan.

Per-token time from the streamed bytes: at batch 1 the devices run one after another and a ring
prefetches only `depth` layers ahead, so the links take turns: the bound is the SUM over links
(fewer bytes cross PCIe than on one device because more layers are resident). Links would
overlap (the MAX over links) only if a streamed layer's bytes were striped over several links
and gathered with a peer copy to the device that computes it; `explain()` prints both.

The engine runs such a plan as it runs every plan (tiers/step_pipeline.py: one device per range, its
share loaded through its backend, model.forward over the runs). On a host backend every
"device" is host memory and the hand-off a host copy (the source poisoned afterwards in tests);
the output is bit-identical to the one-device run (tests/engine/test_tiers_multi_pipeline.py).

The 70B-shaped Q4_K_M (synth, 38.2 GiB of layers) at 24 GiB per GPU: one device keeps 39 layers
resident and streams 19.6 GiB per token; two devices keep all 80 resident (40 + 40) and stream
nothing. At 16 GiB per GPU two devices stream 13.9 GiB against 27.6 GiB (about half), 6.5 and
7.4 GiB per link (tests/engine/test_tiers_multi.py).

On GPUs the same code loads each device under its own cp.cuda.Device (its CudaOps, CudaWeights
over its range, a KV cache of its layers) and hands off through host memory; it has not run on
several GPUs (none was lent). What it still lacks there:
  - pinned buffers any device can DMA (cudaHostAllocPortable), and captured steps per device
    (a multi-device engine runs its steps eagerly);
  - the hand-off as cudaMemcpyPeerAsync on the receiving device's stream after an event on the
    sender's (cudaDeviceEnablePeerAccess where the topology allows); NCCL is not needed for
    pipeline parallelism (one point-to-point copy per boundary per step); keep NVLink multicast
    off (device README);
  - measuring decode tok/s on 2+ GPUs against one (acceptance: >= 1.7x) and output identity.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from ntransformerd.engine.tiers.planner import (ASSUMED_DISK_BPS, ASSUMED_H2D_BPS, PINNED, RAM_RESERVE, STORAGE,
                                                TIERS, VRAM, Plan, PlanError, _int, fmt_bytes, layer_span, plan_tiers)
from ntransformerd.settings import parse_size

MAX_DEVICES = 16


def parse_devices(text: str | int | Sequence[int] | None) -> tuple[int, ...] | None:
    """'0,1' → (0, 1); 2 → (0, 1); None → None (one device, today's behaviour)."""
    if text is None:
        return None
    if isinstance(text, int):
        ids = tuple(range(text))
    elif isinstance(text, str):
        try:
            ids = tuple(int(x) for x in text.replace(" ", "").split(",") if x != "")
        except ValueError:
            raise ValueError(f"devices {text!r} is not a comma-separated list of GPU indexes (e.g. 0,1)") from None
    else:
        ids = tuple(int(x) for x in text)
    if not 1 <= len(ids) <= MAX_DEVICES or len(set(ids)) != len(ids) or min(ids) < 0:
        raise ValueError(f"devices {text!r}: give 1..{MAX_DEVICES} distinct GPU indexes")
    return ids


def parse_budgets(budget, n: int) -> list[int | None]:
    """One size for every device ('24GiB'), or one per device ('24GiB,48GiB' or a list)."""
    if budget is None:
        return [None] * n
    if isinstance(budget, str) and "," in budget:
        budget = [b for b in budget.split(",")]
    if isinstance(budget, (list, tuple)):
        if len(budget) != n:
            raise PlanError(f"{len(budget)} VRAM budgets for {n} devices: give one size, or one per device",
                            setting="vram_budget", value=",".join(map(str, budget)))
        return [None if b is None else parse_size(b, setting="vram_budget") for b in budget]
    return [parse_size(budget, setting="vram_budget")] * n


@dataclasses.dataclass(frozen=True)
class MultiPlan:
    """Per device a `Plan` over its own layer range; `starts[d]` is its first layer."""

    devices: tuple[Plan, ...]
    starts: tuple[int, ...]
    h2d_bps: tuple[float, ...]
    ram_limit: int
    reasons: tuple[str, ...] = ()
    kv: object | None = None  # planner.KVPool: the pool in blocks every device holds its layers' share of

    @property
    def n_devices(self) -> int:
        return len(self.devices)

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return [(s, s + len(p.tiers)) for s, p in zip(self.starts, self.devices)]

    @property
    def tiers(self) -> tuple[str, ...]:
        return tuple(t for p in self.devices for t in p.tiers)

    @property
    def layer_bytes(self) -> tuple[int, ...]:
        return tuple(b for p in self.devices for b in p.layer_bytes)

    def device_of(self, layer: int) -> int:
        for d, (a, b) in enumerate(self.ranges):
            if a <= layer < b:
                return d
        raise IndexError(f"layer {layer} is in no device's range")

    def layers(self, tier: str, device: int | None = None) -> list[int]:
        ds = range(self.n_devices) if device is None else [device]
        return [self.starts[d] + i for d in ds for i in self.devices[d].layers(tier)]

    def bytes(self, tier: str, device: int | None = None) -> int:
        ds = range(self.n_devices) if device is None else [device]
        return sum(self.devices[d].bytes(tier) for d in ds)

    @property
    def streamed(self) -> list[int]:
        return [i for i, t in enumerate(self.tiers) if t != VRAM]

    @property
    def skipped(self) -> list[int]:
        return []  # plan_devices places every layer (model_plan_devices refuses skipped ones)

    @property
    def all_resident(self) -> bool:
        return all(p.all_resident for p in self.devices)

    @property
    def link_bytes(self) -> list[int]:
        """Bytes each device's PCIe link carries per step."""
        return [p.streamed_bytes_per_step for p in self.devices]

    @property
    def streamed_bytes_per_step(self) -> int:
        return sum(self.link_bytes)

    @property
    def ram_bytes(self) -> int:
        return sum(p.ram_bytes for p in self.devices)

    def link_seconds(self, disk_bps: float = ASSUMED_DISK_BPS) -> list[float]:
        return [p.bytes(PINNED) / bw + p.bytes(STORAGE) / min(disk_bps, bw) for p, bw in zip(self.devices, self.h2d_bps)]

    def step_seconds(self, disk_bps: float = ASSUMED_DISK_BPS) -> tuple[float, float]:
        """(sum over links, max over links): the batch-1 pipeline bound and the overlapped one.
        The disk is one for all links: its bytes bound the max too."""
        ls = self.link_seconds(disk_bps)
        return sum(ls), max(max(ls), self.bytes(STORAGE) / disk_bps)

    def expected_tok_s(self, disk_bps: float = ASSUMED_DISK_BPS) -> float:
        """From the streamed bytes alone, the devices taking turns (the sum; compute not counted)."""
        t = self.step_seconds(disk_bps)[0]
        return math.inf if t == 0 else 1.0 / t

    def to_dict(self) -> dict:
        s, m = self.step_seconds()
        return {
            "n_devices": self.n_devices,
            "layers": {t: self.layers(t) for t in TIERS},
            "bytes": {t: self.bytes(t) for t in TIERS},
            "streamed_bytes_per_step": self.streamed_bytes_per_step,
            "link_bytes": self.link_bytes,
            "step_seconds_sum": s, "step_seconds_max": m,
            "ram_bytes": self.ram_bytes, "ram_limit": self.ram_limit,
            "devices": [{"range": list(r), **p.to_dict(), "layers": {t: self.layers(t, d) for t in TIERS}}
                        for d, (r, p) in enumerate(zip(self.ranges, self.devices))],
            "reasons": list(self.reasons),
            **({"kv": self.kv.to_dict()} if self.kv is not None else {}),
        }

    def explain(self, disk_bps: float = ASSUMED_DISK_BPS) -> str:
        if self.n_devices == 1:
            one = self.devices[0] if self.kv is None else dataclasses.replace(self.devices[0], kv=self.kv)
            return one.explain(self.h2d_bps[0], disk_bps)
        lb = self.layer_bytes
        lines = [f"plan for {len(lb)} layers ({fmt_bytes(sum(lb))} of layer weights) over {self.n_devices} devices, "
                 "pipeline order:"]
        for d, ((a, b), p) in enumerate(zip(self.ranges, self.devices)):
            lines.append(f"  device {d}  layers {layer_span(list(range(a, b)))} ({b - a})")
            for t, what in ((VRAM, "VRAM-resident"), (PINNED, "pinned RAM"), (STORAGE, "storage")):
                ls = self.layers(t, d)
                if ls or t == VRAM:
                    lines.append(f"    {what:14s} {len(ls):4d} layers  {fmt_bytes(p.bytes(t)):>12s}  [{layer_span(ls)}]")
            lines.append(f"    VRAM use       {fmt_bytes(p.vram_bytes)} of {fmt_bytes(p.vram_limit)}: fixed "
                         f"{fmt_bytes(p.fixed_bytes)}, KV {fmt_bytes(p.kv_bytes)}, workspace "
                         f"{fmt_bytes(p.workspace_bytes)}, {p.depth} slots x {fmt_bytes(p.slot_bytes)}")
            sec = self.link_seconds(disk_bps)[d]
            lines.append(f"    its link       {fmt_bytes(p.streamed_bytes_per_step)}/step"
                         + (f", {sec * 1e3:.1f} ms at {self.h2d_bps[d] / 1e9:.0f} GB/s" if sec else ""))
        lines.append(f"  handoff        {self.n_devices - 1} device-to-device activation copies per step "
                     "(rows x d_model floats)")
        if self.kv is not None:
            lines += self.kv.explain()
        lines.append(f"  RAM pinned     {fmt_bytes(self.ram_bytes)} of {fmt_bytes(self.ram_limit)}")
        total = self.streamed_bytes_per_step
        lines.append(f"  streamed/step  {fmt_bytes(total)} in all (pinned {fmt_bytes(self.bytes(PINNED))}, storage "
                     f"{fmt_bytes(self.bytes(STORAGE))}); per link " + ", ".join(fmt_bytes(x) for x in self.link_bytes))
        if total:
            s, m = self.step_seconds(disk_bps)
            lines.append(f"  bound          {1 / s:.2f} steps/s with the links taking turns (sum {s * 1e3:.1f} ms: "
                         f"the batch-1 pipeline); {1 / m:.2f} steps/s if they overlapped (max {m * 1e3:.1f} ms)")
        for r in self.reasons:
            lines.append(f"  note: {r}")
        return "\n".join(lines)


class _Short(Exception):
    def __init__(self, device: int, what: str):
        self.device, self.what = device, what


def plan_devices(layer_bytes: list[int], *, n_devices: int | None = None, fixed_bytes: int = 0,
                 fixed_split: tuple[int, int] | None = None, kv_bytes: int = 0, workspace_bytes: int = 0,
                 vram_free: Sequence[int | None] | int | None, ram_available: int | None,
                 vram_budget=None, pinned_budget: int | None = None, max_vram_layers: int | None = None,
                 stream_depth: int = 2, ram_reserve: int = RAM_RESERVE, storage_ok: bool = True,
                 h2d_bps: float | Sequence[float] = ASSUMED_H2D_BPS) -> MultiPlan:
    """Plan `layer_bytes` over several devices.

    vram_free: one entry per device (None: unlimited), or one value for `n_devices` devices.
    vram_budget: one size for every device or a list. fixed_split: (bytes on the first device,
    bytes on the last) when there are several (embedding; output and its norm); default: all
    `fixed_bytes` on both ends (safe). kv_bytes is the cache of all layers (each device holds
    its layers' share). With one device this is `plan_tiers` exactly.
    """
    if isinstance(vram_free, (list, tuple)):
        frees = list(vram_free)
    else:
        frees = [vram_free] * (n_devices or 1)
    n_dev = len(frees)
    if n_devices is not None and n_devices != n_dev:
        raise PlanError(f"{len(frees)} free-VRAM figures for {n_devices} devices")
    if not 1 <= n_dev <= MAX_DEVICES:
        raise PlanError(f"{n_dev} devices: 1..{MAX_DEVICES} are supported")
    budgets = parse_budgets(vram_budget, n_dev)
    bws = list(h2d_bps) if isinstance(h2d_bps, (list, tuple)) else [h2d_bps] * n_dev
    if len(bws) != n_dev:
        raise PlanError(f"{len(bws)} link rates for {n_dev} devices")
    if n_dev == 1:
        p = plan_tiers(layer_bytes, fixed_bytes=fixed_bytes, kv_bytes=kv_bytes, workspace_bytes=workspace_bytes,
                       vram_free=frees[0], ram_available=ram_available, vram_budget=budgets[0],
                       pinned_budget=pinned_budget, max_vram_layers=max_vram_layers, stream_depth=stream_depth,
                       ram_reserve=ram_reserve, storage_ok=storage_ok)
        return MultiPlan((p,), (0,), (float(bws[0]),), p.ram_limit, p.reasons)
    return _plan_many(layer_bytes, frees, budgets, bws, fixed_bytes=fixed_bytes, fixed_split=fixed_split,
                      kv_bytes=kv_bytes, workspace_bytes=workspace_bytes, ram_available=ram_available,
                      pinned_budget=pinned_budget, max_vram_layers=max_vram_layers, stream_depth=stream_depth,
                      ram_reserve=ram_reserve, storage_ok=storage_ok)


def _plan_many(lb, frees, budgets, bws, *, fixed_bytes, fixed_split, kv_bytes, workspace_bytes, ram_available,
               pinned_budget, max_vram_layers, stream_depth, ram_reserve, storage_ok) -> MultiPlan:
    n, N = len(lb), len(frees)
    if not 1 <= stream_depth <= 16:
        raise PlanError("out of range 1..16", setting="stream_depth", value=stream_depth)
    if max_vram_layers is not None and max_vram_layers < 0:
        raise PlanError("is negative", setting="max_vram_layers", value=max_vram_layers)
    reasons = []
    limits = []
    for d, (f, b) in enumerate(zip(frees, budgets)):
        xs = [x for x in (f, b) if x is not None]
        limits.append(min(xs) if xs else math.inf)
    if any(b is not None for b in budgets):
        reasons.append("VRAM budget per device " + ", ".join(fmt_bytes(x) for x in limits))
    rl = [x for x in ((None if ram_available is None else max(0, ram_available - ram_reserve)), pinned_budget)
          if x is not None]
    ram_limit = min(rl) if rl else math.inf
    if pinned_budget is not None:
        reasons.append(f"pinned RAM budget {fmt_bytes(pinned_budget)} (shared by all devices)")
    first, last = fixed_split if fixed_split is not None else (fixed_bytes, fixed_bytes)
    fixed = [0] * N
    fixed[0] += first
    fixed[-1] += last
    kvl = -(-kv_bytes // n) if n else 0  # per layer, rounded up
    ws = workspace_bytes
    cap = n if max_vram_layers is None else min(n, max_vram_layers)
    if max_vram_layers is not None and max_vram_layers < n:
        reasons.append(f"at most {max_vram_layers} VRAM layers in all")
    depth, slot = stream_depth, max(lb)

    for d in range(N):
        base = fixed[d] + ws + kvl
        if base > limits[d]:
            raise PlanError(f"device {d}: VRAM budget {fmt_bytes(limits[d])} cannot hold its fixed weights "
                            f"({fmt_bytes(fixed[d])}), workspace ({fmt_bytes(ws)}) and one layer's KV cache "
                            f"({fmt_bytes(kvl)}) = {fmt_bytes(base)}",
                            fix=[("raise its", ("vram_budget",)), ("leave the device out of", ("devices",))])

    def assign(streams, s_target, soft=None):
        """[(start, resident, streamed)] per device, or None if the last device cannot run the rest."""
        p, res_total, out = 0, 0, []
        for d in range(N):
            is_last = d == N - 1
            over = fixed[d] + ws + (depth * slot if streams[d] else 0)
            avail = limits[d] - over
            want_s = 0 if is_last else s_target[d]
            min_kv = kvl * ((n - p) if is_last else min(want_s, n - p))
            if avail < min_kv:
                raise _Short(d, "slots" if streams[d] else "kv")
            lim = None if soft is None or is_last else soft[d]
            r, used = 0, 0
            while p + r < n and res_total + r < cap:
                b = lb[p + r]
                kv_need = kvl * ((n - p) if is_last else (r + 1 + min(want_s, n - p - r - 1)))
                if used + b + kv_need > avail:
                    break
                if lim is not None and used + b / 2 + kvl * (r + 1) > lim:  # nearest layer boundary
                    break
                used += b
                r += 1
            s = (n - p - r) if is_last else min(want_s, n - p - r)
            if s and not streams[d]:
                return None
            out.append((p, r, s))
            p += r + s
            res_total += r
        return out

    def bytes_of(a):
        return [sum(lb[p + r:p + r + s]) for p, r, s in a]

    no_stream = [False] * N
    zeros = [0] * N
    done = None
    try:
        if cap == n:
            caps = [(lim - fixed[d] - ws) for d, lim in enumerate(limits)]
            need = sum(lb) + kvl * n
            if all(c == math.inf for c in caps):
                soft = [need / N] * N
            elif any(c == math.inf for c in caps):
                soft = None
            else:
                tot = sum(max(c, 0) for c in caps)
                soft = [need * max(c, 0) / tot for c in caps]
            done = assign(no_stream, zeros, soft) or (assign(no_stream, zeros) if soft else None)
    except _Short:
        done = None
    if done is not None:
        assignment, streams = done, no_stream
    else:
        streams = [True] * N
        s_target = [0] * N
        assignment = None
        try:
            for _ in range(6):  # balance the links: move streamed layers from the last device forward
                a = assign(streams, s_target)
                sb, sn = bytes_of(a), sum(x[2] for x in a)
                assignment = a
                if not sn:
                    break
                mean = sum(sb) / sn
                w = [bw if st else 0.0 for bw, st in zip(bws, streams)]
                new = [int(round(sum(sb) * w[d] / sum(w) / mean)) for d in range(N)]
                new[-1] = 0
                if new == s_target:
                    break
                s_target = new
            # Devices left with nothing to stream give their slots back to resident layers.
            idle = [d for d, (_, _, s) in enumerate(assignment) if s == 0]
            if idle:
                st2 = [st and d not in idle for d, st in enumerate(streams)]
                a2 = assign(st2, [0 if d in idle else s_target[d] for d in range(N)])
                if a2 is not None and sum(x[2] for x in a2) <= sum(x[2] for x in assignment):
                    assignment, streams = a2, st2
        except _Short as e:
            d = e.device
            need = fixed[d] + ws + depth * slot + kvl
            raise PlanError(f"device {d}: VRAM budget {fmt_bytes(limits[d])} cannot hold even the {depth} streaming "
                            f"slots of {fmt_bytes(slot)} each on top of its fixed weights ({fmt_bytes(fixed[d])}), "
                            f"workspace ({fmt_bytes(ws)}) and its layers' KV cache: need at least {fmt_bytes(need)} "
                            "and more for the KV of the layers it runs",
                            fix=[("raise its", ("vram_budget",)), ("lower", ("stream_depth",)),
                                 ("leave the device out of", ("devices",))]) from None
    # Tiers in pipeline order; pinned RAM while it lasts, then storage (a contiguous tail).
    tiers = []
    for p, r, s in assignment:
        tiers += [VRAM] * r + [PINNED] * s
    streamed = [i for i, t in enumerate(tiers) if t != VRAM]
    dev_of = [d for d, (p, r, s) in enumerate(assignment) for _ in range(r + s)]
    staging_devs = sum(streams)
    if sum(lb[i] for i in streamed) > ram_limit:
        if not storage_ok:
            raise PlanError(f"{fmt_bytes(sum(lb[i] for i in streamed))} of streamed layers do not fit the pinned "
                            f"RAM limit {fmt_bytes(ram_limit)} and no storage source is allowed",
                            fix=[("raise", ("pinned_budget",))])
        for _ in range(2):  # staging buffers only on the devices that read storage
            if depth * slot * staging_devs > ram_limit:
                raise PlanError(f"pinned RAM limit {fmt_bytes(ram_limit)} cannot hold even the {depth} storage "
                                f"staging buffers of {fmt_bytes(slot)} each for {staging_devs} devices",
                                fix=[("raise", ("pinned_budget",)), ("lower", ("stream_depth",))])
            room = ram_limit - depth * slot * staging_devs
            for i in streamed:
                if lb[i] <= room:
                    tiers[i] = PINNED
                    room -= lb[i]
                else:
                    tiers[i] = STORAGE
                    room = -1
            k = len({dev_of[i] for i in streamed if tiers[i] == STORAGE})
            if k == staging_devs:
                break
            staging_devs = k
        reasons.append(f"{tiers.count(STORAGE)} layers do not fit pinned RAM: read from storage each step")
    plans, starts = [], []
    for d, (p, r, s) in enumerate(assignment):
        c = r + s
        plans.append(Plan(tuple(tiers[p:p + c]), tuple(lb[p:p + c]), depth if streams[d] else 0,
                          slot if streams[d] else 0, fixed[d], kvl * c, ws, _int(limits[d]), _int(ram_limit), ()))
        starts.append(p)
    assert sum(len(x.tiers) for x in plans) == n
    return MultiPlan(tuple(plans), tuple(starts), tuple(float(b) for b in bws), _int(ram_limit), tuple(reasons))
