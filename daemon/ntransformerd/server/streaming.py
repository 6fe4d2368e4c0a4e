"""Tokens to text off the decode loop: detokenizing, stop strings and the writes to each
request's stream run on one thread, fed by a queue, so a step's critical path holds none of it.

The scheduler thread hands over each step's accepted tokens (`send`, the whole step at once) and
each request's end
(`end`); this thread turns tokens into text by the request's decode.Text, in order, and writes
its Outputs. A stop string found here ends the request's text at once (Request.text_done); the
loop sees the flag and retires the request at its next iteration, and whatever it drew for it
meanwhile is dropped here, so the output is the one it would be had the loop stopped at once.

Where the step itself occupies the host's cores (a host backend: the CPU computes every layer
with all of them), a second thread would only take a core from the step, so the streamer runs
`inline`: the same work, in the same order, on the loop's thread right after the step.

Thread rule: after a request is queued, the streaming thread (inline: the loop's) is the only
writer of its outputs and its text state; send() and end() may be called from any thread (the
loop, a drain giving up on it).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time


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

    def then(self, later: "Output") -> "Output":
        """This output and the one after it as one (a writer that fell behind sends them in one
        message): the tokens, text and log-probabilities of both in order, the first's prompt,
        the last's end."""
        return Output(self.token_ids + later.token_ids, self.text + later.text, prompt_ids=self.prompt_ids,
                      finish_reason=later.finish_reason, usage=later.usage,
                      logprobs=None if self.logprobs is None else self.logprobs + (later.logprobs or []),
                      prompt_logprobs=self.prompt_logprobs)


class Streamer:
    def __init__(self, *, on_error, inline: bool = False):
        self.on_error = on_error  # on_error(request, exception): its text failed (this thread)
        self.inline = inline  # the caller's thread does the work (set where the engine is attached)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="stream", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Write what was handed over, then end the thread."""
        self._queue.put(None)
        self._thread.join(timeout)

    def send(self, step: list[tuple]) -> None:
        """What one step's requests accepted, as (request, tokens, logprobs, finish) each; finish:
        the loop's end of that request with its last token. One hand-over a step, not one a row:
        each put can wake this thread, which then takes the interpreter from the loop mid-step."""
        if self.inline:
            for item in step:
                self._handle(item)
        elif step:
            self._queue.put(step)

    def end(self, request, error) -> None:
        """The request's stream ends after what was sent before: with `error` unless its text
        already ended."""
        if self.inline:
            self._handle((request, None, error, None))
        else:
            self._queue.put((request, None, error, None))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, list):  # a step's rows
                for one in item:
                    self._handle(one)
            else:
                self._handle(item)

    def _handle(self, item) -> None:
        request, tokens, extra, finish = item
        try:
            if tokens is None:
                self._end(request, extra)
            else:
                self._text(request, tokens, extra, finish)
        except Exception as e:  # noqa: BLE001 - one request's text must not end the others'
            self.on_error(request, e)  # the loop retires it; its end carries the error

    def _text(self, r, tokens: list[int], logprobs: list | None, finish: str | None) -> None:
        if r.text_done or r.ended:  # a stop string ended it; the loop had drawn more meanwhile
            return
        texts, taken, reason = [], [], None
        for k, token in enumerate(tokens):
            piece, reason = r.text.push(token, finish if k == len(tokens) - 1 else None)
            texts.append(piece)
            taken.append(token)
            if reason is not None:
                break
        first = r.prompt_ids if r.completion_tokens == 0 else None
        r.completion_tokens += len(taken)
        out = Output(taken, "".join(texts), prompt_ids=first, logprobs=logprobs[:len(taken)] if logprobs else logprobs,
                     prompt_logprobs=r.seq.prompt_logprobs if first is not None else None)
        if reason is not None:
            r.t_done = time.monotonic()
            out.finish_reason, out.usage = reason, r.usage()
            r.text_done = True
        r.outputs.put(out)
        if reason is not None:
            r.last_queued.set()

    @staticmethod
    def _end(r, error) -> None:
        if r.ended:
            return
        r.ended = True
        if not r.text_done:
            r.outputs.put(error)
        r.outputs.put(None)
        r.last_queued.set()
