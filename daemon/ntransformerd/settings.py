"""Every setting of ntransformer, one row each, and how a setting is written and named.

    SETTINGS["max_batch"] = Setting(name, kind, default, help, where, env)

A row is the one source of its setting: the name, the kind (the type, the unit, the limits, and
how a value is read into them), the one default, the help, and where it may be set: FILE (the
daemon's config file, which `ntx-model run --config` reads too), DAEMON (an ntransformerd flag),
MODEL (an `ntx-model run` flag), and an environment variable. Everything a user meets derives
from the rows: DaemonConfig's and EngineConfig's fields and defaults (`field`), the config file's
reader (`file_values`), both programs' flags and their --help (`add_flags`), the errors'
spelling (`spelling`), CudaSettings' environment, and the README's table
(`python -m ntransformerd.settings readme`). A value is read once, by its row, into its type
and unit, and keeps its name from the file to its use; None given for a setting means its
default.

Sizes (`parse_size`) have one convention everywhere:

    24GiB  512MiB  64KiB  2TiB      binary: 2^30, 2^20, 2^10, 2^40 bytes
    24GB   512MB   64kB   2TB       decimal: 10^9, 10^6, 10^3, 10^12 bytes
    25769803776  or  25769803776B   bytes
    24G  512M  64K  2T              refused: write which one you mean

A bare `G` is refused because both readings are common and both are plausible for a memory
budget: systemd, coreutils and Docker read `24G` as 24 GiB, Kubernetes and SI as 24 GB, and
the two differ by 7% (1.7 GB of a 24 GiB card). Guessing would overcommit a card or waste it
without a word; the refusal costs one line at start that says what to write. Letter case is
free (`24gib` is 24GiB). Rates (`parse_rate`) are a size per second: "6.5GB/s", "800MiB/s".

An error about a setting is a `SettingError`: its text names settings as {fields}, and
`worded(spelling)` writes them the way the program the user ran does (`kv_dtype = "f32"` in the
daemon's config, `--kv-dtype f32` on ntx-model's command line), leaving out advice about
settings that program does not have.

Thread rule: the table and the kinds are immutable; every function here is pure but for
reading the environment it is handed.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ntx_proto import paths
from ntx_system import config_file
from ntx_system.config_file import ConfigError

from ntransformerd import dirs
from ntransformerd.engine.runtime.kv_cache import KV_DTYPES as STORED_KV_DTYPES
from ntransformerd.engine.calibration.layer_skip import parse_skip
from ntransformerd.engine.generation.speculative_mode import Mode, repeated_layers


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


# ---- kinds: how a value of one kind is read ------------------------------------------------------
#
# parse(setting, value) -> the typed value, or a SettingError naming the setting; a value already
# of the type passes unchanged, so reading twice (dataclasses.replace) changes nothing.
# from_text(text): a flag's or a variable's text as the value the file would hold (never raises:
# parse says what is wrong). type, unit, limits: for --help and the README.


def _what(v: Any) -> str:
    return "true/false" if isinstance(v, bool) else type(v).__name__


def _either(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


@dataclasses.dataclass(frozen=True)
class Integer:
    lo: int
    hi: int
    unit: str = ""
    metavar: str = "N"
    type = "integer"

    @property
    def limits(self) -> str:
        return f"{self.lo}..{self.hi}"

    def parse(self, setting: str, v):
        if not isinstance(v, int) or isinstance(v, bool):
            raise SettingError(f"must be an integer in {self.limits}, not {_what(v)}", setting=setting, value=v)
        if not self.lo <= v <= self.hi:
            raise SettingError(f"must be an integer in {self.limits}", setting=setting, value=v)
        return v

    def from_text(self, text: str):
        return int(text) if re.fullmatch(r"\s*[+-]?[0-9]+\s*", text) else text


@dataclasses.dataclass(frozen=True)
class Number:
    lo: float
    hi: float
    unit: str
    metavar: str = "S"
    type = "number"

    @property
    def limits(self) -> str:
        return f"{self.lo:g}..{self.hi:g}"

    def parse(self, setting: str, v):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) \
                or not self.lo <= v <= self.hi:
            raise SettingError(f"must be {self.unit} in {self.limits}", setting=setting, value=v)
        return float(v)

    def from_text(self, text: str):
        try:
            return float(text)
        except ValueError:
            return text


@dataclasses.dataclass(frozen=True)
class Choice:
    options: tuple[str, ...]
    metavar: str = "NAME"
    unit = ""
    type = "choice"

    @property
    def limits(self) -> str:
        return " | ".join(self.options)

    def parse(self, setting: str, v):
        if not isinstance(v, str) or v.strip().lower() not in self.options:
            raise SettingError(f"use {_either(list(self.options))}", setting=setting, value=v)
        return v.strip().lower()

    def from_text(self, text: str):
        return text


@dataclasses.dataclass(frozen=True)
class Boolean:
    metavar: str = "BOOL"
    unit = ""
    type = "boolean"
    limits = "true | false"

    def parse(self, setting: str, v):
        if not isinstance(v, bool):
            raise SettingError("use true or false", setting=setting, value=v)
        return v

    def from_text(self, text: str):  # flags are --x / --no-x; this reads an environment variable
        low = text.strip().lower()
        return {"1": True, "true": True, "yes": True, "on": True,
                "0": False, "false": False, "no": False, "off": False}.get(low, text)


@dataclasses.dataclass(frozen=True)
class Size:
    """Bytes (parse_size), or `word` (for `word_means`: None, what is free, or 0, off)."""

    minimum: int = 0
    word: str = "auto"
    word_means: int | None = None
    metavar: str = "SIZE"
    unit = "bytes"
    type = "size"

    @property
    def limits(self) -> str:
        least = f"≥ {self.minimum >> 20} MiB" if self.minimum else "≥ 0"
        return f"{least}, or {self.word}"

    def parse(self, setting: str, v):
        if isinstance(v, str) and v.strip().lower() in ("", self.word):
            return self.word_means
        n = parse_size(v, setting=setting)
        if n < self.minimum:
            raise SettingError(f'at least {self.minimum >> 20} MiB, or "{self.word}"', setting=setting, value=v)
        return n

    def from_text(self, text: str):
        return text


@dataclasses.dataclass(frozen=True)
class Rate:
    """Bytes per second (parse_rate: "6.5GB/s", "800MiB/s"), or "off" (None)."""

    metavar: str = "RATE"
    unit = "bytes/s"
    type = "rate"
    limits = '> 0, or "off"'

    def parse(self, setting: str, v):
        if v is None or (isinstance(v, str) and v.strip().lower() in ("", "off")):
            return None
        if not isinstance(v, (str, float)) or isinstance(v, bool):  # a bare 5 is likelier a slip than 5 B/s
            raise SettingError('must be a rate in quotes such as "6.5GB/s", or "off"', setting=setting, value=v)
        return parse_rate(v, setting=setting)

    def from_text(self, text: str):
        return text


@dataclasses.dataclass(frozen=True)
class Text:
    """Text read by `read` (a ValueError says what is wrong); a value `typed` says is read passes."""

    read: Callable[[str], Any] | None = None
    metavar: str = "TEXT"
    type: str = "text"
    limits: str = ""
    typed: Callable[[Any], bool] | None = None  # is this value read already (a Mode, an opened source)?
    unit = ""

    def parse(self, setting: str, v):
        if self.typed is not None and self.typed(v):
            return v
        if not isinstance(v, str):
            raise SettingError(f"must be {self.type} in quotes, not {_what(v)}", setting=setting, value=v)
        if self.read is None:
            return v
        try:
            return self.read(v)
        except ValueError as e:
            raise SettingError(_why(str(e), setting, v), setting=setting, value=v) from None

    def from_text(self, text: str):
        return text


def _why(message: str, setting: str, v) -> str:
    """A reader's message without its own naming of the setting (the error names it once)."""
    for head in (f"{setting} = {v!r}: ", f"{setting} {v!r}: ", f"--{setting.replace('_', '-')} {v!r}: ",
                 f"{setting} is empty: "):
        if message.startswith(head):
            return message[len(head):]
    return message


def _shared(check: config_file.Check) -> Callable[[str], Any]:
    """A check of ntx_system.config_file (ntx-admin reads the drive's keys with the same ones) as
    a reader: one rule for both programs."""
    def read(text: str):
        try:
            return check("value", text)
        except ConfigError as e:
            raise ValueError(_why(str(e), "value", text)) from None
    return read


_GROUP_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?")


def _group_name(v: str) -> str:
    if v and not _GROUP_NAME.fullmatch(v):
        raise ValueError('not a group name (letters, digits, _ . -; "" for none)')
    return v


def _host_port(v: str) -> str:
    host, sep, port = v.rpartition(":")
    if v and (not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536):
        raise ValueError('write HOST:PORT, e.g. "0.0.0.0:7443" (all interfaces) or "[::]:7443"')
    return v


def _skip_spec(v: str) -> str:
    parse_skip(v)
    twice = repeated_layers(v)
    if twice:
        raise ValueError(f'{twice}, e.g. "3,7,11"')
    return v.strip().lower()


# ---- the table ---------------------------------------------------------------------------------

FILE, DAEMON, MODEL = "file", "ntransformerd", "ntx-model"  # where a setting may be set (and env)
SERVED = frozenset({FILE, DAEMON})  # the daemon's own
EVERYWHERE = frozenset({FILE, DAEMON, MODEL})
TOOL = frozenset({MODEL})  # ntx-model run's own
BACKENDS = ("cpu", "cpu-ref", "cuda", "auto")  # engine.backends.BACKENDS (a test holds them equal)
CPU_KERNELS = ("avx512", "avx2", "generic")  # backends/host/native.py's VARIANTS (a test holds them equal)


@dataclasses.dataclass(frozen=True)
class Setting:
    """One setting: its name, kind (type, unit, limits), one default, help, and where it may be
    set (FILE, DAEMON, MODEL; `env`: an environment variable)."""

    name: str
    kind: Any
    default: Any
    help: str
    where: frozenset[str] = frozenset()
    env: str = ""
    shown: str = ""  # the default in words, where the value alone would not say it ("what is free")
    aliases: tuple[str, ...] = ()  # older spellings ntx-model still takes for its flag

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def parse(self, value):
        """The typed value of `value` as given (None: the default); a SettingError naming the setting."""
        return self.default if value is None else self.kind.parse(self.name, value)

    @property
    def default_text(self) -> str:
        if self.shown:
            return self.shown
        if isinstance(self.default, bool):
            return str(self.default).lower()
        return '""' if self.default == "" else str(self.default)


def _path(*, empty: str | None = "", what: str = "path") -> Text:
    return Text(_shared(config_file.path(empty=empty)), "PATH", what)


_MODE = Text(Mode.parse, "MODE", "mode", "off | auto | ngram | draft | skip[:LAYERS] | prefix[:N]",
             typed=lambda v: isinstance(v, Mode))
_STORAGE = Text(_shared(config_file.storage), "KIND", "storage", "file | odirect | mmap | nvme:SERIAL",
                typed=lambda v: hasattr(v, "kind") and not isinstance(v, str))  # a source the caller opened
_DEVICES = Text(None, "IDS", "GPU indexes", "1..16 distinct indexes",  # read by tiers.parse_devices
                typed=lambda v: isinstance(v, (int, tuple, list)) and not isinstance(v, bool))
_PER_TYPE = "per quant type (CudaSettings)"

SETTINGS: dict[str, Setting] = {r.name: r for r in (
    # ---- the sockets ---------------------------------------------------------------------------
    Setting("socket", _path(empty=None), paths.SYSTEM_SOCKET, "the user socket", SERVED, env=paths.SOCKET_ENV),
    Setting("admin_socket", _path(), "", "the admin socket (mode 0600: the daemon's user only)", SERVED,
            shown="as root admin.sock next to socket, else in $XDG_RUNTIME_DIR/ntransformer or none"),
    Setting("socket_group", Text(_group_name, "GROUP", "group name"), paths.SOCKET_GROUP,
            "group owning the user socket when run as root (\"\" for none)", SERVED),
    Setting("tcp_listen", Text(_host_port, "HOST:PORT", "HOST:PORT"), "",
            "also serve on TCP with TLS (needs the tls_* files)", SERVED, shown="off"),
    Setting("tls_cert", _path(), "", "this daemon's TLS certificate (PEM)", SERVED, shown="none"),
    Setting("tls_key", _path(), "", "the key of tls_cert (PEM)", SERVED, shown="none"),
    Setting("tls_client_ca", _path(), "", "CA that signed the clients' certificates (PEM); clients must have one",
            SERVED, shown="none"),
    # ---- the model and its engine ----------------------------------------------------------------
    Setting("model", _path(), "", "GGUF file (ntx-model: its MODEL argument)", EVERYWHERE,
            shown="the embedded SmolLM2-135M-Instruct"),
    Setting("backend", Choice(BACKENDS), "auto", "cpu (quantized kernels), cpu-ref (the float32 reference), cuda, "
            "or auto: cuda where a GPU is visible, else cpu", EVERYWHERE),
    Setting("vram_budget", Size(1 << 20), None, "VRAM the tier plan may use: 24GiB (binary) or 24GB (decimal), a "
            "bare 24G refused as ambiguous; ntx-model over several devices takes one per device (24GiB,48GiB)",
            EVERYWHERE, shown="auto, what is free"),
    Setting("pinned_budget", Size(1 << 20), None, "pinned host RAM the tier plan may use for streamed layers",
            EVERYWHERE, shown="auto, what is free"),
    Setting("max_batch", Integer(1, 4096, "sequences"), 8, "sequences decoded together (KV-cache slots); the plan "
            "reserves their cache", EVERYWHERE),
    Setting("max_ctx", Integer(1, 1 << 24, "positions"), 4096, "positions per sequence, capped by the model's; a "
            "limit, not a reservation", EVERYWHERE, aliases=("--ctx",)),
    Setting("kv_dtype", Choice(("auto",) + STORED_KV_DTYPES, "TYPE"), "auto", "KV-cache storage: auto (the "
            "backend's own: f32 on the CPU, f16 on the GPU), f32, f16, q8_0 (half of f16's bytes, nearly "
            "lossless) or q4_0 (lossy); one the backend cannot store is refused", EVERYWHERE),
    Setting("kv_blocks", Integer(0, 1 << 30, "blocks of 16 positions"), 0, "the KV-cache pool per device "
            "(`ntx-model run --plan` shows the plan's)", EVERYWHERE, shown="0, the plan's choice"),
    Setting("kv_spill", Size(0, "off", 0), 0, "host RAM for finished sequences' KV blocks when a GPU's pool needs "
            "them: a prompt repeating them restores instead of prefilling (the cpu backend keeps its pool in RAM "
            "and ignores it)", EVERYWHERE, shown="0, off"),
    Setting("prefill_chunk", Integer(1, 1 << 20, "tokens"), 256, "prompt tokens per step, shared by all prompts "
            "being read", EVERYWHERE),
    Setting("cpu_threads", Integer(0, 1024, "threads"), 0, "threads of the CPU backend's steps and of the host's "
            "share beside a GPU (0: every CPU the process may use)", EVERYWHERE),
    Setting("cpu_kernels", Choice(("auto",) + CPU_KERNELS, "VARIANT"), "auto", "the build of the CPU backend's "
            "kernels: auto (the best this CPU runs), avx512, avx2 or generic; each sums in its own order, so hosts "
            "that must give the same text pin one; one this CPU cannot run is refused at load", EVERYWHERE),
    Setting("host_compute", Choice(("off", "auto"), "MODE"), "off", "auto: the host CPU computes some streamed "
            "layers beside the GPU, per step shape, from rates measured at load", EVERYWHERE),
    Setting("link_cap", Rate(), None, "pace the stream's host-to-device copies, e.g. 6.5GB/s (a slower PCIe link "
            "emulated)", EVERYWHERE, shown="off"),
    Setting("storage", _STORAGE, "file", "where streamed layers are read from: file (O_DIRECT where it can), "
            "odirect, mmap, or nvme:SERIAL (a drive staged by ntx-admin); the cpu backend computes layers where "
            "they lie: file or mmap", EVERYWHERE),
    Setting("deterministic", Boolean(), False, "a request's output does not depend on which requests share its "
            "steps: every row's matmuls on one kernel whose sums follow the weight alone, and beside a GPU no "
            "streamed layer on the host (host_compute auto set aside) (the cuda backend; its cost at batch "
            "1 / 16 / 64 is measured in bench/RESULTS.md)", EVERYWHERE, env="NTX_DETERMINISTIC"),
    Setting("max_vram_layers", Integer(0, 1 << 20, "layers"), None, "keep at most N layers resident on the device",
            TOOL, shown="no limit"),
    Setting("stream_depth", Integer(1, 16, "slots"), 2, "device slots in the layer stream", TOOL),
    Setting("devices", _DEVICES, None, "GPUs to spread the layers over, e.g. 0,1 (with --plan)", TOOL,
            shown="one device"),
    # ---- fewer bytes per token -------------------------------------------------------------------
    Setting("speculative", _MODE, Mode(), "speculative decoding (of requests that do not say): off, auto, ngram, "
            "draft, skip[:LAYERS] or prefix[:N]; lossless", EVERYWHERE, shown="off"),
    Setting("draft", _path(), "", "a small GGUF with the model's vocabulary that drafts for it (speculative draft)",
            EVERYWHERE, shown="none"),
    Setting("skip_layers", Text(_skip_spec, "SPEC", "layers", "auto[:THRESHOLD] | N | 3,7,11"), "",
            "layers neither loaded, computed nor streamed (lossy; ntx-model calibrate-skip measures it)",
            EVERYWHERE, shown="none"),
    # ---- serving --------------------------------------------------------------------------------
    Setting("max_queue", Integer(0, 1 << 20, "requests"), 64, "requests waiting for a slot before "
            "RESOURCE_EXHAUSTED", SERVED),
    Setting("prefix_cache", Boolean(), True, "start prompts from the cached KV of earlier sequences sharing their "
            "prefix", SERVED),
    Setting("prefix_cache_share", Choice(("none", "group", "all"), "MODE"), "none", "whose cached prompts a "
            "request may start from: none (its caller's own), group (callers whose uid has the same primary "
            "group) or all", SERVED),
    Setting("default_max_tokens", Integer(1, 1 << 24, "tokens"), 512, "max_tokens of a request that does not say",
            SERVED),
    Setting("stream_interval", Number(0, 1, "seconds"), 0.02, "a stream's messages go out at most this often "
            "(the first and the last at once); the tokens of the steps between go as one message (0: a message "
            "per step)", SERVED),
    Setting("drain_timeout", Number(0, 3600, "seconds"), 5.0, "seconds in-flight requests get on SIGTERM / Drain",
            SERVED),
    Setting("log_level", Choice(("debug", "info", "warning", "error"), "LEVEL"), "info", "what is logged", SERVED),
    Setting("state_dir", _path(what="directory"), "", "where what is measured once per model, plan and machine is "
            "kept: step-cost tables, figures, layer-skip calibrations", EVERYWHERE, env=dirs.STATE_DIR_ENV,
            shown="/var/lib/ntransformer as root, else ~/.cache/ntransformer"),
    # ---- the NVMe drive (ntx-admin's service steps read storage, model, noiommu, nvme_release too) --
    Setting("nvme_queues", Integer(1, 64, "queue pairs"), 2, "NVMe I/O queue pairs (reads in flight at once)",
            SERVED),
    Setting("nvme_queue_depth", Integer(1, 4095, "commands"), 32, "NVMe commands in flight per queue pair", SERVED),
    Setting("nvme_io_timeout", Number(0.1, 600, "seconds"), 10.0, "seconds before an NVMe command counts as lost",
            SERVED),
    Setting("nvme_retries", Integer(1, 100, "attempts"), 3, "drive bring-up attempts (at start, after a drive "
            "error)", SERVED),
    Setting("nvme_release", Text(_shared(config_file.release), "MODE", "choice", " | ".join(config_file.RELEASE_MODES)),
            "nvme", "on stop: hand the drive back to nvme, or keep it on vfio-pci", SERVED),
    Setting("noiommu", Boolean(), False, "accept VFIO without an IOMMU (unsafe: the drive can DMA anywhere)", SERVED),
    # ---- the CUDA backend's tuning, for same-run A/B benchmarks (bench/ab_decode.py) ----------------
    Setting("f16_mma", Boolean(), True, "from batch 4, f16 tensor-core products (0: the int8 ones)",
            env="NTX_F16_MMA"),
    Setting("f16_legacy", Boolean(), True, "from batch 4, Q4_1 weights (rows of 32-element blocks, any width) on "
            "f16 tensor cores too (0: the f32 generic kernel)", env="NTX_F16_LEGACY"),
    Setting("mma_one_tile_rows", Integer(0, 1 << 30, "rows"), 8192, "up to N rows the int8 mma kernels take 16 "
            "rows a block", env="NTX_MMA_ONE_TILE_ROWS"),
    Setting("mvq_wide_max_n", Integer(0, 1 << 30, "rows"), None, "one-row matvecs of at most N rows take 4 rows a "
            "warp (one value for every type)", env="NTX_MVQ_WIDE_MAX_N", shown=_PER_TYPE),
    Setting("split_k_warps", Integer(0, 1 << 30, "warps"), 4096, "dp4a matvecs of fewer warps split K over a "
            "block's warps (0: never)", env="NTX_SPLIT_K_WARPS"),
    Setting("mvq_min_blocks", Integer(1, 64, "blocks per SM"), None, "blocks per SM the one-row dp4a matvecs are "
            "compiled to allow (one value for every type)", env="NTX_MVQ_MIN_BLOCKS", shown=_PER_TYPE),
    Setting("mvq_persistent", Boolean(), True, "the Q8_0 dp4a matvec loops over row groups (0: a block per group)",
            env="NTX_MVQ_PERSISTENT"),
    Setting("attn_one_launch_max_bucket", Integer(0, 4096, "rows"), 32, "up to this batch bucket decode attention "
            "is one launch (0: three at every bucket)", env="NTX_ATTN_ONE_LAUNCH"),
    Setting("pdl", Boolean(), True, "captured steps use programmatic dependent launch", env="NTX_PDL"),
)}


def of(where: str) -> dict[str, Setting]:
    """The settings that may be set in `where` (FILE, DAEMON or MODEL), in the table's order."""
    return {name: row for name, row in SETTINGS.items() if where in row.where}


def field(name: str) -> Any:
    """A dataclass field for the setting `name`: its default, its row in the metadata."""
    row = SETTINGS[name]
    return dataclasses.field(default=row.default, metadata={"setting": row})


def spelling(program: str) -> Spelling:
    """How `program` names its settings in errors: the daemon by its keys, ntx-model by its flags."""
    if program == DAEMON:
        return Spelling({name: name for name in of(FILE)})
    return Spelling({name: "MODEL" if name == "model" else row.flag for name, row in of(MODEL).items()}, flags=True)


def add_flags(parser: argparse.ArgumentParser, program: str, *, leave: Sequence[str] = ()) -> None:
    """A flag for each setting of `program` but those in `leave`, with its help, limits and
    default; a flag not given is None (the file, the environment or the default decide)."""
    for name, row in of(program).items():
        if name in leave:
            continue
        limits = row.kind.limits if not isinstance(row.kind, (Choice, Boolean)) else ""
        text = f"{row.help} (default: {row.default_text}{'; ' + limits if limits else ''})".replace("%", "%%")
        if isinstance(row.kind, Boolean):
            parser.add_argument(row.flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=text)
            continue
        names = (row.flag, *(row.aliases if program == MODEL else ()))
        parser.add_argument(*names, dest=name, type=row.kind.from_text, default=None, help=text,
                            metavar=row.kind.metavar)


def file_values(path: str, program: str) -> dict:
    """The settings of `program` in the config file at `path` (config_file.read, the reader
    ntx-admin shares), as the file gives them; a key no setting has is refused, and keys of the
    daemon's that `program` does not have are left to the daemon."""
    data = config_file.read(path)
    unknown = sorted(set(data) - set(of(FILE)))
    if unknown:
        raise ConfigError(f"config {path}: unknown key(s) {', '.join(unknown)}; known: {', '.join(of(FILE))}")
    mine = of(program)
    return {k: v for k, v in data.items() if k in mine}


def given(program: str, *, flags: Mapping[str, Any], file: Mapping[str, Any],
          environ: Mapping[str, str]) -> dict:
    """The settings of `program` that were given, as given: each from its flag, else the file,
    else its environment variable; the rest keep their defaults."""
    out = {}
    for name, row in of(program).items():
        if flags.get(name) is not None:
            out[name] = flags[name]
        elif name in file:
            out[name] = file[name]
        elif row.env and environ.get(row.env):
            out[name] = row.kind.from_text(environ[row.env])
    return out


def from_environment(names: Sequence[str], environ: Mapping[str, str]) -> dict:
    """The typed values of the settings `names` that their environment variables set; an error
    names the variable."""
    out = {}
    for name in names:
        row = SETTINGS[name]
        if environ.get(row.env):
            try:
                out[name] = row.parse(row.kind.from_text(environ[row.env]))
            except SettingError as e:
                raise SettingError(e.why, setting=row.env, value=environ[row.env]) from None
    return out


# ---- the README's table -----------------------------------------------------------------------

README_BEGIN = "<!-- settings table: python -m ntransformerd.settings readme -->"
README_END = "<!-- end of the settings table -->"


def _where(row: Setting) -> str:
    places = [w for w in (FILE, DAEMON, MODEL) if w in row.where]
    return ", ".join(places + ([f"${row.env}"] if row.env else []))


def readme_table() -> str:
    """The README's settings table, from the rows, between its markers."""
    lines = [README_BEGIN, "", "| setting | type | unit | default | limits | set in | what it does |",
             "|---|---|---|---|---|---|---|"]
    for row in SETTINGS.values():
        cells = (f"`{row.name}`", row.kind.type, row.kind.unit, row.default_text, row.kind.limits, _where(row),
                 row.help)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines + ["", README_END])


def export_state_dir(value: str, environ=os.environ) -> None:
    """Make the state_dir setting the process's (and its children's): dirs.state_dir reads it."""
    if value:
        environ[dirs.STATE_DIR_ENV] = value


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ntransformerd.settings", description="Print the settings table.")
    p.add_argument("what", choices=("readme",), help="readme: the README's table, between its markers")
    p.parse_args(argv)
    print(readme_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
