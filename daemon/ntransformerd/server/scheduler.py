"""Continuous batching: every live request advances in one `engine.step` per iteration.

The request path, in the order it runs:

    tokenize(input)              → prompt ids            (caller's thread)
    schedule(ids, params)        → Request, queued       (caller's thread; bounded queue)
    loop, one thread owning the engine, each iteration:
        retire()                 finished / cancelled / past-deadline requests leave, slots freed
                                 (their KV stays for the prefix cache)
        admit()                  queued requests take free KV-cache slots, starting from the
                                 longest cached or live prefix of their prompt
        compose()                one decode token per decoding request + prefill chunks, the
                                 chunks sharing `prefill_chunk` tokens so a long prompt cannot
                                 stall the others
        draft()                  speculating requests: each draft source proposes tokens for
                                 its requests, batched (speculative.Speculator.plan)
        engine.step(batch)       one batched forward; a speculating request's segment is its
                                 last token and its draft, verified in the same step
        sample() → detokenize()  per request whose prompt is done; stream the delta out
                                 (a speculating request: the accepted drafts and one more)

Each Request carries its own Sampler, StopMatcher and Detokenizer and follows exactly the rules
of `engine.generate`, so a request's output is the one it would get alone (up to the engine's
batch-invariance; see tests/server/test_scheduler.py).

Failures never end the loop. What raises while serving one request (admitting it, its prefix
cache, its drafts, sampling, detokenizing) fails that request alone; an engine step that raises
fails the requests of that step, since it cannot tell whose row was at fault. Logits no token
can be drawn from (NaN, +inf: sampler.InvalidLogits) fail their requests with a ModelFault
naming the model, and the scheduler stops serving that model (state "failed", `on_fault` tells
the daemon, which turns health NOT_SERVING) until another is attached. The systemd watchdog is
pinged after each iteration that gets through; a step that never returns, or a loop that
fails outside any request's work on every iteration, stops the pings.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator, Sequence

import numpy as np

from ntransformerd.engine import speculative
from ntransformerd.engine.sampler import InvalidLogits, prompt_logprobs, token_logprobs
from ntransformerd.server.errors import (Cancelled, DeadlineExceeded, Draining, EngineFailed, InvalidRequest,
                                         ModelFault, NotReady, QueueFull, ServiceError, ShuttingDown, shown)
from ntransformerd.server.prefix_cache import PrefixCache, common_prefix

log = logging.getLogger("ntransformerd")
RATE_WINDOW_S = 5.0  # tokens/s and steps/s in Status are over the steps of the last seconds
MAX_DETAIL_CHARS = 300  # of an unexpected exception's text in a client's error message

_ids = itertools.count(1)


@dataclasses.dataclass
class Output:
    """One streamed piece: the tokens of one step and the text they complete."""

    token_ids: list[int]
    text: str
    prompt_ids: list[int] | None = None  # on the first output
    finish_reason: str | None = None  # "stop" | "length" | "eos" on the last
    usage: dict | None = None  # on the last
    # Where asked for, per token: (id, logprob, top ids, their logprobs) (sampler.token_logprobs)
    logprobs: list | None = None  # one per token_ids entry
    prompt_logprobs: list | None = None  # on the first output: prompt_ids[1:]


class Request:
    """One generation, from queued to retired. Written by the scheduler thread, except cancel()."""

    def __init__(self, prompt_ids: list[int], params, *, max_tokens: int, deadline: float | None,
                 prefix_cache: bool = True, logprobs: int | None = None, prompt_logprobs: bool = False,
                 caller=None):
        self.id = next(_ids)
        self.caller = caller  # callers.Caller: whose prefix cache scope it uses; None: in-process
        self.prompt_ids = prompt_ids
        self.params = params
        self.max_tokens = max_tokens
        self.deadline = deadline  # time.monotonic() value, or None
        self.state = "queued"  # queued → prefill → decode → done
        self.slot = -1
        self.prefilled = 0  # prompt tokens already in the KV cache
        self.next_token: int | None = None  # sampled, not yet run through the model
        self.generated = 0
        self.generated_ids: list[int] = []
        self.prefix_cache = prefix_cache  # may start from, and leave its KV to, the prefix cache
        self.cached = 0  # prompt tokens taken from the prefix cache
        self.error: ServiceError | None = None  # set by cancel(); delivered by retire()
        self.outputs: queue.Queue[Output | ServiceError | None] = queue.Queue()
        self.t_created = time.monotonic()
        self.t_admitted = self.t_first = self.t_done = None
        self.cont = None  # engine.Continuation: sampling, stop strings, text; set by schedule()
        self.speculator = None  # speculative.Speculator of its mode; None: off
        self.spec = None  # speculative.SpecSeq while decoding with speculation
        self.logprobs = logprobs  # None: none; n: each token's and its n most likely alternatives'
        self.prompt_logprobs = [] if prompt_logprobs else None  # filled chunk by chunk while prefilling

    def cancel(self, error: ServiceError | None = None) -> None:
        """Ask the scheduler to drop this request at its next iteration (any thread)."""
        if self.error is None:
            self.error = error or Cancelled("request cancelled by the client")

    def stream(self) -> Iterator[Output]:
        """The outputs, in order; raises the ServiceError that ended the request, if any."""
        while True:
            item = self.outputs.get()
            if item is None:
                return
            if isinstance(item, ServiceError):
                raise item
            yield item

    def usage(self) -> dict:
        now = self.t_done or time.monotonic()
        return dict(prompt_tokens=len(self.prompt_ids), completion_tokens=self.generated,
                    cached_prompt_tokens=self.cached,
                    queue_seconds=(self.t_admitted or now) - self.t_created,
                    prefill_seconds=(self.t_first or now) - (self.t_admitted or now),
                    decode_seconds=now - (self.t_first or now))


class Scheduler:
    """Owns the engine from one thread; other threads tokenize, schedule, cancel and read status."""

    def __init__(self, *, config, notifier, on_fault=None):
        self.config = config
        self.notifier = notifier
        self.on_fault = on_fault  # on_fault(reason), scheduler thread: the model was found broken
        self.engine = None
        self.draft_engine = None  # --draft: a small same-vocabulary model for speculation
        self.costs = None  # speculative.StepCosts: kept from an earlier start, or measured when first needed
        self._speculators: dict[str, object] = {}  # mode → speculative.Speculator
        # starting (until the first load begins) | loading | serving | draining | failed | no_model
        self.state = "starting"
        self.load_progress, self.load_fraction, self.error = "starting", 0.0, ""
        self._cv = threading.Condition()
        self._queue: collections.deque[Request] = collections.deque()
        self._live: list[Request] = []
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        self.steps = self.requests_total = self.tokens_total = 0
        self.prompt_tokens_total = self.prefill_tokens_total = 0
        self.prefix = None  # PrefixCache of the attached engine
        self.last_batch = 0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens) per step
        self.t_start = time.monotonic()

    # ---- lifecycle (daemon thread) --------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout)

    def set_loading(self, progress: str, fraction: float) -> None:
        with self._cv:
            self.state, self.load_progress, self.load_fraction = "loading", progress, fraction

    def attach(self, engine, *, draft_engine=None, costs=None) -> None:
        with self._cv:
            self.engine, self.state, self.error = engine, "serving", ""
            self.draft_engine, self.costs, self._speculators = draft_engine, costs, {}
            self.prefix = PrefixCache(engine, enabled=self.config.prefix_cache, share=self.config.prefix_cache_share)
            self.load_progress, self.load_fraction = "loaded", 1.0
            self._cv.notify_all()

    def detach(self, *, replacing: str = ""):
        """Take the engine away (unload); only when nothing is live. `replacing`: another model
        follows (state loading with that progress text, not no_model)."""
        with self._cv:
            engine, self.engine = self.engine, None
            self.state = "loading" if replacing else "no_model"
            if replacing:
                self.load_progress, self.load_fraction = replacing, 0.99
            self.draft_engine, self._speculators, self.costs = None, {}, None
            return engine

    def fail(self, message: str) -> None:
        """Stop serving: new requests get NotReady(message), which names the cause and the fix."""
        with self._cv:
            self.state, self.error = "failed", message

    def drain(self, timeout: float, *, reason: str = "ntransformerd is shutting down") -> tuple[int, int]:
        """Admit nothing new; let in-flight requests finish for `timeout` s, then cancel the rest."""
        end = time.monotonic() + timeout
        with self._cv:
            if self.state == "serving":
                self.state = "draining"
            self._draining_reason = reason
            before = len(self._queue) + len(self._live)
            while (self._queue or self._live) and time.monotonic() < end:
                self._cv.wait(min(0.05, max(0.0, end - time.monotonic())))
            left = list(self._queue) + list(self._live)
            for r in left:
                r.cancel(ShuttingDown(f"{reason}; the request was cancelled after {r.generated} tokens: "
                                      "retry when it is back (systemctl status ntransformerd)"))
            self._cv.notify_all()
            # the loop retires them within one step; if it is stuck, end their streams here
            end = time.monotonic() + 2.0
            while (self._queue or self._live) and time.monotonic() < end:
                self._cv.wait(0.05)
            for r in list(self._queue) + list(self._live):
                r.outputs.put(r.error)
        return before - len(left), len(left)

    def resume(self) -> None:
        with self._cv:
            if self.state == "draining":
                self.state = "serving" if self.engine is not None else "no_model"

    # ---- request path (callers' threads) --------------------------------------------------

    def _ready_engine(self):
        engine = self.engine
        if self.state in ("draining",) or self._stop:
            raise Draining(getattr(self, "_draining_reason", "ntransformerd is draining") +
                           ": it admits no new requests; retry once it is back (systemctl status ntransformerd)")
        if engine is None or self.state != "serving":
            if self.state == "starting":
                raise NotReady("ntransformerd is starting (loading its model comes next): retry in a few seconds "
                               "(ntx-client generate --wait waits for it)")
            if self.state == "loading":
                raise NotReady(f"the model is still loading ({self.load_progress}): retry in a few seconds; "
                               "ntx-client status shows progress")
            if self.state == "failed":
                raise NotReady(self.error)
            raise NotReady("no model is loaded: load one with the Admin LoadModel verb (as root)")
        return engine

    def tokenize(self, *, text: str | None = None, messages: Sequence[dict] | None = None,
                 ids: Sequence[int] | None = None, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Prompt ids from raw text, chat messages (through the model's template) or ids."""
        engine = self._ready_engine()
        tok = engine.tokenizer
        if ids is not None:
            bad = [i for i in ids if not 0 <= i < engine.cfg.vocab_size]
            if bad:
                raise InvalidRequest(f"token id {bad[0]} is out of range: the vocabulary has "
                                     f"{engine.cfg.vocab_size} ids (0..{engine.cfg.vocab_size - 1})")
            return list(ids)
        if messages is not None:
            return encode_chat(engine, messages)
        return tok.encode(text, parse_special=parse_special, add_special=add_special)

    def speculator(self, mode: str | None):
        """The Speculator for a request's mode ('' = the daemon's default), None for off;
        raises InvalidRequest for a mode this daemon cannot serve."""
        try:
            name, arg = speculative.parse_mode(mode or self.config.speculative)
            if name == "off":
                return None
            if name in ("skip", "prefix") and not arg:  # the daemon's own layers for this source
                dname, darg = speculative.parse_mode(self.config.speculative)
                arg = darg if dname == name else ""
            key = f"{name}:{arg}" if arg else name
            with self._cv:
                spec = self._speculators.get(key)
                if spec is None:
                    draft = speculative.make_draft(key, self.engine, draft_engine=self.draft_engine)
                    spec = speculative.Speculator(self.engine, draft, costs=self.costs)
                    self._speculators[key] = spec
                return spec
        except ValueError as e:
            raise InvalidRequest(f"{e}") from None

    def schedule(self, prompt_ids: list[int], params, *, max_tokens: int | None,
                 deadline: float | None = None, prefix_cache: bool = True, speculative: str = "",
                 logprobs: int | None = None, prompt_logprobs: bool = False, constraint=None,
                 caller=None) -> Request:
        """Queue a request; raises InvalidRequest, NotReady, Draining or QueueFull.

        logprobs: report each generated token's log-probability and its n most likely
        alternatives'; prompt_logprobs: the prompt's too (every prompt token is then computed:
        no prefix cache). constraint: a constraints.Constraint the output must satisfy."""
        from ntransformerd.engine.engine import Continuation

        engine = self._ready_engine()
        n_ctx = engine.max_ctx
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty: send at least one token of text")
        if len(prompt_ids) >= n_ctx:
            raise InvalidRequest(f"the prompt is {len(prompt_ids)} tokens and the context holds {n_ctx}: "
                                 "shorten it (ntx-client tokenize counts tokens)")
        if max_tokens is None:
            max_tokens = self.config.default_max_tokens
        if not 1 <= max_tokens <= n_ctx:
            raise InvalidRequest(f"max_tokens {max_tokens} is out of range: use 1..{n_ctx} (the context length)")
        req = Request(list(prompt_ids), params, max_tokens=max_tokens, deadline=deadline,
                      prefix_cache=prefix_cache and not prompt_logprobs, logprobs=logprobs,
                      prompt_logprobs=prompt_logprobs, caller=caller)
        req.cont = Continuation(engine, prompt_ids, params, max_tokens=max_tokens, constraint=constraint)
        req.speculator = self.speculator(speculative)
        with self._cv:
            self._ready_engine()
            if len(self._live) + len(self._queue) >= self.config.max_batch + self.config.max_queue:
                raise QueueFull(f"ntransformerd is full: {len(self._live)} requests running and "
                                f"{len(self._queue)} queued (max_queue {self.config.max_queue}); retry later "
                                "or raise max_batch / max_queue in /etc/ntransformer/ntransformerd.toml")
            self._queue.append(req)
            self.requests_total += 1
            self._cv.notify_all()
        return req

    # ---- the loop (scheduler thread) ------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                if self._stop:
                    break
            outcome = self.iterate()
            if outcome != "failed":
                self.notifier.watchdog()  # only an iteration that got through pings
            if outcome == "idle":
                with self._cv:
                    if not self._stop and not self._queue:
                        self._cv.wait(0.5)
            elif outcome == "failed":
                time.sleep(0.05)  # a fault that repeats must not spin the loop hot
        with self._cv:
            for r in list(self._queue) + list(self._live):
                r.cancel(ShuttingDown("ntransformerd stopped"))
            self.retire()

    def iterate(self) -> str:
        """One iteration: retire → admit → compose → run. "stepped", "idle" (nothing live) or
        "failed": something outside any one request's work raised; it is logged and the requests
        of the iteration's step (all live ones, before a step was composed) fail. Never raises."""
        batch: list = []
        try:
            self.ensure_costs()
            with self._cv:
                self.retire()
                self.admit()
                if not self._live:
                    return "idle"
                batch = self.compose()
            if batch:
                self.run(batch)
            return "stepped"
        except Exception as e:  # noqa: BLE001 - the loop outlives any bug in one iteration
            log.exception("scheduler iteration failed")
            with self._cv:
                for r in [r for r, _, _ in batch] or list(self._live):
                    self.fail_request(r, e, "scheduling it")
            return "failed"

    def ensure_costs(self) -> None:
        """The speculation cost table, measured on this thread (it owns the engine) when first
        needed: before a queued speculating request is admitted (a slot is free for it then),
        or, where the daemon speculates by default, on its first idle iteration. Kept per model,
        plan and machine (speculative.step_costs), so a restart reads it instead."""
        with self._cv:
            engine = self.engine
            if self.costs is not None or engine is None or self.state != "serving" or not engine.kv.free_slots:
                return
            waiting = [r for r in self._queue if r.speculator is not None]
            default = speculative.parse_mode(self.config.speculative)[0] != "off"
            if not waiting and not (default and not self._live):
                return
            draft_engine = self.draft_engine
        self.set_status(f"measuring step costs for speculative decoding ({len(waiting)} requests wait)")
        try:
            costs = speculative.step_costs(engine, draft_engine)
        except Exception as e:  # noqa: BLE001 - the requests that wait for it fail; the next one tries again
            log.exception("measuring the speculation cost table")
            for r in waiting:
                self.fail_request(r, e, "measuring the speculation cost table")
            return
        finally:
            self.set_status("")
        with self._cv:
            if self.engine is engine:
                self.costs = costs
                for spec in self._speculators.values():
                    spec.use_costs(costs)

    def set_status(self, text: str) -> None:
        """What the loop is busy with besides serving (Status shows it as load_progress)."""
        with self._cv:
            if self.state == "serving":
                self.load_progress = text or "loaded"

    def fail_request(self, r: Request, exc: BaseException, doing: str) -> None:
        """r ends with the status of `exc` (raised while `doing` r's work) at the next retire();
        the others go on. Logits no token can be drawn from also stop serving the model."""
        if isinstance(exc, ServiceError):
            err = exc
        elif isinstance(exc, InvalidLogits):
            err = self.model_fault(exc)
        else:
            log.error("request %d failed while %s", r.id, doing, exc_info=exc)
            detail = f"{type(exc).__name__}: {exc}"
            if len(detail) > MAX_DETAIL_CHARS:
                detail = detail[:MAX_DETAIL_CHARS] + "…"
            err = EngineFailed(f"ntransformerd failed while {doing} ({detail}); it keeps serving: retry, and "
                               "if it repeats, report it with the daemon's log (journalctl -u ntransformerd)")
        r.prefix_cache = False  # whatever its KV holds is not worth reusing
        r.cancel(err)

    def model_fault(self, exc: BaseException) -> ModelFault:
        """The model produced logits no token can be drawn from: stop serving it (new requests get
        NotReady naming why) and tell the daemon; the error for the requests that met it."""
        try:
            name = repr(model_name(self.engine))
        except Exception:  # noqa: BLE001 - the reason must come out whatever the engine lacks
            name = "loaded"
        reason = (f"the model {name} produced invalid logits ({exc}); the file or the backend is broken: "
                  "ntransformerd stopped serving it; load a good model with `sudo ntx-admin model load PATH`")
        with self._cv:
            first = self.state == "serving"
            if first:
                self.state, self.error = "failed", reason
                for q in self._queue:
                    q.cancel(ModelFault(reason))
        if first:
            log.error("%s", reason)
            if self.on_fault is not None:
                try:
                    self.on_fault(reason)
                except Exception:  # noqa: BLE001 - the requests still fail with the reason
                    log.exception("reporting the model fault")
        return ModelFault(reason)

    def retire(self) -> None:
        """Requests that finished, failed, were cancelled or ran past their deadline leave the batch."""
        now = time.monotonic()
        for r in list(self._queue) + list(self._live):
            if r.error is None and r.state != "done" and r.deadline is not None and now > r.deadline:
                r.cancel(DeadlineExceeded(f"the deadline passed after {r.generated} tokens: "
                                          "give the call a longer timeout or ask for fewer tokens"))
            if r.error is None and r.state != "done":
                continue
            if r in self._queue:
                self._queue.remove(r)
            elif r in self._live:
                self._live.remove(r)
                self._release(r)
            self._end(r)

    def _release(self, r: Request) -> None:
        """r's draft state and KV slot go back (its KV to the prefix cache); a failure here is
        logged, never passed on to r or the next request."""
        if r.spec is not None:
            try:
                r.speculator.close(r.spec)
            except Exception:  # noqa: BLE001
                log.exception("closing the draft state of request %d", r.id)
            r.spec = None
        if self.engine is not None and r.slot >= 0:
            try:
                self.prefix.close(r.slot, self._kv_tokens(r), keep=r.prefix_cache, caller=r.caller)
            except Exception:  # noqa: BLE001
                log.exception("freeing KV slot %d of request %d", r.slot, r.id)
            r.slot = -1

    def _end(self, r: Request) -> None:
        """r's stream ends: with its error, unless it finished."""
        if r.state != "done":
            r.state = "done"
            r.outputs.put(r.error)
        r.outputs.put(None)
        self._cv.notify_all()

    def admit(self) -> None:
        """Queued requests take free KV-cache slots, oldest first, each starting from the
        longest prefix of its prompt that a free or live slot holds."""
        while self._queue and self.engine is not None and len(self._live) < self.config.max_batch \
                and self.engine.kv.free_slots:
            if self._queue[0].speculator is not None and self.costs is None and self.state == "serving":
                break  # the next iteration measures the cost table first (ensure_costs)
            r = self._queue.popleft()
            try:
                live = [(q.slot, self._kv_tokens(q), q.caller) for q in self._live if q.prefix_cache]
                r.slot, r.prefilled = self.prefix.open(r.prompt_ids, live, use=r.prefix_cache, caller=r.caller)
            except Exception as e:  # noqa: BLE001
                self.fail_request(r, e, "giving it a KV-cache slot")
                self._end(r)
                continue
            r.cached = r.prefilled
            r.state, r.t_admitted = "prefill", time.monotonic()
            self.prompt_tokens_total += len(r.prompt_ids)
            self._live.append(r)

    def _kv_tokens(self, r: Request) -> list[int]:
        """The token ids whose keys and values r's slot holds."""
        n = self.engine.length(r.slot)
        return (r.prompt_ids + r.generated_ids)[:n] if n > len(r.prompt_ids) else r.prompt_ids[:n]

    def _waits_for_shared_prefill(self, r: Request) -> bool:
        """Another prefilling request, older, will compute prompt positions r shares: r waits
        for them (and copies them next iteration) instead of computing them twice."""
        if not (self.prefix.enabled and r.prefix_cache):
            return False
        for o in self._live:
            if o is r:
                return False
            if o.state == "prefill" and o.prefix_cache and self.prefix.shares(r.caller, o.caller) and \
                    min(common_prefix(r.prompt_ids, o.prompt_ids), len(r.prompt_ids) - 1) > max(o.prefilled,
                                                                                                r.prefilled):
                return True
        return False

    def compose(self) -> list[tuple[Request, list[int], bool]]:
        """(request, tokens, completes_prompt) for this step: all decode tokens, then prefill
        chunks from a shared budget of `prefill_chunk` tokens, oldest request first."""
        batch, budget = [], self.config.prefill_chunk
        for r in self._live:
            if r.state == "decode":
                batch.append((r, [r.next_token], True))
        for r in self._live:
            if r.state == "prefill" and r.prefix_cache and self.prefix.enabled:
                try:
                    live = [(q.slot, self._kv_tokens(q), q.caller) for q in self._live if q.prefix_cache]
                    filled = self.prefix.catch_up(r.slot, r.prompt_ids, r.prefilled, live, caller=r.caller)
                except Exception as e:  # noqa: BLE001
                    self.fail_request(r, e, "copying its prompt's cached keys and values")
                    continue
                r.cached += filled - r.prefilled
                r.prefilled = filled
            if r.state == "prefill" and budget > 0 and not self._waits_for_shared_prefill(r):
                chunk = r.prompt_ids[r.prefilled:r.prefilled + budget]
                budget -= len(chunk)
                batch.append((r, chunk, r.prefilled + len(chunk) == len(r.prompt_ids)))
        return batch

    def draft(self, batch: list[tuple[Request, list[int], bool]]) -> dict[int, object]:
        """Draft tokens for every speculating request in decode, each source drafting for all of
        its requests at once: {request id: speculative.Proposal}."""
        groups: dict[int, list[Request]] = {}
        for r, _, _ in batch:
            if r.state == "decode" and r.spec is not None:
                groups.setdefault(id(r.speculator), []).append(r)
        proposals = {}
        for reqs in groups.values():
            try:
                planned = reqs[0].speculator.plan([r.spec for r in reqs])
            except Exception as e:  # noqa: BLE001 - a draft source's fault fails its own requests
                if isinstance(e, InvalidLogits):  # the draft's logits: not a reason to stop serving the model
                    e = EngineFailed(f"the draft {reqs[0].speculator.draft.name} produced invalid logits ({e}): "
                                     "retry with another speculative mode (e.g. --speculative off)")
                for r in reqs:
                    self.fail_request(r, e, "drafting tokens for it")
                continue
            for r, p in zip(reqs, planned):
                proposals[r.id] = p
        return proposals

    def run(self, batch: list[tuple[Request, list[int], bool]]) -> None:
        """One engine step for the whole batch, then sample and stream for each request."""
        engine = self.engine
        # Each row's most likely ids alone where every sampler that draws this step can do with
        # them (Sampler.need): the GPU then picks them on the device instead of copying all logits.
        needs = [r.cont.need() if r.logprobs is None else None for r, tokens, complete in batch if complete]
        top = max(needs) if needs and None not in needs else None
        if any(r.speculator is not None for r, _, _ in batch):  # speculation verifies whole rows
            top = None
        proposals = self.draft(batch)
        try:
            items = [(r.slot, tokens + proposals[r.id].tokens if r.id in proposals else tokens) for r, tokens, _ in batch]
            scoring = any(r.prompt_logprobs is not None and r.state == "prefill" for r, _, _ in batch)
            if scoring or any(p.tokens for p in proposals.values()):  # every row of a draft or scored prompt
                flat = engine.step(items, all_logits=True)
                ends = np.cumsum([len(t) for _, t in items])
                logits = [flat[e - len(t):e] for (_, t), e in zip(items, ends)]
            else:
                logits = engine.step(items, top=top)
                logits = [logits[i] if batch[i][0].id not in proposals else logits[i][None]  # rows (1, V)
                          for i in range(len(batch))]
        except Exception as e:  # noqa: BLE001 - one bad step must not take the daemon down
            log.exception("engine step failed for requests %s", [r.id for r, _, _ in batch])
            # a domain error (the drive under the stream failed) keeps its own status code
            for r, _, _ in batch:
                self.fail_request(r, e, "running the model on its batch")
            return
        n_new = 0
        for (r, tokens, complete), row in zip(batch, logits):
            if r.error is not None:  # failed this step (its draft); retire() ends it
                continue
            try:
                n_new += self.advance(engine, r, tokens, complete, row, proposals.get(r.id))
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                self.fail_request(r, e, "sampling its next token")
        with self._cv:
            self.steps += 1
            self.tokens_total += n_new
            self.last_batch = len(batch)
            now = time.monotonic()
            self._recent.append((now, n_new))
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
                self._recent.popleft()

    def advance(self, engine, r: Request, tokens: list[int], complete: bool, row, proposal) -> int:
        """r's share of a step: its prompt progress, or its next tokens sampled and streamed.
        Returns how many tokens it generated."""
        if r.state == "prefill":
            if r.prompt_logprobs is not None:
                self.score_prompt(r, tokens, row)
            r.prefilled += len(tokens)
            self.prefill_tokens_total += len(tokens)
            if not complete:
                return 0
            r.state, r.t_first = "decode", time.monotonic()
            if isinstance(row, np.ndarray) and row.ndim == 2:  # a chunk's rows: its last one samples
                row = row[-1]
            if r.speculator is not None:  # from its first token on, a speculating request draws by its seed
                r.spec = r.speculator.open(r.cont, r.slot)
                return self.stream_tokens(engine, r, [r.spec.first(row)], row[None])
        if proposal is not None:
            return self.stream_tokens(engine, r, r.speculator.accept(r.spec, row, proposal), row)
        if isinstance(row, np.ndarray) and row.ndim == 2:
            row = row[-1]
        self.sample_and_stream(engine, r, row)
        return 1

    def score_prompt(self, r: Request, tokens: list[int], rows) -> None:
        """The log-probabilities of the prompt tokens that this chunk's rows predict."""
        start = r.prefilled + 1  # row i predicts prompt position prefilled + i + 1
        targets = r.prompt_ids[start:start + len(tokens)]
        rows = np.asarray(rows).reshape(-1, np.shape(rows)[-1])
        r.prompt_logprobs += [(t, *lp) for t, lp in
                              zip(targets, prompt_logprobs(rows[:len(targets)], targets, r.logprobs or 0))]

    def sample_and_stream(self, engine, r: Request, logits) -> None:
        """sample → detokenize → stop strings → stream; the same rules as engine.generate."""
        token = r.cont.sample(logits)
        lps = [(token, *token_logprobs(logits, token, r.logprobs))] if r.logprobs is not None else None
        text, reason = r.cont.push(token, room=engine.length(r.slot) + 1 <= engine.max_ctx)
        r.generated = r.cont.generated
        r.generated_ids.append(token)
        first = r.prompt_ids if r.generated == 1 else None
        if reason is not None:
            return self.finish(r, token, text, reason, first, lps)
        r.next_token = token
        r.outputs.put(self._output(r, [token], text, first, lps))

    def _output(self, r: Request, tokens: list[int], text: str, first, lps, **end) -> Output:
        """One output; the first carries the prompt (and its log-probabilities, if asked for)."""
        prompt_lps = r.prompt_logprobs if first is not None else None
        return Output(tokens, text, prompt_ids=first, logprobs=lps, prompt_logprobs=prompt_lps, **end)

    def stream_tokens(self, engine, r: Request, tokens: list[int], rows) -> int:
        """A speculating request's tokens of this step, through the same Continuation rules,
        streamed as one output; tokens after the end (a stop, EOS, the budget) are dropped.
        rows: the logits each token was drawn from. Returns how many were taken."""
        before, texts, taken, reason = r.cont.generated, [], [], None
        for token in tokens:
            text, reason = r.cont.push(token, room=len(r.cont.history) + 1 <= engine.max_ctx)
            texts.append(text)
            taken.append(token)
            if reason is not None:
                break
        r.generated = r.cont.generated
        r.generated_ids += taken
        first = r.prompt_ids if before == 0 else None
        lps = ([(t, *token_logprobs(row, t, r.logprobs)) for t, row in zip(taken, rows)]
               if r.logprobs is not None else None)
        if reason is not None:
            self.finish(r, taken, "".join(texts), reason, first, lps)
        else:
            r.next_token = taken[-1]
            r.outputs.put(self._output(r, taken, "".join(texts), first, lps))
        return len(taken)

    def finish(self, r: Request, token, text: str, reason: str, first, lps=None) -> None:
        r.t_done = time.monotonic()
        ids = list(token) if isinstance(token, list) else [token]
        r.outputs.put(self._output(r, ids, text, first, lps, finish_reason=reason, usage=r.usage()))
        r.state = "done"  # retire() frees the slot at the top of the next iteration

    # ---- status (any thread) --------------------------------------------------------------

    def snapshot(self) -> dict:
        with self._cv:
            now = time.monotonic()
            # steps within the window only: steps are what prune it, so when idle it is stale
            recent = [(t, n) for t, n in self._recent if t >= now - RATE_WINDOW_S]
            span = now - recent[0][0] if len(recent) > 1 else 0.0
            tps = sum(n for _, n in recent[1:]) / span if span > 0 else 0.0
            reqs = [dict(id=r.id, state=r.state, slot=r.slot, prompt_tokens=len(r.prompt_ids),
                         generated_tokens=r.generated, age_seconds=now - r.t_created, caller=r.caller)
                    for r in list(self._live) + list(self._queue)]
            steps_per_s = (len(recent) - 1) / span if span > 0 else 0.0
            specs = [sp.stats() for sp in self._speculators.values()]
            passes = sum(x["passes"] for x in specs)
            proposed, accepted = sum(x["proposed"] for x in specs), sum(x["accepted"] for x in specs)
            speculation = dict(default_mode=self.config.speculative, passes=passes, proposed=proposed,
                               accepted=accepted, acceptance=accepted / proposed if proposed else 0.0,
                               tokens_per_pass=(sum(x["tokens_per_pass"] * x["passes"] for x in specs) / passes
                                                if passes else 0.0),
                               draft_model=self.draft_engine.model.path if self.draft_engine is not None else "",
                               costs=self.costs.to_dict() if self.costs is not None else None,
                               sources={x["source"]: x for x in specs})
            return dict(state=self.state, load_progress=self.load_progress, load_fraction=self.load_fraction,
                        error=self.error, live=len(self._live), queued=len(self._queue),
                        batch=self.last_batch, free_slots=self.engine.kv.free_slots if self.engine else 0,
                        tokens_per_second=tps, steps_per_second=steps_per_s, steps=self.steps,
                        requests_total=self.requests_total, tokens_total=self.tokens_total,
                        prompt_tokens_total=self.prompt_tokens_total, prefill_tokens_total=self.prefill_tokens_total,
                        prefix_hit_tokens_total=self.prefix.hit_tokens if self.prefix else 0,
                        prefix_evictions_total=self.prefix.evictions if self.prefix else 0,
                        prefix_cached_slots=len(self.prefix.held) if self.prefix else 0,
                        uptime=now - self.t_start, requests=reqs, speculation=speculation,
                        skip_layers=list(getattr(getattr(self.engine, "config", None), "skip_layers", None) or ()))


def model_name(engine) -> str:
    """The model's name as clients see it: general.name, else the file name."""
    return str(engine.model.metadata.get("general.name") or os.path.basename(engine.model.path))


def encode_chat(engine, messages: Sequence[dict]) -> list[int]:
    """Prompt ids of `messages` through the model's chat template, generation prompt added
    (engine.encode_chat: what `ntx-model run --chat` does)."""
    if not messages:
        raise InvalidRequest("the chat has no messages: send at least one user message")
    for m in messages:
        if m["role"] not in ("system", "user", "assistant", "tool"):
            raise InvalidRequest(f"chat role {shown(m['role'])} is not one of system, user, assistant, tool")
    return engine.encode_chat(messages)
