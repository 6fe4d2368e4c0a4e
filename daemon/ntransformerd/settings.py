"""How a setting is written and how an error names it, the same in every program.

Sizes (`parse_size`) have one convention, in the daemon's config file and flags, in ntx-model's
flags and in EngineConfig:

    24GiB  512MiB  64KiB  2TiB      binary: 2^30, 2^20, 2^10, 2^40 bytes
    24GB   512MB   64kB   2TB       decimal: 10^9, 10^6, 10^3, 10^12 bytes
    25769803776  or  25769803776B   bytes
    24G  512M  64K  2T              refused: write which one you mean

A bare `G` is refused because both readings are common and both are plausible for a memory
budget: systemd, coreutils and Docker read `24G` as 24 GiB, Kubernetes and SI as 24 GB, and
the two differ by 7% (1.7 GB of a 24 GiB card). Guessing would overcommit a card or waste it
without a word; the refusal costs one line at start that says what to write. Letter case is
free (`24gib` is 24GiB). Rates (`parse_rate`) are a size per second: "6.5GB/s", "800MiB/s".

A setting has one name from the config file down to its use (vram_budget, pinned_budget,
max_batch, max_ctx, kv_dtype, storage, ...). An error about one is a `SettingError`: its text
names settings as {fields}, and `worded(spelling)` writes them the way the program the user
ran does (`kv_dtype = "f32"` in the daemon's config, `--kv-dtype f32` on ntx-model's command
line), leaving out advice about settings that program does not have.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence

BINARY = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
DECIMAL = {"kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12}
AMBIGUOUS = ("k", "m", "g", "t")
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-z]*)\s*", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Spelling:
    """How one program names its settings. `names`: setting → how it is written there (a key,
    or a flag such as "--kv-dtype"); None: every setting by its own name. `flags`: values are
    shown as `--flag value`, else as `key = "value"`."""

    names: Mapping[str, str] | None = None
    flags: bool = False

    def name(self, setting: str) -> str | None:
        """The setting as this program writes it; None where the program has no such setting."""
        if self.names is None:
            return setting
        return self.names.get(setting)

    def given(self, setting: str, value) -> str:
        """The setting and the value the user gave, as the user wrote them."""
        name = self.name(setting) or setting
        if self.flags:
            return f"{name} {value}"
        return f"{name} = {value!r}"


KEYS = Spelling()  # the config keys (EngineConfig's fields, the daemon's keys)


class SettingError(ValueError):
    """A setting that cannot work as given.

    why: the cause, naming settings as {setting} fields; setting, value: the setting this is
    about and what the user gave (shown first); fix: (verb, settings) pairs such as ("raise",
    ("vram_budget",)), written after the cause without the settings the program lacks.
    str(): worded with the config keys."""

    def __init__(self, why: str, *, setting: str | None = None, value=None,
                 fix: Sequence[tuple[str, Sequence[str]]] = ()):
        self.why, self.setting, self.value, self.fix = why, setting, value, tuple(fix)
        super().__init__(self.worded())

    def worded(self, spelling: Spelling = KEYS) -> str:
        head = f"{spelling.given(self.setting, self.value)}: " if self.setting else ""
        text = self.why.format_map(_Names(spelling))
        advice = []
        for verb, settings in self.fix:
            names = [n for n in (spelling.name(s) for s in settings) if n]
            if names:
                advice.append(f"{verb} {_either(names)}")
        return head + text + (f"; {', or '.join(advice)}" if advice else "")


class _Names(dict):
    def __init__(self, spelling: Spelling):
        super().__init__()
        self.spelling = spelling

    def __missing__(self, setting: str) -> str:
        return self.spelling.name(setting) or setting


def _either(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def parse_size(value, *, setting: str = "size") -> int:
    """Bytes from '24GiB', '24GB', '512MiB', '1.5GiB', '4096', '4096B' or an integer; a
    SettingError naming `setting` for anything else, a bare G/M/K/T included (which one?)."""
    if isinstance(value, str):
        return _bytes(value, setting, value, 'not a size: write one such as "24GiB" (binary), "24GB" (decimal) or a count '
                      "of bytes")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SettingError('write a size such as "24GiB" or "24GB"', setting=setting, value=value)
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise SettingError("a count of bytes is a whole number; or write a size such as 1.5GiB",
                           setting=setting, value=value)
    if value < 0:
        raise SettingError("a size is not negative", setting=setting, value=value)
    return int(value)


def parse_rate(value, *, setting: str = "rate") -> float:
    """Bytes per second from "6.5GB/s", "800MiB/s" (a size per second, in parse_size's units;
    the "/s" may be left out) or a positive number."""
    if isinstance(value, str):
        text = value.strip()
        text = text[:-2] if text.lower().endswith("/s") else text
        rate = _bytes(text, setting, value, 'not a rate: write one such as "6.5GB/s" (decimal) or "800MiB/s" (binary)',
                      whole=False, per="/s")
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        rate = value
    else:
        raise SettingError('write a rate such as "6.5GB/s" or "800MiB/s"', setting=setting, value=value)
    if not rate > 0:
        raise SettingError('must be a positive rate such as "6.5GB/s"', setting=setting, value=value)
    return float(rate)


def _bytes(text: str, setting: str, value, unreadable: str, *, whole: bool = True, per: str = "") -> int | float:
    """A number and its unit (see the module docstring) → bytes; `unreadable`: the message for
    text that is no number with a unit; `whole`: a count of bytes without a unit must be an
    integer; `per`: what follows the unit in the examples ("/s")."""
    m = _SIZE.fullmatch(text)
    if not m:
        raise SettingError(unreadable, setting=setting, value=value)
    number, unit = m.group(1), m.group(2).lower()
    if unit in AMBIGUOUS:
        n, u, p = number, unit.upper(), " kmgt".index(unit)
        raise SettingError(f"{u} is ambiguous: write {n}{u}iB{per} ({n} × 2^{10 * p} bytes{per}) or "
                           f"{n}{'k' if u == 'K' else u}B{per} ({n} × 10^{3 * p} bytes{per})", setting=setting,
                           value=value)
    if unit in ("", "b"):
        if whole and "." in number:
            raise SettingError("a count of bytes is a whole number; or write a size such as 1.5GiB",
                               setting=setting, value=value)
        return int(number) if "." not in number else float(number)
    scale = BINARY.get(unit) or DECIMAL.get(unit)
    if scale is None:
        raise SettingError(f"unknown unit {m.group(2)!r}: use KiB, MiB, GiB, TiB (binary) or kB, MB, GB, TB "
                           "(decimal)", setting=setting, value=value)
    if "." not in number:
        return int(number) * scale
    whole_part, _, frac = number.partition(".")  # exact: 1.5GiB is 3 × 2^29, not a float's nearest
    return (int(whole_part or 0) * 10 ** len(frac) + int(frac or 0)) * scale // 10 ** len(frac)
