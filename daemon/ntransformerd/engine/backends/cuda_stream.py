"""Streamed weights for the CUDA backend: resident layers, pinned layers, storage layers.

Built on the CUDA backend's public pieces (CudaTensor, host_planes, upload, the launchers):
every layer has a device layout (norms as float32, q/k/v and gate/up stacked by type as
CudaWeights stacks them, each plane 256-byte aligned) and one contiguous image of it. Resident
layers keep theirs in VRAM; pinned layers keep it in page-locked host memory and are copied
whole into one of `depth` device slots (one cudaMemcpyAsync on a copy stream); storage layers
are read by reader threads (O_DIRECT) into staging, laid out into a pinned buffer and copied the
same way. CUDA events order the copy stream after the slot's release and the compute stream
after the copy (tiers/pipeline.py), so the host never waits per layer in steady state.

acquire(i) answers CudaTensor views over the slot, exactly the fields CudaWeights hands out.

The captured decode step (backends/cuda_decode.py) takes its layers through decode_feed():
with pinned layers only, a GraphFeed puts the copies into the step's CUDA graph (one replay
per step copies the streamed layers and runs every kernel, no Python per layer), sharing the
slots with the LayerStream that prefill (model.forward) uses; with storage layers, whose reads
are host work per layer, the step runs eagerly through the LayerStream (LayerStreamFeed).
"""

from __future__ import annotations

import concurrent.futures
import types

import numpy as np

from ntransformerd.engine.backends import cuda as K
from ntransformerd.engine.backends.cuda import CudaTensor, cp, host_planes
from ntransformerd.engine.gguf_file import GGUFModel
from ntransformerd.engine.quants import dequantize
from ntransformerd.engine.tiers.pipeline import Device, LayerStream
from ntransformerd.engine.tiers.planner import PINNED, STORAGE, VRAM, Plan
from ntransformerd.engine.tiers.sources import HostMemory, Source, plan_reads

ALIGN = 256
STACKS = (("qkv", ("attn_q", "attn_k", "attn_v")), ("gate_up", ("ffn_gate", "ffn_up")))


def _up(x: int) -> int:
    return (x + ALIGN - 1) // ALIGN * ALIGN


class LayerLayout:
    """Where each plane of layer i's tensors sits in its device image (offsets in bytes)."""

    def __init__(self, model: GGUFModel, i: int):
        self.i = i
        self.t = t = model.layer_tensors(i)
        off = 0
        self.norms = {}
        for n in ("attn_norm", "ffn_norm"):
            self.norms[n] = (off, t[n].shape[0])
            off = _up(off + 4 * t[n].shape[0])
        self.groups = []  # (stack or name, qtype, k, [(name, rows)], [(offset, cols)])
        for stack, names in STACKS + (("attn_output", ("attn_output",)), ("ffn_down", ("ffn_down",))):
            groups = []
            for n in names:  # consecutive tensors of one type share a stacked tensor (as CudaWeights)
                if groups and groups[-1][1] == t[n].qtype:
                    groups[-1][3].append((n, t[n].shape[0]))
                else:
                    groups.append([stack, t[n].qtype, t[n].shape[1], [(n, t[n].shape[0])], []])
            for g in groups:
                rows = sum(r for _, r in g[3])
                info = t[g[3][0][0]]
                probe = host_planes(g[1], np.zeros((1, info.row_bytes), np.uint8), (1, g[2]))
                for p in probe:
                    g[4].append((off, p.shape[1]))
                    off = _up(off + rows * p.shape[1])
            self.groups += groups
        self.nbytes = off

    def pack(self, raw_of, dest: np.ndarray) -> None:
        """Lay the layer's GGUF bytes (raw_of(TensorInfo) → uint8) out into dest (host)."""
        for n, (off, d) in self.norms.items():
            dest[off:off + 4 * d].view(np.float32)[:] = dequantize(raw_of(self.t[n]), self.t[n].qtype, (d,))
        for _, qtype, k, members, planes in self.groups:
            rows_total = sum(r for _, r in members)
            r0 = 0
            for n, rows in members:
                ps = host_planes(qtype, raw_of(self.t[n]), (rows, k))
                for (off, cols), p in zip(planes, ps):
                    region = dest[off:off + rows_total * cols].reshape(rows_total, cols)
                    region[r0:r0 + rows] = p
                r0 += rows

    def views(self, buf) -> types.SimpleNamespace:
        """CudaWeights' fields for this layer over a device buffer holding its image."""
        ns = types.SimpleNamespace()
        for n, (off, d) in self.norms.items():
            setattr(ns, n, buf[off:off + 4 * d].view(cp.float32))
        stacks: dict[str, list] = {"qkv": [], "gate_up": []}
        for stack, qtype, k, members, planes in self.groups:
            rows_total = sum(r for _, r in members)
            ct = CudaTensor(qtype, (rows_total, k),
                            tuple(buf[off:off + rows_total * cols].reshape(rows_total, cols) for off, cols in planes))
            if stack in stacks:
                stacks[stack].append(ct)
                r = 0
                for n, rows in members:
                    setattr(ns, n, ct.rows(r, r + rows))
                    r += rows
            else:
                setattr(ns, stack, ct)
        ns.qkv, ns.gate_up = stacks["qkv"], stacks["gate_up"]
        return ns


class PinnedHost(HostMemory):
    """Page-locked host buffers (cudaHostAlloc through CuPy's pinned pool), page-aligned."""

    name = "pinned"

    def __init__(self):
        self._keep = []

    def alloc(self, nbytes: int) -> np.ndarray:
        mem = cp.cuda.alloc_pinned_memory(nbytes + self.alignment)
        arr = np.frombuffer(mem, np.uint8, nbytes + self.alignment)
        off = (-arr.ctypes.data) % self.alignment
        self._keep.append(mem)
        return arr[off:off + nbytes]


class CudaDevice(Device):
    """Slots in VRAM; copies on a non-blocking copy stream; CUDA events for ordering."""

    name = "cuda"
    is_host = False
    alignment = ALIGN

    def __init__(self):
        self.copy_stream = cp.cuda.Stream(non_blocking=True)

    def alloc(self, nbytes: int):
        return K._device_alloc((nbytes,), np.uint8, "streaming slot")

    def copy(self, slot, src: np.ndarray, nbytes: int, after):
        if after is not None:
            self.copy_stream.wait_event(after)
        cp.cuda.runtime.memcpyAsync(slot.data.ptr, src.ctypes.data, nbytes, cp.cuda.runtime.memcpyHostToDevice,
                                    self.copy_stream.ptr)
        ev = cp.cuda.Event(block=False, disable_timing=True)
        ev.record(self.copy_stream)
        return ev

    def compute_wait(self, event) -> None:
        if event is not None:
            cp.cuda.get_current_stream().wait_event(event)

    def record(self):
        ev = cp.cuda.Event(block=False, disable_timing=True)
        ev.record(cp.cuda.get_current_stream())
        return ev

    def host_wait(self, event) -> None:
        if event is not None:
            event.synchronize()

    def poison(self, slot) -> None:
        slot.fill(0xFF)  # on the compute stream, after the layer's kernels, before its release event


class StreamedCudaWeights:
    """CudaWeights' interface (embed_rows, output, output_norm, acquire/release) with the plan's
    tiers behind it."""

    streamed = True

    def __init__(self, model: GGUFModel, plan: Plan, *, source: Source | None = None, poison: bool = False,
                 threads: int = 8):
        self.model, self.plan, cfg = model, plan, model.config
        self.token_embd = K.upload([model.tensor("token_embd.weight")], "token_embd")
        self.output = self.token_embd if cfg.tied_output else K.upload([model.tensor("output.weight")], "output")
        self.output_norm = cp.asarray(model.dequantize("output_norm.weight"))
        self.layouts = {i: LayerLayout(model, i) for i in range(cfg.n_layers)}
        self.host = PinnedHost()
        pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="ntx-pack")
        raw = lambda t: np.asarray(t.data).view(np.uint8).reshape(-1)  # noqa: E731 (page cache)

        # Resident layers: packed into pinned staging by the pool, then copied to their buffers.
        self._layers: dict[int, types.SimpleNamespace] = {}
        self._resident_bufs = []
        vram = plan.layers(VRAM)
        if vram:
            big = max(self.layouts[i].nbytes for i in vram)
            stage = [self.host.alloc(big) for _ in range(2)]
            stream = cp.cuda.Stream(non_blocking=True)
            evs = [None, None]
            for j, i in enumerate(vram):
                if evs[j % 2] is not None:
                    evs[j % 2].synchronize()
                buf = K._device_alloc((self.layouts[i].nbytes,), np.uint8, f"resident layer {i}")
                self.layouts[i].pack(raw, stage[j % 2])
                cp.cuda.runtime.memcpyAsync(buf.data.ptr, stage[j % 2].ctypes.data, self.layouts[i].nbytes,
                                            cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
                evs[j % 2] = cp.cuda.Event(disable_timing=True)
                evs[j % 2].record(stream)
                self._resident_bufs.append(buf)
                self._layers[i] = self.layouts[i].views(buf)
                model.layer_loaded(i)
            stream.synchronize()

        # Pinned layers: one page-locked image each, packed in parallel.
        self._pinned: dict[int, np.ndarray] = {}

        def pin(i):
            buf = self.host.alloc(self.layouts[i].nbytes)
            self.layouts[i].pack(raw, buf)
            return i, buf

        for i, buf in pool.map(pin, plan.layers(PINNED)):
            self._pinned[i] = buf
            model.layer_loaded(i)
        pool.shutdown()

        # Storage layers: reader threads read the span, then pack into a pinned staging entry.
        self.source = source
        streamed = plan.streamed
        storage = plan.layers(STORAGE)
        if storage and source is None:
            raise ValueError("the plan reads layers from storage: give a storage source")
        slot_bytes = max((self.layouts[i].nbytes for i in streamed), default=0)
        if storage:
            align = max(source.alignment, 4096)
            self._reads = {i: plan_reads(model.layer_tensors(i).values(), align) for i in storage}
            for i in storage:  # read every step: ready once its reads are planned
                model.layer_loaded(i)
            raw_bytes = max(r.nbytes for r in self._reads.values())
            plain = HostMemory()
            self._raw = [plain.alloc(raw_bytes) for _ in range(plan.depth)]
            self._staging = [self.host.alloc(slot_bytes) for _ in range(plan.depth)]
            for b in self._raw:
                source.register(b)
        self.device = CudaDevice()
        self._views: dict[tuple[int, int], types.SimpleNamespace] = {}
        self.stream = (LayerStream(streamed, depth=plan.depth, slot_bytes=slot_bytes,
                                   nbytes={i: self.layouts[i].nbytes for i in streamed}, device=self.device,
                                   host_layer=self._pinned.get, read=self._read, poison=poison)
                       if streamed else None)

    def _read(self, i: int, entry: int) -> np.ndarray:
        r, raw = self._reads[i], self._raw[entry]
        r.fill(self.source, raw)
        self.layouts[i].pack(lambda t: r.raw(raw, t), self._staging[entry])
        return self._staging[entry]

    def embed_rows(self, tokens):
        return K.dequantize_rows(self.token_embd, cp.asarray(tokens, dtype=cp.int32))

    def views(self, i: int, slot) -> types.SimpleNamespace:
        """Layer i's fields over a streaming slot (made once per slot and layer)."""
        key = (id(slot), i)
        ns = self._views.get(key)
        if ns is None:
            ns = self._views[key] = self.layouts[i].views(slot)
        return ns

    def acquire(self, i: int) -> types.SimpleNamespace:
        ly = self._layers.get(i)
        if ly is not None:
            return ly
        return self.views(i, self.stream.acquire(i))

    def release(self, i: int) -> None:
        if i not in self._layers:
            self.stream.release(i)

    def describe(self, i: int) -> types.SimpleNamespace:
        """Layer i's fields, for their shapes and types (a streamed layer's over slot 0: no data)."""
        ly = self._layers.get(i)
        return ly if ly is not None else self.views(i, self.stream.slots[0])

    def decode_feed(self):
        """How the captured decode step gets each layer (module docstring)."""
        if self.stream is None:
            return K.ResidentFeed(self)
        if self.plan.layers(STORAGE):
            return LayerStreamFeed(self)
        return GraphFeed(self)

    @property
    def nbytes(self) -> int:
        n = self.token_embd.nbytes + (0 if self.output is self.token_embd else self.output.nbytes)
        return n + sum(b.nbytes for b in self._resident_bufs) + sum(s.nbytes for s in (self.stream.slots if self.stream else []))

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
        if self.source is not None:
            self.source.close()


class GraphFeed:
    """The streamed layers' copies inside the captured decode step (pinned layers only).

    Position k of a step is streamed layer order[k] (ascending, as the step visits layers), in
    slot k % depth. begin forks the feed's copy stream off the step's stream and queues the
    first `depth` copies, so they overlap the resident layers before them; acquire makes the
    step wait for its layer's copy; release lets the copy of position k + depth into the same
    slot go. The step waits on every copy, so the copy stream has rejoined it when the capture
    ends, and one replay copies and computes the whole step.

    The slots are the LayerStream's, which prefill (model.forward) keeps using: before_launch
    orders the step after what the LayerStream has in flight in them, after_launch makes it copy
    into them again only after the step. One compute thread, as the LayerStream.
    """

    capturable = True

    def __init__(self, weights: StreamedCudaWeights):
        self.w, self.ring = weights, weights.stream
        self.order, self.depth = self.ring.order, self.ring.depth
        if self.order != sorted(self.order):
            raise ValueError(f"streamed layers {self.order} are not in the order the decode step visits them")
        self._pos = {layer: k for k, layer in enumerate(self.order)}
        self.copy_stream = cp.cuda.Stream(non_blocking=True)
        event = lambda: cp.cuda.Event(block=False, disable_timing=True)  # noqa: E731
        self._fork = event()
        self._copied = [event() for _ in self.order]  # position → its copy is in the slot
        self._freed = [event() for _ in self.order]  # position → its slot's kernels are done
        self._stream = None  # the step's stream (begin)

    def _copy(self, k: int) -> None:
        layer = self.order[k]
        cp.cuda.runtime.memcpyAsync(self.ring.slots[k % self.depth].data.ptr, self.w._pinned[layer].ctypes.data,
                                    self.w.layouts[layer].nbytes, cp.cuda.runtime.memcpyHostToDevice,
                                    self.copy_stream.ptr)
        self._copied[k].record(self.copy_stream)

    def begin(self, stream) -> None:
        self._stream = stream
        self._fork.record(stream)
        self.copy_stream.wait_event(self._fork)
        for k in range(min(self.depth, len(self.order))):
            self._copy(k)

    def acquire(self, i: int) -> types.SimpleNamespace:
        k = self._pos.get(i)
        if k is None:
            return self.w._layers[i]
        self._stream.wait_event(self._copied[k])
        return self.w.views(i, self.ring.slots[k % self.depth])

    def release(self, i: int) -> None:
        k = self._pos.get(i)
        if k is None:
            return
        if self.ring.poison:
            with self._stream:
                self.ring.slots[k % self.depth].fill(0xFF)
        if k + self.depth < len(self.order):
            self._freed[k].record(self._stream)
            self.copy_stream.wait_event(self._freed[k])
            self._copy(k + self.depth)

    def before_launch(self, stream) -> None:
        for ev in self.ring.pending_events():
            stream.wait_event(ev)

    def after_launch(self, stream) -> None:
        done = cp.cuda.Event(block=False, disable_timing=True)
        done.record(stream)
        self.ring.invalidate(done)


class LayerStreamFeed(K.DecodeFeed):
    """The decode step's feed when layers come from storage: the LayerStream itself (reader
    threads, a host decision per layer) through the weights' acquire/release, so the step runs
    eagerly, not as a graph; still one launch per kernel of the step instead of model.forward's
    Python per op."""

    capturable = False


def plan(model: GGUFModel, config) -> Plan:
    """The plan on this GPU: free VRAM (memGetInfo), MemAvailable, and the config's overrides."""
    from ntransformerd.engine.tiers import model_plan
    free = cp.cuda.runtime.memGetInfo()[0]
    sizes = [LayerLayout(model, i).nbytes for i in range(model.config.n_layers)]
    return model_plan(model, config, backend="cuda", vram_free=free, layer_bytes=sizes)


def load(model: GGUFModel, plan: Plan, *, source: Source | None = None, poison: bool = False):
    freq = model.dequantize("rope_freqs.weight") if "rope_freqs.weight" in model.tensors else None
    return K.CudaOps(model.config, freq), StreamedCudaWeights(model, plan, source=source, poison=poison)
