"""model.forward captured as a CUDA graph, one per bucket of rows × tokens per row (× layers).

A bucket is (R rows, T tokens per row, the layers to run): R sequences each adding T tokens at
consecutive positions, R × T ≤ 32, T in 1 (decode), 2, 4, 8, 16 (verifying drafts), or up to
64 rows of one token (a wide decode step: its matmuls run as fused matvecs of 32 rows each). Its
graph is model.forward itself, run once eagerly with the ops drawing every output from the
bucket's Arena (this compiles the kernels, and teaches the arena which producers quantize for
an int8 matvec), then once under stream capture with the same buffers. A step then costs one
small host→device copy (token, slot, position of each row), one replay, and one copy of what
the caller wants back (greedy ids, each row's top ids, or the logits). Rows of a bucket beyond
the live batch run on the KV cache's scratch slot (its table row points at the scratch block).
The graphs read the cache's device block tables (kv.DeviceTables: one fixed buffer); a step
brings the rows of its slots up to date on the step's stream before the replay.

Streamed layers from pinned RAM are copied inside the graph (weights.CudaWeights: prefetch,
acquire and release are capturable); a plan with storage layers runs every pass eagerly.

A piece is a stretch of resident layers alone, from hidden states handed in to hidden states
out (`run_piece`): what a step over several devices (tiers/step_pipeline.py) runs on this GPU between
the host's layers. Its graph reads the hidden states from its arena's input buffer (the residual
stream is updated in place, so the output is that buffer) and touches no streaming slot, so it
replays without waiting for the stream's copies.
"""

from __future__ import annotations

import logging
import types

import numpy as np

from ntransformerd.engine.runtime import model as llama
from ntransformerd.engine.backends.cuda import attention as A
from ntransformerd.engine.backends.cuda import launch as K
from ntransformerd.engine.backends.cuda import nvrtc, sampling
from ntransformerd.engine.backends.cuda.kv import CudaKVCache
from ntransformerd.engine.backends.cuda.nvrtc import cp
from ntransformerd.engine.backends.cuda.ops import Arena, CudaOps
from ntransformerd.engine.runtime.model import Batch, Segment
from ntransformerd.engine.generation.sampler import TopLogits

ROWS = (1, 2, 4, 8, 16, 32, 64)
TOKENS = (1, 2, 4, 8, 16)
MAX_ROWS = K.MATVEC_MAX_ROWS  # rows × tokens of a bucket, except…
MAX_DECODE_ROWS = 64  # …one token per row: up to this many rows
log = logging.getLogger(__name__)


class _Bucket:
    def __init__(self, arena: Arena, batch: Batch, layers, *, piece: bool = False):
        self.arena, self.batch, self.layers, self.piece = arena, batch, layers, piece
        self.graph = None
        self.logits = None  # the pass's (R × T, V) output, an arena buffer; a piece's hidden states (R × T, D)
        self.ids = cp.empty((arena.n,), cp.int32)  # greedy id of each row
        self.x = None  # a piece's input hidden states (R × T, D), an arena buffer


class _Resident:
    """A piece's weights: resident layers only (a streamed one would need the stream's slots)."""

    def __init__(self, weights):
        self.w = weights

    def prefetch(self, layers) -> None:
        pass

    def acquire(self, i: int):
        if not self.w.resident(i):
            raise ValueError(f"layer {i} is not resident: a captured piece runs resident layers only")
        return self.w.acquire(i)

    def release(self, i: int) -> None:
        self.w.release(i)


class StepGraphs:
    """The captured steps of one engine (ops, weights, KV cache). One compute thread; every
    step returns its result to the host before the next starts, so steps never overlap."""

    def __init__(self, ops: CudaOps, weights, kv: CudaKVCache, *, use_graphs: bool = True,
                 pdl: bool | None = None):
        """use_graphs=False runs every bucket's pass eagerly (benchmarks); pdl overrides the
        settings' programmatic dependent launch."""
        self.ops, self.w, self.kv, self.cfg = ops, weights, kv, ops.cfg
        self.s = ops.settings
        self.use_graphs = use_graphs and weights.capturable
        self.piece_graphs = use_graphs  # a piece touches no streaming slot: capturable whatever the plan
        self.pdl = self.s.pdl if pdl is None else pdl
        self.stream = cp.cuda.Stream(non_blocking=True)
        self._buckets: dict[tuple, _Bucket] = {}

    @property
    def captured(self) -> types.MappingProxyType:
        """The buckets made so far, read-only, by key (R, T, layers or None for the plan's,
        piece?): each with its `graph` (None where it runs eagerly) and `piece`."""
        return types.MappingProxyType(self._buckets)

    # ---- which steps a bucket serves -----------------------------------------------------------

    def bucket(self, n_rows: int, tokens: int) -> tuple[int, int] | None:
        """(R, T) of the bucket serving n_rows sequences of `tokens` new tokens each, or None."""
        if tokens not in TOKENS or tokens > self.kv.max_ctx:
            return None
        r = next((r for r in ROWS if r >= n_rows), None)
        if r is None or r * tokens > (MAX_DECODE_ROWS if tokens == 1 else MAX_ROWS):
            return None
        return r, tokens

    def covers(self, segments, layers=None) -> bool:
        """Whether a captured step serves these segments (all of one length; see bucket)."""
        if not self.w.capturable or not segments:
            return False
        t = len(segments[0].tokens)
        return all(len(s.tokens) == t for s in segments) and self.bucket(len(segments), t) is not None

    def n_splits(self, n: int) -> int:
        """Attention splits per (row, head) of an n-row bucket (attention.step_splits)."""
        return A.step_splits(n, self.kv.max_ctx, self.cfg, self.s)

    # ---- capture --------------------------------------------------------------------------------

    def covers_piece(self, segments, layers) -> bool:
        """Whether a captured piece serves these segments through `layers` (all resident)."""
        if not layers or not segments or not all(self.w.resident(i) for i in layers):
            return False
        t = len(segments[0].tokens)
        return all(len(s.tokens) == t for s in segments) and self.bucket(len(segments), t) is not None

    def _pass(self, b: _Bucket):
        if b.piece:
            return llama.run_layers(self.ops, self.cfg, _Resident(self.w), self.kv, b.batch, b.x, b.layers)
        logits = llama.forward(self.ops, self.cfg, self.w, self.kv, b.batch, layers=b.layers, all_logits=True)
        K.argmax(logits, out=b.ids)
        return logits

    def _placeholder_io(self, r: int, t: int) -> np.ndarray:
        io = np.zeros((3, r * t), np.int32)
        io[1] = self.kv.scratch_slot
        io[2] = np.tile(np.arange(t, dtype=np.int32), r)
        return io

    def _prepare(self, r: int, t: int, layers, *, piece: bool = False) -> _Bucket:
        key = (r, t, layers, piece)
        b = self._buckets.get(key)
        if b is not None:
            return b
        arena = Arena(self.cfg, r, t, n_splits=self.n_splits(r * t))
        # The batch's structure (R segments of T tokens) is what the ops read from it; every value
        # (tokens, slots, positions) comes from the arena's io rows, set before each replay.
        batch = Batch.of([Segment(self.kv.scratch_slot, 0, np.zeros(t, np.int64)) for _ in range(r)])
        b = _Bucket(arena, batch, layers, piece=piece)
        with self.stream:
            arena.io.set(self._placeholder_io(r, t))
            if piece:
                b.x = arena.take(("embed",), (r * t, self.cfg.d_model))
                b.x.fill(0)
            self.ops.arena = arena
            try:
                b.logits = self._pass(b)  # eager: compiles and loads every kernel before capture
                self.stream.synchronize()
                if self.piece_graphs if piece else self.use_graphs:
                    b.graph = self._capture(b)
            finally:
                self.ops.arena = None
        self._buckets[key] = b
        return b

    def _capture(self, b: _Bucket):
        if self.pdl and b.arena.n <= self.s.pdl_max_bucket:
            try:
                with nvrtc.pdl():
                    return self._capture_once(b)
            except Exception as e:  # noqa: BLE001 (any driver refusal: fall back to plain launches)
                log.warning("captured step: programmatic dependent launch failed (%s); capturing plain launches", e)
                self.pdl = False
        return self._capture_once(b)

    def _capture_once(self, b: _Bucket):
        self.stream.begin_capture()
        try:
            self._pass(b)
        except BaseException:
            try:
                self.stream.end_capture()
            except Exception:  # noqa: BLE001 (the capture is already invalid)
                pass
            raise
        return self.stream.end_capture()

    # ---- steps ------------------------------------------------------------------------------------

    def launch(self, slots, tokens, layers=None, *, eager: bool = False, advance: bool = False,
               x=None, tokens_dev=None) -> tuple[_Bucket, int]:
        """Queue one step (no wait): sequence slots[i] adds tokens[i] (T ids) at its current
        length. Returns the bucket and the live row count (len(slots) × T). The caller moves
        the cache lengths on (Engine.step), or advance=True does (benchmarks driving the steps
        alone). eager: run the bucket's pass kernel by kernel even if it has a graph (profiling).
        x: the hidden states (len(slots) × T, D) of a piece through `layers` (resident only).
        tokens_dev: the rows' tokens as a device int32 array (a previous step's draws, still on
        the device), in place of `tokens`' values."""
        tokens = np.asarray(tokens, np.int64)
        if tokens.ndim == 1:
            tokens = tokens[:, None]
        n, t = tokens.shape
        rt = self.bucket(n, t)
        if rt is None or len(slots) != n:
            raise ValueError(f"no captured step for {len(slots)} sequences of {t} tokens")
        r, t = rt
        piece = x is not None
        if piece and not layers:
            raise ValueError("a piece runs some layers: name them")
        b = self._prepare(r, t, None if layers is None else tuple(layers), piece=piece)
        slots = np.asarray(slots, np.int64)
        start = self.kv.lengths[slots]
        if (start + t > self.kv.max_ctx).any():
            raise ValueError(f"a sequence would pass the context limit of {self.kv.max_ctx}")
        io = self._placeholder_io(r, t)
        m = n * t
        io[0, :m] = tokens.reshape(-1)
        io[1, :m] = np.repeat(slots, t)
        io[2, :m] = (start[:, None] + np.arange(t)).reshape(-1)
        for slot, p in zip(slots, start):  # the engine reserved them already (then a no-op)
            self.kv.blocks.reserve(int(slot), int(p) + t, start=int(p))
        with self.stream:
            if piece:  # resident layers only: no slot to wait for
                if x.shape != (m, self.cfg.d_model):
                    raise ValueError(f"a piece of {m} rows takes hidden states ({m}, {self.cfg.d_model}), not {x.shape}")
                b.x[:m] = x
            else:
                self.w.settle(self.stream)
            self.kv.tables.refresh(slots, stream=self.stream)  # the blocks the engine reserved for this step
            b.arena.io.set(io, stream=self.stream)  # ordered after the previous step on this stream
            if tokens_dev is not None:
                b.arena.io[0, :m] = tokens_dev
            if b.graph is not None and not eager:
                b.graph.launch(self.stream)
            else:
                self.ops.arena = b.arena
                try:
                    self._pass(b)
                finally:
                    self.ops.arena = None
        if advance:
            self.kv.lengths[slots] += t
        return b, m

    def run_piece(self, segments, x, layers):
        """The hidden states (N, D) after resident `layers` of the segments' rows, from theirs x
        (N, D) on this device: a view of the piece's buffer, valid until its next replay."""
        slots, toks = [s.slot for s in segments], np.stack([s.tokens for s in segments])
        b, m = self.launch(slots, toks, layers, x=x)
        return b.logits[:m]

    def _rows(self, b: _Bucket, m: int, t: int, last_only: bool):
        logits = b.logits[:m]
        return logits[t - 1::t] if last_only and t > 1 else logits

    def step(self, slots, tokens, layers=None, *, advance: bool = False) -> np.ndarray:
        """One step; the greedy next token after every row (int32, host, len(slots) × T)."""
        b, m = self.launch(slots, tokens, layers, advance=advance)
        return b.ids[:m].get(stream=self.stream)

    def run_step(self, segments, *, layers=None, all_logits: bool = False, top: int | None = None):
        """The engine's step on covered segments: host logits, or with top a TopLogits."""
        slots, toks = [s.slot for s in segments], np.stack([s.tokens for s in segments])
        if top is not None:
            return self.top(slots, toks, top, layers=layers, last_only=not all_logits)
        return self.ops.to_host(self.logits(slots, toks, layers=layers, last_only=not all_logits))

    @staticmethod
    def draws(sample) -> bool:
        """Whether the device draws these rows (sampling.eligible)."""
        return sampling.eligible(sample)

    def draw(self, segments, sample, *, layers=None):
        """One step on covered segments; the id each row draws (sampler.Drawn), drawn on the
        device (backends/cuda/sampling.py), or None, running nothing, where its rows need the
        host (sampling.eligible)."""
        if not sampling.eligible(sample):
            return None
        return self.draw_async(segments, sample, layers=layers).result()

    def draw_async(self, segments, sample, *, layers=None, after=None, rows=None) -> "sampling.Drawing":
        """draw() queued, nothing waited for (sampling.Drawing); with `after` (a Drawing still in
        flight) and `rows`, each segment's token is that step's draw of row rows[i], taken on the
        device (the segments' own token values are placeholders)."""
        slots, toks = [s.slot for s in segments], np.stack([s.tokens for s in segments])
        with self.stream:
            tokens_dev = None if after is None else after.ids_at(rows)
        b, m = self.launch(slots, toks, layers, tokens_dev=tokens_dev)
        with self.stream:
            logits = cp.ascontiguousarray(self._rows(b, m, b.arena.tokens, True))
            return sampling.draw_async(logits, sample, stream=self.stream)

    def top(self, slots, tokens, n: int, *, layers=None, last_only: bool = True, advance: bool = False) -> TopLogits:
        """One step; each row's (or each sequence's last row's) n most likely ids and their
        logits: a few hundred bytes to the host instead of the logits (Sampler.need)."""
        b, m = self.launch(slots, tokens, layers, advance=advance)
        t = b.arena.tokens
        with self.stream:
            rows = cp.ascontiguousarray(self._rows(b, m, t, last_only))
            ids, vals, nan = K.top_rows(rows, n, stream=self.stream)
        return TopLogits(ids, vals, nan)

    def logits(self, slots, tokens, *, layers=None, last_only: bool = True, advance: bool = False):
        """One step; the logits of every row (or each sequence's last), a device array."""
        b, m = self.launch(slots, tokens, layers, advance=advance)
        self.stream.synchronize()
        return self._rows(b, m, b.arena.tokens, last_only)
