"""The daemon's serving state: what Status and health report, and what a new request is told.

    LOADING (starting, loading a model, replacing one, recovering its drive) → SERVING
    SERVING ⇄ DRAINING (admin Drain / Resume; shutdown and unload drain first)
    → FAILED (the first load failed, the model produced invalid logits) until a good load
    → NO_MODEL (unloaded)

The states are the proto's ServingState (ntx_proto.states), so what Status reports is what is
stored. The daemon changes it; the scheduler reads it to admit requests and reports a model fault
through it; the servicer reads it. Any thread.
"""

from __future__ import annotations

import dataclasses
import threading

from ntransformerd.server.errors import Draining, NotReady
from ntx_proto.states import ServingState


@dataclasses.dataclass(frozen=True)
class LifecycleStatus:
    state: ServingState
    progress: str  # what a load is doing, or what the serving daemon is busy with besides requests
    fraction: float  # of the load done
    error: str  # why it is FAILED


class Lifecycle:
    def __init__(self):
        self._lock = threading.Lock()
        self.state = ServingState.LOADING
        self.progress, self.fraction, self.error = "starting", 0.0, ""
        self._started = False  # a load has begun
        self._drain_reason = "ntransformerd is draining"

    def loading(self, progress: str, fraction: float) -> None:
        with self._lock:
            self.state, self.progress, self.fraction, self._started = ServingState.LOADING, progress, fraction, True

    def serving(self) -> None:
        with self._lock:
            self.state, self.error, self.progress, self.fraction = ServingState.SERVING, "", "loaded", 1.0

    def no_model(self) -> None:
        with self._lock:
            self.state = ServingState.NO_MODEL

    def failed(self, message: str, *, only_serving: bool = False) -> bool:
        """Stop serving: new requests get NotReady(message), which names the cause and the fix.
        only_serving: only where it is serving now (a model fault met by several requests
        counts once). Whether the state changed."""
        with self._lock:
            if only_serving and self.state != ServingState.SERVING:
                return False
            self.state, self.error = ServingState.FAILED, message
            return True

    def draining(self, reason: str) -> None:
        """Admit nothing new (a serving daemon turns DRAINING; others keep their state)."""
        with self._lock:
            self._drain_reason = reason
            if self.state == ServingState.SERVING:
                self.state = ServingState.DRAINING

    def resume(self, *, has_model: bool) -> None:
        with self._lock:
            if self.state == ServingState.DRAINING:
                self.state = ServingState.SERVING if has_model else ServingState.NO_MODEL

    def busy(self, text: str) -> None:
        """What a serving daemon is doing besides requests ("" when nothing): Status shows it."""
        with self._lock:
            if self.state == ServingState.SERVING:
                self.progress = text or "loaded"

    def status(self) -> LifecycleStatus:
        with self._lock:
            return LifecycleStatus(self.state, self.progress, self.fraction, self.error)

    def check(self, *, admitting: bool = True) -> None:
        """Raise what a request is told when the daemon cannot serve it now: Draining (when
        admitting) or NotReady, each naming the cause and the fix."""
        with self._lock:
            state, progress, error, started = self.state, self.progress, self.error, self._started
            reason = self._drain_reason
        if state == ServingState.SERVING or (state == ServingState.DRAINING and not admitting):
            return
        if state == ServingState.DRAINING:
            raise Draining(f"{reason}: it admits no new requests; retry once it is back (systemctl status ntransformerd)")
        if state == ServingState.LOADING and not started:
            raise NotReady("ntransformerd is starting (loading its model comes next): retry in a few seconds "
                           "(ntx-client generate --wait waits for it)")
        if state == ServingState.LOADING:
            raise NotReady(f"the model is still loading ({progress}): retry in a few seconds; "
                           "ntx-client status shows progress")
        if state == ServingState.FAILED:
            raise NotReady(error)
        raise NotReady("no model is loaded: load one with the Admin LoadModel verb (as root)")
