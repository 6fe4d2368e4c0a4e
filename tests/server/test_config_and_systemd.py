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
    ('backend = "tpu"\n', "backend = 'tpu'"),
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


# ≥ 20 bad values: each one line naming its key, whatever the type or range that is wrong
BAD_VALUES = [
    ("socket", "5"), ("socket", '""'), ("socket", "true"), ("socket", '["/x.sock"]'),
    ("admin_socket", "1"), ("model", "5"), ("model", "{ path = \"x\" }"),
    ("socket_group", "7"), ("socket_group", '"no such group!"'),
    ("backend", "1"), ("backend", '"tpu"'),
    ("log_level", "5"), ("log_level", '"loud"'),
    ("kv_dtype", '"f8"'),
    ("max_batch", "-1"), ("max_batch", "true"), ("max_batch", "1.5"), ("max_batch", "100000"),
    ("max_queue", "-5"), ("max_ctx", "8"), ("prefill_chunk", "0"), ("default_max_tokens", '"many"'),
    ("cpu_threads", "-1"),
    ("drain_timeout", "-1"), ("drain_timeout", "nan"), ("drain_timeout", '"5s"'), ("drain_timeout", "false"),
    ("vram_budget", "-1"), ("vram_budget", "0"), ("vram_budget", '"-4GiB"'), ("vram_budget", "1.5"),
    ("vram_budget", "true"), ("pinned_budget", '"lots"'), ("pinned_budget", "-1"),
]


@pytest.mark.parametrize("key,value", BAD_VALUES, ids=[f"{k}={v}" for k, v in BAD_VALUES])
def test_every_bad_value_is_one_line_naming_the_key(tmp_path, capsys, key, value):
    from ntransformerd.main import main

    f = tmp_path / "d.toml"
    f.write_text(f"socket = \"{tmp_path}/d.sock\"\n{key} = {value}\n" if key != "socket" else f"{key} = {value}\n")
    assert main(["--config", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ntransformerd: {key} ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == [f]  # nothing bound, nothing left behind


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        config.argument_parser().parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split("options:", 1)[1].split())
    for flag, default in (("--max-batch N", "8"), ("--socket-group GROUP", "ntransformer"), ("--backend NAME", "auto"),
                          ("--drain-timeout S", "5.0"), ("--vram-budget SIZE", "auto"), ("--cpu-threads N", "0")):
        assert flag in out and f"(default: {default}" in out.split(flag, 1)[1].split("--", 1)[0], flag


def test_config_keys_and_table_agree():
    assert list(config.KEYS) == list(config.FIELDS)
    assert config.DaemonConfig(vram_budget="2GiB", socket="rel.sock").vram_budget == 2 << 30
    assert os.path.isabs(config.DaemonConfig(socket="rel.sock").socket)


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
