"""Speculative decoding: a draft proposes k tokens per sequence, one target step verifies them all.

    history … t               t: the last token, sampled, not yet run through the target
    draft   → d1 … dk         n-gram lookup | a small same-vocabulary model | the model with
                              layers skipped | the model's first layers
    target  step [t, d1 … dk] one segment per sequence → k + 1 rows of logits, every layer
                              read once for all of them (Engine.step, batched over sequences)
    accept  d1 … dn by the rule below, then one token of the target's own (the correction at
            the first rejection, or a bonus after all k): 1 … k + 1 tokens per pass
    KV      cut back to the accepted tokens by the decode loop (decode.Sequence.settle)

The rule (Leviathan et al.; Chen et al.): p_j is the target's distribution at row j — the
sampler's whole chain (Sampler.distribution: ignore_eos ban, penalties over the history *with
the drafts before j*, top-k, top-p, min-p, temperature) — and q_j the distribution the draft
drew d_j from (a point mass for deterministic drafts). Accept d_j with probability
min(1, p_j(d_j) / q_j(d_j)); on rejection draw from the residual max(p_j - q_j, 0), normalized,
and stop. Every output token then has exactly the distribution p_j that plain sampling would
draw from after the same history, so sampled output keeps plain sampling's distribution. Greedy
is the point-mass case: a draft token is kept while it is the target's argmax, so greedy output
equals plain greedy output token for token.

A constraint (engine/generation/constraints.py) is part of that chain: p_j is masked by the constraint's
state after t, d1 … d(j-1), a model draft draws from q masked the same way, and a deterministic
draft is cut at its first token the constraint refuses, so every draft is allowed and the
verified tokens respect the constraint exactly as plain decoding's do.

Penalties are why p_j must be recomputed per row: they read the history, and the history of row
j includes the j drafts before it (which are the real history exactly when they are accepted).

Randomness: each draw takes its uniform from a generator keyed by (seed, position, purpose),
so a seed gives the same text whatever else shares the batch. Draft lengths follow each
sequence's own acceptance and a cost table (status shows it), so with a given table they too
follow from the seed. The table is measured once per model, plan and machine (`step_costs`:
rounds over every step size, medians, made monotone in tokens) and kept in the state directory,
so a restart reads it instead of measuring again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import secrets
import time
from collections.abc import Iterator, Sequence

import numpy as np

from ntransformerd.engine.calibration import layer_skip
from ntransformerd.engine.generation import decode
from ntransformerd.engine.runtime.engine import Engine, EngineConfig
from ntransformerd.engine.gguf_file import GGUFModel
from ntransformerd.engine.generation.sampler import draw_from
from ntransformerd.engine.generation.speculative_mode import OFF, Mode  # noqa: F401 - OFF: the mode's module, named here too

log = logging.getLogger("ntransformerd")
MAX_DRAFT = 16
_DRAFT, _ACCEPT, _RESIDUAL, _TARGET = 1, 2, 3, 4  # purposes of a position's uniforms


class VocabularyMismatch(ValueError):
    """The draft model's tokenizer differs from the target's."""


def parse_mode(mode: str | None) -> tuple[str, str]:
    """(name, argument) of a mode's text (Mode.parse)."""
    m = Mode.parse(mode)
    return m.name, m.arg


# ---- cost of a step ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """A step of T tokens for one row relative to T = 1, and one draft token relative to it.

    On a PCIe-bound stream the verify ratio stays near 1 (every layer is read once whatever T
    is), so long drafts pay; on a resident, compute-bound model it grows with T and short
    drafts win.
    """

    verify: dict[int, float]  # T → seconds(T) / seconds(1)
    draft: float = 0.0  # one draft token / one target token

    def verify_cost(self, t: int) -> float:
        ts = sorted(self.verify)
        if t in self.verify:
            return self.verify[t]
        lo = max([x for x in ts if x < t], default=ts[0])
        hi = min([x for x in ts if x > t], default=None)
        if hi is None:  # past the table: extend its last slope
            a, b = (ts[-2], ts[-1]) if len(ts) > 1 else (ts[-1], ts[-1])
            slope = (self.verify[b] - self.verify[a]) / (b - a) if b > a else 0.0
            return self.verify[b] + slope * (t - b)
        return self.verify[lo] + (self.verify[hi] - self.verify[lo]) * (t - lo) / (hi - lo)

    def to_dict(self) -> dict:
        return {"verify": {str(k): round(v, 4) for k, v in sorted(self.verify.items())}, "draft": round(self.draft, 4)}

    @classmethod
    def from_dict(cls, d: dict) -> "StepCosts":
        verify = {int(k): float(v) for k, v in d["verify"].items()}
        if 1 not in verify or not all(v > 0 for v in verify.values()):
            raise ValueError("a cost table needs T = 1 and positive costs")
        return cls(verify, float(d.get("draft", 0.0)))


COST_SIZES = (1, 2, 4, 8, 16)
COST_ROUNDS = 5  # timed rounds at most; at least MIN_COST_ROUNDS, more while within COST_BUDGET_S
MIN_COST_ROUNDS = 3
COST_BUDGET_S = 10.0


def time_steps(engine, sizes: Sequence[int], *, layers=None, context: int = 64,
               rounds: int = COST_ROUNDS, budget_s: float = COST_BUDGET_S) -> dict[int, float]:
    """Median seconds of one step of T tokens after `context` positions, per T.

    Every round steps each size once, so a change in the machine's load touches all sizes
    alike; an untimed round first lets each shape be recorded or captured; the median of the
    rounds ignores a step that another process delayed. Rounds stop at `rounds`, or past
    `budget_s` once MIN_COST_ROUNDS are done.
    """
    slot = engine.open()
    try:
        ids = (np.arange(context + max(sizes)) * 7919 + 13) % engine.cfg.vocab_size
        engine.prefill(slot, ids[:context])
        seconds: dict[int, list[float]] = {t: [] for t in sizes}
        start = time.perf_counter()
        for r in range(rounds + 1):
            if r > min(MIN_COST_ROUNDS, rounds) and time.perf_counter() - start > budget_s:
                break
            for t in sizes:
                engine.truncate(slot, context)
                t0 = time.perf_counter()
                engine.step([(slot, ids[context:context + t])], all_logits=t > 1, layers=layers)
                if r:
                    seconds[t].append(time.perf_counter() - t0)
        return {t: float(np.median(v)) for t, v in seconds.items()}
    finally:
        engine.close(slot)


def monotone(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence nearest to `values` in least squares (pool adjacent
    violators): a step of more tokens never costs less than one of fewer."""
    blocks: list[list[float]] = []  # [mean, weight]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, w2), (m1, w1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2])
    return [m for m, w in blocks for _ in range(int(w))]


def measure_costs(engine, draft: "Draft | None" = None, *, draft_engine=None, sizes=COST_SIZES,
                  rounds: int = COST_ROUNDS) -> StepCosts:
    """The cost table of this engine, measured now (rounds x sizes steps): relative to one
    token, monotone in tokens; the draft cost from `draft` (a source) or `draft_engine` (a
    separate draft model)."""
    t = time_steps(engine, sizes, rounds=rounds)
    ts = sorted(t)
    rel = monotone([t[k] / t[1] for k in ts])
    verify = {k: max(1.0, v) for k, v in zip(ts, rel)}
    if draft_engine is not None:
        d = time_steps(draft_engine, (1,), rounds=rounds)[1] / t[1]
    else:
        d = draft.step_seconds(engine) / t[1] if draft is not None else 0.0
    return StepCosts(verify, d)


# ---- the cost table's cache --------------------------------------------------------------------

COSTS_VERSION = 2


def _file_id(path: str | None) -> list | None:
    """What identifies a model file without reading it: path, size, modification time, inode."""
    if not path:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return [path]
    return [os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino]


def _machine() -> dict:
    cpu = ""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return {"arch": platform.machine(), "cpu": cpu, "cpus": len(os.sched_getaffinity(0))}


def cost_key(engine, draft_engine=None) -> str:
    """A name for this model, plan and machine: a table measured for them stays valid."""
    plan = getattr(engine, "plan", None)
    config = getattr(engine, "config", None)
    key = {"version": COSTS_VERSION, "model": _file_id(engine.model.path),
           "draft": _file_id(draft_engine.model.path) if draft_engine is not None else None,
           "backend": getattr(engine, "backend_name", ""), "layers": list(getattr(engine, "layers", None) or ()),
           "plan": plan.explain() if plan is not None else "resident",
           "config": {k: str(getattr(config, k, "")) for k in ("kv_dtype", "cpu_threads", "max_ctx", "max_batch")},
           "machine": _machine()}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def cost_cache_path(engine, draft_engine=None) -> str:
    return os.path.join(layer_skip.state_dir(), f"step-costs-{cost_key(engine, draft_engine)}.json")


def cached_costs(engine, draft_engine=None) -> StepCosts | None:
    """The table kept for this model, plan and machine, or None."""
    try:
        with open(cost_cache_path(engine, draft_engine)) as f:
            return StepCosts.from_dict(json.load(f))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def step_costs(engine, draft_engine=None) -> StepCosts:
    """The cost table for this engine (and draft model) on this machine: the kept one, else
    measured now (on the thread that owns the engine; it needs one free KV slot) and kept."""
    costs = cached_costs(engine, draft_engine)
    if costs is not None:
        return costs
    t0 = time.monotonic()
    costs = StepCosts.from_dict(measure_costs(engine, draft_engine=draft_engine).to_dict())  # as it is kept
    path = cost_cache_path(engine, draft_engine)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(costs.to_dict(), f)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("speculation: cannot keep the step cost table in %s (%s); it is measured again next start",
                    path, e)
    log.info("speculation: step costs %s measured in %.1f s", costs.to_dict(), time.monotonic() - t0)
    return costs


# ---- per-sequence state ----------------------------------------------------------------------


class Controller:
    """The draft length of one sequence: the k that maximizes expected tokens per unit of cost.

    Acceptance is modelled as a per-token probability a (each draft token kept with chance a
    until the first rejection), estimated from the recent passes: k drafts then yield
    (1 - a^(k+1)) / (1 - a) tokens for a cost of verify(k + 1) + k * draft. Where no k > 0 beats
    a plain step the sequence stops drafting, and probes with one draft token every
    `probe_every` passes so it notices when drafting starts to pay again.
    """

    DECAY = 0.8
    CANDIDATES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)

    def __init__(self, costs: StepCosts, *, max_draft: int = MAX_DRAFT, probe_every: int = 16):
        self.costs, self.max_draft, self.probe_every = costs, max_draft, probe_every
        self.hits, self.trials = 1.0, 2.0  # prior: a = 0.5
        self.idle = 0

    @property
    def acceptance(self) -> float:
        return self.hits / self.trials

    def next_k(self, limit: int) -> int:
        a = min(self.acceptance, 0.995)
        best_k, best = 0, 1.0  # k = 0: one token for one plain step
        for k in self.CANDIDATES:
            if k > min(limit, self.max_draft):
                break
            gain = (1.0 - a ** (k + 1)) / (1.0 - a) / (self.costs.verify_cost(k + 1) + k * self.costs.draft)
            if gain > best:
                best_k, best = k, gain
        if best_k == 0 and limit >= 1:
            self.idle += 1
            if self.idle >= self.probe_every:
                self.idle = 0
                return 1
        return best_k

    def update(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        self.hits = self.hits * self.DECAY + accepted
        self.trials = self.trials * self.DECAY + accepted + (1 if accepted < proposed else 0)


class SpecSeq:
    """The speculation state of one sequence (decode.Sequence: its history, sampler, constraint
    and slot): seed, draft length and the draft's own state. Owned by the thread that owns the
    engine."""

    def __init__(self, sequence, controller: Controller, seed: int | None):
        self.sequence, self.ctl = sequence, controller
        self.seed = secrets.randbits(63) if seed is None else int(seed)
        self.state: dict = {}  # the draft source's per-sequence state

    @property
    def slot(self) -> int:
        return self.sequence.slot

    def uniform(self, position: int, purpose: int) -> float:
        return float(np.random.default_rng([self.seed, position, purpose]).random())

    def first(self, logits) -> int:
        """A token drawn from one row, keyed like every other draw of this sequence."""
        s = self.sequence
        ids, p = s.sampler.distribution(logits, s.history, s.mask())
        return draw_from(ids, p, self.uniform(len(s.history), _TARGET))


@dataclasses.dataclass
class Proposal:
    """Draft tokens and, per token, the distribution it was drawn from (None: a point mass)."""

    tokens: list[int]
    q: list[tuple[np.ndarray, np.ndarray] | None]


def draw_draft(seq: SpecSeq, row: np.ndarray, proposal: Proposal) -> int:
    """Draw the next draft token from a draft model's row by the sequence's own sampler chain
    (its history plus the drafts so far), and append it and its distribution to the proposal."""
    hist = seq.sequence.history + proposal.tokens
    c = seq.sequence.constraint
    ids, q = seq.sequence.sampler.distribution(row, hist, None if c is None else c.mask_after(proposal.tokens))
    x = draw_from(ids, q, seq.uniform(len(hist), _DRAFT))
    proposal.tokens.append(x)
    proposal.q.append((ids, q))
    return x


def verify(seq: SpecSeq, rows: np.ndarray, proposal: Proposal) -> tuple[list[int], int]:
    """(tokens to emit, drafts accepted) from the target's rows (len(proposal) + 1, V) for
    [t, d1 … dk]; the rule of the module docstring."""
    hist, out, k = list(seq.sequence.history), [], len(proposal.tokens)
    sampler, c = seq.sequence.sampler, seq.sequence.constraint
    masks = [None] * (k + 1) if c is None else c.masks(proposal.tokens)  # row j: after d1 … dj, all kept so far
    for j in range(k + 1):
        ids, p = sampler.distribution(rows[j], hist + out, masks[j])
        pos = len(hist) + len(out)
        if j == k:  # every draft kept: the target's own next token
            out.append(draw_from(ids, p, seq.uniform(pos, _TARGET)))
            return out, k
        x, q = proposal.tokens[j], proposal.q[j]
        px = float(p[ids == x].sum())
        qx = 1.0 if q is None else float(q[1][q[0] == x].sum())
        if qx > 0 and seq.uniform(pos, _ACCEPT) < px / qx:
            out.append(x)
            continue
        out.append(residual_draw(ids, p, x, q, sampler.vocab_size, seq.uniform(pos, _RESIDUAL)))
        return out, j
    raise AssertionError("unreachable")


def residual_draw(ids, p, x: int, q, vocab: int, u: float) -> int:
    """A draw from max(p - q, 0), normalized (q None: the point mass on x)."""
    r = np.zeros(vocab)
    r[ids] = p
    if q is None:
        r[x] = 0.0
    else:
        r[q[0]] = np.maximum(r[q[0]] - q[1], 0.0)
    nz = np.flatnonzero(r > 0)
    if nz.size == 0:  # p == q: a rejection has probability 0; fall back to p itself
        return draw_from(ids, p, u)
    return draw_from(nz, r[nz], u)


# ---- draft sources -----------------------------------------------------------------------------


class Draft:
    """What every draft source answers. propose() drafts for several sequences at once (a model
    draft runs them as one batch per draft position)."""

    name = "draft"

    def propose(self, seqs: Sequence[SpecSeq], ks: Sequence[int]) -> list[Proposal]:
        raise NotImplementedError

    def step_seconds(self, engine) -> float:
        """Seconds of drafting one token for one sequence (for the cost table)."""
        return 0.0

    def relative_cost(self, costs: StepCosts, n_layers: int) -> float:
        """One draft token against a one-token target step, from a table measured with the
        draft model (costs.draft) where this source is that model."""
        return 0.0

    def close(self, seq: SpecSeq) -> None:
        pass


class NgramDraft(Draft):
    """Lookup decoding: find the latest earlier occurrence of the history's last n tokens (n from
    n_max down to n_min) in the prompt and the text generated so far, and propose what followed
    it. Free to run; strong where the output repeats its input (editing code, quoting)."""

    name = "ngram"

    def __init__(self, *, n_min: int = 1, n_max: int = 4):
        self.n_min, self.n_max = n_min, n_max

    def propose(self, seqs, ks):
        return [Proposal(toks, [None] * len(toks))
                for toks in (self.lookup(s.sequence.history, k) for s, k in zip(seqs, ks))]

    def lookup(self, history: Sequence[int], k: int) -> list[int]:
        h = np.asarray(history, np.int64)
        if k <= 0:
            return []
        for n in range(min(self.n_max, len(h) - 1), self.n_min - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(h[:-1], n)  # (L - n, n): earlier n-grams
            hits = np.flatnonzero((windows == h[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # what followed the latest occurrence
                return h[start:start + k].tolist()
        return []


class ModelDraft(Draft):
    """A draft that is a model: each draft token is drawn from the model's logits by the
    sequence's own sampler chain (Sampler.distribution), so q is known exactly.

    Either a separate small engine with the same vocabulary (its own KV slots, kept in step with
    the target's history), or the target engine itself run on fewer layers (`layers`: the model
    minus skipped layers, or its first layers), whose draft positions the decode loop cuts away
    before the target verifies them (decode.Sequence.settle).
    """

    def __init__(self, engine, *, name: str, layers: Sequence[int] | None = None, own: bool):
        self.engine, self.name, self.layers, self.own = engine, name, layers, own

    def step_seconds(self, engine) -> float:
        target = self.engine if self.own else engine
        return time_steps(target, (1,), layers=self.layers, rounds=3)[1]

    def relative_cost(self, costs: StepCosts, n_layers: int) -> float:
        # a self-draft reads its share of the layers (and the output head, which we neglect)
        return costs.draft if self.own else len(self.layers) / n_layers

    def close(self, seq: SpecSeq) -> None:
        if self.own and "slot" in seq.state:
            self.engine.close(seq.state.pop("slot"))

    def _pending(self, seq: SpecSeq) -> list[int]:
        """The tokens to run before the first draft token: for the target engine, the last one;
        for an own engine, everything its cache lacks (the whole prompt the first time)."""
        hist = seq.sequence.history
        if not self.own:
            return [hist[-1]]
        if "slot" not in seq.state:
            seq.state["slot"], seq.state["fed"] = self.engine.open(), []
        fed = seq.state["fed"]
        common = 0
        for a, b in zip(fed, hist):
            if a != b:
                break
            common += 1
        common = min(common, len(hist) - 1)  # the last token is always run: its logits draft d1
        self.engine.truncate(seq.state["slot"], common)
        seq.state["fed"] = list(hist[:common])
        pending = list(hist[common:])
        if len(pending) > 1:  # a prompt: prefill in chunks, keep the last token for the draft step
            self.engine.prefill(seq.state["slot"], pending[:-1])
            seq.state["fed"] += pending[:-1]
            pending = pending[-1:]
        return pending

    def propose(self, seqs, ks):
        engine = self.engine
        out = [Proposal([], []) for _ in seqs]
        active = [i for i, k in enumerate(ks) if k > 0]
        if not active:
            return out
        inputs = {i: self._pending(seqs[i]) for i in active}  # an own engine's slot opens here
        slot = {i: seqs[i].state["slot"] if self.own else seqs[i].slot for i in active}
        for j in range(max(ks)):
            active = [i for i in active if j < ks[i]]
            if not active:
                break
            rows = engine.step([(slot[i], inputs[i]) for i in active], layers=self.layers)  # (len(active), V)
            for i, row in zip(active, rows):
                s = seqs[i]
                if self.own:
                    s.state["fed"] += inputs[i]
                x = draw_draft(s, row, out[i])
                inputs[i] = [x]
        return out


def check_vocabulary(target_model, draft_model) -> None:
    """Raise VocabularyMismatch unless the two GGUFs tokenize identically."""
    tm, dm = target_model.metadata, draft_model.metadata
    tt, dt = tm.get("tokenizer.ggml.tokens"), dm.get("tokenizer.ggml.tokens")
    where = f"draft {draft_model.path} and target {target_model.path}"
    if tt is None or dt is None:
        raise VocabularyMismatch(f"{where}: a model has no tokenizer.ggml.tokens to compare")
    if len(tt) != len(dt):
        raise VocabularyMismatch(f"{where} have different vocabularies ({len(dt)} and {len(tt)} tokens): "
                                 "a draft must use the target's tokenizer")
    diff = next((i for i, (a, b) in enumerate(zip(tt, dt)) if a != b), None)
    if diff is not None:
        raise VocabularyMismatch(f"{where} have different vocabularies: token {diff} is {dt[diff]!r} in the draft "
                                 f"and {tt[diff]!r} in the target; a draft must use the target's tokenizer")
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        if tm.get(key) != dm.get(key):
            raise VocabularyMismatch(f"{where}: {key} differs ({dm.get(key)!r} vs {tm.get(key)!r})")
    if draft_model.config.vocab_size != target_model.config.vocab_size:
        raise VocabularyMismatch(f"{where}: output sizes differ ({draft_model.config.vocab_size} vs "
                                 f"{target_model.config.vocab_size})")


def load_draft_engine(path: str, target, *, backend: str | None = None):
    """A small same-vocabulary model as its own engine, with as many slots as the target."""
    model = GGUFModel(path)
    check_vocabulary(target.model, model)
    tc = target.config
    return Engine(model, config=EngineConfig(backend=backend or tc.backend, max_batch=tc.max_batch,
                                             max_ctx=target.max_ctx, kv_dtype=tc.kv_dtype,
                                             prefill_chunk=tc.prefill_chunk))


def make_draft(mode: "Mode | str", engine, *, draft_engine=None, model_path: str | None = None) -> Draft | None:
    """The draft source a mode names (None for off). auto: the draft model where one is loaded,
    else n-gram lookup."""
    m = mode if isinstance(mode, Mode) else Mode.parse(mode)
    name, arg = m.name, m.arg
    n = engine.cfg.n_layers
    if name == "off":
        return None
    if name == "auto":
        name = "draft" if draft_engine is not None else "ngram"
    if name == "ngram":
        return NgramDraft()
    if name == "draft":
        if draft_engine is None:
            raise ValueError("speculative draft needs a draft model: start with --draft MODEL.gguf")
        return ModelDraft(draft_engine, name="draft", own=True)
    if name == "prefix":
        k = int(arg) if arg else n // 2
        if not 1 <= k < n:
            raise ValueError(f"speculative prefix:{k}: the draft runs the first 1..{n - 1} of the model's {n} layers")
        return ModelDraft(engine, name=f"prefix:{k}", layers=list(range(k)), own=False)
    skip = _skip_layers(arg or str(n // 4), model_path or engine.model.path, n)
    base = engine.layers if engine.layers is not None else range(n)
    return ModelDraft(engine, name=f"skip:{','.join(map(str, skip))}",
                      layers=[i for i in base if i not in set(skip)], own=False)


def _skip_layers(arg: str, path: str, n: int) -> tuple[int, ...]:
    """The layers `skip:ARG` leaves out of the draft, each way it can be wrong named in the
    speculative mode's own terms."""
    try:
        spec = layer_skip.parse_skip(arg)
    except ValueError:
        raise ValueError(f"speculative skip:{arg}: use skip:N (the N most similar layers), skip:auto, "
                         "skip:auto:0.03 or layer indices (skip:3,7,11)") from None
    if spec is None:
        raise ValueError(f"speculative skip:{arg} skips no layer: the draft would be the model itself; "
                         "use speculative off, or name layers (skip:3,7,11)")
    if spec.layers is not None:
        bad = [i for i in spec.layers if not 0 <= i < n]
        if bad:
            raise ValueError(f"speculative skip:{arg}: layer {bad[0]} does not exist: the model has layers "
                             f"0..{n - 1}")
        if len(spec.layers) >= n:
            raise ValueError(f"speculative skip:{arg} skips every layer: leave some (the model has {n})")
        return spec.layers
    if spec.count is not None and not 1 <= spec.count <= n - 2:
        raise ValueError(f"speculative skip:{spec.count}: one number is how many layers to skip (the most "
                         f"similar ones), and the model has {n} layers, {n - 2} of them skippable: give a count "
                         f"in 1..{n - 2}, or layer indices (skip:3,7,11)")
    calibration = layer_skip.load_cached(path)
    if calibration is None:
        raise ValueError(f"speculative skip:{arg} picks its layers from the model's layer-skip calibration, "
                         f"and there is none yet: run `ntx-model calibrate-skip {path} --file TEXT` once, "
                         "or name the layers (skip:3,7,11)")
    return layer_skip.resolve(spec, n, calibration)


# ---- the speculator ----------------------------------------------------------------------------


class Speculator:
    """One draft source for an engine, its cost table, and the figures status reports.

    The decode loop (engine/generation/decode.py) calls: open(sequence) → SpecSeq; plan(seqs) → drafts;
    one Engine.step with [t] + drafts per sequence and all_logits; accept(seq, rows, proposal)
    → tokens to emit (the loop then cuts the KV cache back to them); close(seq).
    """

    def __init__(self, engine, draft: Draft, *, costs: StepCosts | None = None, max_draft: int = MAX_DRAFT):
        self.engine, self.draft, self.max_draft = engine, draft, max_draft
        self._costs = (None if costs is None else
                       dataclasses.replace(costs, draft=draft.relative_cost(costs, engine.cfg.n_layers)))
        self.passes = self.proposed = self.accepted = self.emitted = 0

    @property
    def costs(self) -> StepCosts:
        if self._costs is None:  # measured once: draft lengths then follow from the seed alone
            self._costs = measure_costs(self.engine, self.draft)
        return self._costs

    def use_costs(self, costs: StepCosts) -> None:
        """Plan with `costs` (the engine's table; this source's own draft cost is derived)."""
        self._costs = dataclasses.replace(costs, draft=self.draft.relative_cost(costs, self.engine.cfg.n_layers))

    def open(self, sequence) -> SpecSeq:
        return SpecSeq(sequence, Controller(self.costs, max_draft=self.max_draft), sequence.params.seed)

    def close(self, seq: SpecSeq) -> None:
        self.draft.close(seq)

    def limit(self, seq: SpecSeq) -> int:
        """Most draft tokens worth proposing: within the context and the token budget."""
        s = seq.sequence
        return max(0, min(self.max_draft, s.free_positions(), s.max_tokens - s.generated - 1))

    def plan(self, seqs: Sequence[SpecSeq]) -> list[Proposal]:
        ks = [s.ctl.next_k(self.limit(s)) for s in seqs]
        proposals = self.draft.propose(seqs, ks)
        for s, p in zip(seqs, proposals):  # a draft goes no further than the constraint allows
            if s.sequence.constraint is not None and p.tokens:
                n = s.sequence.constraint.valid_prefix(p.tokens)
                p.tokens, p.q = p.tokens[:n], p.q[:n]
        return proposals

    def accept(self, seq: SpecSeq, rows: np.ndarray, proposal: Proposal) -> list[int]:
        """The tokens one sequence's rows verify (its rejected positions stay in the KV cache until
        the loop settles the sequence)."""
        tokens, n = verify(seq, rows, proposal)
        seq.ctl.update(len(proposal.tokens), n)
        self.passes += 1
        self.proposed += len(proposal.tokens)
        self.accepted += n
        self.emitted += len(tokens)
        return tokens

    def stats(self) -> dict:
        return dict(source=self.draft.name, passes=self.passes, proposed=self.proposed, accepted=self.accepted,
                    acceptance=self.accepted / self.proposed if self.proposed else 0.0,
                    tokens_per_pass=self.emitted / self.passes if self.passes else 0.0,
                    costs=self._costs.to_dict() if self._costs else None)


def generate(engine, prompt_ids: Sequence[int], params, speculator: Speculator, *, constraint=None) -> Iterator:
    """engine.generate with speculation (decode.generate): the same events; greedy gives the same tokens."""
    return decode.generate(engine, prompt_ids, params, speculator=speculator, constraint=constraint)
