"""Perplexity of a model on a text, in llama.cpp's `llama-perplexity` convention.

    tokens = tokenizer.encode(text, parse_special=False)       # BOS only if the model adds one
    for each of the len(tokens) // ctx chunks, from an empty KV cache:
        chunk[0] = BOS if the model adds BOS
        logits = engine.step(chunk, all_logits=True)            # (ctx, V)
        score rows first = ctx // 2 … ctx - 2 against tokens first + 1 … ctx - 1
    perplexity = exp(sum of -log softmax(logits)[next] / tokens scored)

Scoring only the second half of each chunk gives every scored token at least ctx/2 tokens of
context, so the figure compares across models and quantizations run with the same ctx. The
log-softmax is taken in float64 so the sum over thousands of tokens does not drift.
"""

from __future__ import annotations

import dataclasses
import os
import math
from collections.abc import Callable, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Perplexity:
    """The figure and what it was computed over."""

    perplexity: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    tokens_scored: int
    chunks: int
    ctx: int
    chunk_perplexities: tuple[float, ...]  # exp of each chunk's mean NLL

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"chunk_perplexities": list(self.chunk_perplexities)}


LICENSES = "/usr/share/common-licenses"  # Debian's license texts: the long text of the KV-cache figures


def licenses_text(directory: str = LICENSES) -> str:
    """The directory's regular files (symlinks are other names of them), sorted, concatenated."""
    names = sorted(n for n in os.listdir(directory) if not os.path.islink(os.path.join(directory, n)))
    parts = []
    for n in names:
        with open(os.path.join(directory, n), encoding="utf-8") as f:
            parts.append(f.read())
    return "\n".join(parts)


def text_tokens(engine, text: str) -> list[int]:
    """The text as llama-perplexity tokenizes it: special-token text not parsed, BOS as the
    model's metadata says."""
    return engine.tokenizer.encode(text, parse_special=False, add_special=True)


def chunk_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log softmax(logits)[target] per row, in float64. logits (n, V), targets (n,)."""
    z = logits.astype(np.float64)  # (n, V)
    m = z.max(axis=-1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(z - m).sum(axis=-1))  # (n,)
    return lse - z[np.arange(len(targets)), targets]


def perplexity(engine, tokens: Sequence[int], *, ctx: int = 512, layers: Sequence[int] | None = None,
               max_chunks: int | None = None, progress: Callable[[int, int], None] | None = None) -> Perplexity:
    """Perplexity of `tokens` with chunks of `ctx` tokens (see the module docstring).

    layers: the layers to run (Engine.step), e.g. the model minus skipped layers.
    max_chunks: score only the first chunks (a quick figure; llama-perplexity's --chunks).
    progress(done, total) is called after each chunk.
    """
    if ctx < 4:
        raise ValueError(f"ctx {ctx} is too small: use at least 4 tokens per chunk")
    if ctx > engine.max_ctx:
        raise ValueError(f"ctx {ctx} exceeds the engine's context of {engine.max_ctx}")
    n_chunks = len(tokens) // ctx
    if max_chunks is not None:
        n_chunks = min(n_chunks, max_chunks)
    if n_chunks == 0:
        raise ValueError(f"the text is {len(tokens)} tokens: perplexity needs at least ctx = {ctx} "
                         "(use a longer text or a smaller --ctx)")
    tok = engine.tokenizer
    first = ctx // 2
    step_rows = engine.config.prefill_chunk
    total, scored, per_chunk = 0.0, 0, []
    slot = engine.open()
    try:
        for c in range(n_chunks):
            chunk = np.asarray(tokens[c * ctx:(c + 1) * ctx], dtype=np.int64)
            if tok.add_bos:
                chunk[0] = tok.bos_id
            engine.truncate(slot, 0)
            nll = []
            for r0 in range(0, ctx, step_rows):  # prefill-sized steps keep (rows, V) logits small
                r1 = min(r0 + step_rows, ctx)
                logits = engine.step([(slot, chunk[r0:r1])], all_logits=True, layers=layers)  # (r1 - r0, V)
                lo, hi = max(r0, first), min(r1, ctx - 1)  # rows scored in this step
                if lo < hi:
                    nll.append(chunk_nll(logits[lo - r0:hi - r0], chunk[lo + 1:hi + 1]))
            nll = np.concatenate(nll)
            total += float(nll.sum())
            scored += nll.size
            per_chunk.append(math.exp(float(nll.mean())))
            if progress is not None:
                progress(c + 1, n_chunks)
    finally:
        engine.close(slot)
    mean = total / scored
    return Perplexity(math.exp(mean), mean, scored, n_chunks, ctx, tuple(per_chunk))
