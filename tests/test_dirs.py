"""Where ntransformer keeps what it computes once (ntransformerd/dirs.py): one resolution, which
the step-cost tables, the figures, the layer-skip calibrations and the CPU kernels all ask."""

from __future__ import annotations

import os

from ntransformerd import dirs
from ntransformerd.engine.calibration import figures, layer_skip
from ntransformerd.engine.backends.host import native


def test_the_state_dir_setting_then_root_then_the_users_cache(monkeypatch, tmp_path):
    assert dirs.state_dir({"NTX_STATE_DIR": "/srv/ntx"}) == "/srv/ntx"
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert dirs.state_dir({}) == "/var/lib/ntransformer"  # the service's, and any root run's
    assert dirs.cache_dir({}) == "/var/cache/ntransformer"
    assert dirs.cache_dir({"CACHE_DIRECTORY": "/var/cache/ntx:/other"}) == "/var/cache/ntx"
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert dirs.state_dir({"XDG_CACHE_HOME": str(tmp_path)}) == str(tmp_path / "ntransformer")
    assert dirs.cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == str(tmp_path / "ntransformer")


def test_every_cache_helper_asks_the_one_place(monkeypatch, tmp_path):
    monkeypatch.setenv("NTX_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("CACHE_DIRECTORY", str(tmp_path / "cache"))
    assert layer_skip.state_dir() == str(tmp_path / "state")
    assert layer_skip.cache_paths("/m.gguf", "abc")[1] == str(tmp_path / "state" / "skip-abc.json")
    assert figures.cache_dir() == str(tmp_path / "state" / "figures")
    assert native.cache_dir() == str(tmp_path / "cache" / "cpu-kernels")
