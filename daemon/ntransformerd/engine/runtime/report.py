"""What an engine says about itself for Status: one declared record (Engine.report()).

The daemon's servicer maps an EngineReport into the proto (server/servicer.py) and asks the
engine nothing else about its insides: where its layers are, its KV pool, where the layers ran
at each step shape, what it keeps in page-locked RAM, the layers it skips.

Thread rule: any thread may ask for a report; its counters are those the engine's thread wrote
last (a moment's figures, not a transaction's).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TierShare:
    """The layers one tier holds: vram, pinned, storage (on a host backend "resident" for vram),
    or, without a tier plan, every layer in vram or ram."""

    name: str
    layers: int
    bytes: int


@dataclasses.dataclass(frozen=True)
class KVReport:
    """The KV pool of the engine's (first) device and what its plan weighed."""

    dtype: str
    bytes_per_token: int  # keys and values of one position, every layer
    max_ctx: int  # positions one sequence may reach
    resident_layers: int  # layers the plan keeps resident with this pool
    resident_by_dtype: dict[str, int]  # the same, had the pool (in blocks) held each KV type
    block_size: int
    blocks: int
    used_blocks: int
    shared_blocks: int
    spill_limit: int  # bytes of host RAM for closed slots' blocks
    spilled_bytes: int
    spilled_blocks_total: int
    restored_blocks_total: int


@dataclasses.dataclass(frozen=True)
class PlacementReport:
    """Where the layers ran at one step shape (steps of at most `rows` token rows) of a plan with
    the host computing beside the GPU."""

    rows: int
    host_layers: tuple[int, ...]
    link_layers: int  # streamed over the link
    predicted_seconds: float
    measured_seconds: float  # mean of the steps of this shape since the load (0: none yet)
    steps: int


@dataclasses.dataclass(frozen=True)
class EngineReport:
    backend: str  # cpu | cuda
    tiers: tuple[TierShare, ...]
    plan: str  # the tier plan explained
    kv: KVReport
    placements: tuple[PlacementReport, ...]  # empty but for a plan with the host beside the GPU
    pinned_bytes: int  # layers kept in page-locked host RAM (0 on a host backend)
    skip_layers: tuple[int, ...]
    deterministic: bool  # EngineConfig.deterministic: a row's arithmetic independent of the rows sharing its step


__all__ = ["EngineReport", "KVReport", "PlacementReport", "TierShare"]
