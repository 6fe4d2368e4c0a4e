"""The tier planner: which layers live in VRAM, which in pinned RAM, which stay on storage.

    plan = plan_tiers(layer_bytes, fixed_bytes=..., kv_bytes=..., workspace_bytes=...,
                      vram_free=free, ram_available=mem_available(), stream_depth=2)
    print(plan.explain())

VRAM first holds what every step needs (embedding, output, norms: `fixed_bytes`), the KV cache
and the workspace; if every layer then fits, every layer is resident and nothing streams.
Otherwise `stream_depth` slots of the largest streamed layer are set aside and layers are made
resident in order until the VRAM budget (or `max_vram_layers`) is spent. The rest go to pinned
RAM while the pinned budget lasts (less `stream_depth` staging buffers when any layer stays on
storage), and the remainder is read from storage on every step. Every streamed byte crosses
PCIe once per step whatever the batch, so a step's time is bounded by
    pinned_bytes / h2d_bw  (+ storage_bytes / disk_bw, which then dominates).

Budgets arrive in bytes (EngineConfig parsed them: settings.parse_size) under the names of the
config keys (vram_budget, pinned_budget, stream_depth, max_vram_layers), and a PlanError names
the settings that would fix it the same way, so each program words them as its user writes them.
"""

from __future__ import annotations

import dataclasses
import math
import os

from ntransformerd.settings import SettingError

VRAM, PINNED, STORAGE = "vram", "pinned", "storage"
HOST = "host"  # computed by the host where it lies (RAM, the page cache), not brought to the GPU
SKIP = "skip"  # a skipped layer (layer skip): neither loaded, computed nor streamed
TIERS = (VRAM, PINNED, STORAGE)
GiB = 1 << 30
MiB = 1 << 20

# Defaults for the "expected" figures: the H200 machine's measured pinned H2D and O_DIRECT rates
# (shared/notes/gpu-machine.md). Only the explanation uses them; the plan itself does not.
ASSUMED_H2D_BPS = 55e9
ASSUMED_DISK_BPS = 1.5e9
RAM_RESERVE = 4 * GiB  # MemAvailable kept for the OS, the page cache and Python


def layer_span(ls: list[int]) -> str:
    """Layer indices as ranges for the plan's explanation: [0, 1, 2, 5] → "0-2,5"."""
    if not ls:
        return "-"
    out, a = [], ls[0]
    for p, q in zip(ls, ls[1:] + [None]):
        if q != p + 1:
            out.append(f"{a}" if a == p else f"{a}-{p}")
            a = q
    return ",".join(out)


class PlanError(SettingError):
    """A budget that cannot hold what streaming needs; the message says what and how much, and
    its `fix` which settings would help (SettingError.worded spells them for the program)."""


SHRINK_KV = ("kv_blocks", "max_batch", "max_ctx")  # the settings that make the KV cache smaller


def fmt_bytes(n: float) -> str:
    if n < 0 or n == math.inf:
        return "unlimited"
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / MiB:.1f} MiB"


def mem_available(path: str = "/proc/meminfo") -> int:
    """MemAvailable in bytes (what can be allocated without swapping)."""
    with open(path) as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


KV_BY_SIZE = ("q4_0", "q8_0", "f16", "f32")  # the KV types, fewest bytes per position first


@dataclasses.dataclass(frozen=True)
class KVPool:
    """The KV cache a plan sets aside on a device: `blocks` of `block_size` positions, each
    position `token_bytes` over the device's layers (kv_cache.bytes_per_token). max_ctx limits
    one sequence; the pool is shared by all of them (admission and growth count blocks).
    `resident`: layers the plan keeps resident at this pool with each KV type, (type, layers),
    the pool's own type first: what a smaller type buys. `against`: (the other type, layers
    resident) with that type's own pool as the config would size it (f16 against q8_0 and the
    others; None for layers: it would not fit), the trade the KV choice made."""

    dtype: str
    token_bytes: int
    blocks: int
    block_size: int
    max_ctx: int
    max_batch: int
    why: str = ""  # how the size was chosen
    resident: tuple[tuple[str, int], ...] = ()
    against: tuple[str, int | None] | None = None

    def trade(self) -> str:
        """The KV choice's trade in layers, e.g. "q8_0 KV keeps +10 layers resident against f16",
        "f16 KV would not fit"; "" where the plan does not know it."""
        if self.against is None or not self.resident:
            return ""
        other, theirs = self.against
        if theirs is None:
            return f"{other} KV would not fit"
        mine = self.resident[0][1]
        if KV_BY_SIZE.index(self.dtype) < KV_BY_SIZE.index(other):
            return f"{self.dtype} KV keeps {mine - theirs:+d} layers resident against {other}"
        return f"{other} KV would keep {theirs - mine:+d} layers resident against {self.dtype}"

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size

    @property
    def bytes(self) -> int:
        return self.tokens * self.token_bytes

    def to_dict(self) -> dict:
        return {"dtype": self.dtype, "token_bytes": self.token_bytes, "blocks": self.blocks,
                "block_size": self.block_size, "tokens": self.tokens, "bytes": self.bytes, "max_ctx": self.max_ctx,
                "max_batch": self.max_batch, "why": self.why, "resident": dict(self.resident),
                **({"against": {"dtype": self.against[0], "resident": self.against[1], "trade": self.trade()}}
                   if self.against is not None else {})}

    def explain(self, indent: str = "  ") -> list[str]:
        full = self.tokens / max(1, self.max_ctx)
        lines = [f"{indent}KV cache       {self.dtype}, {self.token_bytes / 1024:.1f} KiB per token; pool {self.blocks} "
                 f"blocks x {self.block_size} = {self.tokens} tokens, {fmt_bytes(self.bytes)} ({full:.2f} x max_ctx "
                 f"{self.max_ctx}; {self.max_batch} sequences at once)" + (f": {self.why}" if self.why else "")]
        if self.resident:
            lines.append(f"{indent}KV trade       layers resident at this pool: "
                         + ", ".join(f"{t} KV {n}" for t, n in self.resident)
                         + (f"; each type with its own pool, {self.trade()}" if self.trade() else ""))
        return lines


@dataclasses.dataclass(frozen=True)
class Plan:
    """The tier of every layer and what it costs; `explain()` is what `ntx-model run --plan` prints."""

    tiers: tuple[str, ...]  # per layer: vram | pinned | storage | skip
    layer_bytes: tuple[int, ...]
    depth: int  # streaming slots on the device (0 when nothing streams)
    slot_bytes: int  # one slot: the largest streamed layer
    fixed_bytes: int
    kv_bytes: int
    workspace_bytes: int
    vram_limit: int  # what the plan was allowed to use on the device
    ram_limit: int  # what the plan was allowed to pin in host RAM
    reasons: tuple[str, ...] = ()  # the overrides and limits that shaped it, for explain()
    skipped_streamed_bytes: int = 0  # bytes per step the skipped layers would have streamed
    # Which streamed layers the host computes at each step shape (placement.Schedule); None: none.
    schedule: object | None = None
    kv: KVPool | None = None  # the KV pool kv_bytes holds, where the plan knows it (tiers.model_plan)

    def layers(self, tier: str) -> list[int]:
        return [i for i, t in enumerate(self.tiers) if t == tier]

    def bytes(self, tier: str) -> int:
        return sum(b for b, t in zip(self.layer_bytes, self.tiers) if t == tier)

    @property
    def streamed(self) -> list[int]:
        return [i for i, t in enumerate(self.tiers) if t in (PINNED, STORAGE)]

    @property
    def skipped(self) -> list[int]:
        return self.layers(SKIP)

    @property
    def all_resident(self) -> bool:
        return all(t in (VRAM, SKIP) for t in self.tiers)

    @property
    def kv_tokens(self) -> int:
        """Positions the KV pool holds, all sequences together (0 where the plan does not know)."""
        return self.kv.tokens if self.kv is not None else 0

    @property
    def streamed_bytes_per_step(self) -> int:
        """Bytes that cross PCIe each step (one decode step, or one prefill chunk), any batch."""
        return self.bytes(PINNED) + self.bytes(STORAGE)

    @property
    def staging_bytes(self) -> int:
        """Host staging buffers for storage reads (pinned)."""
        return self.depth * self.slot_bytes if self.layers(STORAGE) else 0

    @property
    def vram_bytes(self) -> int:
        return self.fixed_bytes + self.kv_bytes + self.workspace_bytes + self.bytes(VRAM) + self.depth * self.slot_bytes

    @property
    def ram_bytes(self) -> int:
        return self.bytes(PINNED) + self.staging_bytes

    def expected_tok_s(self, h2d_bps: float = ASSUMED_H2D_BPS, disk_bps: float = ASSUMED_DISK_BPS) -> float:
        """Upper bound on steps per second from the streamed bytes alone (compute not counted)."""
        t = self.bytes(PINNED) / h2d_bps + self.bytes(STORAGE) / min(disk_bps, h2d_bps)
        return math.inf if t == 0 else 1.0 / t

    def to_dict(self) -> dict:
        return {
            "layers": {t: self.layers(t) for t in TIERS + (SKIP,)},
            "bytes": {t: self.bytes(t) for t in TIERS + (SKIP,)},
            "depth": self.depth, "slot_bytes": self.slot_bytes,
            "fixed_bytes": self.fixed_bytes, "kv_bytes": self.kv_bytes, "workspace_bytes": self.workspace_bytes,
            "vram_bytes": self.vram_bytes, "ram_bytes": self.ram_bytes,
            "vram_limit": self.vram_limit, "ram_limit": self.ram_limit,
            "streamed_bytes_per_step": self.streamed_bytes_per_step,
            "skipped_streamed_bytes": self.skipped_streamed_bytes,
            "reasons": list(self.reasons),
            **({"host_compute": self.schedule.to_dict()} if self.schedule is not None else {}),
            **({"kv": self.kv.to_dict()} if self.kv is not None else {}),
        }

    def explain(self, h2d_bps: float = ASSUMED_H2D_BPS, disk_bps: float = ASSUMED_DISK_BPS) -> str:
        n = len(self.tiers)
        lines = [f"plan for {n} layers ({fmt_bytes(sum(self.layer_bytes))} of layer weights):"]
        for t, what in ((VRAM, "VRAM-resident"), (PINNED, "pinned RAM"), (STORAGE, "storage")):
            ls = self.layers(t)
            lines.append(f"  {what:14s} {len(ls):4d} layers  {fmt_bytes(self.bytes(t)):>12s}  [{layer_span(ls)}]")
        lines.append(f"  VRAM use       {fmt_bytes(self.vram_bytes)} of {fmt_bytes(self.vram_limit)}: fixed "
                     f"{fmt_bytes(self.fixed_bytes)}, KV {fmt_bytes(self.kv_bytes)}, workspace "
                     f"{fmt_bytes(self.workspace_bytes)}, {self.depth} slots x {fmt_bytes(self.slot_bytes)}")
        if self.kv is not None:
            lines += self.kv.explain()
        lines.append(f"  RAM pinned     {fmt_bytes(self.ram_bytes)} of {fmt_bytes(self.ram_limit)}"
                     + (f" (incl. {self.depth} staging buffers)" if self.staging_bytes else ""))
        s = self.streamed_bytes_per_step
        lines.append(f"  streamed/step  {fmt_bytes(s)} (pinned {fmt_bytes(self.bytes(PINNED))}, storage "
                     f"{fmt_bytes(self.bytes(STORAGE))}); one pass serves the whole batch")
        tps = self.expected_tok_s(h2d_bps, disk_bps)
        if s:
            lines.append(f"  bound          {tps:.2f} steps/s at {h2d_bps / 1e9:.0f} GB/s H2D, "
                         f"{disk_bps / 1e9:.1f} GB/s storage")
        if self.skipped:
            saved = sum(self.layer_bytes[i] for i in self.skipped if i < len(self.layer_bytes))
            lines.append(f"  skipped        {len(self.skipped):4d} layers  {fmt_bytes(saved):>12s}  "
                         f"[{layer_span(self.skipped)}]: neither loaded nor computed"
                         + (f", {fmt_bytes(self.skipped_streamed_bytes)} per step not streamed"
                            if self.skipped_streamed_bytes else ""))
        if self.schedule is not None:
            lines += self.schedule.explain()
        for r in self.reasons:
            lines.append(f"  note: {r}")
        return "\n".join(lines)


def resident_plan(layer_bytes) -> Plan:
    """Every layer resident (the plan a device without budgets loads)."""
    return Plan((VRAM,) * len(layer_bytes), tuple(layer_bytes), 0, 0, 0, 0, 0, -1, -1)


def plan_tiers(layer_bytes: list[int], *, skip=(), **kw) -> Plan:
    """Assign every layer a tier (see _plan_kept); the layers in `skip` get SKIP and take no
    memory, so the others may take their room (more resident, less streamed)."""
    skip = set(skip)
    if not skip:
        return _plan_kept(list(layer_bytes), **kw)
    n = len(layer_bytes)
    if not skip <= set(range(n)):
        raise PlanError(f"layers {sorted(skip - set(range(n)))} are not among the {n} layers",
                        setting="skip_layers", value=",".join(map(str, sorted(skip))))
    kept = [i for i in range(n) if i not in skip]
    if not kept:
        raise PlanError("every layer is skipped", setting="skip_layers", value=",".join(map(str, sorted(skip))))
    sub = _plan_kept([layer_bytes[i] for i in kept], **kw)
    tiers = [SKIP] * n
    for j, i in enumerate(kept):
        tiers[i] = sub.tiers[j]
    full = _plan_kept(list(layer_bytes), **kw)  # what the skip saves on the stream
    saved = sum(layer_bytes[i] for i in skip if full.tiers[i] in (PINNED, STORAGE))
    return dataclasses.replace(sub, tiers=tuple(tiers), layer_bytes=tuple(layer_bytes),
                               reasons=sub.reasons + (f"{len(skip)} layers skipped",), skipped_streamed_bytes=saved)


def _plan_kept(layer_bytes: list[int], *, fixed_bytes: int = 0, kv_bytes: int = 0, workspace_bytes: int = 0,
               vram_free: int | None, ram_available: int | None, vram_budget: int | None = None,
               pinned_budget: int | None = None, max_vram_layers: int | None = None, stream_depth: int = 2,
               ram_reserve: int = RAM_RESERVE, storage_ok: bool = True) -> Plan:
    """Assign every layer a tier. vram_free/ram_available None mean unlimited (the CPU backend).

    vram_budget caps the device memory the engine may use in all (e.g. 24 GiB emulates an RTX
    3090 on an H200); pinned_budget caps the pinned host RAM; max_vram_layers caps resident layers.
    """
    n = len(layer_bytes)
    if not 1 <= stream_depth <= 16:
        raise PlanError("out of range 1..16", setting="stream_depth", value=stream_depth)
    if max_vram_layers is not None and not 0 <= max_vram_layers:
        raise PlanError("is negative", setting="max_vram_layers", value=max_vram_layers)
    reasons = []
    limits = [x for x in (vram_free, vram_budget) if x is not None]
    vram_limit = min(limits) if limits else math.inf
    if vram_budget is not None:
        reasons.append(f"VRAM budget {fmt_bytes(vram_budget)}"
                       + (f" (free: {fmt_bytes(vram_free)})" if vram_free is not None else ""))
    rlimits = [x for x in ((None if ram_available is None else max(0, ram_available - ram_reserve)), pinned_budget)
               if x is not None]
    ram_limit = min(rlimits) if rlimits else math.inf
    if pinned_budget is not None:
        reasons.append(f"pinned RAM budget {fmt_bytes(pinned_budget)}")
    base = fixed_bytes + kv_bytes + workspace_bytes
    if base > vram_limit:
        raise PlanError(f"VRAM budget {fmt_bytes(vram_limit)} cannot hold the fixed weights "
                        f"({fmt_bytes(fixed_bytes)}), KV cache ({fmt_bytes(kv_bytes)}) and workspace "
                        f"({fmt_bytes(workspace_bytes)}) = {fmt_bytes(base)}",
                        fix=[("lower", SHRINK_KV), ("raise", ("vram_budget",))])
    cap = n if max_vram_layers is None else min(n, max_vram_layers)
    if max_vram_layers is not None and max_vram_layers < n:
        reasons.append(f"at most {max_vram_layers} VRAM layers")
    if cap == n and base + sum(layer_bytes) <= vram_limit:
        return Plan((VRAM,) * n, tuple(layer_bytes), 0, 0, fixed_bytes, kv_bytes, workspace_bytes,
                    _int(vram_limit), _int(ram_limit), tuple(reasons))

    # Something streams: set the slots aside first (the largest layer that may stream: any).
    depth = stream_depth
    slot = max(layer_bytes)
    avail = vram_limit - base - depth * slot
    if avail < 0:
        raise PlanError(f"VRAM budget {fmt_bytes(vram_limit)} cannot hold even the {depth} streaming slots "
                        f"of {fmt_bytes(slot)} each on top of {fmt_bytes(base)} (fixed weights, KV cache, "
                        f"workspace): need at least {fmt_bytes(base + depth * slot)}",
                        fix=[("raise", ("vram_budget",)), ("lower", ("stream_depth", *SHRINK_KV))])
    tiers = [PINNED] * n
    used = 0
    resident = 0
    for i, b in enumerate(layer_bytes):  # resident in order: the first layers run while the stream fills
        if resident >= cap or used + b > avail:
            break
        tiers[i] = VRAM
        used += b
        resident += 1
    streamed = [i for i in range(n) if tiers[i] != VRAM]
    if len(streamed) <= depth and streamed and max_vram_layers is None:
        reasons.append(f"{len(streamed)} streamed layers share {depth} slots")

    # Pinned RAM while it lasts; the rest from storage (which then needs staging buffers).
    total_streamed = sum(layer_bytes[i] for i in streamed)
    if total_streamed <= ram_limit:
        return Plan(tuple(tiers), tuple(layer_bytes), depth, slot, fixed_bytes, kv_bytes, workspace_bytes,
                    _int(vram_limit), _int(ram_limit), tuple(reasons))
    if not storage_ok:
        raise PlanError(f"{fmt_bytes(total_streamed)} of streamed layers do not fit the pinned RAM limit "
                        f"{fmt_bytes(ram_limit)} and no storage source is allowed", fix=[("raise", ("pinned_budget",))])
    staging = depth * slot
    if staging > ram_limit:
        raise PlanError(f"pinned RAM limit {fmt_bytes(ram_limit)} cannot hold even the {depth} storage staging "
                        f"buffers of {fmt_bytes(slot)} each", fix=[("raise", ("pinned_budget",)),
                                                                   ("lower", ("stream_depth",))])
    room = ram_limit - staging
    for i in streamed:
        if layer_bytes[i] <= room:
            room -= layer_bytes[i]
        else:
            tiers[i] = STORAGE
            room = -1  # keep the storage layers a contiguous tail: reads stay sequential
    reasons.append(f"{sum(t == STORAGE for t in tiers)} layers do not fit pinned RAM: read from storage each step")
    return Plan(tuple(tiers), tuple(layer_bytes), depth, slot, fixed_bytes, kv_bytes, workspace_bytes,
                _int(vram_limit), _int(ram_limit), tuple(reasons))


def _int(x: float) -> int:
    return -1 if x == math.inf else int(x)
