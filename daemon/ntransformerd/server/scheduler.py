"""Continuous batching: every live request advances in one step of the decode loop per iteration.

The request path, in the order it runs:

    tokenize(input)              → prompt ids            (caller's thread)
    schedule(ids, params)        → Request, queued       (caller's thread; bounded queue)
    loop, one thread owning the engine, each iteration (iterate):
        retire()                 finished / cancelled / past-deadline requests leave, slots freed
                                 (their KV stays for the prefix cache)
        admit()                  queued requests take free KV-cache slots (policy.admits),
                                 starting from the longest cached or live prefix of their prompt
        compose()                the step's rows (policy.compose): one per decoding request +
                                 prefill chunks sharing `prefill_chunk` tokens, so a long prompt
                                 cannot stall the others
        run()                    server/steps.py: drafts, one engine step (on a device launched
                                 behind the one in flight), the draws (on the device where every
                                 row allows), each request's accepted tokens
        streamer.send()          the tokens go to the streaming thread (server/streaming.py):
                                 detokenize, stop strings and the writes to the client's stream
                                 happen there, off the next step's critical path

The house of it: server/policy.py decides (pure functions of the queue and the running set:
who is admitted, who is preempted, what a step holds); this module's Scheduler is the loop (it
owns the threads, the queue, the live set and the engine, and carries the decisions out);
server/steps.py runs the steps; server/metrics.py counts what both do and makes the status;
server/speculation.py keeps the speculators and the step-cost table.

On a device (Scheduler.overlap) no step is run and waited for: decode.launch queues step n+1
behind step n still in flight, and only then is step n finished (its draws or logits taken, its
requests advanced and streamed: decode.Launched.finish), whatever either step holds (decode
rows, drafts verified, prompt chunks). The host composes, drafts, launches and streams while the
device computes. What step n+1 may hold while step n is in flight is policy.compose's: a plain
decode row (decode.Sequence.runs_ahead) runs step n's draw for it where it is (on the device); a
prompt's next chunk follows the chunk in flight; a request whose next step needs step n's
outcome on the host (a verified draft's accepted tokens, a prompt's first draw) waits for it, so
rows whose logits go to the host take turns with the others. A request that ended in step n
(EOS, length) had a position run in step n+1, which its sequence discards (Sequence.settle).

When a step's KV blocks cannot be reserved (kv_cache.KVPoolFull), the youngest live request
(policy.victim) gives its slot back and waits at the head of the queue to recompute its prompt
and what it has generated (Scheduler.preempt); its stream goes on where it was.

Each Request is a decode.Sequence (engine/generation/decode.py, the loop `ntx-model run` drives too), so a
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

import time
from collections.abc import Sequence

from ntransformerd.engine.generation import decode
from ntransformerd.engine.generation.speculative import Mode
from ntransformerd.server.errors import Draining, InvalidRequest, NotReady, QueueFull, ShuttingDown, shown
from ntransformerd.server.loop import Loop
from ntransformerd.server.metrics import RequestStatus, SchedulerStatus
from ntransformerd.server.prefix_cache import PrefixCache
from ntransformerd.server.request import Request
from ntransformerd.server.served import ServedEngine, model_name
from ntransformerd.server.streaming import Output

__all__ = ["Output", "Request", "Scheduler", "SchedulerStatus", "encode_chat", "model_name"]


class Scheduler(Loop):
    """The loop (server/loop.py) and its front: the engine attached and drained, requests
    tokenized, checked and queued from callers' threads, status from any thread."""

    # ---- the engine (daemon thread) -------------------------------------------------------

    def attach(self, engine: ServedEngine, *, draft_engine=None, costs=None) -> None:
        """Serve `engine` (the daemon then turns its lifecycle SERVING)."""
        with self._cv:
            self.engine = engine
            # a host backend's step takes every core: its text runs after the step, on this thread
            self.streamer.inline = engine.backend.is_host
            # a device's steps run while the host composes the next (a host backend's use every core)
            self.overlap = not engine.backend.is_host
            self.speculation.attach(draft_engine=draft_engine, costs=costs)
            self.prefix = PrefixCache(engine, enabled=self.config.prefix_cache, share=self.config.prefix_cache_share)
            self._cv.notify_all()

    def detach(self):
        """Take the engine away (unload); only when nothing is live."""
        with self._cv:
            engine, self.engine = self.engine, None
            if self.prefix is not None:
                self.prefix.clear()
            self.speculation.attach()
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

    def serving_engine(self, *, admitting: bool = True) -> ServedEngine:
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
        if ids is not None:
            bad = [i for i in ids if not 0 <= i < engine.cfg.vocab_size]
            if bad:
                raise InvalidRequest(f"token id {bad[0]} is out of range: the vocabulary has "
                                     f"{engine.cfg.vocab_size} ids (0..{engine.cfg.vocab_size - 1})")
            return list(ids)
        if messages is not None:
            return encode_chat(engine, messages, tools)
        return engine.tokenizer.encode(text, parse_special=parse_special, add_special=add_special)

    def speculator(self, mode: Mode | None):
        """The Speculator for a request's mode (None: the daemon's default), None for off;
        raises InvalidRequest for a mode this daemon cannot serve."""
        with self._cv:
            return self.speculation.speculator(mode, self.engine)

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
            self.metrics.queued()
            self._cv.notify_all()
        return req

    # ---- status (any thread) --------------------------------------------------------------

    def status(self) -> SchedulerStatus:
        with self._cv:
            now = time.monotonic()
            reqs = tuple(RequestStatus(r.id, r.state, r.slot, len(r.prompt_ids), r.generated, now - r.t_created,
                                       r.caller) for r in list(self._live) + list(self._queue))
            open_slots = self.prefix.slots_open if self.engine is not None and self.prefix else 0
            return self.metrics.status(requests=reqs, live=len(self._live), queued=len(self._queue),
                                       free_slots=open_slots, speculation=self.speculation.status(), prefix=self.prefix)


def encode_chat(engine, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
    """Prompt ids of `messages` through the model's chat template, generation prompt added
    (engine.encode_chat: what `ntx-model run --chat` does)."""
    if not messages:
        raise InvalidRequest("the chat has no messages: send at least one user message")
    for m in messages:
        if m["role"] not in ("system", "user", "assistant", "tool"):
            raise InvalidRequest(f"chat role {shown(m['role'])} is not one of system, user, assistant, tool")
    return engine.encode_chat(messages, tools=tools)
