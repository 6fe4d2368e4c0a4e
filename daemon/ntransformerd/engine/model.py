"""The Llama forward pass, top to bottom.

Every backend runs this same code: `ops` is the backend's op set (numpy on the CPU, our
kernels on the GPU) and `weights` hands out one layer at a time from wherever it lives
(resident, pinned RAM, storage), so this file never knows where a layer came from.

A step runs a ragged batch: each segment is one sequence's new tokens (one for decode, a
chunk for prefill) at its own position, all flattened into N rows that share every weight
read.

    x = token_embd[tokens]
    for each layer:  x += attn(norm(x));  x += ffn(norm(x))
    logits = output(norm(x[last token of each segment]))
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ntransformerd.engine.gguf_file import LlamaConfig


@dataclasses.dataclass(frozen=True)
class Segment:
    """New tokens of one sequence: KV-cache slot, position of the first token, token ids."""

    slot: int
    start: int
    tokens: np.ndarray  # (n,) int


@dataclasses.dataclass(frozen=True)
class Batch:
    """Segments flattened into rows: row r holds token `tokens[r]` at `positions[r]`."""

    segments: tuple[Segment, ...]
    tokens: np.ndarray  # (N,) int64
    positions: np.ndarray  # (N,) int64
    offsets: np.ndarray  # (S + 1,) row where each segment starts; offsets[-1] == N

    @classmethod
    def of(cls, segments: list[Segment]) -> "Batch":
        tokens = np.concatenate([np.asarray(s.tokens, np.int64).reshape(-1) for s in segments])
        positions = np.concatenate([s.start + np.arange(len(s.tokens), dtype=np.int64) for s in segments])
        offsets = np.cumsum([0] + [len(s.tokens) for s in segments])
        return cls(tuple(segments), tokens, positions, offsets)

    @property
    def last_rows(self) -> np.ndarray:
        return self.offsets[1:] - 1  # (S,)


def forward(ops, cfg: LlamaConfig, weights, kv, batch: Batch, *, layers=None, all_logits: bool = False):
    """Run one step; return logits (S, V) for each segment's last token, or (N, V) for all.

    layers: the layers to run, in order (default all): a prefix is a self-draft, the plan minus
    skipped layers a skip; a layer not run leaves its hidden state and its KV cache untouched.
    """
    x = ops.embed(weights, batch.tokens)  # (N, D)
    rope = ops.rope_table(batch.positions)
    for i in range(cfg.n_layers) if layers is None else layers:
        w = weights.acquire(i)
        x = block(ops, cfg, x, w, kv.layer(i), batch, rope)
        weights.release(i)
    if not all_logits:
        x = x[batch.last_rows]  # (S, D)
    x = ops.rms_norm(x, weights.output_norm, cfg.rms_eps)
    return ops.matmul(x, weights.output)  # (S or N, V)


def block(ops, cfg: LlamaConfig, x, w, kv, batch: Batch, rope):
    """One transformer block: pre-norm attention and SwiGLU feed-forward, each residual."""
    h = ops.rms_norm(x, w.attn_norm, cfg.rms_eps)  # (N, D)
    q = ops.matmul(h, w.attn_q)  # (N, H * hd)
    k = ops.matmul(h, w.attn_k)  # (N, Hkv * hd)
    v = ops.matmul(h, w.attn_v)  # (N, Hkv * hd)
    q = ops.rope(q, rope, cfg.n_heads)  # (N, H * hd), rotated in place of position
    k = ops.rope(k, rope, cfg.n_kv_heads)  # (N, Hkv * hd)
    a = ops.attention(q, k, v, kv, batch)  # (N, H * hd): appends k, v to the cache first
    x = x + ops.matmul(a, w.attn_output)  # (N, D)

    h = ops.rms_norm(x, w.ffn_norm, cfg.rms_eps)  # (N, D)
    g = ops.matmul(h, w.ffn_gate)  # (N, F)
    u = ops.matmul(h, w.ffn_up)  # (N, F)
    return x + ops.matmul(ops.swiglu(g, u), w.ffn_down)  # (N, D)
