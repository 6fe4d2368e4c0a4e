"""The decode step captured as a CUDA graph, one per batch-size bucket.

The same Llama block as model.forward, for one new token per sequence, written against fixed
device buffers so that the whole step (embedding → 32 blocks → output → argmax) is captured
once per bucket and replayed: Python then pays one small host→device copy (token, slot,
position of each row), one graph launch and one device→host copy of the token ids per step.
Differences from model.forward, all load-time or buffer-level: q/k/v and gate/up of one
type are stacked and multiplied once; the residual adds are the matvec epilogue (x += W a);
rows of a bucket beyond the live batch run on the cache's scratch slot; RMSNorm, attention and
SwiGLU also write their output quantized (QAct) for the int8 matvecs; RoPE of q and k and the
cache append are one launch when k follows q in the stack. A sampled step (`top`) copies back
each row's n most likely ids and logits (cuda.top_rows) instead of the ids or the whole logits.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from ntransformerd.engine.backends import cuda as K
from ntransformerd.engine.backends.cuda import cp
from ntransformerd.engine.sampler import TopLogits

BUCKETS = (1, 2, 4, 8, 16, 32)
# Programmatic dependent launch in every bucket (it lets each kernel start while the one before
# drains, and attn_decode load the cache then). H200, 8B, same run (bench/ab_decode.py, round 7):
# at 1 row it gave 286 -> 300 tok/s (Q8_0, round 3); at 4, 8 and 16 rows, once the tensor-core
# matvecs had replaced the kernels it once slowed by 16%, the step 3.7-4.5% (B=4, 8) and 1.7-2.6%
# (B=16) faster. PDL_MAX_BUCKET = 2 brings back plain launches from bucket 4.
PDL_MAX_BUCKET = 32
# Attention splits per (row, head) from bucket 4 (DecodeGraphs.n_splits): attn_decode's grid is
# sized for the longest context, so with many rows fewer splits waste fewer blocks. With
# attn_decode for every bucket (cuda.ATTN_ONE_LAUNCH_MAX_BUCKET) and PDL, same run: B=16 step
# Q4_K_M 4.622 -> 4.397 ms with 16 splits (4.557 with 32), Q8_0 5.600 -> 5.327.
BATCHED_SPLITS = 16
log = logging.getLogger(__name__)


class _Bufs:
    pass


class DecodeGraphs:
    def __init__(self, ops: K.CudaOps, weights, kv: K.CudaKVCache, *, use_graphs: bool = True,
                 pdl: bool | None = None):
        """weights: CudaWeights or cuda_stream.StreamedCudaWeights (describe, decode_feed,
        token_embd, output, output_norm)."""
        self.ops, self.w, self.kv, self.cfg = ops, weights, kv, ops.cfg
        # Where each layer's weights come from during a step: resident, or streamed slots whose
        # copies are part of the step (backends/cuda_stream.py). Not every feed can be captured.
        self.feed = weights.decode_feed()
        self.use_graphs = use_graphs and self.feed.capturable
        # Capture with programmatic dependent launch (each kernel may start while the previous
        # one drains; NTX_PDL=0 turns it off); a driver that cannot capture it gets plain launches.
        self.pdl = os.environ.get("NTX_PDL", "1") != "0" if pdl is None else pdl
        self.stream = cp.cuda.Stream(non_blocking=True)
        c = self.cfg
        self._bufs: dict[int, _Bufs] = {}
        self._graphs: dict[int, object] = {}
        # Per layer, where q, k, v and gate, up land: (stack, piece index, first column) per name.
        # Layers may stack differently (Q4_K_M keeps attn_v in Q6_K on some layers only).
        shapes = [weights.describe(i) for i in range(c.n_layers)]
        self._cols = [self._layout(ly) for ly in shapes]
        self._pieces = sorted({(s, j, t.shape[0]) for ly in shapes
                               for s in ("qkv", "gate_up") for j, t in enumerate(getattr(ly, s))})

    def n_splits(self, bk: int) -> int:
        """Attention splits per (row, head) of a bucket's step (kernels/attention.cu): the grid
        is sized for the longest context, so a bucket of many rows takes fewer."""
        return min(64 if bk <= 2 else BATCHED_SPLITS, self.kv.max_ctx)

    @staticmethod
    def _layout(ly) -> dict:
        cols = {}
        for stack, names in (("qkv", ("attn_q", "attn_k", "attn_v")), ("gate_up", ("ffn_gate", "ffn_up"))):
            widths = [t.shape[0] for t in getattr(ly, stack)]
            j, col = 0, 0
            for n in names:
                if col == widths[j]:
                    j, col = j + 1, 0
                cols[n] = (stack, j, widths[j], col)
                col += getattr(ly, n).shape[0]
        return cols

    def _alloc(self, bk: int) -> _Bufs:
        c, b = self.cfg, _Bufs()
        f32 = cp.float32
        b.io = cp.zeros((3, bk), cp.int32)  # token, slot, position of each row
        b.x = cp.empty((bk, c.d_model), f32)
        b.h = cp.empty((bk, c.d_model), f32)
        b.piece = {key: cp.empty((bk, key[2]), f32) for key in self._pieces}  # matvec outputs
        b.att = cp.empty((bk, c.q_dim), f32)
        b.act = cp.empty((bk, c.d_ff), f32)
        b.n_splits = self.n_splits(bk)
        b.scratch = K.attention_scratch(bk, c, b.n_splits, counters=True)
        qact = lambda k: K.QAct(bk, k) if k % 32 == 0 else None  # noqa: E731
        b.hq, b.attq, b.actq = qact(c.d_model), qact(c.q_dim), qact(c.d_ff)  # quantized h, att, act
        b.logits = cp.empty((bk, c.vocab_size), f32)
        b.ids = cp.empty((bk,), cp.int32)
        return b

    def _view(self, b: _Bufs, i: int, name: str):
        stack, j, width, col = self._cols[i][name]
        buf = b.piece[(stack, j, width)]
        return buf[:, col:], width  # a pointer to the first column, and the row stride

    def _body(self, bk: int, b: _Bufs) -> None:
        c, w = self.cfg, self.w
        tok, slot, pos = b.io[0], b.io[1], b.io[2]
        K.dequantize_rows(w.token_embd, tok, out=b.x)  # (B, D)
        self.feed.begin(self.stream)
        for i in range(c.n_layers):
            ly = self.feed.acquire(i)
            # Producers quantize their output only where an int8 matvec reads it (K.reads_qact).
            hq = b.hq if K.reads_qact(ly.qkv, bk) else None
            K.rms_norm(b.x, ly.attn_norm, c.rms_eps, out=b.h, q=hq)
            for j, t in enumerate(ly.qkv):
                K.matvec(b.h, t, out=b.piece[("qkv", j, t.shape[0])], xq=hq)  # (B, q+kv+kv) in 1 to 3 pieces
            q, ldq = self._view(b, i, "attn_q")
            k, ldk = self._view(b, i, "attn_k")
            v, ldv = self._view(b, i, "attn_v")
            cq, ck = self._cols[i]["attn_q"], self._cols[i]["attn_k"]
            attq = b.attq if K.reads_qact([ly.attn_output], bk) else None  # attention writes it quantized too
            fused = cq[:2] == ck[:2] and ck[3] == cq[3] + c.q_dim  # k right after q
            if fused and bk <= K.ATTN_ONE_LAUNCH_MAX_BUCKET:  # RoPE, append, attention: one launch
                K.attention_decode_(q, v, self.kv.layer(i), slot, pos, self.ops.freqs, c, n=bk, n_splits=b.n_splits,
                                    ld=ldq, ldv=ldv, out=b.att, scratch=b.scratch, q_out=attq)
            else:
                if fused:  # RoPE + append in one launch
                    K.rope_kv_(q, v, pos, slot, self.ops.freqs, self.kv.layer(i), c, n=bk, ld=ldq, ldv=ldv)
                else:
                    K.rope_(q, pos, self.ops.freqs, c, c.n_heads, n=bk, ld=ldq)
                    K.rope_(k, pos, self.ops.freqs, c, c.n_kv_heads, n=bk, ld=ldk)
                K.attention_(q, k, v, self.kv.layer(i), slot, pos, c, n=bk, n_splits=b.n_splits, ldq=ldq, ldk=ldk,
                             ldv=ldv, out=b.att, scratch=b.scratch, append=not fused, q_out=attq)
            K.matvec(b.att, ly.attn_output, out=b.x, res=b.x, xq=attq)  # x += attn @ Wo.T
            hq = b.hq if K.reads_qact(ly.gate_up, bk) else None
            K.rms_norm(b.x, ly.ffn_norm, c.rms_eps, out=b.h, q=hq)
            for j, t in enumerate(ly.gate_up):
                K.matvec(b.h, t, out=b.piece[("gate_up", j, t.shape[0])], xq=hq)
            g, ldg = self._view(b, i, "ffn_gate")
            u, ldu = self._view(b, i, "ffn_up")
            assert ldg == ldu or ldu == c.d_ff  # one row stride serves both in swiglu
            actq = b.actq if K.reads_qact([ly.ffn_down], bk) else None
            K.swiglu(g, u, out=b.act, n=bk, ld=ldg, f=c.d_ff, q=actq)
            K.matvec(b.act, ly.ffn_down, out=b.x, res=b.x, xq=actq)  # x += swiglu @ Wd.T
            self.feed.release(i)
        hq = b.hq if K.reads_qact([w.output], bk) else None
        K.rms_norm(b.x, w.output_norm, c.rms_eps, out=b.h, q=hq)
        K.matvec(b.h, w.output, out=b.logits, xq=hq)
        K.argmax(b.logits, out=b.ids)

    def _prepare(self, bk: int):
        if bk in self._bufs:
            return self._bufs[bk], self._graphs.get(bk)
        b = self._bufs[bk] = self._alloc(bk)
        with self.stream:
            io = np.zeros((3, bk), np.int32)
            io[1] = self.kv.scratch_slot
            b.io.set(io)
            self.feed.before_launch(self.stream)
            self._body(bk, b)  # compiles and loads every kernel before capture
            self.feed.after_launch(self.stream)
            self.stream.synchronize()
            if self.use_graphs:
                self._graphs[bk] = self._capture(bk, b)
        return b, self._graphs.get(bk)

    def _capture(self, bk: int, b: _Bufs):
        if self.pdl and bk <= PDL_MAX_BUCKET:
            try:
                with K.pdl():
                    return self._capture_once(bk, b)
            except Exception as e:  # noqa: BLE001 (any driver refusal: fall back to plain launches)
                log.warning("decode step: capture with programmatic dependent launch failed (%s); "
                            "capturing plain launches", e)
                self.pdl = False
        return self._capture_once(bk, b)

    def _capture_once(self, bk: int, b: _Bufs):
        self.stream.begin_capture()
        try:
            self._body(bk, b)
        except BaseException:
            try:
                self.stream.end_capture()
            except Exception:  # noqa: BLE001 (the capture is already invalid)
                pass
            raise
        return self.stream.end_capture()

    def launch(self, slots, tokens):
        """Queue one decode step (no wait); returns the bucket's buffers and the live row count."""
        n = len(slots)
        bk = next((m for m in BUCKETS if m >= n), None)
        if bk is None:
            raise ValueError(f"a decode step takes at most {BUCKETS[-1]} sequences, got {n}")
        b, graph = self._prepare(bk)
        slots = np.asarray(slots, np.int64)
        pos = self.kv.lengths[slots]
        if (pos >= self.kv.max_ctx).any():
            raise ValueError(f"a sequence is at the context limit of {self.kv.max_ctx}")
        io = np.zeros((3, bk), np.int32)
        io[1] = self.kv.scratch_slot
        io[0, :n], io[1, :n], io[2, :n] = tokens, slots, pos
        with self.stream:
            self.feed.before_launch(self.stream)
            b.io.set(io, stream=self.stream)  # ordered after the previous step on this stream
            if graph is not None:
                graph.launch(self.stream)
            else:
                self._body(bk, b)
            self.feed.after_launch(self.stream)
        self.kv.lengths[slots] += 1
        return b, n

    def step(self, slots, tokens) -> np.ndarray:
        """One decode step; the greedy next token of each sequence (int32, host)."""
        b, n = self.launch(slots, tokens)
        return b.ids[:n].get(stream=self.stream)

    def top(self, slots, tokens, n: int) -> TopLogits:
        """One decode step; each row's n most likely ids and their logits: a few hundred bytes
        to the host instead of the (B, V) logits, for the host's sampler (Sampler.need)."""
        b, m = self.launch(slots, tokens)
        with self.stream:
            ids, vals, nan = K.top_rows(b.logits[:m], n, stream=self.stream)
        return TopLogits(ids, vals, nan)

    def logits(self, slots, tokens):
        """One decode step; the logits (B, V) as a device array."""
        b, n = self.launch(slots, tokens)
        self.stream.synchronize()
        return b.logits[:n]
