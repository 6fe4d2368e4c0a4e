"""Next-token choice from logits, and stop strings.

The chain is llama.cpp's default order (common/sampling.cpp): penalties -> top-k -> top-p ->
min-p -> temperature -> draw. Each step follows its llama-sampling.cpp counterpart:

* penalties, over the last ``penalty_last_n`` ids of the history, for each id seen ``c`` times:
  ``logit = logit * r if logit <= 0 else logit / r`` (repetition), then
  ``logit -= c * frequency_penalty + (c > 0) * presence_penalty``;
* top-k keeps the k largest logits (0 = off);
* top-p keeps the smallest prefix of the sorted distribution whose probability reaches p;
* min-p keeps ids whose probability is at least ``min_p`` times the largest one;
* temperature divides the logits; below ``GREEDY_BELOW`` (0 included) it is greedy: the largest
  logit, lowest id on ties (dividing by a vanishing temperature would overflow).

Logits that hold NaN or +inf, or no finite value, are the model's fault, not the request's:
the sampler raises ``InvalidLogits`` so the caller can tell the two apart. Every parameter range
keeps a finite row finite, so the chain always has a candidate; should the penalties still push
a row out of range (logits near float32's limit), that token is the argmax of the unpenalised
row (``unpenalised_fallback``).

A constraint (engine/generation/constraints.py) reaches the chain as a mask: a boolean row of the ids
that may come next, applied right after the ignore_eos ban, before the penalties and every
filter, so greedy, sampled and speculative paths all draw from the masked row.

Log-probabilities (``token_logprobs``, ``prompt_logprobs``) are log-softmax of the model's own
row in float64: before the penalties, temperature, filters and mask, as OpenAI reports them.

Thread rule: a ``Sampler`` and a ``StopMatcher`` belong to one sequence and one thread. Each
``Sampler`` owns its numpy Generator, so a seed reproduces a sequence whatever else runs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Iterable, Sequence

import numpy as np

__all__ = ["Drawn", "GREEDY_BELOW", "InvalidLogits", "InvalidParameter", "MAX_TOP_LOGPROBS", "NoAllowedToken",
           "SampleRows", "SamplingParams", "Sampler", "StopMatcher", "TopLogits", "TopRow", "draw_from",
           "prompt_logprobs", "sample_rows", "token_logprobs"]

MAX_STOPS = 16
MAX_STOP_CHARS = 256
GREEDY_BELOW = 1e-5  # temperatures below this are greedy
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # |logit| grows at most 100x: a finite row stays finite
MAX_TOP_LOGPROBS = 20  # alternatives per position a request may ask for (OpenAI's limit)


class InvalidLogits(ValueError):
    """A row of logits no token can be drawn from (NaN, +inf, nothing finite): the model or its
    backend is broken; no sampling parameter causes it."""


class RequestCannotGoOn(ValueError):
    """The request itself allows no next token (its constraint): its fault, not the model's or
    the daemon's; the request ends with INVALID_ARGUMENT."""


class NoAllowedToken(RequestCannotGoOn):
    """The request's mask (its constraint) leaves no token with a finite logit: the request's
    fault, not the model's."""


class InvalidParameter(ValueError):
    """A SamplingParams field out of its range or of the wrong type; `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to choose each next token. Defaults are llama.cpp's (llama-cli / llama-server).

    temperature: below GREEDY_BELOW (1e-5; 0 included) greedy (argmax); otherwise logits are
        divided by it.
    top_k: keep the k most likely ids; 0 = off.
    top_p: nucleus sampling, in (0, 1]; 1 = off.
    min_p: drop ids less likely than min_p x the most likely one, in [0, 1]; 0 = off.
    repetition_penalty: in [0.01, 100]; 1 = off. frequency_penalty, presence_penalty: in [-2, 2]; 0 = off.
    penalty_last_n: how many of the latest history ids the penalties look at; 0 = none,
        -1 = the whole history.
    seed: None draws a fresh seed from the OS; an int in [0, 2**64) makes sampling repeatable.
    stop: strings that end generation; the stop string itself is not returned.
    max_tokens: most tokens to generate. ignore_eos: keep going past end-of-generation tokens.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 64
    seed: int | None = None
    stop: tuple[str, ...] = ()
    max_tokens: int = 256
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # a list is a natural thing to pass; keep the dataclass hashable and immutable
        if isinstance(self.stop, (list, str)):
            object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))

    @property
    def is_greedy(self) -> bool:
        """Argmax decoding: a temperature below GREEDY_BELOW."""
        return self.temperature < GREEDY_BELOW

    @classmethod
    def greedy(cls, **overrides) -> "SamplingParams":
        """Argmax decoding with no filters or penalties (for tests and golden runs)."""
        return cls(**{"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, **overrides})

    def validate(self) -> "SamplingParams":
        """Raise InvalidParameter (a ValueError) naming the first bad field; return self when
        all are fine."""

        def number(name: str, lo: float, hi: float, *, lo_open: bool = False) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise InvalidParameter(name, f"{name} must be a number, not {type(v).__name__}")
            if math.isnan(v) or math.isinf(v):
                raise InvalidParameter(name, f"{name} must be a finite number, got {v}")
            if v < lo or v > hi or (lo_open and v == lo):
                left = "(" if lo_open else "["
                raise InvalidParameter(name, f"{name} must be in {left}{lo:g}, {hi:g}], got {v:g}")

        def integer(name: str, lo: int, hi: int) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise InvalidParameter(name, f"{name} must be an integer, not {type(v).__name__}")
            if not lo <= v <= hi:
                raise InvalidParameter(name, f"{name} must be in [{lo}, {hi}], got {v}")

        number("temperature", 0.0, 100.0)
        integer("top_k", 0, 2**31 - 1)
        number("top_p", 0.0, 1.0, lo_open=True)
        number("min_p", 0.0, 1.0)
        number("repetition_penalty", *REPETITION_PENALTY_RANGE)
        number("frequency_penalty", -2.0, 2.0)
        number("presence_penalty", -2.0, 2.0)
        integer("penalty_last_n", -1, 2**31 - 1)
        integer("max_tokens", 1, 2**31 - 1)
        if self.seed is not None:
            integer("seed", 0, 2**64 - 1)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidParameter("ignore_eos", f"ignore_eos must be true or false, not {self.ignore_eos!r}")
        if not isinstance(self.stop, tuple):
            raise InvalidParameter("stop", "stop must be a list of strings")
        if len(self.stop) > MAX_STOPS:
            raise InvalidParameter("stop", f"at most {MAX_STOPS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidParameter("stop", f"each stop string must be a non-empty string, got {s!r}")
            if len(s) > MAX_STOP_CHARS:
                raise InvalidParameter("stop", f"stop strings are at most {MAX_STOP_CHARS} characters, got {len(s)}")
        return self


class Sampler:
    """Chooses token ids for one sequence. ``sample(logits, history)`` with logits (V,) float32
    and history the ids so far (prompt and generated; the penalties read its tail).

    eog_ids: with ``params.ignore_eos``, these ids are never drawn (as llama.cpp's logit bias of
    -inf); otherwise they are ordinary candidates and the caller stops on them.
    """

    def __init__(self, params: SamplingParams, vocab_size: int, *, eog_ids: Iterable[int] = ()) -> None:
        params.validate()
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.params = params
        self.vocab_size = vocab_size
        self.rng = np.random.default_rng(params.seed)
        self.held: float | None = None  # a uniform drawn for a step that did not run, given back (give_back)
        self._banned = np.array(sorted(eog_ids), dtype=np.int64) if params.ignore_eos else None
        self._need = self._needed()
        # its row of a step's SampleRows, but for the uniform and the penalties' window (the
        # params are frozen: built once, not at every step)
        self.chain = np.array([1.0, params.is_greedy, params.temperature, params.top_k, params.top_p, params.min_p,
                               params.repetition_penalty, params.frequency_penalty, params.presence_penalty,
                               self._need or 0, penalises(params)], np.float64)
        self.chain.flags.writeable = False

    def sample(self, logits: np.ndarray | "TopRow", history: Sequence[int] = (), mask: np.ndarray | None = None) -> int:
        """The next id from a row of logits (V,), or from its TopRow where need() allowed one;
        mask: the ids allowed next (bool (V,)), None: all. The same draw as this row in a
        batch (`sample_rows`): one implementation."""
        if isinstance(logits, TopRow):
            if mask is not None:
                raise ValueError("a masked row needs the whole row of logits, not its top ids")
            top = TopLogits(logits.ids[None], logits.vals[None], np.array([logits.nan]), sort=False)
            drawn = sample_rows(top, SampleRows.of([self], [history]))
        else:
            x = np.asarray(logits, dtype=np.float32).reshape(-1)
            if x.shape != (self.vocab_size,):
                raise ValueError(f"logits must have shape ({self.vocab_size},), got {np.shape(logits)}")
            drawn = sample_rows(x[None], SampleRows.of([self], [history], masks=[mask]))
        return drawn.id(0)

    def _penalised(self, logits, history: Sequence[int], mask: np.ndarray | None = None) -> np.ndarray:
        """A float32 copy of the row, checked, with the ignore_eos ban, the mask and the penalties
        applied (penalised_row); raises InvalidLogits or NoAllowedToken for a row no id can be
        drawn from."""
        x = np.asarray(logits, dtype=np.float32).reshape(-1)
        if x.shape != (self.vocab_size,):
            raise ValueError(f"logits must have shape ({self.vocab_size},), got {np.shape(logits)}")
        ids, counts = penalty_window(history, self.params, self.vocab_size)
        p = self.params
        y = penalised_row(x, self.banned, mask, ids, counts, p.repetition_penalty, p.frequency_penalty,
                          p.presence_penalty)
        if isinstance(y, int):
            raise_fault(y)
        return y

    def uniform(self) -> float:
        """The next uniform of its draws: one given back first, else its generator's next."""
        if self.held is not None:
            u, self.held = self.held, None
            return u
        return self.rng.random()

    def give_back(self, u: float) -> None:
        """A uniform drawn for a step that failed before drawing (its KV blocks could not be
        reserved): the next draw uses it, so a retried step draws what it would have."""
        self.held = float(u)

    @property
    def banned(self) -> np.ndarray:
        """The ids never drawn (end-of-generation ids with ignore_eos), int64."""
        return self._banned if self._banned is not None else _NONE

    def distribution(self, logits: np.ndarray, history: Sequence[int] = (),
                     mask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The distribution sample() draws from: (ids, probabilities float64), most likely first.

        The same chain (ignore_eos ban, mask, penalties from `history`, top-k, top-p, min-p,
        temperature); greedy is a point mass on the argmax. Speculative decoding verifies drafts
        against exactly this distribution, so accepting by it keeps sample()'s distribution.
        """
        p = self.params
        x = self._penalised(logits, history, mask)
        if p.is_greedy:
            return np.array([int(np.argmax(x))]), np.ones(1)
        ids = top_sorted(x, p.top_k)
        ids, v = filter_candidates(ids, x[ids], p.top_p, p.min_p)
        z = v.astype(np.float64) / p.temperature
        w = np.exp(z - z[0])
        return ids, w / w.sum()

    def need(self) -> int | None:
        """How many of a row's most likely ids (TopLogits) make sample_top draw exactly what
        sample would from the whole row; None where only the whole row will do (penalties, which
        can lift any id, or no top-k with a temperature)."""
        return self._need

    def _needed(self) -> int | None:
        p = self.params
        if penalises(p):
            return None
        banned = 0 if self._banned is None else self._banned.size
        k = 1 if p.is_greedy else p.top_k
        if k <= 0 or k + banned > TOP_MAX:
            return None
        return min(k + banned, self.vocab_size)

    def sample_top(self, top: "TopRow") -> int:
        """sample() from a row's need() most likely ids and their logits (most likely first, ties
        lowest id first): the same id, and the same draw from the generator."""
        if self.need() is None:
            raise ValueError("these sampling parameters need the whole row of logits")
        return self.sample(top)


# The most ids a TopLogits row carries (the device's top_rows kernel has no bound; the host's
# copy and sort of them stay small).
TOP_MAX = 256


@dataclasses.dataclass(frozen=True)
class TopRow:
    """A row's n most likely ids and their logits, most likely first (ties: lower id first), and
    how many NaNs the row had."""

    ids: np.ndarray  # (n,) int64
    vals: np.ndarray  # (n,) float32
    nan: int = 0


class TopLogits:
    """TopRows of a batch: what a decode step hands back instead of (B, V) logits when every
    row's sampler says how many ids it needs (Sampler.need)."""

    def __init__(self, ids: np.ndarray, vals: np.ndarray, nan: np.ndarray, *, sort: bool = True):
        ids, vals = np.asarray(ids, np.int64), np.asarray(vals, np.float32)
        if sort:  # logit descending, then id ascending, per row
            order = np.lexsort((ids, -vals), axis=-1)
            ids, vals = np.take_along_axis(ids, order, -1), np.take_along_axis(vals, order, -1)
        self.ids, self.vals, self.nan = ids, vals, np.asarray(nan)

    @classmethod
    def of(cls, logits: np.ndarray, n: int) -> "TopLogits":
        """From host logits (B, V): the reference for the device's top_rows."""
        logits = np.asarray(logits, np.float32)
        nan = np.isnan(logits).sum(-1)
        x = np.where(np.isnan(logits), -np.inf, logits)
        ids = np.stack([top_sorted(r, n) for r in x])
        return cls(ids, np.take_along_axis(x, ids, -1), nan, sort=False)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int) -> TopRow:
        return TopRow(self.ids[i], self.vals[i], int(self.nan[i]))

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def _log_softmax(rows: np.ndarray) -> np.ndarray:
    """float64 log-softmax of rows (n, V); InvalidLogits where a row holds NaN or +inf."""
    z = np.asarray(rows, dtype=np.float64)
    m = z.max(axis=-1, keepdims=True)  # NaN if any is NaN
    if not np.isfinite(m).all():
        raise InvalidLogits("logits contain NaN or +inf, or nothing finite: the forward pass produced invalid numbers")
    return z - (m + np.log(np.exp(z - m).sum(axis=-1, keepdims=True)))


def token_logprobs(row: np.ndarray, token: int, n: int) -> tuple[float, np.ndarray, np.ndarray]:
    """(log-probability of `token`, the n most likely ids, their log-probabilities) of one row
    of logits (V,): log-softmax of the row itself, most likely first, ties lower id first."""
    lp = _log_softmax(np.asarray(row).reshape(1, -1))[0]
    top = top_sorted(lp, n) if n > 0 else np.zeros(0, np.int64)
    return float(lp[token]), top, lp[top]


def prompt_logprobs(rows: np.ndarray, targets: Sequence[int], n: int) -> list[tuple[float, np.ndarray, np.ndarray]]:
    """token_logprobs for each row of (k, V) logits and the token that followed it (targets)."""
    lp = _log_softmax(rows)  # (k, V)
    out = []
    for r, t in zip(lp, targets):
        top = top_sorted(r, n) if n > 0 else np.zeros(0, np.int64)
        out.append((float(r[t]), top, r[top]))
    return out


def apply_penalties(x: np.ndarray, history: Sequence[int], p: SamplingParams) -> np.ndarray:
    """Repetition, frequency and presence penalties on ``x`` (float32, changed in place) from the
    last ``p.penalty_last_n`` ids of ``history``, as llama.cpp's penalties sampler."""
    ids, counts = penalty_window(history, p, x.shape[0])
    if ids is None:
        return x
    return penalise(x, ids, counts, p.repetition_penalty, p.frequency_penalty, p.presence_penalty)


def penalises(p: SamplingParams) -> bool:
    """Whether any penalty acts on the draws of `p` (given a history to read)."""
    return p.penalty_last_n != 0 and (p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
                                      or p.presence_penalty != 0.0)


def penalty_window(history: Sequence[int], p: SamplingParams, vocab_size: int):
    """(ids, counts) of the last ``p.penalty_last_n`` ids of ``history`` that the penalties
    act on; (None, None) where no penalty applies."""
    if not penalises(p) or len(history) == 0:
        return None, None
    tail = history if p.penalty_last_n < 0 else history[-p.penalty_last_n:]
    tail = np.asarray(tail, dtype=np.int64)
    tail = tail[(tail >= 0) & (tail < vocab_size)]
    return np.unique(tail, return_counts=True)


def penalise(x: np.ndarray, ids: np.ndarray, counts: np.ndarray, repetition: float, frequency: float,
             presence: float) -> np.ndarray:
    """The penalties on ``x`` (float32, changed in place) for ids seen ``counts`` times."""
    v = x[ids]
    with np.errstate(over="ignore"):  # an overflow is the caller's to handle (penalised_row: unpenalised_fallback)
        v = np.where(v <= 0, v * np.float32(repetition), v / np.float32(repetition))
    v = v - (counts.astype(np.float32) * np.float32(frequency) + np.float32(presence))
    x[ids] = v.astype(np.float32)
    return x


def unpenalised_fallback(x: np.ndarray) -> np.ndarray:
    """The row reduced to its argmax (0 there, -inf elsewhere): what the chain draws from when
    the penalties push a row out of float32's range. Every filter then keeps that one id."""
    y = np.full_like(x, -np.inf)
    y[int(np.argmax(x))] = 0.0
    return y


def top_sorted(x: np.ndarray, top_k: int) -> np.ndarray:
    """The top_k ids of ``x`` (0 or less: all), sorted by logit descending, ties lower id first;
    ties at the k-th logit are resolved to the lowest ids."""
    n = x.shape[0]
    k = n if top_k <= 0 else min(top_k, n)
    if k < n:
        part = np.argpartition(-x, k - 1)[:k]
        # argpartition picks arbitrarily among ids tied with the k-th; take the lowest ids
        kth = x[part].min()
        above = np.flatnonzero(x > kth)
        tied = np.flatnonzero(x == kth)[: k - above.size]
        ids = np.concatenate([above, tied])
    else:
        ids = np.arange(n)
    return ids[np.lexsort((ids, -x[ids]))]  # logit descending, then id ascending


def draw_filtered(ids: np.ndarray, v: np.ndarray, top_p: float, min_p: float, temperature: float, u: float) -> int:
    """Top-p, min-p, temperature and the draw by a uniform u in [0, 1) over sorted candidates
    ids (logits v): the end of the chain."""
    ids, v = filter_candidates(ids, v, top_p, min_p)  # most likely first
    z = v.astype(np.float64) / temperature
    w = np.exp(z - z[0])
    c = np.cumsum(w)
    k = int(np.searchsorted(c, u * c[-1], side="right"))
    return int(ids[min(k, len(ids) - 1)])


def draw_from(ids: np.ndarray, probs: np.ndarray, u: float) -> int:
    """The id a uniform u in [0, 1) picks from a distribution by its running sum (as _draw does)."""
    c = np.cumsum(probs)
    k = int(np.searchsorted(c, u * c[-1], side="right"))
    return int(ids[min(k, len(ids) - 1)])


def filter_candidates(ids: np.ndarray, v: np.ndarray, top_p: float, min_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Drop -inf (but never the first), then top-p, then min-p from sorted ids with logits v."""
    keep = np.isfinite(v) | (np.arange(v.size) == 0)
    ids, v = ids[keep], v[keep]
    if top_p < 1.0 and ids.size > 1:
        z = v.astype(np.float64)
        prob = np.exp(z - z[0])
        prob /= prob.sum()
        cum = np.cumsum(prob)
        # the first index where the running sum reaches p is kept, as llama.cpp does
        last = min(int(np.searchsorted(cum, top_p, side="left")), ids.size - 1) + 1
        ids, v = ids[:last], v[:last]
    if min_p > 0.0 and ids.size > 1:
        keep = v >= v[0] + np.float32(math.log(min_p))
        ids, v = ids[keep], v[keep]
    return ids, v


def candidates(x: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Ids that survive top-k, top-p and min-p (in that order) from logits ``x``, sorted by
    logit descending (ties: lower id first). Always at least one id."""
    ids = top_sorted(x, top_k)
    return filter_candidates(ids, x[ids], top_p, min_p)[0]


class StopMatcher:
    """Finds stop strings in streamed text. ``feed(delta)`` returns ``(text, stopped)``: the
    text that is safe to show now, and whether a stop string was found. Text that could still
    turn out to be the start of a stop string is held back until it can be decided; a found
    stop string and everything after it are dropped. ``flush()`` returns what is held back when
    generation ends for another reason.
    """

    def __init__(self, stops: Iterable[str] = ()) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        buf = self._held + delta
        if not self.stops:
            self._held = ""
            return buf, False
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return buf[: min(hits)], True
        hold = self._partial_suffix(buf)
        self._held = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """The held-back text (not a stop string after all); empty once stopped."""
        text, self._held = ("" if self.stopped else self._held), ""
        return text

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best


# ---- a step's draws, all rows at once ------------------------------------------------------------
#
# A step whose rows all sample on the device hands back ids, not logits (Engine.step(sample=…)).
# SampleRows is what such a sampler takes: each row's chain as numbers, and the uniform its draw
# uses, drawn on the host from the request's own generator (one per sampled draw, exactly as
# Sampler.sample draws it), so a seed gives the same ids whichever computes them. `sample_rows`
# is the host's implementation and the reference a device one is tested against; Sampler.sample
# is sample_rows on one row, so the per-request and the batched draws are one implementation.
# A device sampler takes the step's logits where they are (B, V) and a SampleRows whose ragged
# fields it receives packed, and returns Drawn (B ids, B fault codes): 9 bytes a row to the host.
# Greedy rows must give sample_rows' ids exactly; a filtered draw uses the row's uniform as given
# (top-k, top-p, min-p, temperature, then the running-sum search), so its ids equal
# sample_rows' wherever float64 rounding of exp and the sums does not move a boundary.

_NONE = np.zeros(0, np.int64)
# Sampler.chain of a row that draws nothing: draws, greedy, temperature, top_k, top_p, min_p,
# repetition, frequency, presence, need, penalises
_IDLE = np.array([0.0, 0.0, 0.0, 0, 1.0, 0.0, 1.0, 0.0, 0.0, 0, 0.0])
FAULT_NAN, FAULT_INF, FAULT_NO_FINITE, FAULT_NOT_ALLOWED = 1, 2, 3, 4  # Drawn.fault: why a row has no id


def raise_fault(code: int) -> None:
    """The error for a row no id can be drawn from (Drawn.fault)."""
    if code == FAULT_NAN:
        raise InvalidLogits("logits contain NaN: the forward pass produced invalid numbers")
    if code == FAULT_INF:
        raise InvalidLogits("logits contain +inf: the forward pass overflowed")
    if code == FAULT_NO_FINITE:
        raise InvalidLogits("no token can be drawn: every logit is -inf")
    if code == FAULT_NOT_ALLOWED:
        raise NoAllowedToken("no token can be drawn: the request's constraint allows no token the model can "
                             "produce here; check the schema, regex or grammar")
    raise ValueError(f"unknown sampling fault {code}")


RECENT_ROW_SETS = 4  # SampleRows.of keeps what the samplers of this many row sets fix


@dataclasses.dataclass(frozen=True)
class SampleRows:
    """Each row's sampling chain for one step, as arrays (B rows), and the uniform of its draw.

    Rows that do not draw (a prompt chunk that does not end its prompt) have draws False. The
    ragged fields are per row: `penalty` the (ids, counts) of the history window the penalties
    read (None: no penalty), `banned` the ids never drawn (ignore_eos), `masks` a constraint's
    allowed ids (bool (V,), None: all). A device sampler packs them as offsets and values.
    """

    draws: np.ndarray  # (B,) bool
    greedy: np.ndarray  # (B,) bool: argmax (temperature below GREEDY_BELOW)
    temperature: np.ndarray  # (B,) float64
    top_k: np.ndarray  # (B,) int64, 0: off
    top_p: np.ndarray  # (B,) float64
    min_p: np.ndarray  # (B,) float64
    repetition: np.ndarray  # (B,) float64 (applied as float32, as llama.cpp)
    frequency: np.ndarray  # (B,) float64
    presence: np.ndarray  # (B,) float64
    need: np.ndarray  # (B,) int64: the most likely ids a row draws from (Sampler.need), 0: the whole row
    uniform: np.ndarray  # (B,) float64 in [0, 1); NaN where the row draws no random number
    penalty: tuple
    banned: tuple
    masks: tuple

    # (samplers, their _Chains) of the row sets of the last few `of` calls, the latest first
    _recent: ClassVar[tuple[tuple[tuple, "_Chains"], ...]] = ()

    @classmethod
    def of(cls, samplers: Sequence["Sampler | None"], histories: Sequence[Sequence[int]],
           masks: Sequence[np.ndarray | None] | None = None) -> "SampleRows":
        """The rows of `samplers` (None: a row that does not draw) after `histories`; each
        sampled row's uniform is drawn from its sampler's generator now.

        What does not change from draw to draw (each Sampler.chain) is built once for a set of
        rows and shared, read-only, by the steps that repeat it: a scheduler's steps hold the same
        rows until a request joins or leaves, and on a device consecutive steps may hold different
        rows, a set coming back a step or two later (policy.compose: a request in the step in
        flight waits for it, unless it runs ahead), so the last RECENT_ROW_SETS sets are kept. A
        step then draws its uniforms and reads the penalties' windows alone."""
        n = len(samplers)
        masks = tuple(masks) if masks is not None else (None,) * n
        key = tuple(samplers)
        recent = SampleRows._recent  # read and replaced whole: another thread's steps only miss it
        if recent and recent[0][0] == key:
            chains = recent[0][1]
        else:
            chains = next((c for k, c in recent if k == key), None)
            if chains is None:
                chains = _Chains.of(key)
            kept = tuple(e for e in recent if e[1] is not chains)[:RECENT_ROW_SETS - 1]
            SampleRows._recent = ((key, chains),) + kept
        uniform = np.full(n, np.nan)
        for i in chains.sampled:
            uniform[i] = samplers[i].uniform()
        penalty = [None] * n
        for i in chains.penalised:
            s = samplers[i]
            ids, counts = penalty_window(histories[i], s.params, s.vocab_size)
            penalty[i] = None if ids is None else (ids, counts)
        return cls(*chains.arrays, uniform, tuple(penalty), chains.banned, masks)

    def __len__(self) -> int:
        return self.draws.shape[0]

    def take(self, rows: Sequence[int]) -> "SampleRows":
        """These rows alone, in this order (their uniforms as drawn: nothing is drawn again)."""
        idx = np.asarray(rows, np.int64)
        return SampleRows(*(v[idx] if isinstance(v, np.ndarray) else tuple(v[int(i)] for i in idx)
                            for v in (getattr(self, f.name) for f in dataclasses.fields(self))))


@dataclasses.dataclass(frozen=True)
class _Chains:
    """The part of a step's SampleRows that its samplers fix: the arrays from `draws` to `need`
    (read-only), the rows that draw a uniform, the rows whose penalties read a history window,
    and each row's banned ids."""

    arrays: tuple
    sampled: list
    penalised: list
    banned: tuple

    @classmethod
    def of(cls, samplers: tuple) -> "_Chains":
        n = len(samplers)
        t = np.concatenate([_IDLE if s is None else s.chain for s in samplers] or [_IDLE[:0]]).reshape(n, _IDLE.size)
        draws, greedy, pen = t[:, 0] != 0, t[:, 1] != 0, t[:, 10] != 0
        arrays = (draws, greedy, t[:, 2].copy(), t[:, 3].astype(np.int64), t[:, 4].copy(), t[:, 5].copy(),
                  t[:, 6].copy(), t[:, 7].copy(), t[:, 8].copy(), t[:, 9].astype(np.int64))
        for a in arrays:
            a.flags.writeable = False
        return cls(arrays, np.flatnonzero(draws & ~greedy).tolist(), np.flatnonzero(pen).tolist(),
                   tuple(_NONE if s is None else s.banned for s in samplers))


@dataclasses.dataclass(frozen=True)
class Drawn:
    """The ids of a step's rows (-1 where a row does not draw) and, per row, why none could be
    drawn (0: drawn; FAULT_*)."""

    ids: np.ndarray  # (B,) int64
    fault: np.ndarray  # (B,) int8

    def id(self, i: int) -> int:
        """Row i's id; InvalidLogits or NoAllowedToken where it has none."""
        if self.fault[i]:
            raise_fault(int(self.fault[i]))
        return int(self.ids[i])


def penalised_row(x: np.ndarray, banned: np.ndarray, mask: np.ndarray | None, pen_ids, pen_counts,
                  repetition: float, frequency: float, presence: float) -> np.ndarray | int:
    """A float32 copy of the row with the ignore_eos ban, the mask and the penalties applied,
    or the FAULT_* code of a row no id can be drawn from. Where the penalties leave no finite
    maximum (only possible for logits near float32's limit) the row is the unpenalised one
    reduced to its argmax (unpenalised_fallback)."""
    top = x.max()  # NaN if any is NaN
    if np.isnan(top):
        return FAULT_NAN
    if top == np.inf:
        return FAULT_INF
    x = x.copy()
    if banned.size:
        x[banned] = -np.inf
    if x.max() == -np.inf:
        return FAULT_NO_FINITE
    if mask is not None:
        x[~mask] = -np.inf
    if x.max() == -np.inf:
        return FAULT_NOT_ALLOWED
    if pen_ids is None:
        return x
    y = penalise(x.copy(), pen_ids, pen_counts, repetition, frequency, presence)
    if np.isfinite(y.max()):
        return y
    return unpenalised_fallback(x)


def sample_rows(x: "np.ndarray | TopLogits", rows: SampleRows) -> Drawn:
    """One id per drawing row of logits x (B, V), or of its TopLogits where every drawing row's
    need() allows: the reference of a device sampler. Greedy rows without penalties, ban or mask
    are one argmax over the batch; the others follow the chain row by row."""
    n = len(rows)
    ids, fault = np.full(n, -1, np.int64), np.zeros(n, np.int8)
    if isinstance(x, TopLogits):
        return _draw_tops(x, rows)
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[0] != n:
        raise ValueError(f"logits must have shape ({n}, V), got {x.shape}")
    plain = rows.draws & rows.greedy & np.array([p is None and b.size == 0 and m is None for p, b, m in
                                                  zip(rows.penalty, rows.banned, rows.masks)], bool)
    if plain.any():
        sub = x[plain]
        top = sub.max(axis=1)
        ids[plain] = np.argmax(sub, axis=1)  # first maximum: the lowest id wins ties
        fault[plain] = np.where(np.isnan(top), FAULT_NAN, np.where(top == np.inf, FAULT_INF,
                                                                  np.where(top == -np.inf, FAULT_NO_FINITE, 0)))
    for i in np.flatnonzero(rows.draws & ~plain):
        pen = rows.penalty[i]
        y = penalised_row(x[i], rows.banned[i], rows.masks[i], *(pen if pen is not None else (None, None)),
                          rows.repetition[i], rows.frequency[i], rows.presence[i])
        if isinstance(y, int):
            fault[i] = y
        elif rows.greedy[i]:
            ids[i] = int(np.argmax(y))
        else:
            cand = top_sorted(y, int(rows.top_k[i]))
            ids[i] = draw_filtered(cand, y[cand], rows.top_p[i], rows.min_p[i], rows.temperature[i], rows.uniform[i])
    return Drawn(ids, fault)


def _draw_tops(top: TopLogits, rows: SampleRows) -> Drawn:
    """Each drawing row's (id, fault) from its most likely ids (Sampler.need of them): the checks,
    the ignore_eos bans and greedy rows for all rows at once; a filtered row's draw by
    draw_filtered over its candidates."""
    n = len(rows)
    ids, fault = np.full(n, -1, np.int64), np.zeros(n, np.int8)
    d = np.flatnonzero(rows.draws)
    if d.size == 0:
        return Drawn(ids, fault)
    need = rows.need[d]
    if (need == 0).any():
        raise ValueError("these sampling parameters need the whole row of logits")
    if any(rows.masks[i] is not None for i in d):
        raise ValueError("a masked row needs the whole row of logits, not its top ids")
    short = (top.nan[d] == 0) & (need > top.ids.shape[1])  # a row of NaNs faults whatever it got
    if short.any():
        raise ValueError(f"sampling needs the {int(need[short].max())} most likely ids, got {top.ids.shape[1]}")
    cid, cv = top.ids[d], top.vals[d]
    keep = None
    groups: dict[bytes, tuple[np.ndarray, list[int]]] = {}  # rows sharing one ban list (the model's EOG ids)
    for j, i in enumerate(d):
        b = rows.banned[i]
        if b.size:
            groups.setdefault(b.tobytes(), (b, []))[1].append(j)
    if groups:  # banned ids leave the candidates, the others keep their order
        keep = np.ones(cid.shape, bool)
        for b, js in groups.values():
            keep[js] = ~(cid[js, :, None] == b).any(-1) if b.size <= 16 else ~np.isin(cid[js], b)
        kept, at = keep.sum(1), keep.argmax(1)
    else:
        kept, at = np.full(d.size, cid.shape[1]), np.zeros(d.size, np.int64)
    first = cv[np.arange(d.size), at]
    code = np.where(top.nan[d] > 0, FAULT_NAN,
                    np.where(cv[:, 0] == np.inf, FAULT_INF,
                             np.where((kept == 0) | (first == -np.inf), FAULT_NO_FINITE, 0)))
    fault[d] = code
    ok = code == 0
    greedy = ok & rows.greedy[d]
    ids[d[greedy]] = cid[greedy, at[greedy]]
    for j in np.flatnonzero(ok & ~rows.greedy[d]):
        i = int(d[j])
        k = int(rows.top_k[i])  # need() is None without a top-k: k ≥ 1 here
        c, v = (cid[j], cv[j]) if keep is None else (cid[j][keep[j]], cv[j][keep[j]])
        ids[i] = draw_filtered(c[:k], v[:k], rows.top_p[i], rows.min_p[i], rows.temperature[i], rows.uniform[i])
    return Drawn(ids, fault)
