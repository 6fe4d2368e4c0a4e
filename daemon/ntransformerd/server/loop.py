"""The scheduler's loop: one thread owns the engine and, each iteration, retires the requests
that ended, admits queued ones, composes the next step and runs it (server/scheduler.py tells
the whole request path). What to do comes from server/policy.py, which sees the queue and the
running set as records this module makes; the steps run in server/steps.py; server/metrics.py
counts.

Thread rule: the loop's own thread, or a caller that drives it by hand (iterate(), as ntx-model
and the tests do), owns the engine, the live set and the steps; the queue and the live set
change under `_cv`, which callers' threads take to queue and to read status.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterator

from ntransformerd.engine.generation import speculative
from ntransformerd.engine.generation.decode import DraftFault, Row
from ntransformerd.engine.generation.sampler import InvalidLogits, RequestCannotGoOn
from ntransformerd.server import policy
from ntransformerd.server.errors import (DeadlineExceeded, EngineFailed, InvalidRequest, ModelFault, ServiceError,
                                         ShuttingDown)
from ntransformerd.server.lifecycle import Lifecycle
from ntransformerd.server.metrics import Metrics
from ntransformerd.server.prefix_cache import PrefixCache
from ntransformerd.server.request import Request
from ntransformerd.server.served import ServedEngine, model_name
from ntransformerd.server.speculation import Speculation
from ntransformerd.server.steps import StepRunner
from ntransformerd.server.streaming import Streamer
from ntx_proto.states import RequestState, ServingState

log = logging.getLogger("ntransformerd")
MAX_DETAIL_CHARS = 300  # of an unexpected exception's text in a client's error message


class Loop:
    """The scheduler thread's half of the Scheduler: its state and its iteration."""

    def __init__(self, *, config, notifier, lifecycle: Lifecycle | None = None, on_fault=None):
        self.config = config
        self.notifier = notifier
        self.lifecycle = lifecycle if lifecycle is not None else Lifecycle()
        self.on_fault = on_fault  # on_fault(reason), scheduler thread: the model was found broken
        self.engine: ServedEngine | None = None
        self.speculation = Speculation(config.speculative)
        self.metrics = Metrics()
        self.prefix: PrefixCache | None = None  # of the attached engine
        self.overlap = False  # steps launched ahead (run): on a device, set where the engine is attached
        self._cv = threading.Condition()
        self._queue: collections.deque[Request] = collections.deque()
        self._live: list[Request] = []
        self._described: dict[int, policy.Running] = {}  # each live request's record, by id (_describe)
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        self.streamer = Streamer(on_error=lambda r, e: self.fail_request(r, e, "turning its tokens into text"))
        self.streamer.start()
        self.runner = StepRunner(streamer=self.streamer, metrics=self.metrics, preempt=lambda e: self.preempt(e),
                                 fail=lambda r, e, doing: self.fail_request(r, e, doing))

    @property
    def costs(self) -> speculative.StepCosts | None:
        """The speculation step-cost table (None until kept or measured)."""
        return self.speculation.costs

    # ---- the thread ----------------------------------------------------------------------

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
            self.runner.finish_pending()
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
            elif self.runner.pending is not None:
                self.runner.finish_pending()
            elif idle:
                return "idle"
            return "stepped"
        except Exception as e:  # noqa: BLE001 - the loop outlives any bug in one iteration
            log.exception("scheduler iteration failed")
            self.runner.pending = None  # its requests fail below with the others
            with self._cv:
                for r in [r for r, _ in batch] or list(self._live):
                    self.fail_request(r, e, "scheduling it")
            return "failed"

    def ensure_costs(self) -> None:
        """The speculation cost table, measured on this thread (it owns the engine) when first
        needed (policy.measures_costs), with a slot free for the measurement. Kept per model,
        plan and machine (speculative.step_costs), so a restart reads it instead."""
        with self._cv:
            engine = self.engine
            if self.costs is not None or engine is None or self.lifecycle.state != ServingState.SERVING:
                return
            waiting = [r for r in self._queue if r.speculator is not None]
            if not policy.measures_costs(queued_speculating=len(waiting), running=len(self._live),
                                         speculates_by_default=self.speculation.by_default):
                return
            if not engine.free_slots and not self.prefix.evict():
                return  # every slot is live: the measurement waits for one to end
            draft_engine = self.speculation.draft_engine
        self.runner.finish_pending()  # the measurement's steps must not run beside (or wait behind) one in flight
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
                self.speculation.use_costs(costs)

    def fail_request(self, r: Request, exc: BaseException, doing: str) -> None:
        """r ends with the status of `exc` (raised while `doing` r's work) when it retires; the
        others go on. Logits no token can be drawn from also stop serving the model."""
        r.prefix_cache = False  # whatever its KV holds is not worth reusing
        r.cancel(self.model_fault(exc) if isinstance(exc, InvalidLogits) else request_error(r, exc, doing))

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
                del self._described[r.id]
                self._release(r)
            self._done(r)

    def _done(self, r: Request) -> None:
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
        """Queued requests take free KV-cache slots, oldest first, while policy.admits the head,
        each starting from the longest prefix of its prompt that a kept or live slot holds."""
        if not self._queue or self.engine is None:
            return
        # what the running set owes does not change as requests join (their slots are new or were
        # kept, never a running one's): described once, each admitted request appended
        running = self._describe(self._live, owed=True)
        while self._queue and policy.admits(self._queued(self._queue[0]), running, self._room()):
            r = self._queue.popleft()
            try:
                r.seq.slot, r.seq.prefilled = self.prefix.open(r.prompt_ids, self._live_kv(), use=r.prefix_cache,
                                                               caller=r.caller)
            except Exception as e:  # noqa: BLE001
                self.fail_request(r, e, "giving it a KV-cache slot")
                self._done(r)
                continue
            r.cached = r.prefilled
            if r.resume_below is not None:  # a preempted request back: its prompt was counted
                r.resume_below, r.state = None, RequestState.PREFILL
            else:
                r.state, r.t_admitted = RequestState.PREFILL, time.monotonic()
                self.metrics.admitted(len(r.prompt_ids))
            self._live.append(r)
            self._described[r.id] = self._record(r)
            running += self._describe([r], owed=True)

    def preempt(self, cause: BaseException) -> bool:
        """A step's KV blocks could not be reserved: the youngest live request (policy.victim)
        gives its slot back and goes to the head of the queue, to recompute its prompt and what
        it generated so far once a request leaves (decode.Sequence.restart); its stream goes on,
        nothing is sent twice. False where it is the only one (nothing to take blocks from)."""
        key = policy.victim(self._describe(self._live))
        if key is None:
            return False
        r = next(q for q in self._live if q.id == key)
        log.info("KV pool full (%s): request %d yields its slot and recomputes %d tokens later", cause, r.id,
                 len(r.seq.history))
        with self._cv:
            self._live.remove(r)
            del self._described[r.id]  # readmitted, it is described anew
            r.prefix_cache = False  # its blocks are what the others need; it recomputes from scratch
            self._release(r)
            r.seq.restart()
            r.state, r.resume_below = RequestState.QUEUED, len(self._live)
            self._queue.appendleft(r)
        return True

    def compose(self) -> list[tuple[Request, Row]]:
        """This step's rows (policy.compose), once each prefilling request that may share a
        prefix has copied what another live request already computed of its prompt."""
        flying = self.runner.in_flight or frozenset()
        if self.prefix.enabled:
            for r in self._live:
                if r.state == RequestState.PREFILL and r.prefix_cache and r.id not in flying:
                    self._catch_up(r)
        by_id = {r.id: r for r in self._live}
        rows = policy.compose(self._describe(self._live), self.config.prefill_chunk, overlap=self.overlap)
        batch, in_flight = [], self.runner.prompt_in_flight
        for row in rows:
            r = by_id[row.key]
            seq = r.seq  # a decode row runs its last token: no prompt positions in flight to follow
            batch.append((r, seq.row(row.tokens) if seq.decoding else seq.row(row.tokens, in_flight(r))))
        return batch

    def _catch_up(self, r: Request) -> None:
        try:
            filled = self.prefix.catch_up(r.slot, r.prompt_ids, r.prefilled, self._live_kv(), caller=r.caller)
        except Exception as e:  # noqa: BLE001
            self.fail_request(r, e, "copying its prompt's cached keys and values")
            return
        r.cached += filled - r.prefilled
        r.seq.prefilled = filled

    def run(self, batch: list[tuple[Request, Row]]) -> None:
        """One step of the decode loop for the batch (server/steps.py); on a device (overlap)
        launched behind the step in flight, which is finished after (policy.compose chose rows
        whose composition does not wait for it)."""
        self.runner.run(self.engine, batch, ahead=self.overlap)

    # ---- what the policy sees --------------------------------------------------------------

    def _queued(self, r: Request) -> policy.Queued:
        waits = r.speculator is not None and self.costs is None and self.lifecycle.state == ServingState.SERVING
        return policy.Queued(self.engine.kv.blocks_for(len(r.seq.history)), waits, r.resume_below)

    def _room(self) -> policy.Room:
        return policy.Room(self.config.max_batch, self.prefix.slots_open, self.engine.kv.available())

    def _record(self, r: Request) -> policy.Running:
        """A record for r, just admitted, kept while it is live (_describe brings it up to date):
        what stays as it is while r runs is filled in here, once. Its caller's scope (dropped
        should r stop sharing its prefix: prefix_cache only ever turns off), whether its rows need
        logits on the host (the constraint, log-probabilities and speculator a request was
        queued with stay its own). `decoding` starts False: its first description is whole."""
        seq = r.seq
        share = self.prefix.share if self.prefix.enabled else None
        return policy.Running(key=r.id, decoding=False, admitted_at=r.t_admitted or 0.0, prompt=seq.prompt_ids,
                              scope=r.scope(share) if share is not None and r.prefix_cache else None,
                              host=not seq.draws_anywhere() or seq.prompt_logprobs is not None)

    def _describe(self, requests: list[Request], *, owed: bool = False, fresh: bool = False) -> list[policy.Running]:
        """Each of `requests` as the policy sees it now: its record (_record), what changes from step
        to step brought up to date in place (every live one, every step: what they share is
        looked up once here, not once a request); `owed`: with the blocks their positions still
        need. `fresh`: new records, described whole, nothing kept (what a kept one must equal).

        A request that was decoding at its last description and still is has its whole prompt
        in its slot since then (a Sequence's prefilled changes only while it prefills, and
        DECODE follows its last prompt chunk): its prompt progress is not looked at again, only
        whether it may run, its place in the step in flight and whether it runs ahead of it."""
        kv, engine, runner = self.engine.kv, self.engine, self.runner
        flying = runner.in_flight or ()
        draws_ahead = runner.draws_ahead
        max_ctx = engine.max_ctx
        decode, described = RequestState.DECODE, self._described
        out = []
        for r in requests:
            seq = r.seq
            d = self._record(r) if fresh else described[r.id]
            in_flight = d.key in flying
            d.ready = r.error is None and not r.finished
            d.in_flight = in_flight
            if not r.prefix_cache:  # it stopped sharing (it failed): it neither waits for nor is waited for
                d.scope = None
            if d.decoding and r.state == decode:
                d.runs_ahead = (in_flight and draws_ahead and seq.runs_ahead()
                                and engine.length(seq.slot) < max_ctx)
            else:
                # prompt positions in flight (a decoding request has none)
                queued = runner.prompt_in_flight(r) if in_flight and not seq.decoding else 0
                d.prefilled = prefilled = seq.prefilled + queued
                d.left = left = max(0, len(seq.inputs) - prefilled)
                d.decoding = decoding = r.state == decode
                d.runs_ahead = in_flight and (left > 0 if queued else (
                    draws_ahead and decoding and seq.runs_ahead() and engine.length(seq.slot) < max_ctx))
            if owed and seq.slot >= 0:
                n = len(seq.history)
                d.owed_blocks = max(0, kv.blocks_for(n) - kv.blocks_for(min(kv.kept(seq.slot), n)))
            else:
                d.owed_blocks = 0
            out.append(d)
        return out

    def _kv_tokens(self, r: Request) -> list[int]:
        """The token ids whose keys and values r's slot holds."""
        return r.seq.history[:self.engine.length(r.slot)]

    def _live_kv(self) -> Iterator[tuple[int, list[int], int, object]]:
        """(slot, token ids it has run, how many its KV holds, caller) of the live requests that
        share their prefix (prefix_cache.Live), made as the cache reads them."""
        length = self.engine.length
        return ((q.slot, q.seq.history, length(q.slot), q.caller) for q in self._live if q.prefix_cache)


def request_error(r: Request, exc: BaseException, doing: str) -> ServiceError:
    """The error a request ends with when `exc` was raised while `doing` its work: a ServiceError
    as it is; a draft's fault or the request's own constraint named; anything else a bounded
    EngineFailed (logged whole here). InvalidLogits are not mapped here: they stop the model
    (Loop.model_fault)."""
    if isinstance(exc, ServiceError):
        return exc
    if isinstance(exc, DraftFault):
        return EngineFailed(str(exc))
    if isinstance(exc, RequestCannotGoOn):  # the request's constraint, not the daemon
        return InvalidRequest(f"the request's constraint allows no token after {r.generated} generated ({exc}): "
                              "loosen the schema, regex or grammar (or max_digits)")
    log.error("request %d failed while %s", r.id, doing, exc_info=exc)
    detail = f"{type(exc).__name__}: {exc}"
    if len(detail) > MAX_DETAIL_CHARS:
        detail = detail[:MAX_DETAIL_CHARS] + "…"
    return EngineFailed(f"ntransformerd failed while {doing} ({detail}); it keeps serving: retry, and "
                        "if it repeats, report it with the daemon's log (journalctl -u ntransformerd)")


__all__ = ["Loop", "request_error"]
