"""ntransformerd.toml, read in one place.

ntransformerd reads every key through `read` and checks each with its row of KEYS
(daemon/ntransformerd/config.py); ntx-admin's service steps (`bind --service`) read the same
file with the same `read` and check the drive's keys (DRIVE_KEYS: storage, model, noiommu,
nvme_release) with the same functions the daemon's rows use, so the two programs never read one
file two ways.

Thread rule: pure functions.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable
from typing import Any

DEFAULT_PATH = "/etc/ntransformer/ntransformerd.toml"
STORAGE_KINDS = ("file", "odirect", "mmap")  # and nvme:SERIAL (or nvme:PCI_ADDRESS)
RELEASE_MODES = ("nvme", "keep")

Check = Callable[[str, Any], Any]


class ConfigError(ValueError):
    """A bad setting or config file; the message names the key (or the file) and what it accepts."""


def read(path: str, *, missing_ok: bool = False) -> dict:
    """The file's keys and values as TOML gives them (each key checked by its reader);
    {} for a missing file when `missing_ok`."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError as e:
        if missing_ok:
            return {}
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config {path} is not valid TOML: {e}") from None


def kind(v: Any) -> str:
    """What a wrong value is, for a message: "true/false", "int", "list", ..."""
    return "true/false" if isinstance(v, bool) else type(v).__name__


# ---- the checks of the keys both programs read: (key, value) -> the value to use ------------

def path(*, empty: str | None = None) -> Check:
    """A file path made absolute; `empty` (when not None) is what an empty string means."""
    def check(key, v):
        if not isinstance(v, str):
            raise ConfigError(f"{key} = {v!r}: must be a path in quotes, not {kind(v)}")
        if "\0" in v:
            raise ConfigError(f"{key} = {v!r}: a path cannot contain a NUL character")
        if not v.strip():
            if empty is None:
                raise ConfigError(f"{key} is empty: give a path")
            return empty
        return os.path.abspath(os.path.expanduser(v))
    return check


def boolean(key: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"{key} = {v!r}: use true or false")
    return v


def storage(key: str, v: Any) -> str:
    """file | odirect | mmap | nvme:SERIAL (or nvme:PCI_ADDRESS)."""
    if not isinstance(v, str):
        raise ConfigError(f"{key} = {v!r}: must be a name in quotes, not {kind(v)}")
    if v in STORAGE_KINDS:
        return v
    if v.startswith("nvme:") and v[5:].strip():
        return f"nvme:{v[5:].strip()}"
    raise ConfigError(f"{key} = {v!r}: use file, odirect, mmap or nvme:SERIAL (the serial `ntx-admin devices` "
                      "shows; a PCI address also works)")


def release(key: str, v: Any) -> str:
    if not isinstance(v, str) or v not in RELEASE_MODES:
        raise ConfigError(f"{key} = {v!r}: use {' or '.join(RELEASE_MODES)}")
    return v


DRIVE_KEYS: dict[str, Check] = {"storage": storage, "model": path(empty=""), "noiommu": boolean,
                                "nvme_release": release}


def drive_settings(path: str) -> dict:
    """The drive's keys of the config at `path` (a missing file: none), checked."""
    data = read(path, missing_ok=True)
    try:
        return {key: check(key, data[key]) for key, check in DRIVE_KEYS.items() if key in data}
    except ConfigError as e:
        raise ConfigError(f"config {path}: {e}") from None
