"""The stream on a device that is host memory: the whole pipeline of a plan's streamed layers
(planner tiers, pinned copies, storage reads by reader threads `depth` ahead, the slot ring,
release and reuse) on plain host memory, so CI runs the same logic the GPU runs.

A slot holds one layer's file bytes as `reads[i]` lays them out (`LayerReads.raw(slot, tensor)`
gives a tensor's bytes); the backend that computes on the host turns them into its own layout
(backends/cpu.py: StreamedCpuWeights).
"""

from __future__ import annotations

import numpy as np

from ntransformerd.engine.gguf_file import GGUFModel
from ntransformerd.engine.tiers.layer_stream import Device, LayerStream
from ntransformerd.engine.tiers.planner import PINNED, STORAGE, Plan
from ntransformerd.engine.tiers.sources import HostMemory, LayerReads, MmapSource, Source, plan_reads


def layer_reads(model: GGUFModel, i: int, alignment: int) -> LayerReads:
    return plan_reads(model.layer_tensors(i).values(), alignment)


class HostStream:
    """The plan's streamed layers through `depth` host slots: the pinned tier from host buffers
    filled once (through the page cache), the storage tier read by `source` every pass. One
    compute thread calls prefetch / acquire / release, as model.forward drives them."""

    def __init__(self, model: GGUFModel, plan: Plan, *, source: Source | None = None, poison: bool = False,
                 readers: int | None = None, host: HostMemory | None = None, device: Device | None = None,
                 link_cap: float | None = None):
        host = host or HostMemory()
        storage = plan.layers(STORAGE)
        if storage and source is None:
            raise ValueError("the plan reads layers from storage: give a storage source")
        self.source = source
        align = max(source.alignment if source else 1, host.alignment)
        streamed = plan.streamed
        self.reads = {i: layer_reads(model, i, align) for i in streamed}
        slot_bytes = max((r.nbytes for r in self.reads.values()), default=0)
        self.pinned: dict[int, np.ndarray] = {}
        with MmapSource(model.path) as mm:  # the pinned tier is filled once, through the page cache
            for i in plan.layers(PINNED):
                buf = host.alloc(self.reads[i].nbytes)
                self.reads[i].fill(mm, buf)
                self.pinned[i] = buf
                model.layer_loaded(i)
        for i in storage:  # read every step: ready once its reads are planned
            model.layer_loaded(i)
        self._staging = [host.alloc(slot_bytes) for _ in range(plan.depth)] if storage else []
        for buf in self._staging:
            source.register(buf)
        self.stream = (LayerStream(streamed, depth=plan.depth, slot_bytes=slot_bytes,
                                   nbytes={i: r.nbytes for i, r in self.reads.items()},
                                   device=device or Device(), host_layer=self.pinned.get, read=self._read,
                                   readers=readers, poison=poison, link_cap=link_cap) if streamed else None)

    def _read(self, i: int, entry: int) -> np.ndarray:
        buf = self._staging[entry]
        self.reads[i].fill(self.source, buf)
        return buf

    def prefetch(self, layers) -> None:
        if self.stream is not None:
            self.stream.begin(layers)

    def acquire(self, i: int) -> np.ndarray:
        """The slot holding layer i's bytes (valid until release)."""
        return self.stream.acquire(i)

    def release(self, i: int) -> None:
        self.stream.release(i)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
        if self.source is not None:
            self.source.close()
