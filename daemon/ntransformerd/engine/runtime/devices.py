"""What a device answers: the interfaces model.forward, the engine and the planner rely on.

model.forward calls an `Ops` (the op set), a `Weights` (the layers, handed out one at a time from
wherever they live) and a `KV` (each layer's keys and values); the engine makes them through a
`Backend`, one per kind of device (the host's CPU, a CUDA GPU). tiers/ (the planner, the streams,
the pipeline over devices) sees only these and never imports a backend; a backend receives what
it needs from the planner (a plan, a storage source) from the engine. Nothing inherits from these
protocols: they declare what is already answered (tests/engine/test_devices.py checks each
backend against them).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import numpy as np

from ntransformerd.engine.gguf_file import GGUFModel, LlamaConfig
from ntransformerd.engine.runtime.model import Batch, Segment
from ntransformerd.engine.generation.sampler import TopLogits

Array = Any  # a device array: numpy on the host, CuPy on a GPU


class Layer(Protocol):
    """One block's weights in the layout the backend's matmul takes, under GGUF's names; the
    stacks multiply as one (attn_q|attn_k|attn_v, ffn_gate|ffn_up)."""

    attn_norm: Array
    attn_qkv: Any
    attn_output: Any
    ffn_norm: Array
    ffn_gate_up: Any
    ffn_down: Any


class Weights(Protocol):
    """The model's weights on one device. A pass announces its layers once (prefetch: the
    streamed ones start coming, in that order), then acquires and releases each in turn; a
    layer is valid from acquire to release."""

    token_embd: Any
    output: Any
    output_norm: Array

    def prefetch(self, layers: Iterable[int]) -> None: ...

    def acquire(self, i: int) -> Layer: ...

    def release(self, i: int) -> None: ...

    def link_busy(self) -> tuple[float, int]:
        """(seconds its copies onto the device took, their bytes) since the last call; (0, 0)
        for weights that stream nothing."""
        ...


class KVLayer(Protocol):
    """One layer's keys and values, the device's arrays in the paged layout of engine/runtime/kv_cache.py
    (n_blocks, Hkv, BLOCK_SIZE, row), read through the cache's block tables by every attention
    path (a cuda layer: CuPy arrays with one scratch block more, the kernels reading a device
    copy of the tables). Rows come and go as float (n, Hkv, hd): the layer converts to and from
    its storage type. copy_blocks, save_blocks and load_blocks move whole blocks in the storage
    type (sharing's copy on write, spilling to host RAM and back)."""

    k: Array
    v: Array

    def write(self, slot: int, start: int, k: Array, v: Array) -> None: ...

    def rows(self, slot: int, p0: int, p1: int) -> tuple[Array, Array]: ...

    def read(self, slot: int, end: int) -> tuple[np.ndarray, np.ndarray]: ...

    def copy_blocks(self, src: np.ndarray, dst: np.ndarray) -> None: ...

    def save_blocks(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...

    def load_blocks(self, ids: np.ndarray, k: np.ndarray, v: np.ndarray) -> None: ...


class KV(Protocol):
    """The KV cache of a device: the slot table (which sequences are live, their lengths), the
    blocks each slot holds, and each layer's cache.

    A slot grows as it is written: `reserve(slot, n)` gives it room for positions [0, n) (a
    paged cache takes blocks from its pool, raising kv_cache.KVPoolFull when none is left),
    `trim(slot, n)` gives back what lies past n. A slot is FREE, LIVE or PARKED
    (kv_cache.SlotState): `alloc` hands out FREE slots only; `park` keeps a finished sequence's
    keys and values for the caller (until the pool needs its blocks; `kept(slot)` is how many
    positions it still holds), `reopen` makes it live again, `free` forgets it."""

    n_slots: int
    max_ctx: int  # positions one sequence may reach
    lengths: np.ndarray  # (n_slots,) positions each slot holds

    def layer(self, i: int) -> KVLayer: ...

    def alloc(self, slot: int | None = None) -> int: ...

    def park(self, slot: int) -> None: ...

    def reopen(self, slot: int) -> None: ...

    def free(self, slot: int) -> None: ...

    def blocks_for(self, n: int) -> int: ...

    def available(self) -> int: ...

    def reserve(self, slot: int, n: int) -> None: ...

    def reserve_rows(self, slots: list[int], ends: list[int]) -> None: ...  # reserve of each segment of a step

    def trim(self, slot: int, n: int) -> None: ...

    def kept(self, slot: int) -> int: ...

    def copy_prefix(self, src: int, dst: int, n: int, start: int = 0) -> None: ...

    @property
    def free_slots(self) -> int: ...


class Ops(Protocol):
    """The op set model.forward calls (model.block names each use), and what the engine asks
    around a step: its context, the logits on the host, the top ids picked where they are."""

    cfg: LlamaConfig

    def step_context(self, batch: Batch) -> AbstractContextManager: ...

    def embed(self, weights: Weights, tokens: np.ndarray) -> Array: ...

    def rope_table(self, positions: np.ndarray) -> Any: ...

    def rms_norm(self, x: Array, w: Array, eps: float) -> Array: ...

    def matmul(self, x: Array, w: Any, residual: Array | None = None) -> Any: ...

    def attention(self, q: Array, k: Array, v: Array, kv: KVLayer, batch: Batch, rope: Any = None) -> Array: ...

    def swiglu(self, g: Array, u: Array) -> Array: ...

    def rows(self, x: Array, rows: np.ndarray) -> Array: ...

    def to_host(self, x: Array) -> np.ndarray: ...

    def top(self, logits: Array, n: int) -> TopLogits: ...


class Pieces(Protocol):
    """A device that runs each piece of a step as one recorded call (the host's cpu backend):
    from the tokens or handed-in hidden states x (N, D), through `layers`, to the logits
    (head) or the hidden states (host arrays)."""

    def run(self, batch: Batch, *, x: np.ndarray | None = None, layers: Sequence[int] | None = None,
            head: bool = True, all_logits: bool = False, out: np.ndarray | None = None) -> np.ndarray: ...


class Steps(Protocol):
    """model.forward captured (CUDA graphs) or recorded per bucket of rows × tokens: the steps a
    bucket covers run from it, the others eagerly."""

    def covers(self, segments: Sequence[Segment], layers: Sequence[int] | None = None) -> bool: ...

    def run_step(self, segments: Sequence[Segment], *, layers: Sequence[int] | None = None,
                 all_logits: bool = False, top: int | None = None) -> np.ndarray | TopLogits: ...

    def top(self, slots, tokens, n: int, *, layers=None, last_only: bool = True) -> TopLogits: ...


class Backend(Protocol):
    """One kind of device. `device` is its ordinal (a GPU's index; 0 for the host).

    load takes a share: a tiers.Plan over every layer of the model whose tiers say what this
    device holds (vram: resident in its memory; pinned, storage: streamed into it; host:
    computed here by the host; skip: not this device's) and `depth` its streaming slots.
    """

    name: str  # the registry's name (backends.BACKENDS)
    is_host: bool  # computes in host memory: its arrays are numpy, its KV cache host RAM
    kv_dtypes: tuple[str, ...]  # the KV-cache types it stores; the first is what kv_dtype "auto" means
    reads_storage: bool  # streams layers from the storage setting (False: computes them where they lie)

    def available(self) -> bool: ...

    def layer_bytes(self, model: GGUFModel, i: int) -> int:
        """Bytes of layer i as this device holds it (what the planner places)."""

    def free_memory(self, device: int = 0) -> int | None:
        """Device memory free now; None: host memory (the planner reads MemAvailable)."""

    def load(self, model: GGUFModel, share, *, device: int = 0, source=None, poison: bool = False,
             link_cap: float | None = None, deterministic: bool = False,
             cpu_kernels: str = "auto") -> tuple[Ops, Weights]:
        """This device's op set and the weights of its share (source: the storage its streamed
        layers are read from; poison: fill released buffers, for tests; link_cap: bytes per
        second its streamed layers' copies are paced to, None: unpaced; deterministic: a row's
        arithmetic independent of the rows sharing its step, where the backend chooses kernels by
        row count (EngineConfig.deterministic); cpu_kernels: the build of the host's compiled
        kernels (EngineConfig.cpu_kernels; backends without them ignore it))."""

    def kv_cache(self, cfg: LlamaConfig, *, n_slots: int, max_ctx: int, dtype: str, device: int = 0,
                 n_blocks: int | None = None) -> KV:
        """A cache of n_slots sequences of up to max_ctx positions each, stored as `dtype`, over
        a pool of n_blocks blocks (None: enough for every slot to reach max_ctx)."""

    def capture(self, ops: Ops, weights: Weights, kv: KV, *, threads: int | None = None) -> Steps | None:
        """The captured or recorded steps of this device's whole forward pass, or None."""

    def context(self, device: int = 0) -> AbstractContextManager:
        """Makes `device` the current one for the work inside (a GPU's ordinal)."""

    def to_device(self, x: np.ndarray, device: int = 0) -> Array:
        """A copy of host array x on the device (never a view of x)."""
