"""Weights on the GPU: one object per plan, whatever the plan puts where.

Every layer has one device layout (LayerLayout: norms as float32, q/k/v and gate/up stacked by
type, each plane 256-byte aligned) and one contiguous image of it. The plan says where each
image lives: VRAM-resident layers keep theirs on the device; pinned layers keep it in
page-locked host memory and are copied whole into one of `depth` device slots (one
cudaMemcpyAsync on a copy stream); storage layers are read by reader threads (O_DIRECT or the
NVMe queues) into staging, laid out into a pinned buffer and copied the same way. "All in
VRAM" is one plan among others.

model.forward asks `prefetch(layers)` once per pass, then `acquire(i)` / `release(i)` around
each layer; they record and wait on CUDA events, so the host never waits per layer in steady
state. While the pass is being captured into a CUDA graph (graphs.py), the same calls put the
streamed layers' copies into the graph (pinned layers only: storage reads are host work per
layer, so a plan with storage layers runs its passes eagerly). acquire(i) answers GGUF-named
fields: attn_norm, ffn_norm, attn_q/k/v, ffn_gate/up (row views), attn_output, ffn_down, and the
stacks model.block multiplies at once, attn_qkv and ffn_gate_up.
"""

from __future__ import annotations

import concurrent.futures
import types

import numpy as np
from gguf import GGMLQuantizationType as Q

from ntransformerd.engine.backends.cuda.nvrtc import cp, device_alloc
from ntransformerd.engine.gguf_file import GGUFModel, TensorInfo
from ntransformerd.engine.quants import BLOCK_DTYPES, dequantize
from ntransformerd.engine.tiers.layer_stream import Device, LayerStream
from ntransformerd.engine.tiers.planner import PINNED, STORAGE, VRAM, Plan
from ntransformerd.engine.tiers.sources import HostMemory, Source, plan_reads

ALIGN = 256
STACKS = (("attn_qkv", ("attn_q", "attn_k", "attn_v")), ("ffn_gate_up", ("ffn_gate", "ffn_up")))


class CudaTensor:
    """A 2-D weight (N, K) on the device as its planes (see kernels/quant.cu for the layouts)."""

    def __init__(self, qtype: Q, shape: tuple[int, int], planes: tuple):
        self.qtype, self.shape, self.planes = qtype, shape, planes

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.planes)

    def rows(self, a: int, b: int) -> "CudaTensor":
        """Rows a..b as a view (planes are row-major, so a row slice stays contiguous)."""
        return CudaTensor(self.qtype, (b - a, self.shape[1]), tuple(p[a:b] for p in self.planes))

    def ptrs(self) -> tuple:
        p = list(self.planes) + [self.planes[0]] * (4 - len(self.planes))
        return tuple(p)


def host_planes(qtype: Q, raw: np.ndarray, shape: tuple[int, int]) -> list[np.ndarray]:
    """The device layout of a tensor's GGUF bytes (N, row_bytes), as host arrays (N, ·) uint8."""
    n, k = shape
    raw = np.ascontiguousarray(raw).reshape(n, -1).view(np.uint8)
    if qtype == Q.Q8_0:
        b = raw.view(BLOCK_DTYPES[Q.Q8_0]).reshape(n, k // 32)
        return [np.ascontiguousarray(b["qs"]).view(np.uint8).reshape(n, k),
                np.ascontiguousarray(b["d"]).view(np.uint8).reshape(n, k // 16)]
    if qtype == Q.Q6_K:
        b = raw.view(BLOCK_DTYPES[Q.Q6_K]).reshape(n, k // 256)
        return [np.ascontiguousarray(b["ql"]).reshape(n, k // 2),
                np.ascontiguousarray(b["qh"]).reshape(n, k // 4),
                np.ascontiguousarray(b["scales"]).view(np.uint8).reshape(n, k // 16),
                np.ascontiguousarray(b["d"]).view(np.uint8).reshape(n, k // 128)]
    return [raw]




class Stacked:
    """Matrices of one layer multiplied as one (attn_q|attn_k|attn_v, ffn_gate|ffn_up): the
    consecutive members of one quant type share a piece, stacked by rows at load; members
    says where each member's rows sit: (piece, first row, rows)."""

    def __init__(self, pieces: tuple[CudaTensor, ...], members: tuple[tuple[int, int, int], ...]):
        self.pieces, self.members = pieces, members

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


def upload(infos: list[TensorInfo], what: str) -> CudaTensor:
    """Whole tensors of one type stacked by rows, as one resident CudaTensor (token_embd, output)."""
    qtype, k = infos[0].qtype, infos[0].shape[-1]
    assert all(t.qtype == qtype and t.shape[-1] == k for t in infos)
    n = sum(t.shape[0] for t in infos)
    parts = [host_planes(qtype, t.data, (t.shape[0], k)) for t in infos]
    planes = []
    for j in range(len(parts[0])):
        dev = device_alloc((n, parts[0][j].shape[1]), np.uint8, what)
        r = 0
        for p in parts:
            dev[r:r + len(p[j])].set(p[j])
            r += len(p[j])
        planes.append(dev)
    return CudaTensor(qtype, (n, k), tuple(planes))


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
            for n in names:  # consecutive tensors of one type share a piece of the stack
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
        """The layer's GGUF-named fields and stacks over a device buffer holding its image."""
        ns = types.SimpleNamespace()
        for n, (off, d) in self.norms.items():
            setattr(ns, n, buf[off:off + 4 * d].view(cp.float32))
        stacks: dict[str, tuple[list, list]] = {name: ([], []) for name, _ in STACKS}
        for stack, qtype, k, members, planes in self.groups:
            rows_total = sum(r for _, r in members)
            ct = CudaTensor(qtype, (rows_total, k),
                            tuple(buf[off:off + rows_total * cols].reshape(rows_total, cols) for off, cols in planes))
            if stack in stacks:
                pieces, where = stacks[stack]
                r = 0
                for n, rows in members:
                    setattr(ns, n, ct.rows(r, r + rows))
                    where.append((len(pieces), r, rows))
                    r += rows
                pieces.append(ct)
            else:
                setattr(ns, stack, ct)
        for name, (pieces, where) in stacks.items():
            setattr(ns, name, Stacked(tuple(pieces), tuple(where)))
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
        return device_alloc((nbytes,), np.uint8, "streaming slot")

    def copy(self, slot, src: np.ndarray, nbytes: int, after, *, hold: float | None = None,
             timed: list | None = None):
        if after is not None:
            self.copy_stream.wait_event(after)
        start = self._mark() if timed is not None else None
        if hold is not None:  # a slower link emulated: host functions in copy order around the copy
            self.copy_stream.launch_host_func(lambda _: self.pace_start(), None)
        cp.cuda.runtime.memcpyAsync(slot.data.ptr, src.ctypes.data, nbytes, cp.cuda.runtime.memcpyHostToDevice,
                                    self.copy_stream.ptr)
        if hold is not None:
            self.copy_stream.launch_host_func(lambda seconds: self.pace_hold(seconds), hold)
        if timed is not None:
            timed.append((start, self._mark(), nbytes))
        return self.record(self.copy_stream)

    def compute_wait(self, event) -> None:
        if event is not None:
            cp.cuda.get_current_stream().wait_event(event)

    def _mark(self):
        ev = cp.cuda.Event(block=False)  # timing on: the copy's own span
        ev.record(self.copy_stream)
        return ev

    def elapsed(self, start, end) -> float:
        end.synchronize()
        return cp.cuda.get_elapsed_time(start, end) / 1e3

    def record(self, stream=None):
        ev = cp.cuda.Event(block=False, disable_timing=True)
        ev.record(stream or cp.cuda.get_current_stream())
        return ev

    def host_wait(self, event) -> None:
        if event is not None:
            event.synchronize()

    def poison(self, slot) -> None:
        slot.fill(0xFF)  # on the compute stream, after the layer's kernels, before its release event


def layer_nbytes(model: GGUFModel, i: int) -> int:
    """The device image size of layer i (what the planner places)."""
    return LayerLayout(model, i).nbytes


def _capturing() -> bool:
    return cp.cuda.get_current_stream().is_capturing()


class CudaWeights:
    """The model's weights on the GPU under `plan`: embedding, output and its norm resident;
    each layer where the plan puts it (module docstring). One compute thread."""

    def __init__(self, model: GGUFModel, plan: Plan, *, source: Source | None = None, poison: bool = False,
                 threads: int = 8, link_cap: float | None = None):
        self.model, self.plan, cfg = model, plan, model.config
        self.token_embd = upload([model.tensor("token_embd.weight")], "token_embd")
        self.output = self.token_embd if cfg.tied_output else upload([model.tensor("output.weight")], "output")
        self.output_norm = cp.asarray(model.dequantize("output_norm.weight"))
        placed = [i for i in range(cfg.n_layers) if plan.tiers[i] in (VRAM, PINNED, STORAGE)]
        self.layouts = {i: LayerLayout(model, i) for i in placed}
        self.host = PinnedHost()
        raw = lambda t: np.asarray(t.data).view(np.uint8).reshape(-1)  # noqa: E731 (page cache)

        # Resident layers: packed into pinned staging, then copied to their own buffers.
        self._layers: dict[int, types.SimpleNamespace] = {}
        self._resident_bufs = []
        vram = plan.layers(VRAM)
        if vram:
            stage = [self.host.alloc(max(self.layouts[i].nbytes for i in vram)) for _ in range(2)]
            stream = cp.cuda.Stream(non_blocking=True)
            done = [None, None]
            for j, i in enumerate(vram):
                if done[j % 2] is not None:
                    done[j % 2].synchronize()  # the staging buffer's previous copy has left it
                buf = device_alloc((self.layouts[i].nbytes,), np.uint8, f"resident layer {i}")
                self.layouts[i].pack(raw, stage[j % 2])
                cp.cuda.runtime.memcpyAsync(buf.data.ptr, stage[j % 2].ctypes.data, self.layouts[i].nbytes,
                                            cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
                done[j % 2] = cp.cuda.Event(disable_timing=True)
                done[j % 2].record(stream)
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

        with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="ntx-pack") as pool:
            for i, buf in pool.map(pin, plan.layers(PINNED)):
                self._pinned[i] = buf
                model.layer_loaded(i)

        # Storage layers: reader threads read the span, then pack it into a pinned staging entry.
        self.source = source
        streamed = [i for i in plan.streamed if i in self.layouts]
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
                                   host_layer=self._pinned.get, read=self._read, poison=poison,
                                   link_cap=link_cap)
                       if streamed else None)
        # A pass may be captured into a CUDA graph unless a layer comes from storage (host reads)
        # or the copies are paced (link_cap: host functions on the copy stream, eager passes only).
        self.capturable = not storage and not (streamed and link_cap is not None)
        self._captured = _CapturedCopies(self) if streamed and self.capturable else None

    def _read(self, i: int, entry: int) -> np.ndarray:
        r, raw = self._reads[i], self._raw[entry]
        r.fill(self.source, raw)
        self.layouts[i].pack(lambda t: r.raw(raw, t), self._staging[entry])
        return self._staging[entry]

    def views(self, i: int, slot) -> types.SimpleNamespace:
        """Layer i's fields over a streaming slot (made once per slot and layer)."""
        key = (slot.data.ptr, i)
        ns = self._views.get(key)
        if ns is None:
            ns = self._views[key] = self.layouts[i].views(slot)
        return ns

    # ---- the interface model.forward drives ---------------------------------------------------

    def prefetch(self, layers) -> None:
        """A pass will acquire `layers` in this order: start the streamed ones' copies."""
        if self.stream is None:
            return
        if _capturing():
            self._captured.begin(layers)
        else:
            self.stream.begin(layers)

    def resident(self, i: int) -> bool:
        """Whether layer i stays in device memory (acquire neither waits nor copies)."""
        return i in self._layers

    def acquire(self, i: int) -> types.SimpleNamespace:
        ly = self._layers.get(i)
        if ly is not None:
            return ly
        if i not in self.layouts:
            raise ValueError(f"layer {i} is not loaded (the plan skips it)")
        slot = self._captured.acquire(i) if _capturing() else self.stream.acquire(i)
        return self.views(i, slot)

    def release(self, i: int) -> None:
        if i in self._layers:
            return
        if _capturing():
            self._captured.release(i)
        else:
            self.stream.release(i)

    def link_busy(self) -> tuple[float, int]:
        return self.stream.busy() if self.stream is not None else (0.0, 0)

    def settle(self, stream) -> None:
        """Order `stream` after every copy into the slots queued so far: a captured pass replayed
        on it writes the slots outside the LayerStream's bookkeeping (an eager pass that raised
        may have left copies in flight)."""
        if self.stream is not None:
            stream.wait_event(self.device.record(self.device.copy_stream))

    # ---- sizes and lifetime --------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Device bytes: embedding, output, resident layers and the streaming slots."""
        n = self.token_embd.nbytes + (0 if self.output is self.token_embd else self.output.nbytes)
        return n + sum(b.nbytes for b in self._resident_bufs) + sum(s.nbytes for s in (self.stream.slots if self.stream else []))

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
        if self.source is not None:
            self.source.close()


class _CapturedCopies:
    """The streamed layers' copies of a pass being captured (pinned layers only): position k of
    the pass is its k-th streamed layer, in slot k % depth. begin forks a copy stream off the
    capturing stream and queues the first `depth` copies, so they overlap the resident layers
    before them; acquire makes the pass wait for its layer's copy; release lets the copy of
    position k + depth into the same slot go. The pass waits on every copy, so the copy stream
    has rejoined it when the capture ends and one replay copies and computes the whole step.

    The slots are the LayerStream's: eager passes and replays never overlap, because every
    step returns its result to the host before the next one starts (Engine.step), and a replay
    first waits for the eager copy stream (CudaWeights.settle)."""

    def __init__(self, weights: CudaWeights):
        self.w, self.ring = weights, weights.stream
        self.copy_stream = cp.cuda.Stream(non_blocking=True)
        self.order: list[int] = []

    def _event(self):
        return cp.cuda.Event(block=False, disable_timing=True)

    def _copy(self, k: int) -> None:
        layer = self.order[k]
        cp.cuda.runtime.memcpyAsync(self.ring.slots[k % self.ring.depth].data.ptr, self.w._pinned[layer].ctypes.data,
                                    self.w.layouts[layer].nbytes, cp.cuda.runtime.memcpyHostToDevice,
                                    self.copy_stream.ptr)
        self._copied[k].record(self.copy_stream)

    def begin(self, layers) -> None:
        self.order = self.ring.streamed_of(layers)
        self._pos = {layer: k for k, layer in enumerate(self.order)}
        self._copied = [self._event() for _ in self.order]  # position → its copy is in the slot
        self._freed = [self._event() for _ in self.order]  # position → its slot's kernels are done
        self._stream = cp.cuda.get_current_stream()
        fork = self._event()
        fork.record(self._stream)
        self.copy_stream.wait_event(fork)
        for k in range(min(self.ring.depth, len(self.order))):
            self._copy(k)

    def acquire(self, i: int):
        k = self._pos[i]
        self._stream.wait_event(self._copied[k])
        return self.ring.slots[k % self.ring.depth]

    def release(self, i: int) -> None:
        k = self._pos[i]
        if self.ring.poison:
            self.ring.slots[k % self.ring.depth].fill(0xFF)
        if k + self.ring.depth < len(self.order):
            self._freed[k].record(self._stream)
            self.copy_stream.wait_event(self._freed[k])
            self._copy(k + self.ring.depth)
