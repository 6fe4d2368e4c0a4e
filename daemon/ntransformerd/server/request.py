"""One generation as the daemon serves it, from queued to retired: a decode.Sequence and what
serving adds (its caller, deadline, prefix-cache use, state, outputs and timings).

Thread rule: the scheduler thread writes its sequence and state, the streaming thread its text
and outputs; cancel() from any thread; stream() from the thread that answers the caller.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Iterator

from ntransformerd.engine.generation import decode
from ntransformerd.engine.generation.decode import Text
from ntransformerd.server.errors import Cancelled, ServiceError
from ntransformerd.server.prefix_cache import scope
from ntransformerd.server.streaming import Output
from ntx_proto.states import RequestState

_ids = itertools.count(1)
_WAIT = object()  # Request.stream: nothing taken from the queue yet


class Request:
    """One generation, from queued to retired (the module's thread rule)."""

    def __init__(self, seq: decode.Sequence, *, deadline: float | None, prefix_cache: bool = True, caller=None):
        self.id = next(_ids)
        self.seq = seq
        self.caller = caller  # callers.Caller: whose prefix cache scope it uses; None: in-process
        self.deadline = deadline  # time.monotonic() value, or None
        self.state = RequestState.QUEUED  # → PREFILL → DECODE → DONE (retired); back to QUEUED when preempted
        self.prefix_cache = prefix_cache  # may start from, and leave its KV to, the prefix cache
        self.cached = 0  # prompt tokens taken from the prefix cache
        self.error: ServiceError | None = None  # set by cancel(); delivered when it retires
        # SimpleQueue: a put and a get in C, no Condition built per wait (one put a token at most)
        self.outputs: queue.SimpleQueue[Output | ServiceError | None] = queue.SimpleQueue()
        self.t_created = time.monotonic()
        self.t_admitted = self.t_first = self.t_done = None
        self.text = Text(seq.engine.tokenizer, seq.params.stop)  # the streaming thread's
        self.completion_tokens = 0  # streamed (the streaming thread's)
        self.text_done = False  # its last output is written (the streaming thread sets it)
        self.resume_below: int | None = None  # preempted: readmitted once fewer than this many are live
        self.ended = False  # its stream is closed (the streaming thread sets it)
        self.last_queued = threading.Event()  # its last output or its end is in `outputs` (the streaming thread's)
        self._scope: tuple[str, str] | None = None  # (prefix_cache_share, its scope under it)

    def scope(self, share: str) -> str:
        """Its caller's prefix-cache scope under `share` (prefix_cache.scope), worked out once: the
        policy reads it every step."""
        if self._scope is None or self._scope[0] != share:
            self._scope = (share, scope(self.caller, share))
        return self._scope[1]

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

    def stream(self, *, interval: float = 0.0) -> Iterator[Output]:
        """The outputs, in order; raises the ServiceError that ended the request, if any. What
        queued up while the reader was busy (its writes behind the steps) comes as one Output
        (Output.then): fewer, larger messages, the same text. interval: the least seconds
        between two outputs after the first; the steps' tokens of that time come as one (each
        message costs the daemon, its relay and the client a wake, on cores the step may need)."""
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
            if after is not _WAIT:
                item = after
                continue
            if interval > 0 and item.finish_reason is None:
                # not a wait on the queue, which would wake at each step's put; the end cuts it short
                self.last_queued.wait(interval)
            item = self.outputs.get()

    def usage(self) -> dict:
        now = self.t_done or time.monotonic()
        return dict(prompt_tokens=len(self.prompt_ids), completion_tokens=self.completion_tokens,
                    cached_prompt_tokens=self.cached,
                    queue_seconds=(self.t_admitted or now) - self.t_created,
                    prefill_seconds=(self.t_first or now) - (self.t_admitted or now),
                    decode_seconds=now - (self.t_first or now))


__all__ = ["Request"]
