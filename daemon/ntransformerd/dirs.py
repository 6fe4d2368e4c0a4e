"""Where ntransformer keeps what it computes once: the one place these directories are resolved.

    state_dir()   what is measured once per model, plan and machine: the step-cost tables
                  (speculative.py), the host and link figures (figures/, engine/calibration/figures.py) and
                  the layer-skip calibrations (layer_skip.py), all of which can be measured again
    cache_dir()   the CPU kernels compiled for this machine (cpu-kernels/, backends/host/native.py)

state_dir follows the `state_dir` setting (settings.SETTINGS): the daemon and ntx-model put it
in $NTX_STATE_DIR at start, so every part of the process, and every process it starts, reads one
value. Without it, root's is /var/lib/ntransformer: the service's StateDirectory, where an
administrator's `ntx-model calibrate-skip` leaves what the service reads, and where every root
daemon run, `--config /dev/null` included, keeps its step-cost table. Anyone else's is their
cache, $XDG_CACHE_HOME/ntransformer (~/.cache/ntransformer).

The kernels are not state: a build is the same bytes for every state directory (the tests give
each daemon its own) and compiling one takes seconds, so they stay in the cache: systemd's
$CACHE_DIRECTORY (the unit's CacheDirectory=), else /var/cache/ntransformer for root, else the
user's cache.

Thread rule: pure functions of the environment they are handed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

STATE_DIR_ENV = "NTX_STATE_DIR"  # the state_dir setting's variable
SERVICE_STATE_DIR = "/var/lib/ntransformer"  # the unit's StateDirectory=
SERVICE_CACHE_DIR = "/var/cache/ntransformer"  # the unit's CacheDirectory=


def _user_cache(environ: Mapping[str, str]) -> str:
    return os.path.join(environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ntransformer")


def state_dir(environ: Mapping[str, str] = os.environ) -> str:
    """The directory for what is measured once per model, plan and machine (see above)."""
    if environ.get(STATE_DIR_ENV):
        return environ[STATE_DIR_ENV]
    return SERVICE_STATE_DIR if os.geteuid() == 0 else _user_cache(environ)


def cache_dir(environ: Mapping[str, str] = os.environ) -> str:
    """The directory for what is built once per machine: the CPU kernels (see above)."""
    if environ.get("CACHE_DIRECTORY"):  # systemd may list several, separated by colons
        return environ["CACHE_DIRECTORY"].split(":")[0]
    return SERVICE_CACHE_DIR if os.geteuid() == 0 else _user_cache(environ)
