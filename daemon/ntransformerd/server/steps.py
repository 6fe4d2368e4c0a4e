"""The composed steps, run: one step of the decode loop for a batch (decode.step), or, on a
device, launched behind the step still in flight (decode.launch), that step's rows advanced
after; each request advanced, its tokens handed to the streaming thread, the step counted.

On a device the host composes and launches step n+1 and finishes step n (its draws or logits
taken, its requests advanced and streamed) while the device runs step n+1, whatever either
step holds: decode rows, drafts verified, prompt chunks. Which rows step n+1 may hold while step
n is in flight is the policy's (policy.compose); an empty step means: finish step n first. A
step whose KV blocks cannot be reserved (kv_cache.KVPoolFull) asks the scheduler to preempt a
request; any other failure of a step fails its requests (it cannot tell whose row was at
fault), never the loop.

Thread rule: the scheduler thread's (it owns the engine).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ntransformerd.engine.generation import decode
from ntransformerd.engine.runtime import kv_cache
from ntransformerd.engine.generation.decode import Row
from ntransformerd.server.metrics import Metrics
from ntransformerd.server.request import Request
from ntransformerd.server.streaming import Streamer
from ntx_proto.states import RequestState

log = logging.getLogger("ntransformerd")

Batch = list[tuple[Request, Row]]


class StepRunner:
    def __init__(self, *, streamer: Streamer, metrics: Metrics, preempt: Callable[[BaseException], bool],
                 fail: Callable[[Request, BaseException, str], None]):
        self.streamer, self.metrics = streamer, metrics
        self.preempt = preempt  # (cause) → whether a request yielded its blocks (Scheduler.preempt)
        self.fail = fail  # (request, exception, what it was doing): it ends with that error (Scheduler.fail_request)
        self.pending = None  # the step in flight: (decode.Launched, Batch)

    @property
    def pending(self) -> tuple[decode.Launched, Batch] | None:
        """The step in flight: (its launch, its batch); None when there is none."""
        return self._pending

    @pending.setter
    def pending(self, value: tuple[decode.Launched, Batch] | None) -> None:
        # the policy asks of every live request, every step, whether it is in flight: one look-up
        # each, not a walk of the batch each (quadratic in the batch, a wide step's largest cost)
        self._pending = value
        self._rows: dict[int, Row] = {}
        if value is not None:
            for r, row in value[1]:
                self._rows.setdefault(r.id, row)
        self._in_flight = None if value is None else frozenset(self._rows)

    @property
    def draws_ahead(self) -> bool:
        """The step in flight draws where it runs: a next step may run its draws (decode.Launched)."""
        return self.pending is not None and self.pending[0].draws_ahead

    def prompt_in_flight(self, r: Request) -> int:
        """Prompt positions of r's chunk in the step in flight (0: none)."""
        row = self._rows.get(r.id)
        return len(row.tokens) if row is not None and not row.seq.decoding else 0

    @property
    def in_flight(self) -> frozenset[int] | None:
        """The ids of the requests of the step in flight; None when there is none."""
        return self._in_flight

    def run(self, engine, batch: Batch, *, ahead: bool) -> None:
        """One step for the batch; `ahead` (on a device): launched behind the step in flight,
        which is finished after. Otherwise run now, once any step in flight is finished (that
        step is finished instead, and the next iteration composes again)."""
        if ahead:
            self._launch(engine, batch)
            return
        if self.pending is not None:
            self.finish_pending()
            return
        try:
            decode.step(engine, [row for _, row in batch])
        except Exception as e:  # noqa: BLE001 - one bad step must not take the daemon down
            self._failed(batch, e)
            return
        self._account(batch)

    def finish_pending(self) -> None:
        """The step in flight, if any: its draws taken, its requests advanced and streamed."""
        if self.pending is not None:
            prev, self.pending = self.pending, None
            self._finish(prev, None)

    def _launch(self, engine, batch: Batch) -> None:
        prev = self.pending
        try:
            launched = decode.launch(engine, [row for _, row in batch], None if prev is None else prev[0])
        except Exception as e:  # noqa: BLE001 - as a step that raised
            if prev is not None:
                self.finish_pending()
            self._failed(batch, e)
            return
        self.pending = (launched, batch)
        if prev is not None:
            self._finish(prev, launched)

    def _finish(self, pending, ahead) -> None:
        launched, batch = pending
        try:
            launched.finish(ahead)
        except Exception as e:  # noqa: BLE001
            self._failed(batch, e)
            return
        self._account([(r, row) for r, row in batch if r.state != RequestState.DONE])

    def _failed(self, batch: Batch, e: BaseException) -> None:
        """A step that raised: its blocks could not be reserved (the youngest request yields its
        own), or it fails its requests."""
        if isinstance(e, kv_cache.KVPoolFull):
            if self.preempt(e):
                return
            log.warning("KV pool full with one request live: %s", e)
            for r, _ in batch:
                self.fail(r, e, "reserving KV-cache blocks for its next step")
            return
        log.error("engine step failed for requests %s", [r.id for r, _ in batch], exc_info=e)
        # a domain error (the drive under the stream failed) keeps its own status code
        for r, _ in batch:
            self.fail(r, e, "running the model on its batch")

    def _account(self, batch: Batch) -> None:
        """A step's accepted tokens to the streaming thread; the counters."""
        n_new, now = 0, time.monotonic()
        accepted = []
        for r, row in batch:
            if row.error is not None:
                self.fail(r, row.error, row.doing)
                continue
            if r.state == RequestState.PREFILL:
                self.metrics.prefilled(len(row.tokens))
            if not row.accepted:
                continue
            if r.state == RequestState.PREFILL:
                r.state, r.t_first = RequestState.DECODE, r.t_first or now
            n_new += len(row.accepted)
            accepted.append((r, row.accepted, row.logprobs, r.seq.finish))
        self.streamer.send(accepted)
        self.metrics.stepped(len(batch), n_new, now)


__all__ = ["StepRunner"]
