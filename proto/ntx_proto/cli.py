"""What the project's command lines share (ntx-client and ntx-model run): the sampling defaults a
request gets when the user does not set them, and the terminal's one status line."""

from __future__ import annotations

import sys

# The daemon's own temperature for a request that does not set one (proto SamplingParams), and,
# for text through the chat template, a mild repetition penalty (over the last 64 tokens): without
# it a small model at low temperature falls into loops ("I'm glad to have you." again and again).
DEFAULT_TEMPERATURE = 0.8
CHAT_REPETITION_PENALTY = 1.1


class StatusLine:
    """One self-overwriting line on stderr, only when stderr is a terminal."""

    def __init__(self, stream=None):
        self.stream = sys.stderr if stream is None else stream
        self.on = self.stream.isatty()
        self.width = 0

    def show(self, text: str) -> None:
        if self.on:
            self.stream.write("\r" + text.ljust(self.width))
            self.stream.flush()
            self.width = len(text)

    def close(self) -> None:
        if self.on and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()
            self.width = 0
