"""Continuous batching: every live request advances in one step of the decode loop per iteration.

The request path, in the order it runs:

    tokenize(input)              → prompt ids            (caller's thread)
    schedule(ids, params)        → Request, queued       (caller's thread; bounded queue)
    loop, one thread owning the engine, each iteration:
        retire()                 finished / cancelled / past-deadline requests leave, slots freed
                                 (their KV stays for the prefix cache)
        admit()                  queued requests take free KV-cache slots, starting from the
                                 longest cached or live prefix of their prompt
        compose()                one row per decoding request + prefill chunks, the chunks
                                 sharing `prefill_chunk` tokens so a long prompt cannot stall
                                 the others
        decode.step(rows)        drafts (speculating requests, batched per draft source), one
                                 engine step, the draws (on the device where every row allows),
                                 each request's accepted tokens
        streamer.send()          the tokens go to the streaming thread (server/streaming.py):
                                 detokenize, stop strings and the writes to the client's stream
                                 happen there, off the next step's critical path

On a device (Scheduler.overlap), a batch of decode rows that can run ahead (no prefill chunk,
speculation, log-probabilities, constraint or penalties: decode.Sequence.runs_ahead) is not run
and waited for: decode.launch queues step n+1 behind step n still in flight, its tokens step n's
draws where they are (on the device), and only then are step n's ids taken, its requests
advanced and streamed (decode.Launched.finish). The host composes, launches and streams while
the device computes; a request that ended in step n (EOS, length) had a position run in step
n+1, which its sequence discards (Sequence.settle). A batch that changes otherwise (a request
admitted, a prefill chunk, a row that needs the host) waits for the step in flight first.

When a step's KV blocks cannot be reserved (kv_cache.KVPoolFull), the youngest live request
gives its slot back and waits at the head of the queue to recompute its prompt and what it has
generated (Scheduler.preempt); its stream goes on where it was.

Each Request is a decode.Sequence (engine/decode.py, the loop `ntx-model run` drives too), so a
request's output is the one it would get alone (up to the engine's batch-invariance; see
tests/engine/test_decode_identity.py). The daemon's serving state is its own
(server/lifecycle.py); the scheduler reads it to admit, and reports a broken model through it.

Failures never end the loop. What raises while serving one request (admitting it, its prefix
cache, its drafts, its draw, its text) fails that request alone; an engine step that raises
fails the requests of that step, since it cannot tell whose row was at fault. Logits no token
can be drawn from (NaN, +inf: sampler.InvalidLogits) fail their requests with a ModelFault
naming the model, and the scheduler stops serving that model (FAILED, `on_fault` tells the
daemon, which turns health NOT_SERVING) until another is attached. The systemd watchdog is
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

from ntransformerd.engine import decode, kv_cache, speculative
from ntransformerd.engine.decode import DraftFault, Row, Text
from ntransformerd.engine.constraints import ConstraintFailed
from ntransformerd.engine.sampler import InvalidLogits, NoAllowedToken
from ntransformerd.engine.speculative import Mode, StepCosts
from ntransformerd.server.errors import (Cancelled, DeadlineExceeded, Draining, EngineFailed, InvalidRequest, ModelFault,
                                         NotReady, QueueFull, ServiceError, ShuttingDown, shown)
from ntransformerd.server.lifecycle import Lifecycle
from ntransformerd.server.prefix_cache import PrefixCache, common_prefix
from ntransformerd.server.streaming import Output, Streamer
from ntx_proto.states import RequestState, ServingState

log = logging.getLogger("ntransformerd")
RATE_WINDOW_S = 5.0  # tokens/s and steps/s in Status are over the steps of the last seconds
MAX_DETAIL_CHARS = 300  # of an unexpected exception's text in a client's error message

_ids = itertools.count(1)
_WAIT = object()  # Request.stream: nothing taken from the queue yet

__all__ = ["Output", "Request", "Scheduler", "SchedulerStatus", "encode_chat", "model_name"]


class Request:
    """One generation, from queued to retired: a decode.Sequence and what serving it adds. The
    scheduler thread writes its sequence and state, the streaming thread its text and outputs;
    cancel() any thread."""

    def __init__(self, seq: decode.Sequence, *, deadline: float | None, prefix_cache: bool = True, caller=None):
        self.id = next(_ids)
        self.seq = seq
        self.caller = caller  # callers.Caller: whose prefix cache scope it uses; None: in-process
        self.deadline = deadline  # time.monotonic() value, or None
        self.state = RequestState.QUEUED  # → PREFILL → DECODE → DONE (retired); back to QUEUED when preempted
        self.prefix_cache = prefix_cache  # may start from, and leave its KV to, the prefix cache
        self.cached = 0  # prompt tokens taken from the prefix cache
        self.error: ServiceError | None = None  # set by cancel(); delivered when it retires
        self.outputs: queue.Queue[Output | ServiceError | None] = queue.Queue()
        self.t_created = time.monotonic()
        self.t_admitted = self.t_first = self.t_done = None
        self.text = Text(seq.engine.tokenizer, seq.params.stop)  # the streaming thread's
        self.completion_tokens = 0  # streamed (the streaming thread's)
        self.text_done = False  # its last output is written (the streaming thread sets it)
        self.resume_below: int | None = None  # preempted: readmitted once fewer than this many are live
        self.ended = False  # its stream is closed (the streaming thread sets it)

    @property
    def prompt_ids(self) -> list[int]:
        return self.seq.prompt_ids

    @property
    def slot(self) -> int:
        return self.seq.slot

    @property
    def prefilled(self) -> int:
        return self.seq.prefilled

    @property
    def generated(self) -> int:
        return self.seq.generated

    @property
    def speculator(self):
        return self.seq.speculator

    @property
    def finished(self) -> bool:
        """Its sequence ended (EOS, budget, context, constraint) or its text did (a stop string)."""
        return self.seq.finish is not None or self.text_done

    def cancel(self, error: ServiceError | None = None) -> None:
        """Ask the scheduler to drop this request at its next iteration (any thread)."""
        if self.error is None:
            self.error = error or Cancelled("request cancelled by the client")

    def stream(self) -> Iterator[Output]:
        """The outputs, in order; raises the ServiceError that ended the request, if any. What
        queued up while the reader was busy (its writes behind the steps) comes as one Output
        (Output.then): fewer, larger messages, the same text."""
        item = self.outputs.get()
        while True:
            if item is None:
                return
            if isinstance(item, ServiceError):
                raise item
            after = _WAIT
            while True:  # join the outputs already waiting behind it
                try:
                    after = self.outputs.get_nowait()
                except queue.Empty:
                    after = _WAIT
                    break
                if not isinstance(after, Output):
                    break  # the end, or an error: after this output
                item, after = item.then(after), _WAIT
            yield item
            item = self.outputs.get() if after is _WAIT else after

    def usage(self) -> dict:
        now = self.t_done or time.monotonic()
        return dict(prompt_tokens=len(self.prompt_ids), completion_tokens=self.completion_tokens,
                    cached_prompt_tokens=self.cached,
                    queue_seconds=(self.t_admitted or now) - self.t_created,
                    prefill_seconds=(self.t_first or now) - (self.t_admitted or now),
                    decode_seconds=now - (self.t_first or now))


@dataclasses.dataclass(frozen=True)
class RequestStatus:
    id: int
    state: RequestState  # QUEUED | PREFILL | DECODE
    slot: int
    prompt_tokens: int
    generated_tokens: int
    age_seconds: float
    caller: object = None  # callers.Caller that sent it (Status shows a caller its own)


@dataclasses.dataclass(frozen=True)
class SpeculationStatus:
    default_mode: str
    passes: int
    proposed: int
    accepted: int
    acceptance: float
    tokens_per_pass: float
    draft_model: str
    costs: StepCosts | None


@dataclasses.dataclass(frozen=True)
class SchedulerStatus:
    """What the scheduler reports (the servicer maps it to StatusResponse)."""

    live: int
    queued: int
    batch: int  # rows of the last step
    free_slots: int
    tokens_per_second: float
    steps_per_second: float
    steps: int
    requests_total: int
    tokens_total: int
    prompt_tokens_total: int
    prefill_tokens_total: int
    prefix_hit_tokens_total: int
    prefix_evictions_total: int
    prefix_cached_slots: int
    uptime: float
    requests: tuple[RequestStatus, ...]
    speculation: SpeculationStatus


class Scheduler:
    """Owns the engine from one thread; other threads tokenize, schedule, cancel and read status."""

    def __init__(self, *, config, notifier, lifecycle: Lifecycle | None = None, on_fault=None):
        self.config = config
        self.notifier = notifier
        self.lifecycle = lifecycle if lifecycle is not None else Lifecycle()
        self.on_fault = on_fault  # on_fault(reason), scheduler thread: the model was found broken
        self.default_mode: Mode = config.speculative  # of requests that do not say (parsed by config.py)
        self.engine = None
        self.draft_engine = None  # --draft: a small same-vocabulary model for speculation
        self.costs = None  # speculative.StepCosts: kept from an earlier start, or measured when first needed
        self._speculators: dict[str, speculative.Speculator] = {}  # str(mode) → its Speculator
        self._cv = threading.Condition()
        self._queue: collections.deque[Request] = collections.deque()
        self._live: list[Request] = []
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        self.streamer = Streamer(on_error=lambda r, e: self.fail_request(r, e, "turning its tokens into text"))
        self.streamer.start()
        self.steps = self.requests_total = self.tokens_total = 0
        self.prompt_tokens_total = self.prefill_tokens_total = 0
        self.prefix = None  # PrefixCache of the attached engine
        self.last_batch = 0
        self.overlap = False  # steps launched ahead (run): on a device, set where the engine is attached
        self._pending = None  # (decode.Launched, its batch): the step in flight
        self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens) per step
        self.t_start = time.monotonic()

    # ---- the engine (daemon thread) -------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():  # the loop is done with the engine: what the cache kept goes back
            with self._cv:
                if self.prefix is not None:
                    self.prefix.clear()
        self.streamer.stop(timeout)

    def attach(self, engine, *, draft_engine=None, costs=None) -> None:
        """Serve `engine` (the daemon then turns its lifecycle SERVING)."""
        with self._cv:
            self.engine = engine
            # a host backend's step takes every core: its text runs after the step, on this thread
            self.streamer.inline = engine.backend.is_host
            # a device's steps run while the host composes the next (a host backend's use every core)
            self.overlap = not engine.backend.is_host
            self.draft_engine, self.costs, self._speculators = draft_engine, costs, {}
            self.prefix = PrefixCache(engine, enabled=self.config.prefix_cache, share=self.config.prefix_cache_share)
            self._cv.notify_all()

    def detach(self):
        """Take the engine away (unload); only when nothing is live."""
        with self._cv:
            engine, self.engine = self.engine, None
            if self.prefix is not None:
                self.prefix.clear()
            self.draft_engine, self._speculators, self.costs = None, {}, None
            return engine

    def drain(self, timeout: float, *, reason: str = "ntransformerd is shutting down") -> tuple[int, int]:
        """Let in-flight requests finish for `timeout` s, then cancel the rest (the daemon has
        stopped admitting: Lifecycle.draining). (finished, cancelled)."""
        end = time.monotonic() + timeout
        with self._cv:
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
                self.streamer.end(r, r.error)
        return before - len(left), len(left)

    # ---- request path (callers' threads) --------------------------------------------------

    def serving_engine(self, *, admitting: bool = True):
        """The engine requests are served by; NotReady or (admitting) Draining, naming the cause
        and the fix, when there is none to serve them now."""
        if admitting and self._stop:
            raise Draining("ntransformerd is stopping: it admits no new requests; retry once it is back "
                           "(systemctl status ntransformerd)")
        self.lifecycle.check(admitting=admitting)
        engine = self.engine
        if engine is None:
            raise NotReady("no model is loaded: load one with the Admin LoadModel verb (as root)")
        return engine

    def tokenize(self, *, text: str | None = None, messages: Sequence[dict] | None = None,
                 ids: Sequence[int] | None = None, add_special: bool = True, parse_special: bool = True,
                 tools: Sequence[dict] | None = None) -> list[int]:
        """Prompt ids from raw text, chat messages and tools (through the model's template) or ids."""
        engine = self.serving_engine()
        tok = engine.tokenizer
        if ids is not None:
            bad = [i for i in ids if not 0 <= i < engine.cfg.vocab_size]
            if bad:
                raise InvalidRequest(f"token id {bad[0]} is out of range: the vocabulary has "
                                     f"{engine.cfg.vocab_size} ids (0..{engine.cfg.vocab_size - 1})")
            return list(ids)
        if messages is not None:
            return encode_chat(engine, messages, tools)
        return tok.encode(text, parse_special=parse_special, add_special=add_special)

    def speculator(self, mode: Mode | None):
        """The Speculator for a request's mode (None: the daemon's default), None for off;
        raises InvalidRequest for a mode this daemon cannot serve."""
        mode = (mode or self.default_mode).within(self.default_mode)
        if mode.off:
            return None
        with self._cv:
            spec = self._speculators.get(str(mode))
            if spec is None:
                try:
                    draft = speculative.make_draft(mode, self.engine, draft_engine=self.draft_engine)
                except ValueError as e:
                    raise InvalidRequest(f"{e}") from None
                spec = speculative.Speculator(self.engine, draft, costs=self.costs)
                self._speculators[str(mode)] = spec
            return spec

    def schedule(self, prompt_ids: list[int], params, *, max_tokens: int | None,
                 deadline: float | None = None, prefix_cache: bool = True, speculative: Mode | None = None,
                 logprobs: int | None = None, prompt_logprobs: bool = False, constraint=None,
                 caller=None) -> Request:
        """Queue a request; raises InvalidRequest, NotReady, Draining or QueueFull.

        speculative: the request's mode, None for the daemon's default. logprobs: report each
        generated token's log-probability and its n most likely alternatives'; prompt_logprobs:
        the prompt's too (every prompt token is then computed: no prefix cache). constraint: a
        constraints.Constraint the output must satisfy."""
        engine = self.serving_engine()
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
        seq = decode.Sequence(engine, prompt_ids, params, max_tokens=max_tokens, constraint=constraint,
                              speculator=self.speculator(speculative), logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs)
        req = Request(seq, deadline=deadline, prefix_cache=prefix_cache and not prompt_logprobs, caller=caller)
        with self._cv:
            self.serving_engine()
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
        try:
            self.finish_pending()
        except Exception:  # noqa: BLE001 - stopping: its requests are cancelled below
            log.exception("finishing the step in flight")
        with self._cv:
            for r in list(self._queue) + list(self._live):
                r.cancel(ShuttingDown("ntransformerd stopped"))
            self.retire()

    def iterate(self) -> str:
        """One iteration: retire → admit → compose → run. "stepped", "idle" (nothing live) or
        "failed": something outside any one request's work raised; it is logged and the requests
        of the iteration's step (all live ones, before a step was composed) fail. Never raises."""
        batch: list[tuple[Request, Row]] = []
        try:
            self.ensure_costs()
            with self._cv:
                self.retire()
                self.admit()
                idle = not self._live
                batch = [] if idle else self.compose()
            if batch:
                self.run(batch)
            elif self._pending is not None:
                self.finish_pending()
            elif idle:
                return "idle"
            return "stepped"
        except Exception as e:  # noqa: BLE001 - the loop outlives any bug in one iteration
            log.exception("scheduler iteration failed")
            self._pending = None  # its requests fail below with the others
            with self._cv:
                for r in [r for r, _ in batch] or list(self._live):
                    self.fail_request(r, e, "scheduling it")
            return "failed"

    def ensure_costs(self) -> None:
        """The speculation cost table, measured on this thread (it owns the engine) when first
        needed: before a queued speculating request is admitted (a slot is free for it then),
        or, where the daemon speculates by default, on its first idle iteration. Kept per model,
        plan and machine (speculative.step_costs), so a restart reads it instead."""
        with self._cv:
            engine = self.engine
            if self.costs is not None or engine is None or self.lifecycle.state != ServingState.SERVING:
                return
            waiting = [r for r in self._queue if r.speculator is not None]
            if not waiting and not (not self.default_mode.off and not self._live):
                return
            if not engine.free_slots and not self.prefix.evict():
                return  # every slot is live: the measurement waits for one to end
            draft_engine = self.draft_engine
        self.lifecycle.busy(f"measuring step costs for speculative decoding ({len(waiting)} requests wait)")
        try:
            costs = speculative.step_costs(engine, draft_engine)
        except Exception as e:  # noqa: BLE001 - the requests that wait for it fail; the next one tries again
            log.exception("measuring the speculation cost table")
            for r in waiting:
                self.fail_request(r, e, "measuring the speculation cost table")
            return
        finally:
            self.lifecycle.busy("")
        with self._cv:
            if self.engine is engine:
                self.costs = costs
                for spec in self._speculators.values():
                    spec.use_costs(costs)

    def fail_request(self, r: Request, exc: BaseException, doing: str) -> None:
        """r ends with the status of `exc` (raised while `doing` r's work) when it retires; the
        others go on. Logits no token can be drawn from also stop serving the model."""
        if isinstance(exc, ServiceError):
            err = exc
        elif isinstance(exc, InvalidLogits):
            err = self.model_fault(exc)
        elif isinstance(exc, DraftFault):
            err = EngineFailed(str(exc))
        elif isinstance(exc, (NoAllowedToken, ConstraintFailed)):  # the request's constraint, not the daemon
            err = InvalidRequest(f"the request's constraint allows no token after {r.generated} generated ({exc}): "
                                 "loosen the schema, regex or grammar (or max_digits)")
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
            first = self.lifecycle.failed(reason, only_serving=True)
            if first:
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
            if r.error is None and not r.finished and r.deadline is not None and now > r.deadline:
                r.cancel(DeadlineExceeded(f"the deadline passed after {r.generated} tokens: "
                                          "give the call a longer timeout or ask for fewer tokens"))
            if r.error is None and not r.finished:
                continue
            if r in self._queue:
                self._queue.remove(r)
            elif r in self._live:
                self._live.remove(r)
                self._release(r)
            r.state = RequestState.DONE
            self.streamer.end(r, r.error)
            self._cv.notify_all()

    def _release(self, r: Request) -> None:
        """r's draft state and KV slot go back (its KV to the prefix cache); a failure here is
        logged, never passed on to r or the next request."""
        seq = r.seq
        if seq.spec is not None:
            try:
                seq.speculator.close(seq.spec)
            except Exception:  # noqa: BLE001
                log.exception("closing the draft state of request %d", r.id)
            seq.spec = None
        if self.engine is not None and seq.slot >= 0:
            try:
                self.prefix.close(seq.slot, self._kv_tokens(r), keep=r.prefix_cache, caller=r.caller)
            except Exception:  # noqa: BLE001
                log.exception("freeing KV slot %d of request %d", seq.slot, r.id)
            seq.slot = -1

    def admit(self) -> None:
        """Queued requests take free KV-cache slots, oldest first, each starting from the
        longest prefix of its prompt that a free or live slot holds."""
        while self._queue and self.engine is not None and len(self._live) < self.config.max_batch \
                and self.prefix.slots_open:
            if self._queue[0].speculator is not None and self.costs is None \
                    and self.lifecycle.state == ServingState.SERVING:
                break  # the next iteration measures the cost table first (ensure_costs)
            head = self._queue[0]
            if head.resume_below is not None and len(self._live) >= head.resume_below:
                break  # preempted: it waits (and those behind it) until a request leaves and frees blocks
            kv = self.engine.kv
            if self._live and kv.blocks_for(len(head.seq.history)) + self._blocks_owed() > kv.available():
                break  # its prompt's blocks are not free: it waits for a request to leave (alone, it runs or fails)
            r = self._queue.popleft()
            try:
                live = [(q.slot, self._kv_tokens(q), q.caller) for q in self._live if q.prefix_cache]
                r.seq.slot, r.seq.prefilled = self.prefix.open(r.prompt_ids, live, use=r.prefix_cache,
                                                               caller=r.caller)
            except Exception as e:  # noqa: BLE001
                self.fail_request(r, e, "giving it a KV-cache slot")
                r.state = RequestState.DONE
                self.streamer.end(r, r.error)
                self._cv.notify_all()
                continue
            r.cached = r.prefilled
            if r.resume_below is not None:  # a preempted request back: its prompt was counted
                r.resume_below, r.state = None, RequestState.PREFILL
            else:
                r.state, r.t_admitted = RequestState.PREFILL, time.monotonic()
                self.prompt_tokens_total += len(r.prompt_ids)
            self._live.append(r)

    def _blocks_owed(self) -> int:
        """Blocks the live requests' positions so far still need (a prompt admitted but not yet
        run holds none): admission leaves them free."""
        kv = self.engine.kv
        return sum(max(0, kv.blocks_for(len(q.seq.history)) - kv.blocks_for(min(kv.kept(q.slot), len(q.seq.history))))
                   for q in self._live if q.slot >= 0)

    def preempt(self, cause: BaseException) -> bool:
        """A step's KV blocks could not be reserved: the youngest live request gives its slot
        back and goes to the head of the queue, to recompute its prompt and what it generated so
        far once a request leaves (decode.Sequence.restart); its stream goes on, nothing is sent
        twice. False where it is the only one (nothing to take blocks from)."""
        if len(self._live) < 2:
            return False
        r = max(self._live, key=lambda q: q.t_admitted or 0.0)
        log.info("KV pool full (%s): request %d yields its slot and recomputes %d tokens later", cause, r.id,
                 len(r.seq.history))
        with self._cv:
            self._live.remove(r)
            r.prefix_cache = False  # its blocks are what the others need; it recomputes from scratch
            self._release(r)
            r.seq.restart()
            r.state, r.resume_below = RequestState.QUEUED, len(self._live)
            self._queue.appendleft(r)
        return True

    def _kv_tokens(self, r: Request) -> list[int]:
        """The token ids whose keys and values r's slot holds."""
        return r.seq.history[:self.engine.length(r.slot)]

    def _waits_for_shared_prefill(self, r: Request) -> bool:
        """Another prefilling request, older, will compute prompt positions r shares: r waits
        for them (and copies them next iteration) instead of computing them twice."""
        if not (self.prefix.enabled and r.prefix_cache):
            return False
        for o in self._live:
            if o is r:
                return False
            if o.state == RequestState.PREFILL and o.prefix_cache and self.prefix.shares(r.caller, o.caller) and \
                    min(common_prefix(r.prompt_ids, o.prompt_ids), len(r.prompt_ids) - 1) > max(o.prefilled,
                                                                                                r.prefilled):
                return True
        return False

    def compose(self) -> list[tuple[Request, Row]]:
        """This step's rows: every decoding request's, then prefill chunks from a shared budget of
        `prefill_chunk` tokens, oldest request first."""
        batch, budget = [], self.config.prefill_chunk
        for r in self._live:
            if r.state == RequestState.DECODE and r.error is None and not r.finished:
                batch.append((r, r.seq.row(1)))
        for r in self._live:
            if r.state == RequestState.PREFILL and r.prefix_cache and self.prefix.enabled:
                try:
                    live = [(q.slot, self._kv_tokens(q), q.caller) for q in self._live if q.prefix_cache]
                    filled = self.prefix.catch_up(r.slot, r.prompt_ids, r.prefilled, live, caller=r.caller)
                except Exception as e:  # noqa: BLE001
                    self.fail_request(r, e, "copying its prompt's cached keys and values")
                    continue
                r.cached += filled - r.prefilled
                r.seq.prefilled = filled
            if r.state == RequestState.PREFILL and r.error is None and budget > 0 \
                    and not self._waits_for_shared_prefill(r):
                row = r.seq.row(budget)
                budget -= len(row.tokens)
                batch.append((r, row))
        return batch

    def run(self, batch: list[tuple[Request, Row]]) -> None:
        """One step of the decode loop for the whole batch; each request's accepted tokens go to
        the streaming thread. On a device (overlap), a batch of decode rows that can run ahead
        is launched behind the step in flight, and that step's draws are taken after: the host
        composes and launches step n+1 and streams step n while the device runs them."""
        if self.overlap and self._runs_ahead(batch):
            self._launch(batch)
            return
        if self._pending is not None:  # the batch changed: the step in flight ends first, the next recomposes
            self.finish_pending()
            return
        try:
            decode.step(self.engine, [row for _, row in batch])
        except Exception as e:  # noqa: BLE001 - one bad step must not take the daemon down
            self._failed_step(batch, e)
            return
        self._account(batch)

    def _runs_ahead(self, batch) -> bool:
        """Every row decodes and may run ahead (decode.Sequence.runs_ahead) with room for one
        more position, and, with a step in flight, its request is in it."""
        held = {id(r) for r, _ in self._pending[1]} if self._pending is not None else None
        limit = self.engine.max_ctx
        return bool(batch) and all(
            r.state == RequestState.DECODE and r.seq.runs_ahead() and self.engine.length(r.slot) < limit
            and (held is None or id(r) in held) for r, _ in batch)

    def _launch(self, batch) -> None:
        prev = self._pending
        try:
            launched = decode.launch(self.engine, [row for _, row in batch], None if prev is None else prev[0])
        except Exception as e:  # noqa: BLE001 - as a step that raised
            if prev is not None:
                self.finish_pending()
            self._failed_step(batch, e)
            return
        self._pending = (launched, batch)
        if prev is not None:
            self._finish(prev, launched)

    def finish_pending(self) -> None:
        """The step in flight, if any: its draws taken, its requests advanced and streamed."""
        if self._pending is not None:
            prev, self._pending = self._pending, None
            self._finish(prev, None)

    def _finish(self, pending, ahead) -> None:
        launched, batch = pending
        try:
            launched.finish(ahead)
        except Exception as e:  # noqa: BLE001
            self._failed_step(batch, e)
            return
        self._account([(r, row) for r, row in batch if r.state != RequestState.DONE])

    def _failed_step(self, batch, e: BaseException) -> None:
        """A step that raised: its blocks could not be reserved (the youngest request yields its
        own, Scheduler.preempt), or it fails its requests."""
        if isinstance(e, kv_cache.KVPoolFull):
            if self.preempt(e):
                return
            log.warning("KV pool full with one request live: %s", e)
            for r, _ in batch:
                self.fail_request(r, e, "reserving KV-cache blocks for its next step")
            return
        log.error("engine step failed for requests %s", [r.id for r, _ in batch], exc_info=e)
        # a domain error (the drive under the stream failed) keeps its own status code
        for r, _ in batch:
            self.fail_request(r, e, "running the model on its batch")

    def _account(self, batch) -> None:
        """A step's accepted tokens to the streaming thread; the counters."""
        n_new, now = 0, time.monotonic()
        for r, row in batch:
            if row.error is not None:
                self.fail_request(r, row.error, row.doing)
                continue
            if r.state == RequestState.PREFILL:
                self.prefill_tokens_total += len(row.tokens)
            if not row.accepted:
                continue
            if r.state == RequestState.PREFILL:
                r.state, r.t_first = RequestState.DECODE, r.t_first or now
            n_new += len(row.accepted)
            self.streamer.send(r, row.accepted, row.logprobs, r.seq.finish)
        with self._cv:
            self.steps += 1
            self.tokens_total += n_new
            self.last_batch = len(batch)
            self._recent.append((now, n_new))
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
                self._recent.popleft()

    # ---- status (any thread) --------------------------------------------------------------

    def status(self) -> SchedulerStatus:
        with self._cv:
            now = time.monotonic()
            # steps within the window only: steps are what prune it, so when idle it is stale
            recent = [(t, n) for t, n in self._recent if t >= now - RATE_WINDOW_S]
            span = now - recent[0][0] if len(recent) > 1 else 0.0
            reqs = tuple(RequestStatus(r.id, r.state, r.slot, len(r.prompt_ids), r.generated, now - r.t_created,
                                       r.caller) for r in list(self._live) + list(self._queue))
            specs = [sp.stats() for sp in self._speculators.values()]
            passes = sum(x["passes"] for x in specs)
            proposed, accepted = sum(x["proposed"] for x in specs), sum(x["accepted"] for x in specs)
            speculation = SpeculationStatus(
                default_mode=str(self.default_mode), passes=passes, proposed=proposed, accepted=accepted,
                acceptance=accepted / proposed if proposed else 0.0,
                tokens_per_pass=sum(x["tokens_per_pass"] * x["passes"] for x in specs) / passes if passes else 0.0,
                draft_model=self.draft_engine.model.path if self.draft_engine is not None else "", costs=self.costs)
            engine, prefix = self.engine, self.prefix
            return SchedulerStatus(
                live=len(self._live), queued=len(self._queue), batch=self.last_batch,
                free_slots=prefix.slots_open if engine is not None and prefix else 0,
                tokens_per_second=sum(n for _, n in recent[1:]) / span if span > 0 else 0.0,
                steps_per_second=(len(recent) - 1) / span if span > 0 else 0.0, steps=self.steps,
                requests_total=self.requests_total, tokens_total=self.tokens_total,
                prompt_tokens_total=self.prompt_tokens_total, prefill_tokens_total=self.prefill_tokens_total,
                prefix_hit_tokens_total=prefix.hit_tokens if prefix else 0,
                prefix_evictions_total=prefix.evictions if prefix else 0,
                prefix_cached_slots=len(prefix.held) if prefix else 0, uptime=now - self.t_start, requests=reqs,
                speculation=speculation)


def model_name(engine) -> str:
    """The model's name as clients see it: general.name, else the file name."""
    return str(engine.model.metadata.get("general.name") or os.path.basename(engine.model.path))


def encode_chat(engine, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
    """Prompt ids of `messages` through the model's chat template, generation prompt added
    (engine.encode_chat: what `ntx-model run --chat` does)."""
    if not messages:
        raise InvalidRequest("the chat has no messages: send at least one user message")
    for m in messages:
        if m["role"] not in ("system", "user", "assistant", "tool"):
            raise InvalidRequest(f"chat role {shown(m['role'])} is not one of system, user, assistant, tool")
    return engine.encode_chat(messages, tools=tools)
