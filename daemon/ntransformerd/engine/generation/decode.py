"""One decode loop: how every sequence advances, whoever drives it.

    seq = Sequence(engine, prompt_ids, params, speculator=…)   sampler, budget, constraint, draft state
    seq.open()                                                  a KV slot (the daemon's prefix cache
                                                                gives it one instead)
    rows = [seq.row(budget), …]                                 what each sequence runs next: a prompt
                                                                chunk, or its last token
    step(engine, rows)                                          drafts, one engine.step for all rows,
                                                                then each sequence advances by the
                                                                tokens it accepts (row.accepted): one
                                                                drawn, or a verified draft and one more
    Text(tokenizer, stops).push(token, seq.finish)              the text a client may see

`generate` (`ntx-model run`, with or without speculation) drives one sequence with it; the
daemon's scheduler drives its live batch through the same `step` and turns tokens into text on
its streaming thread. The rules live here, once:

* room: a sequence's slot holds every accepted token but the last, which runs in the next step;
  a token is accepted with room while len(history) ≤ max_ctx, and the one past that ends the
  sequence ("length") without being run;
* KV: after a step each sequence's slot is cut back to what it accepted (`Sequence.settle`, the
  one place a slot is truncated): a verified draft's rejected positions, a self-draft's scratch
  positions;
* draws: a step whose drawing rows can all be drawn where the logits are asks the engine for ids
  (Engine.step(sample=…): sampler.sample_rows on the host, a device sampler on a GPU), so the
  host receives ids, not rows; rows that need logits on the host (log-probabilities, a
  constraint's mask, speculation's verification) take them, drawn by the same sample_rows.

Thread rule: a Sequence, its rows and `step` belong to the thread that owns the engine; a Text
belongs to the thread that streams its sequence.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence as Seq

import numpy as np

from ntransformerd.engine.generation.sampler import (Drawn, InvalidLogits, SampleRows, Sampler, StopMatcher, prompt_logprobs,
                                          token_logprobs)
from ntransformerd.engine.generation.tokenizer import Detokenizer


class DraftFault(RuntimeError):
    """A draft source produced logits no token can be drawn from: its requests fail, and the model
    keeps serving (the draft is not the model)."""


class Sequence:
    """One sequence from its prompt to its last accepted token: KV slot, history, sampler,
    token budget, constraint and, when it speculates, its draft state (speculative.SpecSeq)."""

    def __init__(self, engine, prompt_ids: Seq[int], params, *, max_tokens: int | None = None, constraint=None,
                 speculator=None, logprobs: int | None = None, prompt_logprobs: bool = False):
        self.engine, self.params = engine, params
        self.prompt_ids = list(prompt_ids)
        self.max_tokens = params.max_tokens if max_tokens is None else max_tokens
        self.max_ctx = engine.max_ctx
        self.sampler = Sampler(params, engine.cfg.vocab_size, eog_ids=engine.tokenizer.eog_ids)
        self.eog_ids = engine.tokenizer.eog_ids
        self.constraint = constraint  # constraints.Constraint: masks every draw, ends the output when complete
        self.speculator = speculator  # speculative.Speculator of the request's mode; None: off
        self.spec = None  # speculative.SpecSeq, from the first token on when speculating
        self.logprobs = logprobs  # None: none; n: each token's and its n most likely alternatives'
        self.prompt_logprobs: list | None = [] if prompt_logprobs else None  # filled chunk by chunk
        self.history = list(prompt_ids)  # prompt + accepted tokens: what penalties and drafts read
        self.inputs = self.prompt_ids  # what prefill runs: the prompt, or after a restart its history
        self.generated = 0  # accepted tokens
        self.slot = -1
        self.prefilled = 0  # prompt positions in the slot (sets decoding)
        self.finish: str | None = None  # "eos" | "length" | "stop" (the constraint is complete)
        self.keep_rows = False  # the driver wants each draw's row of logits (Row.logits)

    @property
    def prefilled(self) -> int:
        """Prompt positions in the slot (after a restart: of its history)."""
        return self._prefilled

    @prefilled.setter
    def prefilled(self, n: int) -> None:
        # decoding is read by every row several times a step, prefilled set once a prompt chunk:
        # kept beside it, not computed at each read (inputs changes only with prefilled, in restart)
        self._prefilled = n
        self.decoding = n >= len(self.inputs)  # the whole prompt (after a restart: the whole history) is in the slot

    @property
    def restarted(self) -> bool:
        return self.inputs is not self.prompt_ids

    def restart(self) -> None:
        """Its slot was taken back (the scheduler preempted it; the caller frees the slot): from
        its next row on it recomputes its prompt and the tokens it accepted as one prompt, then
        draws on; what it accepted stays accepted, its sampler's generator goes on where it was."""
        if self.spec is not None:
            self.speculator.close(self.spec)
            self.spec = None
        self.inputs = list(self.history)
        self.prefilled, self.slot = 0, -1

    def free_positions(self) -> int:
        """Positions left after the last accepted token's (negative: it has none)."""
        return self.max_ctx - len(self.history)

    def mask(self):
        """The ids the constraint allows next (bool (V,)), None without one."""
        return None if self.constraint is None else self.constraint.mask()

    def need(self) -> int | None:
        """How many most likely ids this sequence draws from (Sampler.need); None: the whole row
        (a constraint's allowed ids may lie anywhere in it; log-probabilities and a kept row read
        all of it)."""
        if self.constraint is not None or self.logprobs is not None or self.keep_rows:
            return None
        return self.sampler.need()

    def draws_anywhere(self) -> bool:
        """Its draws need nothing on the host but an id: where the logits are, they can be drawn."""
        return self.constraint is None and self.logprobs is None and self.speculator is None and not self.keep_rows

    def runs_ahead(self) -> bool:
        """Its next decode step may be launched before the last one's draw is on the host (the
        token it runs is that draw, where it is): it decodes, draws anywhere, and its draws read
        no history (no penalties: their window would lack the token still in flight)."""
        p = self.params
        return self.decoding and self.finish is None and self.draws_anywhere() and (
            p.penalty_last_n == 0 or (p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0
                                      and p.presence_penalty == 0.0))

    def sample(self, row) -> int:
        """The next id from a row of logits (V,) or, where need() allows, its TopRow."""
        return self.sampler.sample(row, self.history, self.mask())

    def open(self) -> int:
        self.slot = self.engine.open()
        return self.slot

    def close(self) -> None:
        """Its draft state and its slot go back."""
        if self.spec is not None:
            self.speculator.close(self.spec)
            self.spec = None
        if self.slot >= 0:
            self.engine.close(self.slot)
            self.slot = -1

    def row(self, budget: int, ahead: int = 0) -> "Row | None":
        """What it runs next: up to `budget` prompt tokens, or its last token; None when finished.
        ahead: prompt positions of a step still in flight, which this chunk follows."""
        if self.finish is not None:
            return None
        if not self.decoding:
            at = self.prefilled + ahead
            chunk = self.inputs[at:at + budget]
            return Row(self, chunk, ahead=ahead) if chunk else None
        return Row(self, [self.history[-1]])

    def accept(self, tokens: Seq[int]) -> list[int]:
        """Append tokens while none ends the sequence; the ones taken (finish says why it ended)."""
        taken, history, constraint = [], self.history, self.constraint
        for t in tokens:
            t = int(t)
            history.append(t)
            self.generated += 1
            taken.append(t)
            if t in self.eog_ids and not self.params.ignore_eos:
                self.finish = "eos"
                break
            if constraint is not None:
                constraint.consume(t)
                if constraint.stopped:
                    self.finish = "stop"
                    break
            if self.generated >= self.max_tokens or len(history) > self.max_ctx:  # free_positions() < 0
                self.finish = "length"
                break
        return taken

    def settle(self, ahead: int = 0) -> None:
        """Cut the slot back to the accepted tokens but the last (rejected drafts, a self-draft's
        scratch positions, the position a step launched ahead ran after the sequence had ended):
        the one place a sequence's KV is truncated. ahead: positions of steps launched since, still
        in flight, that the sequence keeps (none once it has ended)."""
        keep = len(self.history) - 1 + (ahead if self.finish is None else 0)
        if self.slot >= 0 and self.decoding and self.engine.length(self.slot) > keep:
            self.engine.truncate(self.slot, keep)


class Text:
    """A sequence's tokens as text a client may see: whole characters, never the start of a
    possible stop string. push() follows the sequence's own end (Sequence.finish) and ends it
    earlier at a stop string."""

    def __init__(self, tokenizer, stops: Seq[str] = ()):
        self.detok = Detokenizer(tokenizer)
        self.stops = StopMatcher(list(stops))

    def push(self, token: int, finish: str | None) -> tuple[str, str | None]:
        """(text to emit, finish reason or None) for `token`, which the sequence accepted with
        `finish` (None: it goes on)."""
        if finish == "eos":  # an end-of-generation token is not text
            text, _ = self.stops.feed(self.detok.flush())
            return text + self.stops.flush(), "eos"
        text, stopped = self.stops.feed(self.detok.feed(token))
        if stopped:
            return text, "stop"
        if finish is not None:
            tail, _ = self.stops.feed(self.detok.flush())
            return text + tail + self.stops.flush(), finish
        return text, None


@dataclasses.dataclass(eq=False)
class Row:
    """One sequence's share of a step, and what came of it."""

    seq: Sequence
    tokens: list[int]  # a prompt chunk, or the last accepted token
    ahead: int = 0  # a prompt chunk's positions after those of a step still in flight
    draft: object = None  # speculative.Proposal verified in this step
    accepted: list[int] = dataclasses.field(default_factory=list)
    logprobs: list | None = None  # per accepted token: (id, logprob, top ids, their logprobs)
    logits: np.ndarray | None = None  # the row the first token was drawn from (Sequence.keep_rows)
    error: BaseException | None = None  # this row failed; the others went on
    doing: str = ""  # what failed, for the error's message

    @property
    def draws(self) -> bool:
        """It draws a token: a decode row, or the chunk that ends its prompt."""
        return self.seq.decoding or self.seq.prefilled + self.ahead + len(self.tokens) >= len(self.seq.inputs)

    def fail(self, exc: BaseException, doing: str) -> None:
        self.error, self.doing = exc, doing


def step(engine, rows: Seq[Row]) -> None:
    """One step for `rows`: drafts for the speculating ones, one engine.step for all, then each
    sequence advances (Row.accepted). A row's own failure (its draft, its draw) is its
    Row.error; what engine.step raises is every row's and is raised."""
    launch(engine, rows, now=True).finish()


class _Ran:
    """A step run at once (launch(now=True)): what engine.step returned."""

    def __init__(self, out):
        self.out = out

    def result(self):
        return self.out


class Launched:
    """A step launched (launch): its rows advance when it is finished (finish()), in launch order.
    `draws_ahead`: its draws stay where it ran, so a next step may run them (Sequence.runs_ahead
    rows) before they reach the host."""

    def __init__(self, rows: Seq[Row], live: Seq[Row], handle, *, kind: str, sample: SampleRows | None = None):
        self.rows, self.live, self.handle, self.kind, self.sample = list(rows), list(live), handle, kind, sample
        self.draws_ahead = kind == "draw"

    def finish(self, ahead: "Launched | None" = None) -> None:
        """Each row's sequence after the step (Row.accepted), as step() leaves it. A sequence that
        ended before this step ran (its end was found a step late) accepts nothing, and the
        position the step ran for it is discarded; one gone from its slot (retired) is left
        alone. ahead: the step launched since, still in flight: its sequences keep its
        position. What the engine raises is every row's and is raised."""
        if self.handle is None:  # every row failed before the step (its draft)
            return
        try:
            out = self.handle.result()
        except BaseException:  # nothing was drawn: the uniforms go back, so a retried step draws the same
            if self.sample is not None:
                for r, u in zip(self.live, self.sample.uniform):
                    if u == u:
                        r.seq.sampler.give_back(u)
            raise
        later = {id(r.seq) for r in ahead.live} if ahead is not None else ()
        if self.kind == "draw":
            self._finish_draws(out, later)
            return
        if self.kind == "all":
            ends = np.cumsum([len(r.tokens) + (len(r.draft.tokens) if r.draft is not None else 0) for r in self.live])
            outs = [out[e - n:e] for r, e, n in zip(self.live, ends, np.diff(ends, prepend=0))]
        else:
            # a verify row (its draft empty): (1, V)
            outs = [out[i] if r.draft is None else out[i][None] for i, r in enumerate(self.live)]
        for i, (r, o) in enumerate(zip(self.live, outs)):
            seq = r.seq
            if seq.slot < 0:
                continue
            if seq.finish is None:
                try:
                    advance(r, o, None, i)
                except Exception as e:  # noqa: BLE001 - this row fails, the others go on
                    r.fail(e, "sampling its next token")
            seq.settle(1 if id(seq) in later else 0)

    def _finish_draws(self, drawn: Drawn, later) -> None:
        """finish() of a step that drew its rows' ids (kind "draw"): a decode row accepts its id
        (draws_anywhere: no draft, no log-probabilities), read from one list, not one numpy
        scalar a row; a prompt chunk advances as advance() says."""
        ids, faults = drawn.ids.tolist(), drawn.fault.tolist()
        for i, r in enumerate(self.live):
            seq = r.seq
            if seq.slot < 0:
                continue
            if seq.finish is None:
                try:
                    if seq.decoding and not faults[i]:
                        r.accepted = seq.accept((ids[i],))
                    else:
                        advance(r, None, drawn, i)
                except Exception as e:  # noqa: BLE001 - this row fails, the others go on
                    r.fail(e, "sampling its next token")
            seq.settle(1 if id(seq) in later else 0)


def launch(engine, rows: Seq[Row], after: Launched | None = None, *, now: bool = False) -> Launched:
    """One step for `rows` launched without waiting (Engine.launch): drafts for the speculating
    rows, then one engine step for all, of the kind its rows need: every row's logits (a draft
    verified, a prompt scored), draws where the logits are (every drawing row draws_anywhere), or
    each row's last logits. With `after`, a step still in flight: a row whose sequence is in it
    (Sequence.runs_ahead) runs after's draw for it, taken where it is (on the device), and keeps
    the position after runs for it. Draws' uniforms are drawn now, in each sequence's order, and
    given back if the step fails. now: engine.step runs it here (step(); no `after`)."""
    if now and after is not None:
        raise ValueError("launch: a step run now runs after no step in flight")

    def run(items, **kw):
        if now:
            return _Ran(engine.step(items, **{k: v for k, v in kw.items() if k not in ("after", "rows")}))
        return engine.launch(items, **kw)

    draft(rows)
    live = [r for r in rows if r.error is None]
    if not live:
        return Launched(rows, live, None, kind="none")
    where = {} if after is None else {id(r.seq): i for i, r in enumerate(after.live)}
    idx = [where.get(id(r.seq), -1) if r.seq.decoding else -1 for r in live]  # a prompt chunk runs its own tokens
    if where and not after.draws_ahead and any(j >= 0 for j in idx):
        raise ValueError("launch: a row runs ahead of a step that did not draw its token where it ran")
    # one pass over the rows (every step's per-row cost): what the step runs, and what decides its kind
    items, samplers, top, scoring, drafted, anywhere, ahead = [], [], 0, False, False, True, False
    for r, j in zip(live, idx):
        seq = r.seq
        if j < 0:
            seq.settle()  # a self-draft ran scratch positions on the slot
        else:
            ahead = True
        d = r.draft
        if d is None:
            items.append((seq.slot, r.tokens))
        else:
            items.append((seq.slot, r.tokens + d.tokens))
            drafted = drafted or bool(d.tokens)
        if not seq.decoding and seq.prompt_logprobs is not None and not seq.restarted:
            scoring = True
        if r.draws:
            samplers.append(seq.sampler)
            if top is not None:
                n = seq.need()
                top = None if n is None else max(top, n)
            anywhere = anywhere and seq.draws_anywhere()
        else:
            samplers.append(None)
    drawing = len(samplers) - samplers.count(None)
    if not drawing:
        top = None
    rows_of, after_handle = (idx, after.handle) if ahead else (None, None)
    if scoring or drafted:  # every row of a draft or a scored prompt
        handle = run(items, all_logits=True, after=after_handle, rows=rows_of)
        return Launched(rows, live, handle, kind="all")
    if drawing and anywhere:
        sample = SampleRows.of(samplers, [r.seq.history for r in live])
        try:
            handle = run(items, top=top, sample=sample, after=after_handle, rows=rows_of)
        except BaseException:  # nothing was drawn: the uniforms go back, so a retried step draws the same
            for r, u in zip(live, sample.uniform):
                if u == u:
                    r.seq.sampler.give_back(u)
            raise
        return Launched(rows, live, handle, kind="draw", sample=sample)
    if any(r.seq.speculator is not None for r in live):  # speculation verifies whole rows
        top = None
    handle = run(items, top=top, after=after_handle, rows=rows_of)
    return Launched(rows, live, handle, kind="last")


def draft(rows: Seq[Row]) -> None:
    """Draft tokens for every speculating row in decode, each source drafting for all of its rows
    at once (speculative.Speculator.plan); a source's failure fails its rows."""
    groups: dict[int, list[Row]] = {}
    for r in rows:
        if r.error is None and r.seq.decoding and r.seq.spec is not None:
            groups.setdefault(id(r.seq.speculator), []).append(r)
    for group in groups.values():
        speculator = group[0].seq.speculator
        try:
            proposals = speculator.plan([r.seq.spec for r in group])
        except Exception as e:  # noqa: BLE001 - a draft source's fault fails its own rows
            if isinstance(e, InvalidLogits):  # the draft's logits: not a reason to stop serving the model
                e = DraftFault(f"the draft {speculator.draft.name} produced invalid logits ({e}): "
                               "retry with another speculative mode (e.g. --speculative off)")
            for r in group:
                r.fail(e, "drafting tokens for it")
            continue
        for r, p in zip(group, proposals):
            r.draft = p


def advance(r: Row, out, drawn: Drawn | None, i: int) -> None:
    """Row i's sequence after the step: its prompt progress, or the tokens it accepts (the caller
    then settles its slot). out: its logits ((V,), a TopRow, or (n, V) for its tokens) or None
    where the step drew its id."""
    seq = r.seq
    if not seq.decoding:
        if seq.prompt_logprobs is not None and not seq.restarted:  # a restart's prompt was scored before
            score_prompt(seq, r.tokens, out)
        seq.prefilled += len(r.tokens)
        if not seq.decoding:
            return
        row = out[-1] if isinstance(out, np.ndarray) and out.ndim == 2 else out
        r.logits = row if seq.keep_rows else None
        if seq.speculator is not None:  # from its first token on, a speculating sequence draws by its seed
            seq.spec = seq.speculator.open(seq)
            tokens, rows = [seq.spec.first(row)], [row]
        else:
            tokens, rows = [drawn.id(i) if drawn is not None else seq.sample(row)], [row]
    elif r.draft is not None:
        tokens, rows = seq.speculator.accept(seq.spec, out, r.draft), out
    else:
        row = out[-1] if isinstance(out, np.ndarray) and out.ndim == 2 else out
        tokens, rows = [drawn.id(i) if drawn is not None else seq.sample(row)], [row]
    r.accepted = seq.accept(tokens)
    if seq.logprobs is not None:
        r.logprobs = [(t, *token_logprobs(row, t, seq.logprobs)) for t, row in zip(r.accepted, rows)]


def score_prompt(seq: Sequence, tokens: list[int], rows) -> None:
    """The log-probabilities of the prompt tokens that this chunk's rows predict."""
    start = seq.prefilled + 1  # row i predicts prompt position prefilled + i + 1
    targets = seq.prompt_ids[start:start + len(tokens)]
    rows = np.asarray(rows).reshape(-1, np.shape(rows)[-1])
    seq.prompt_logprobs += [(t, *lp) for t, lp in
                            zip(targets, prompt_logprobs(rows[:len(targets)], targets, seq.logprobs or 0))]


@dataclasses.dataclass
class GenerationEvent:
    """One generated token and the text it completes (may be empty mid-character)."""

    token: int | None
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "eos" on the last event


def generate(engine, prompt_ids: Seq[int], params, *, speculator=None, constraint=None,
             dump_logits: list | None = None) -> Iterator[GenerationEvent]:
    """Greedy or sampled continuation of one prompt, streamed token by token: the decode loop
    with one sequence.

    `params` is a sampler.SamplingParams; speculator: a speculative.Speculator (greedy output
    is the same, sampled output keeps its distribution). If `dump_logits` is a list, the logits
    of the last prompt position are appended to it. constraint: a constraints.Constraint.
    """
    params.validate()
    seq = Sequence(engine, prompt_ids, params, constraint=constraint, speculator=speculator)
    seq.keep_rows = dump_logits is not None
    text = Text(engine.tokenizer, params.stop)
    seq.open()
    try:
        while True:
            row = seq.row(engine.config.prefill_chunk)
            step(engine, [row])
            if row.error is not None:
                raise row.error
            if row.logits is not None:
                dump_logits.append(np.array(row.logits, dtype=np.float32))
                seq.keep_rows = False
            for k, token in enumerate(row.accepted):
                piece, finish = text.push(token, seq.finish if k == len(row.accepted) - 1 else None)
                yield GenerationEvent(token, piece, finish)
                if finish:
                    return
    finally:
        seq.close()
