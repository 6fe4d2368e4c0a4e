"""A speculative mode as a value (`Mode`): what the `speculative` setting and a request's mode
say, parsed once where they enter (the settings table, a request, a command line).

It imports nothing of the engine, so the settings table (ntransformerd/settings.py) can read a
mode the way speculative.py runs it without importing the engine it configures.

Thread rule: immutable values and pure functions; any thread.
"""

from __future__ import annotations

import dataclasses
import re

SOURCES = ("ngram", "draft", "skip", "prefix")
MODES = ("off", "auto") + SOURCES
MAX_MODE_CHARS = 64  # longer is no mode; an error then quotes none of it
MODE_HELP = ("use off, auto, ngram, draft, skip[:LAYERS] (e.g. skip:3,7,11 or skip:auto:0.2) "
             "or prefix[:N] (e.g. prefix:8)")


@dataclasses.dataclass(frozen=True)
class Mode:
    """A speculative mode as a value: parsed once where it enters (the daemon's config, a
    request, a command line) and passed down as is."""

    name: str = "off"  # off | auto | ngram | draft | skip | prefix
    arg: str = ""  # skip's layers, prefix's layer count; "" for the others

    @classmethod
    def parse(cls, mode: str | None) -> "Mode":
        """'ngram' | 'draft' | 'skip[:SPEC]' | 'prefix[:N]' | 'auto' | 'off' | '' (off); ValueError
        naming the modes otherwise."""
        s = (mode or "off").strip().lower()
        if len(s) > MAX_MODE_CHARS:
            raise ValueError(f"a speculative mode of {len(s)} characters is none: {MODE_HELP}")
        name, _, arg = s.partition(":")
        if name not in MODES or (arg and name not in ("skip", "prefix")):
            raise ValueError(f"speculative {mode!r}: {MODE_HELP}")
        if name == "prefix" and arg and not re.fullmatch(r"[0-9]+", arg):
            raise ValueError(f"speculative {mode!r}: prefix:N takes a layer count in digits 0-9, e.g. prefix:8")
        twice = repeated_layers(arg) if name == "skip" else ""
        if twice:  # a slip, not a wish: merging them would run another draft than the one written
            raise ValueError(f"speculative {mode!r}: {twice}, e.g. skip:3,7,11")
        return cls(name, arg)

    @property
    def off(self) -> bool:
        return self.name == "off"

    def within(self, default: "Mode") -> "Mode":
        """This mode as a request means it under the daemon's `default`: a self-draft source named
        without its layers (skip, prefix) takes the default's where the default is that source."""
        if self.name in ("skip", "prefix") and not self.arg and default.name == self.name:
            return default
        return self

    def __str__(self) -> str:
        return f"{self.name}:{self.arg}" if self.arg else self.name


OFF = Mode()


def repeated_layers(spec: str) -> str:
    """What is wrong with a list of layer indices that names one twice ("3,7,3"), as the middle
    of an error; "" for any other text."""
    if not re.fullmatch(r"\s*[0-9]+(\s*,\s*[0-9]+)+\s*,?\s*", spec):
        return ""
    layers = [int(i) for i in spec.strip().strip(",").split(",")]
    twice = sorted({i for i in layers if layers.count(i) > 1})
    if not twice:
        return ""
    named = f"layer {twice[0]} is" if len(twice) == 1 else f"layers {', '.join(map(str, twice))} are"
    return f"{named} named more than once: name each layer once"
