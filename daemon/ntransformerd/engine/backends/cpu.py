"""The CPU backend: numpy, float32. The reference every other backend is tested against.

Each op is the plain definition (vLLM's `forward_native`): RMSNorm, RoPE in both orderings
with Llama 3.1 frequency factors, causal GQA attention over a KV cache, SwiGLU. Weights are
dequantized to float32 once, at load (or per use for layers that are not kept resident); under a
tier plan, the streamed layers come through tiers' host stream (StreamedCpuWeights), so CI runs
the GPU's streaming logic on this backend.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types

import numpy as np
from gguf import GGMLQuantizationType as Q
from threadpoolctl import ThreadpoolController

from ntransformerd.engine.gguf_file import LAYER_TENSORS, GGUFModel, LlamaConfig
from ntransformerd.engine.runtime.kv_cache import KVCache, KVLayer
from ntransformerd.engine.runtime.model import Batch
from ntransformerd.engine.quants import dequantize
from ntransformerd.engine.generation.sampler import TopLogits
from ntransformerd.engine.tiers.cpu_stream import HostStream
from ntransformerd.engine.tiers.layer_stream import Device
from ntransformerd.engine.tiers.planner import HOST, VRAM, Plan
from ntransformerd.engine.tiers.sources import HostMemory, Source


def rope_frequencies(cfg: LlamaConfig, freq_factors: np.ndarray | None) -> np.ndarray:
    """Angle per position for each rotated pair: base^(-2i/rope_dim) / factor_i / scale. (rope_dim/2,)"""
    i = np.arange(cfg.rope_dim // 2, dtype=np.float64)
    freqs = cfg.rope_base ** (-2.0 * i / cfg.rope_dim) / cfg.rope_scale
    if freq_factors is not None:
        freqs = freqs / freq_factors.astype(np.float64)
    return freqs


class CpuOps:
    """numpy implementations of the ops `model.forward` calls."""

    name = "cpu"

    def __init__(self, cfg: LlamaConfig, freq_factors: np.ndarray | None = None):
        self.cfg = cfg
        self.freqs = rope_frequencies(cfg, freq_factors)  # (rope_dim/2,) float64
        self.scale = np.float32(1.0 / np.sqrt(cfg.head_dim))
        self._blas = ThreadpoolController()

    def step_context(self, batch: Batch):
        """BLAS threads for one step: one for decode-sized batches.

        A matrix-vector product is memory-bound; extra BLAS threads only spin, and when the
        cores are shared (a daemon beside other work, CI) they made decode 4x slower here.
        Prefill-sized batches are compute-bound and keep every thread.
        """
        if len(batch.tokens) <= 4:
            return self._blas.limit(limits=1, user_api="blas")
        return contextlib.nullcontext()

    def embed(self, weights, tokens: np.ndarray) -> np.ndarray:
        return weights.embed_rows(tokens)  # (N, D)

    @staticmethod
    def to_host(x: np.ndarray) -> np.ndarray:
        return x

    @staticmethod
    def top(logits: np.ndarray, n: int):
        """Each row's n most likely ids and their logits (sampler.TopLogits)."""
        return TopLogits.of(logits, n)

    @staticmethod
    def matmul(x: np.ndarray, w, residual: np.ndarray | None = None):
        """x @ w (+ residual); w prepared by `prepare_matrix` at load: (N, in) @ (in, out) → (N, out).
        A stack of matrices (attn_qkv, ffn_gate_up) gives one product per member."""
        if isinstance(w, tuple):
            return tuple(x @ m for m in w)
        return x @ w if residual is None else residual + x @ w

    @staticmethod
    def rows(x: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return x[rows]

    @staticmethod
    def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        ms = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)  # (N, 1)
        return (x * (1.0 / np.sqrt(ms + np.float32(eps)))) * w

    @staticmethod
    def swiglu(g: np.ndarray, u: np.ndarray) -> np.ndarray:
        return g / (1.0 + np.exp(-g)) * u  # silu(g) * u

    def rope_table(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        theta = positions.astype(np.float64)[:, None] * self.freqs[None, :]  # (N, rope_dim/2)
        return np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)

    def rope(self, x: np.ndarray, table: tuple[np.ndarray, np.ndarray], n_heads: int) -> np.ndarray:
        cos, sin = table[0][:, None, :], table[1][:, None, :]  # (N, 1, rope_dim/2)
        hd, rd = self.cfg.head_dim, self.cfg.rope_dim
        x = x.reshape(len(x), n_heads, hd).copy()  # (N, H, hd)
        r = x[..., :rd]
        if self.cfg.rope_neox:  # pairs (i, i + rd/2)
            a, b = r[..., : rd // 2].copy(), r[..., rd // 2:].copy()
            r[..., : rd // 2], r[..., rd // 2:] = a * cos - b * sin, a * sin + b * cos
        else:  # adjacent pairs (2i, 2i+1), Llama's order in GGUF
            a, b = r[..., 0::2].copy(), r[..., 1::2].copy()
            r[..., 0::2], r[..., 1::2] = a * cos - b * sin, a * sin + b * cos
        return x.reshape(len(x), n_heads * hd)

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, kv: KVLayer, batch: Batch,
                  rope=None) -> np.ndarray:
        """RoPE on q and k (unless rope is None: already rotated), k and v into the cache at their
        positions, then causal GQA attention."""
        if rope is not None:
            q = self.rope(q, rope, self.cfg.n_heads)  # (N, H * hd)
            k = self.rope(k, rope, self.cfg.n_kv_heads)  # (N, Hkv * hd)
        if len(batch.segments) > 1 and len(batch.tokens) == len(batch.segments):
            return self._decode_attention(q, k, v, kv, batch)
        c = self.cfg
        g = c.n_heads // c.n_kv_heads
        out = np.empty_like(q)  # (N, H * hd)
        for s, seg in enumerate(batch.segments):
            r0, r1 = batch.offsets[s], batch.offsets[s + 1]
            n, end = r1 - r0, seg.start + (r1 - r0)
            kv.write(seg.slot, seg.start, k[r0:r1].reshape(n, c.n_kv_heads, c.head_dim),
                     v[r0:r1].reshape(n, c.n_kv_heads, c.head_dim))
            keys, values = kv.read(seg.slot, end)  # (L, Hkv, hd) each, float32
            qs = q[r0:r1].reshape(n, c.n_kv_heads, g, c.head_dim)  # (n, Hkv, g, hd)
            scores = np.einsum("nkgd,lkd->kgnl", qs, keys) * self.scale  # (Hkv, g, n, L)
            causal = np.arange(end)[None, :] > (seg.start + np.arange(n))[:, None]  # (n, L)
            scores[..., causal] = -np.inf
            scores -= scores.max(axis=-1, keepdims=True)
            p = np.exp(scores)
            p /= p.sum(axis=-1, keepdims=True)
            o = np.einsum("kgnl,lkd->nkgd", p, values)  # (n, Hkv, g, hd)
            out[r0:r1] = o.reshape(n, c.n_heads * c.head_dim)
        return out

    def _decode_attention(self, q, k, v, kv: KVLayer, batch: Batch) -> np.ndarray:
        """One new token for each of B sequences: one padded attention instead of B small ones."""
        c = self.cfg
        b, g = len(batch.tokens), c.n_heads // c.n_kv_heads
        slots = np.array([seg.slot for seg in batch.segments])
        pos = batch.positions  # (B,) where each new token goes
        kv.write_rows(slots, pos, k.reshape(b, c.n_kv_heads, c.head_dim), v.reshape(b, c.n_kv_heads, c.head_dim))
        keys, values = kv.gather(slots, int(pos.max()) + 1)  # (B, L, Hkv, hd) each, float32
        qs = q.reshape(b, c.n_kv_heads, g, c.head_dim)  # (B, Hkv, g, hd)
        scores = np.einsum("bkgd,blkd->bkgl", qs, keys) * self.scale  # (B, Hkv, g, L)
        past_end = np.arange(keys.shape[1])[None, :] > pos[:, None]  # (B, L)
        scores[np.broadcast_to(past_end[:, None, None, :], scores.shape)] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        o = np.einsum("bkgl,blkd->bkgd", p, values)  # (B, Hkv, g, hd)
        return o.reshape(b, c.n_heads * c.head_dim)


def prepare_matrix(w: np.ndarray) -> np.ndarray:
    """GGUF's (out, in) float32 weight → contiguous (in, out), once, at load.

    BLAS reads the transposed layout faster for the products decode makes (a row times a
    matrix), the output matrix most of all.
    """
    return np.ascontiguousarray(w.T)


def prepare_layer(tensors: dict[str, np.ndarray]) -> types.SimpleNamespace:
    """A layer's dequantized tensors as ops.matmul wants them: matrices transposed, norms as is,
    and the stacks model.block multiplies (attn_qkv, ffn_gate_up): here plainly the members."""
    ly = types.SimpleNamespace(**{n: prepare_matrix(a) if a.ndim == 2 else a for n, a in tensors.items()})
    ly.attn_qkv, ly.ffn_gate_up = (ly.attn_q, ly.attn_k, ly.attn_v), (ly.ffn_gate, ly.ffn_up)
    return ly


class CpuWeights:
    """Float32 weights: layers in `resident` are dequantized once, the others on each use.

    `acquire(i)` / `release(i)` is the interface every placement answers; here release is a
    no-op for resident layers and drops the float32 copy of the others.
    """

    def __init__(self, model: GGUFModel, resident: set[int] | None = None):
        self.model = model
        cfg = model.config
        self.resident = set(range(cfg.n_layers)) if resident is None else set(resident)
        self.token_embd = model.dequantize("token_embd.weight")  # (V, D): rows are looked up
        self.output = prepare_matrix(self.token_embd if cfg.tied_output else model.dequantize("output.weight"))  # (D, V)
        self.output_norm = model.dequantize("output_norm.weight")  # (D,)
        self._layers = {}
        for i in sorted(self.resident):
            self._layers[i] = self._load(i)
            model.layer_loaded(i)

    def _load(self, i: int) -> types.SimpleNamespace:
        t = self.model.layer_tensors(i)
        return prepare_layer({n: self.model.dequantize(t[n].name) for n in LAYER_TENSORS})

    def embed_rows(self, tokens: np.ndarray) -> np.ndarray:
        return self.token_embd[tokens]  # (N, D); same values as dequantize_rows, already in memory

    def acquire(self, i: int) -> types.SimpleNamespace:
        layer = self._layers.get(i)
        return layer if layer is not None else self._load(i)

    def release(self, i: int) -> None:
        pass

    def prefetch(self, layers) -> None:
        """The layers a pass will acquire, in order (the streamed subclass reads ahead itself)."""

    def link_busy(self) -> tuple[float, int]:
        return 0.0, 0


class StreamedCpuWeights(CpuWeights):
    """CpuWeights under a tier plan: its vram layers resident, its pinned and storage layers
    streamed through a tiers.cpu_stream.HostStream (slots of file bytes, dequantized from there
    on acquire). acquire(i)/release(i) as every placement answers them."""

    streamed = True

    def __init__(self, model: GGUFModel, plan: Plan, *, source: Source | None = None, poison: bool = False,
                 readers: int | None = None, host: HostMemory | None = None, device: Device | None = None,
                 shared: CpuWeights | None = None, link_cap: float | None = None):
        if shared is None:
            super().__init__(model, resident=set(plan.layers(VRAM)))
        else:  # reuse another CpuWeights' embedding, output and resident layers (tests)
            self.model, self.resident = model, set(plan.layers(VRAM))
            self.token_embd, self.output, self.output_norm = shared.token_embd, shared.output, shared.output_norm
            self._layers = {i: shared.acquire(i) for i in self.resident}
            for i in self.resident:
                model.layer_loaded(i)
        self.plan = plan
        self.host = HostStream(model, plan, source=source, poison=poison, readers=readers, host=host, device=device,
                               link_cap=link_cap)
        self.stream, self.source = self.host.stream, self.host.source

    def _views(self, i: int, slot: np.ndarray) -> types.SimpleNamespace:
        t, r = self.model.layer_tensors(i), self.host.reads[i]
        out = {}
        for n in LAYER_TENSORS:
            raw = r.raw(slot, t[n])
            if t[n].qtype == Q.F32 and len(t[n].shape) == 1:  # zero-copy: a view of the slot, valid until release
                out[n] = raw.view(np.float32).reshape(t[n].shape)
            else:
                out[n] = dequantize(raw, t[n].qtype, t[n].shape)
        return prepare_layer(out)  # the same layout resident layers have

    def prefetch(self, layers) -> None:
        self.host.prefetch(layers)

    def acquire(self, i: int) -> types.SimpleNamespace:
        layer = self._layers.get(i)
        if layer is not None:
            return layer
        return self._views(i, self.host.acquire(i))

    def release(self, i: int) -> None:
        if i not in self._layers:
            self.host.release(i)

    def link_busy(self) -> tuple[float, int]:
        return self.stream.busy() if self.stream is not None else (0.0, 0)

    def close(self) -> None:
        self.host.close()


def ops_for(model: GGUFModel) -> CpuOps:
    freq = model.dequantize("rope_freqs.weight") if "rope_freqs.weight" in model.tensors else None
    return CpuOps(model.config, freq)


def load(model: GGUFModel, *, resident: set[int] | None = None) -> tuple[CpuOps, CpuWeights]:
    return ops_for(model), CpuWeights(model, resident)


def load_share(model: GGUFModel, share: Plan, *, source: Source | None = None, poison: bool = False,
               link_cap: float | None = None) -> tuple[CpuOps, CpuWeights]:
    """The op set and the weights of a plan's share: its vram and host layers resident, its
    pinned and storage layers streamed, the others (skip: another device's, or skipped) never
    loaded."""
    ops = ops_for(model)
    if not share.streamed:
        return ops, CpuWeights(model, resident={i for i, t in enumerate(share.tiers) if t in (VRAM, HOST)})
    hosted = share.layers(HOST)
    if hosted:  # one device both streams and computes host layers: the host layers count as resident
        share = dataclasses.replace(share, tiers=tuple(VRAM if t == HOST else t for t in share.tiers))
    return ops, StreamedCpuWeights(model, share, source=source, poison=poison, link_cap=link_cap)


def kv_cache(cfg: LlamaConfig, *, n_slots: int, max_ctx: int, dtype: str, n_blocks: int | None = None) -> KVCache:
    """The paged cache (kv_cache.py); this reference reads its quantized types dequantized."""
    return KVCache(cfg, n_slots=n_slots, max_ctx=max_ctx, dtype=dtype, n_blocks=n_blocks)
