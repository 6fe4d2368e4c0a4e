"""The TCP keys of the config: off by default, all or nothing, TLS files that exist; a daemon
whose TLS files are not usable says so and exits 1. (Serving on TCP: tests/client/openai_gateway/
test_several_hosts.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ntransformerd import config


def _load(*flags):
    return config.load(["--config", os.devnull, *flags])


def test_tcp_is_off_by_default():
    assert _load().tcp_listen == ""


@pytest.mark.parametrize("flags,message", [
    (["--tcp-listen", "0.0.0.0:7443"], "TLS is required: set tls_cert, tls_key, tls_client_ca"),
    (["--tcp-listen", "7443"], "write HOST:PORT"),
    (["--tcp-listen", "host:99999"], "write HOST:PORT"),
    (["--tls-cert", "/etc/hostname"], "tcp_listen is not"),
    (["--tcp-listen", "127.0.0.1:7443", "--tls-cert", "/nonexistent.pem", "--tls-key", "/nonexistent.key",
      "--tls-client-ca", "/nonexistent-ca.pem"], "no such file"),
])
def test_bad_tcp_settings_name_the_key_and_the_fix(flags, message):
    with pytest.raises(config.ConfigError, match=message):
        _load(*flags)


def test_unusable_tls_files_make_the_daemon_exit_1_with_the_reason(tmp_path):
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    sock = tmp_path / "d.sock"
    r = subprocess.run([sys.executable, "-m", "ntransformerd.main", "--config", os.devnull, "--backend", "cpu",
                        "--socket", str(sock), "--socket-group", "", "--tcp-listen", "127.0.0.1:0",
                        "--tls-cert", str(junk), "--tls-key", str(junk), "--tls-client-ca", str(junk)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    assert f"tls_cert {junk} is not a certificate in PEM form" in r.stderr
    assert not sock.exists()
