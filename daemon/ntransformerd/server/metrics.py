"""What the scheduler reports: its counters, the token and step rates of the last seconds, and
the SchedulerStatus it hands the servicer (mapped into StatusResponse in server/servicer.py).

The request path counts each queued request, the loop each admission, prefill chunk and step;
Status reads them all at once from any thread.

Thread rule: any thread; one lock of its own.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time

from ntransformerd.engine.generation.speculative import StepCosts
from ntx_proto.states import RequestState

RATE_WINDOW_S = 5.0  # tokens/s and steps/s in Status are over the steps of the last seconds


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


class Metrics:
    """The scheduler's counters since it started."""

    def __init__(self):
        self._lock = threading.Lock()
        self.steps = self.requests_total = self.tokens_total = 0
        self.prompt_tokens_total = self.prefill_tokens_total = 0
        self.last_batch = 0  # rows of the last step
        self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens) per step
        self.t_start = time.monotonic()

    def queued(self) -> None:
        with self._lock:
            self.requests_total += 1

    def admitted(self, prompt_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens_total += prompt_tokens

    def prefilled(self, tokens: int) -> None:
        with self._lock:
            self.prefill_tokens_total += tokens

    def stepped(self, rows: int, tokens: int, now: float) -> None:
        """A step of `rows` rows ran and its requests accepted `tokens` tokens."""
        with self._lock:
            self.steps += 1
            self.tokens_total += tokens
            self.last_batch = rows
            self._recent.append((now, tokens))
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
                self._recent.popleft()

    def status(self, *, requests: tuple[RequestStatus, ...], live: int, queued: int, free_slots: int,
               speculation: SpeculationStatus, prefix=None) -> SchedulerStatus:
        """The counters with what the scheduler adds: its requests, the slots open, the
        speculation's figures and the prefix cache's (a PrefixCache, or None without an engine)."""
        with self._lock:
            now = time.monotonic()
            # steps within the window only: steps are what prune it, so when idle it is stale
            recent = [(t, n) for t, n in self._recent if t >= now - RATE_WINDOW_S]
            span = now - recent[0][0] if len(recent) > 1 else 0.0
            return SchedulerStatus(
                live=live, queued=queued, batch=self.last_batch, free_slots=free_slots,
                tokens_per_second=sum(n for _, n in recent[1:]) / span if span > 0 else 0.0,
                steps_per_second=(len(recent) - 1) / span if span > 0 else 0.0, steps=self.steps,
                requests_total=self.requests_total, tokens_total=self.tokens_total,
                prompt_tokens_total=self.prompt_tokens_total, prefill_tokens_total=self.prefill_tokens_total,
                prefix_hit_tokens_total=prefix.hit_tokens if prefix else 0,
                prefix_evictions_total=prefix.evictions if prefix else 0,
                prefix_cached_slots=len(prefix.held) if prefix else 0, uptime=now - self.t_start,
                requests=requests, speculation=speculation)


__all__ = ["Metrics", "RATE_WINDOW_S", "RequestStatus", "SchedulerStatus", "SpeculationStatus"]
