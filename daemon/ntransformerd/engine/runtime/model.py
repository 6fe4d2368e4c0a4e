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

The GPU runs this same function: its ops are our fused kernels behind these names, and its
decode and draft-verify steps are this function captured as a CUDA graph per bucket of rows ×
tokens (backends/cuda/graphs.py). The ops decide how (fused, quantized, stacked); this file
decides what.
"""

from __future__ import annotations

import dataclasses
import typing

import numpy as np

from ntransformerd.engine.gguf_file import LlamaConfig


class Segment(typing.NamedTuple):
    """New tokens of one sequence: KV-cache slot, position of the first token, token ids. (A
    named tuple: a step builds one per row, at half a frozen dataclass's cost.)"""

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

    @classmethod
    def of_tokens(cls, segments: list[Segment], tokens: np.ndarray, positions: np.ndarray) -> "Batch":
        """Segments of one token each (a decode step) whose tokens and positions (S,) the caller
        already holds flat. (The offsets from range, not np.arange, whose fill lets the GIL go:
        the scheduler's thread would wait for it again behind the daemon's others.)"""
        n = len(segments)
        return cls(tuple(segments), tokens, positions, np.fromiter(range(n + 1), np.int64, n + 1))

    @property
    def last_rows(self) -> np.ndarray:
        return self.offsets[1:] - 1  # (S,)


def forward(ops, cfg: LlamaConfig, weights, kv, batch: Batch, *, layers=None, all_logits: bool = False):
    """Run one step; return logits (S, V) for each segment's last token, or (N, V) for all.

    layers: the layers to run, in order (default all): a prefix is a self-draft, the plan minus
    skipped layers a skip; a layer not run leaves its hidden state and its KV cache untouched.
    """
    layers = range(cfg.n_layers) if layers is None else layers
    x = ops.embed(weights, batch.tokens)  # (N, D)
    x = run_layers(ops, cfg, weights, kv, batch, x, layers)
    return head(ops, cfg, weights, x, batch, all_logits=all_logits)


def run_layers(ops, cfg: LlamaConfig, weights, kv, batch: Batch, x, layers):
    """x through `layers` in order, each fetched from wherever it lives (a stage of a pipeline
    runs its own range on its own device)."""
    rope = ops.rope_table(batch.positions)
    weights.prefetch(layers)  # the streamed ones start coming now, in this order
    for i in layers:
        w = weights.acquire(i)
        x = block(ops, cfg, x, w, kv.layer(i), batch, rope)
        weights.release(i)
    return x


def head(ops, cfg: LlamaConfig, weights, x, batch: Batch, *, all_logits: bool = False):
    """Final norm and output matrix: logits of each segment's last row (S, V), or of all (N, V)."""
    if not all_logits:
        x = ops.rows(x, batch.last_rows)  # (S, D)
    x = ops.rms_norm(x, weights.output_norm, cfg.rms_eps)
    return ops.matmul(x, weights.output)  # (S or N, V)


def block(ops, cfg: LlamaConfig, x, w, kv, batch: Batch, rope):
    """One transformer block: pre-norm attention and SwiGLU feed-forward, each residual."""
    h = ops.rms_norm(x, w.attn_norm, cfg.rms_eps)  # (N, D)
    q, k, v = ops.matmul(h, w.attn_qkv)  # (N, H * hd), (N, Hkv * hd) × 2: q, k, v stacked at load
    a = ops.attention(q, k, v, kv, batch, rope)  # (N, H * hd): RoPE on q and k, k and v to the cache first
    x = ops.matmul(a, w.attn_output, residual=x)  # (N, D): x + a Wo

    h = ops.rms_norm(x, w.ffn_norm, cfg.rms_eps)  # (N, D)
    g, u = ops.matmul(h, w.ffn_gate_up)  # (N, F) × 2
    return ops.matmul(ops.swiglu(g, u), w.ffn_down, residual=x)  # (N, D): x + swiglu(g, u) Wd
