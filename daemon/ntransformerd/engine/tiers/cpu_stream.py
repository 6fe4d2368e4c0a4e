"""Streamed weights for the CPU backend: the whole pipeline (planner tiers, pinned copies,
storage reads by reader threads `depth` ahead, the slot ring, release and reuse) on plain host
memory, so CI runs the same logic the GPU runs. "VRAM" layers are CpuWeights' resident float32
layers; streamed layers land in a slot as their file bytes and are dequantized from there.
"""

from __future__ import annotations

import types

import numpy as np
from gguf import GGMLQuantizationType as Q

from ntransformerd.engine.backends.cpu import CpuWeights, prepare_layer
from ntransformerd.engine.gguf_file import LAYER_TENSORS, GGUFModel
from ntransformerd.engine.quants import dequantize
from ntransformerd.engine.tiers.pipeline import Device, LayerStream
from ntransformerd.engine.tiers.planner import PINNED, STORAGE, VRAM, Plan
from ntransformerd.engine.tiers.sources import HostMemory, MmapSource, Source, plan_reads


def layer_reads(model: GGUFModel, i: int, alignment: int):
    return plan_reads(model.layer_tensors(i).values(), alignment)


class StreamedCpuWeights(CpuWeights):
    """CpuWeights whose non-resident layers stream: pinned tier from host buffers, storage tier
    read by `source` every step. acquire(i)/release(i) as every placement answers them."""

    streamed = True

    def __init__(self, model: GGUFModel, plan: Plan, *, source: Source | None = None, poison: bool = False,
                 readers: int | None = None, host: HostMemory | None = None, device: Device | None = None,
                 shared: CpuWeights | None = None):
        if shared is None:
            super().__init__(model, resident=set(plan.layers(VRAM)))
        else:  # reuse another CpuWeights' embedding, output and resident layers (tests)
            self.model, self.resident = model, set(plan.layers(VRAM))
            self.token_embd, self.output, self.output_norm = shared.token_embd, shared.output, shared.output_norm
            self._layers = {i: shared.acquire(i) for i in self.resident}
            for i in self.resident:
                model.layer_loaded(i)
        self.plan = plan
        host = host or HostMemory()
        storage = plan.layers(STORAGE)
        if storage and source is None:
            raise ValueError("the plan reads layers from storage: give a storage source")
        self.source = source
        align = max(source.alignment if source else 1, host.alignment)
        streamed = plan.streamed
        self._reads = {i: layer_reads(model, i, align) for i in streamed}
        slot_bytes = max((r.nbytes for r in self._reads.values()), default=0)
        self._pinned: dict[int, np.ndarray] = {}
        with MmapSource(model.path) as mm:  # the pinned tier is filled once, through the page cache
            for i in plan.layers(PINNED):
                buf = host.alloc(self._reads[i].nbytes)
                self._reads[i].fill(mm, buf)
                self._pinned[i] = buf
                model.layer_loaded(i)
        for i in storage:  # read every step: ready once its reads are planned
            model.layer_loaded(i)
        self._staging = [host.alloc(slot_bytes) for _ in range(plan.depth)] if storage else []
        for buf in self._staging:
            source.register(buf)
        self.stream = (LayerStream(streamed, depth=plan.depth, slot_bytes=slot_bytes,
                                   nbytes={i: r.nbytes for i, r in self._reads.items()},
                                   device=device or Device(), host_layer=self._pinned.get, read=self._read,
                                   readers=readers, poison=poison) if streamed else None)

    def _read(self, i: int, entry: int) -> np.ndarray:
        buf = self._staging[entry]
        self._reads[i].fill(self.source, buf)
        return buf

    def _views(self, i: int, slot: np.ndarray) -> types.SimpleNamespace:
        t, r = self.model.layer_tensors(i), self._reads[i]
        out = {}
        for n in LAYER_TENSORS:
            raw = r.raw(slot, t[n])
            if t[n].qtype == Q.F32 and len(t[n].shape) == 1:  # zero-copy: a view of the slot, valid until release
                out[n] = raw.view(np.float32).reshape(t[n].shape)
            else:
                out[n] = dequantize(raw, t[n].qtype, t[n].shape)
        return prepare_layer(out)  # the same layout resident layers have

    def prefetch(self, layers) -> None:
        if self.stream is not None:
            self.stream.begin(layers)

    def acquire(self, i: int) -> types.SimpleNamespace:
        layer = self._layers.get(i)
        if layer is not None:
            return layer
        return self._views(i, self.stream.acquire(i))

    def release(self, i: int) -> None:
        if i not in self._layers:
            self.stream.release(i)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
        if self.source is not None:
            self.source.close()
