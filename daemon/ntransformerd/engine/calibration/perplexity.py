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

KL divergence, as llama-perplexity's --kl-divergence: one run (the exact float32 reference,
say) saves what it predicted on every scored token (`Base`), another run of the same tokens is
compared with it token by token:

    KL(base ‖ run) = Σ_v p_base(v) (log p_base(v) - log p_run(v))     per scored token, in nats
    mean, 99th percentile, and how often both runs rank the same token first ("same top")

A base keeps each row's `top` most likely tokens and folds the rest of the vocabulary into one
outcome (its total probability). Folding outcomes can only lower a KL divergence, so the figure
is a lower bound that reaches the full sum as `top` reaches the vocabulary; with the default
top the tail holds little of the mass (`Base.tail_mass` says how much).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
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
               max_chunks: int | None = None, progress: Callable[[int, int], None] | None = None,
               observe: Callable[[np.ndarray, np.ndarray], None] | None = None) -> Perplexity:
    """Perplexity of `tokens` with chunks of `ctx` tokens (see the module docstring).

    layers: the layers to run (Engine.step), e.g. the model minus skipped layers.
    max_chunks: score only the first chunks (a quick figure; llama-perplexity's --chunks).
    progress(done, total) is called after each chunk.
    observe(logits, targets) is called with each chunk's scored rows, in order: their logits
    (ctx - 1 - ctx // 2, V) and the tokens they score (a Recorder or a KLMeter).
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
            nll, rows = [], []
            for r0 in range(0, ctx, step_rows):  # prefill-sized steps keep (rows, V) logits small
                r1 = min(r0 + step_rows, ctx)
                logits = engine.step([(slot, chunk[r0:r1])], all_logits=True, layers=layers)  # (r1 - r0, V)
                lo, hi = max(r0, first), min(r1, ctx - 1)  # rows scored in this step
                if lo < hi:
                    nll.append(chunk_nll(logits[lo - r0:hi - r0], chunk[lo + 1:hi + 1]))
                    if observe is not None:
                        rows.append(logits[lo - r0:hi - r0])
            if observe is not None:
                observe(np.concatenate(rows), chunk[first + 1:ctx])
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


# ---- KL divergence against a saved run ---------------------------------------------------------

BASE_TOP = 1024  # tokens a base keeps per scored row (bench/RESULTS.md: what the tail leaves out)
BASE_FORMAT = "ntransformer kl-base 1"


def logsumexp(z: np.ndarray) -> np.ndarray:
    """log Σ exp over the last axis of float64 rows; -inf for a row that is all -inf."""
    m = z.max(axis=-1)  # (n,)
    finite = np.isfinite(m)
    shift = np.where(finite, m, 0.0)
    with np.errstate(divide="ignore"):
        return np.where(finite, shift + np.log(np.exp(z - shift[:, None]).sum(axis=-1)), m)


def top_tokens(logits: np.ndarray, top: int) -> np.ndarray:
    """The `top` largest logits' ids of each row (n, top), largest first, ties to the lower id
    (so column 0 is numpy's argmax)."""
    n, v = logits.shape
    ids = (np.argpartition(-logits, top - 1, axis=-1)[:, :top] if top < v
           else np.broadcast_to(np.arange(v), (n, v)))
    vals = np.take_along_axis(logits, ids, axis=-1)
    order = np.lexsort((ids, -vals), axis=-1)
    return np.take_along_axis(ids, order, axis=-1).astype(np.int32)


def tail_lse(z: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """log Σ exp(z) over each row's tokens not in ids (n, k). z (n, V) float64 is overwritten."""
    np.put_along_axis(z, ids.astype(np.int64), -np.inf, axis=-1)
    return logsumexp(z)


@dataclasses.dataclass(frozen=True)
class Base:
    """What one run predicted on each scored token of a text: its `top` most likely tokens and
    the total of the rest. Rows run over the chunks in order, ctx - 1 - ctx // 2 per chunk."""

    tokens: np.ndarray  # (n_tokens,) int64: the text as the run read it (the compared run reads these)
    ctx: int
    n_vocab: int
    top_ids: np.ndarray  # (rows, top) int32, most likely first
    top_logits: np.ndarray  # (rows, top) float32: their logits
    lse: np.ndarray  # (rows,) float64: log Σ exp(logits) over the vocabulary
    tail_lse: np.ndarray  # (rows,) float64: the same over the tokens not in top_ids (-inf: none)
    nll: np.ndarray  # (rows,) float64: -log p(next token)
    about: dict  # what made it (model, backend, text), for the report

    @property
    def chunks(self) -> int:
        return len(self.lse) // (self.ctx - 1 - self.ctx // 2)

    @property
    def tail_mass(self) -> float:
        """The mean probability the base folds into its one tail outcome."""
        return float(np.exp(self.tail_lse - self.lse).mean())

    def save(self, path: str) -> None:
        ids = self.top_ids.astype(np.uint16 if self.n_vocab <= 1 << 16 else np.int32)  # the larger half of it
        with open(path, "wb") as f:  # a path without .npz stays as given
            np.savez_compressed(f, format=np.array(BASE_FORMAT), about=np.array(json.dumps(self.about)),
                                tokens=self.tokens, ctx=np.array(self.ctx), n_vocab=np.array(self.n_vocab),
                                top_ids=ids, top_logits=self.top_logits, lse=self.lse, tail_lse=self.tail_lse,
                                nll=self.nll)

    @classmethod
    def load(cls, path: str) -> "Base":
        what = f"{path} is not a KL base (one written by ntx-model perplexity --save-logits)"
        with open(path, "rb") as f:
            if f.read(4) != b"PK\x03\x04":  # not an .npz: np.load would take it for a pickle
                raise ValueError(what)
        try:
            with np.load(path, allow_pickle=False) as z:
                if "format" not in z.files or str(z["format"]) != BASE_FORMAT:
                    raise KeyError(f"no {BASE_FORMAT!r} in it")
                base = cls(tokens=z["tokens"].astype(np.int64), ctx=int(z["ctx"]), n_vocab=int(z["n_vocab"]),
                           top_ids=z["top_ids"].astype(np.int32), top_logits=z["top_logits"], lse=z["lse"],
                           tail_lse=z["tail_lse"], nll=z["nll"], about=json.loads(str(z["about"])))
        except (OSError, KeyError, EOFError, ValueError) as e:  # a broken zip, a member missing or odd
            raise ValueError(f"{what}: {e}") from None
        rows, top = base.top_ids.shape if base.top_ids.ndim == 2 else (0, 0)
        per = base.ctx - 1 - base.ctx // 2
        if (base.ctx < 4 or rows == 0 or rows % per or base.top_logits.shape != (rows, top)
                or any(a.shape != (rows,) for a in (base.lse, base.tail_lse, base.nll))
                or len(base.tokens) < rows // per * base.ctx
                or base.top_ids.min() < 0 or base.top_ids.max() >= base.n_vocab):
            raise ValueError(f"{what}: its arrays do not agree in shape or range")
        return base


class Recorder:
    """perplexity()'s observe that keeps each scored row's top tokens: the Base of the run."""

    def __init__(self, top: int = BASE_TOP):
        if top < 1:
            raise ValueError(f"top {top}: keep at least one token per row")
        self.top = top
        self.parts: list[tuple[np.ndarray, ...]] = []
        self.n_vocab = 0

    def __call__(self, logits: np.ndarray, targets: np.ndarray) -> None:
        self.n_vocab = logits.shape[1]
        ids = top_tokens(logits, min(self.top, self.n_vocab))
        z = logits.astype(np.float64)
        lse = logsumexp(z)
        nll = lse - z[np.arange(len(targets)), targets]
        vals = np.take_along_axis(logits, ids, axis=-1).astype(np.float32)
        self.parts.append((ids, vals, lse, tail_lse(z, ids), nll))

    def base(self, tokens: Sequence[int], ctx: int, about: dict) -> Base:
        ids, vals, lse, tail, nll = (np.concatenate(a) for a in zip(*self.parts))
        return Base(np.asarray(tokens, np.int64), ctx, self.n_vocab, ids, vals, lse, tail, nll, dict(about))


@dataclasses.dataclass(frozen=True)
class KLDivergence:
    """KL(base ‖ run) over the scored tokens, in nats, and how often the two agree on the top token."""

    mean: float
    mean_err: float  # standard error of the mean
    median: float
    p99: float
    max: float
    same_top: float  # fraction of tokens whose most likely token is the same in both runs
    same_top_err: float
    ln_ppl_ratio: float  # mean of nll(run) - nll(base): ln(PPL(run) / PPL(base))
    tokens: int
    base_tail_mass: float  # Base.tail_mass: what the base folded into one outcome

    @classmethod
    def of(cls, kl: np.ndarray, same: np.ndarray, dnll: np.ndarray, tail_mass: float) -> "KLDivergence":
        n = len(kl)
        f = float(same.mean())
        return cls(float(kl.mean()), float(kl.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan,
                   float(np.median(kl)), float(np.percentile(kl, 99)), float(kl.max()),
                   f, math.sqrt(f * (1 - f) / (n - 1)) if n > 1 else math.nan, float(dnll.mean()), n, tail_mass)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def kl_rows(logits: np.ndarray, targets: np.ndarray, top_ids: np.ndarray, top_logits: np.ndarray,
            lse: np.ndarray, tail: np.ndarray, nll: np.ndarray):
    """Per row: (KL(base ‖ run), whether the top tokens agree, nll(run) - nll(base)) for the run's
    logits (n, V) against the base's rows (its arrays sliced to these n rows)."""
    z = logits.astype(np.float64)  # (n, V)
    lse_q = logsumexp(z)  # (n,)
    same = z.argmax(axis=-1) == top_ids[:, 0]
    dnll = lse_q - z[np.arange(len(targets)), targets] - nll
    lp = top_logits.astype(np.float64) - lse[:, None]  # (n, k): base log-probs
    lq = np.take_along_axis(z, top_ids, axis=-1) - lse_q[:, None]  # (n, k): the run's
    kl = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    folded = np.isfinite(tail)  # rows whose base left tokens out: one more outcome, the rest
    if folded.any():
        lp_rest = tail[folded] - lse[folded]
        lq_rest = tail_lse(z[folded], top_ids[folded]) - lse_q[folded]
        kl[folded] += np.exp(lp_rest) * (lp_rest - lq_rest)
    return kl, same, dnll


class KLMeter:
    """perplexity()'s observe that compares each chunk's rows with a Base, in order."""

    def __init__(self, base: Base):
        self.base = base
        self.row = 0
        self.parts: list[tuple[np.ndarray, ...]] = []

    def __call__(self, logits: np.ndarray, targets: np.ndarray) -> None:
        b, n = self.base, len(targets)
        if logits.shape[1] != b.n_vocab:
            raise ValueError(f"the run's vocabulary has {logits.shape[1]} tokens, the base's {b.n_vocab}: "
                             "compare runs of the same model (or of its requantized copies)")
        if self.row + n > len(b.lse):
            raise ValueError(f"the base has {b.chunks} chunks; this run scores more")
        rows = slice(self.row, self.row + n)
        self.parts.append(kl_rows(logits, targets, b.top_ids[rows], b.top_logits[rows], b.lse[rows],
                                  b.tail_lse[rows], b.nll[rows]))
        self.row += n

    def result(self) -> KLDivergence:
        kl, same, dnll = (np.concatenate(a) for a in zip(*self.parts))
        return KLDivergence.of(kl, same, dnll, float(np.exp(self.base.tail_lse - self.base.lse)[:self.row].mean()))


def kl_divergence(engine, base: Base, *, layers: Sequence[int] | None = None, max_chunks: int | None = None,
                  progress: Callable[[int, int], None] | None = None) -> tuple[Perplexity, KLDivergence]:
    """This engine's run over the base's tokens and chunks: its perplexity, and its KL divergence
    from the base."""
    meter = KLMeter(base)
    chunks = base.chunks if max_chunks is None else min(max_chunks, base.chunks)
    p = perplexity(engine, base.tokens, ctx=base.ctx, layers=layers, max_chunks=chunks, progress=progress,
                   observe=meter)
    return p, meter.result()
