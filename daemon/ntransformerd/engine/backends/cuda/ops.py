"""The op set model.forward calls, on the GPU: our kernels behind the names of cpu.CpuOps.

Eagerly (prefill, or any step no captured bucket covers) each op allocates its output from
CuPy's pool. While an `Arena` is set, every output comes from the arena instead: one fixed
buffer per (op, piece, shape), the same buffers pass after pass, so that running
model.forward under stream capture records a graph that can be replayed (graphs.py), and the
step's tokens, slots and positions come from the arena's device `io` rows.

The decode fusions live here, behind the names: q/k/v and gate/up stacks multiplied piece by
piece (their outputs are column views of the pieces); the residual add as the matvec's epilogue
(x += W a, in place); RoPE, the cache append and the split attention in one launch for one token
per row (attn_decode), or RoPE and the append in one (rope_kv) where k follows q in a piece; and
the int8 matvecs' quantized activations (QAct) written by the op that produces them. Which
producers quantize is learned in the arena's first (eager) pass: a matvec that had to quantize
its input marks that buffer, and from then on the producer writes both forms in one launch.
"""

from __future__ import annotations

import contextlib

import numpy as np

from ntransformerd.engine.backends.cpu import rope_frequencies
from ntransformerd.engine.backends.cuda import attention as A
from ntransformerd.engine.backends.cuda import launch as K
from ntransformerd.engine.backends.cuda.nvrtc import cp
from ntransformerd.engine.backends.cuda.settings import DEFAULT, CudaSettings
from ntransformerd.engine.backends.cuda.weights import Stacked
from ntransformerd.engine.gguf_file import LlamaConfig
from ntransformerd.engine.runtime.model import Batch
from ntransformerd.engine.generation.sampler import TopLogits


def _ld(x) -> int:
    """Row stride (in float32 elements) of a 2-D float32 array or column view."""
    return x.strides[0] // 4


class Arena:
    """Fixed device buffers for one bucket of `rows` rows × `tokens` per row: the outputs of
    every op of a pass, the step's io (token, slot, position of each row), and the attention
    scratch (shared by every bucket of the engine: graphs.StepGraphs makes one). Buffers are
    keyed by what makes them (op, piece, shape), never by call order, so a layer's h and the
    next layer's h share one buffer, and the whole pass needs a few dozen."""

    def __init__(self, cfg: LlamaConfig, rows: int, tokens: int, *, scratch: A.AttentionScratch):
        self.cfg, self.rows, self.tokens, self.n = cfg, rows, tokens, rows * tokens
        self.io = cp.zeros((3, self.n), cp.int32)  # token, slot, position of each row
        self.scratch = scratch
        self._bufs: dict[tuple, object] = {}
        self._owner: dict[int, tuple] = {}  # buffer pointer → key
        self._qact: dict[tuple, K.QAct] = {}  # keys whose readers want the quantized form too
        self._fresh: set[tuple] = set()  # keys whose QAct holds the buffer's current contents

    @property
    def tokens_dev(self):
        return self.io[0]

    @property
    def slots_dev(self):
        return self.io[1]

    @property
    def pos_dev(self):
        return self.io[2]

    def take(self, key: tuple, shape: tuple, *inputs):
        """The buffer for key (made on first use); never one of the op's inputs."""
        buf = self._bufs.get((key, shape))
        if buf is None:
            buf = self._bufs[(key, shape)] = cp.empty(shape, cp.float32)
            self._owner[buf.data.ptr] = (key, shape)
        if any(getattr(x, "data", None) is not None and x.data.ptr == buf.data.ptr for x in inputs):
            raise RuntimeError(f"arena: the output {key} would overwrite its own input")
        self._fresh.discard((key, shape))
        return buf

    def written(self, buf) -> None:
        """buf was written in place (a residual add): its QAct, if any, is stale."""
        key = self._owner.get(buf.data.ptr)
        if key is not None:
            self._fresh.discard(key)

    def q_for(self, buf) -> K.QAct | None:
        """The QAct a producer writing `buf` should fill too (readers asked for it), marked fresh."""
        key = self._owner.get(buf.data.ptr)
        q = self._qact.get(key)
        if q is not None:
            self._fresh.add(key)
        return q

    def q_of(self, x, k: int) -> K.QAct | None:
        """x's quantized form for a matvec: fresh from its producer, or None after marking x's
        buffer so that its producer writes one from the next pass on (a QAct is made here, in the
        first pass, never while capturing)."""
        key = self._owner.get(x.data.ptr)
        if key is None or x.shape != key[1]:
            return None
        if key in self._fresh:
            return self._qact[key]
        if key not in self._qact and not cp.cuda.get_current_stream().is_capturing():
            self._qact[key] = K.QAct(x.shape[0], k)
        q = self._qact.get(key)
        if q is not None:
            K.quantize(x, q)
            self._fresh.add(key)
        return q


class CudaOps:
    """cpu.CpuOps' interface on our kernels. One compute thread; `arena` set by graphs.py."""

    name = "cuda"

    def __init__(self, cfg: LlamaConfig, freq_factors: np.ndarray | None = None, *,
                 settings: CudaSettings = DEFAULT):
        self.cfg, self.settings = cfg, settings
        self.freqs = cp.asarray(rope_frequencies(cfg, freq_factors))  # (rope_dim/2,) float64
        self.arena: Arena | None = None
        self._batch = None  # (batch, slots, positions, tiles) of the eager step in flight
        self._refreshed = None  # (batch, device tables) last brought up to date

    # ---- outputs ------------------------------------------------------------------------------

    def _out(self, key: tuple, shape: tuple, *inputs):
        if self.arena is not None:
            return self.arena.take(key, shape, *inputs)
        return cp.empty(shape, cp.float32)

    def _q_out(self, buf, k: int) -> K.QAct | None:
        """The QAct to fill with buf's contents, where a reader wants it (arena passes only)."""
        if self.arena is None or k % 32:
            return None
        return self.arena.q_for(buf)

    # ---- the step's rows ----------------------------------------------------------------------

    def _rows(self, batch: Batch, kv_layer):
        """Slots, positions and prefill-attention tiles (or None) of the step's rows on the
        device: the arena's io (graphs.py brings the block tables up to date before a replay),
        or made once per eager step, the device block tables of its slots refreshed once per
        step and cache."""
        if self.arena is not None:
            return self.arena.slots_dev, self.arena.pos_dev, None
        done = self._refreshed
        if done is None or done[0] is not batch or done[1] is not kv_layer.tables:
            for seg in batch.segments:  # held already where the engine reserved the step (a no-op then)
                kv_layer.table.reserve(seg.slot, seg.start + len(seg.tokens), start=seg.start)
            kv_layer.tables.refresh([s.slot for s in batch.segments])
            self._refreshed = (batch, kv_layer.tables)
        if self._batch is None or self._batch[0] is not batch:
            c = self.cfg
            slots = np.repeat([s.slot for s in batch.segments], np.diff(batch.offsets)).astype(np.int32)
            # the deterministic setting: every row on attn_decode, so a prompt's rows round alike
            # however the scheduler cut it (a prefix from the cache, a chunk beside other rows)
            chunk = (not self.settings.deterministic and c.head_dim in A.CHUNK_HEAD_DIMS
                     and int(np.diff(batch.offsets).max()) >= A.CHUNK_ROWS)
            tiles = cp.asarray(A.chunk_tiles(batch.offsets, batch.positions)) if chunk else None
            self._batch = (batch, cp.asarray(slots), cp.asarray(batch.positions.astype(np.int32)), tiles)
        return self._batch[1:]

    @staticmethod
    def to_host(x) -> np.ndarray:
        return cp.asnumpy(x)

    @staticmethod
    def top(logits, n: int) -> TopLogits:
        """Each row's n most likely ids and their logits, picked on the device (top_rows): only
        those come to the host."""
        return TopLogits(*K.top_rows(cp.ascontiguousarray(logits), n))

    @staticmethod
    def step_context(batch: Batch):
        return contextlib.nullcontext()

    # ---- the ops ------------------------------------------------------------------------------

    def embed(self, weights, tokens):
        """token_embd rows of the step's tokens (N, D): the arena's io tokens while it is set."""
        tok = self.arena.tokens_dev if self.arena is not None else cp.asarray(np.asarray(tokens, np.int32))
        out = self._out(("embed",), (len(tok), self.cfg.d_model))
        return K.dequantize_rows(weights.token_embd, tok, out=out)

    def rope_table(self, positions):
        if self.arena is not None:
            return self.arena.pos_dev
        return cp.asarray(np.asarray(positions, np.int32))  # angles are made inside the kernels

    def rope(self, x, table, n_heads: int):
        """RoPE of x's rows (a copy; the fused attention path rotates in place)."""
        return K.rope_(x.copy(), table, self.freqs, self.cfg, n_heads)

    def rows(self, x, rows: np.ndarray):
        if len(rows) == x.shape[0] and np.array_equal(rows, np.arange(len(rows))):
            return x  # one token per segment: every row is a last row
        if self.arena is not None:
            raise ValueError("a captured bucket computes the logits of every row (all_logits)")
        return x[cp.asarray(rows)]

    def rms_norm(self, x, w, eps: float):
        x = cp.ascontiguousarray(x)
        out = self._out(("rms_norm",), x.shape, x)
        return K.rms_norm(x, w, eps, out=out, q=self._q_out(out, x.shape[1]))

    def swiglu(self, g, u):
        n, f = g.shape
        if _ld(g) != _ld(u):  # one row stride serves both in the kernel
            g, u = cp.ascontiguousarray(g), cp.ascontiguousarray(u)
        out = self._out(("swiglu",), (n, f))
        return K.swiglu(g, u, out=out, n=n, ld=_ld(g), f=f, q=self._q_out(out, f))

    def matmul(self, x, w, residual=None):
        """x @ W.T (+ residual, in place); a Stacked weight gives one column view per member."""
        if isinstance(w, Stacked):
            outs = [self._matmul(x, p, ("matmul", j)) for j, p in enumerate(w.pieces)]
            return tuple(outs[j][:, r0:r0 + rows] for j, r0, rows in w.members)
        if residual is not None:
            return self._matmul(x, w, None, residual=residual)
        return self._matmul(x, w, ("matmul", "out"))

    def _matmul(self, x, w, key, *, residual=None):
        n = x.shape[0]
        if K.uses_cublas(n, self.settings):  # prefill: f16 dequantization and cuBLAS (never in an arena)
            y = K.matmul(cp.ascontiguousarray(x), w, self.settings)
            if residual is None:
                return y
            residual += y
            return residual
        if residual is not None and self.arena is not None:
            self.arena.written(residual)
        out = residual if residual is not None else self._out(key, (n, w.shape[0]), x)
        xq = None
        if self.arena is not None and K.reads_qact([w], K.bucket_of(min(n, K.MATVEC_MAX_ROWS)), self.settings):
            xq = self.arena.q_of(x, w.shape[1])
        if n > K.MATVEC_MAX_ROWS:  # a wide decode step: fused matvecs of ≤ 32 rows
            x = cp.ascontiguousarray(x)
        return K.matvec_rows(x, w, out=out, res=residual, xq=xq, s=self.settings)

    def attention(self, q, k, v, kv_layer, batch: Batch, rope=None):
        """RoPE on q and k (unless rope is None: already rotated), k and v to the cache at each
        row's (slot, position), then causal GQA attention over the cache; q, k, v may be column
        views of one matmul output. (N, H * hd)."""
        c, s = self.cfg, self.settings
        slots, pos, tiles = self._rows(batch, kv_layer)
        n = q.shape[0]
        out = self._out(("attention",), (n, c.q_dim))
        q_out = self._q_out(out, c.q_dim)
        one_token = len(batch.tokens) == len(batch.segments)
        # k right after q in one buffer: RoPE of both and the append are one launch
        fused = rope is not None and _ld(q) == _ld(k) and k.data.ptr == q.data.ptr + 4 * c.q_dim
        if (fused and one_token and tiles is None and n <= K.MATVEC_MAX_ROWS
                and K.bucket_of(n) <= s.attn_one_launch_max_bucket):
            return A.attention_decode_(q, v, kv_layer, slots, pos, self.freqs, c, n=n, ld=_ld(q), ldv=_ld(v), out=out,
                                       scratch=self._scratch(n, kv_layer), q_out=q_out)
        appended = False
        if fused:
            A.rope_kv_(q, v, pos, slots, self.freqs, kv_layer, c, n=n, ld=_ld(q), ldv=_ld(v))
            appended = True
        elif rope is not None:
            K.rope_(q, pos, self.freqs, c, c.n_heads, n=n, ld=_ld(q))
            K.rope_(k, pos, self.freqs, c, c.n_kv_heads, n=n, ld=_ld(k))
        if tiles is not None:  # a prefill chunk: tensor cores
            if not appended:
                A.kv_append_(k, v, kv_layer, slots, pos, c, n=n, ldk=_ld(k), ldv=_ld(v))
            return A.attention_chunk_(q, kv_layer, slots, pos, tiles, c, ldq=_ld(q), out=out)
        return A.attention_(q, k, v, kv_layer, slots, pos, c, n=n, ldq=_ld(q), ldk=_ld(k), ldv=_ld(v), out=out,
                            scratch=self._scratch(n, kv_layer), append=not appended, q_out=q_out)

    def _scratch(self, n: int, kv_layer) -> A.AttentionScratch:
        """The arena's shared attention scratch, or (eager) one for up to DECODE_ROWS rows at a
        time from CuPy's pool."""
        if self.arena is not None:
            return self.arena.scratch
        return A.attention_scratch(min(n, A.DECODE_ROWS), self.cfg, kv_layer.table.max_ctx)
