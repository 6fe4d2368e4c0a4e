"""The daemon's config (TOML + flags → one object) and its sd_notify datagrams."""

from __future__ import annotations

import os
import socket

import pytest

from ntransformerd import config
from ntransformerd.server.systemd import Notifier


def test_flags_override_the_file_which_overrides_defaults(tmp_path):
    f = tmp_path / "d.toml"
    f.write_text('max_batch = 4\nbackend = "cpu"\nvram_budget = "24GiB"\nsocket = "/x/d.sock"\n')
    cfg = config.load(["--config", str(f), "--max-batch", "12"])
    assert cfg.max_batch == 12 and cfg.backend == "cpu" and cfg.vram_budget == 24 << 30
    assert cfg.socket == "/x/d.sock" and cfg.admin_socket == "/x/admin.sock"
    assert cfg.max_queue == config.DaemonConfig().max_queue


@pytest.mark.parametrize("text,words", [
    ("max_bach = 4\n", "unknown key(s) max_bach"),
    ("max_batch = 0\n", "max_batch = 0"),
    ('backend = "tpu"\n', "backend 'tpu'"),
    ('vram_budget = "lots"\n', "not a size"),
    ("max_batch = \n", "not valid TOML"),
    ('max_batch = "8"\n', "max_batch = '8'"),
])
def test_bad_config_names_the_key(tmp_path, text, words):
    f = tmp_path / "d.toml"
    f.write_text(text)
    with pytest.raises(config.ConfigError) as e:
        config.load(["--config", str(f)])
    assert words in str(e.value)


def test_missing_config_file_is_an_error():
    with pytest.raises(config.ConfigError, match="cannot read config"):
        config.load(["--config", "/nonexistent/ntransformerd.toml"])


def test_config_is_frozen_and_keyword_only():
    with pytest.raises(TypeError):
        config.DaemonConfig("/x.sock")
    with pytest.raises(Exception):
        config.DaemonConfig().max_batch = 3


def test_sd_notify_datagrams(tmp_path):
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(path)
        s.settimeout(2)
        n = Notifier(environ={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000", "WATCHDOG_PID": str(os.getpid())})
        n.status("loading layer 3/30")
        n.ready("serving")
        n.watchdog()
        n.watchdog()  # within a quarter interval of the last: not sent again
        n.stopping()
        got = [s.recv(4096).decode() for _ in range(4)]
    assert got[0] == "STATUS=loading layer 3/30"
    assert got[1].startswith("READY=1\nSTATUS=serving")
    assert got[2] == "WATCHDOG=1"
    assert got[3].startswith("STOPPING=1")


def test_notify_without_systemd_is_a_no_op():
    n = Notifier(environ={})
    assert not n.enabled and n.notify("READY=1") is False and n.watchdog_interval is None
