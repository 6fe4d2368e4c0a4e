"""The socket path is resolved in one place: explicit > $NTX_SOCKET > the system default."""

import os
import re

from ntx_proto import paths


def test_socket_path_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("NTX_SOCKET", raising=False)
    assert paths.socket_path() == "/run/ntransformer/ntransformerd.sock"
    monkeypatch.setenv("NTX_SOCKET", str(tmp_path / "env.sock"))
    assert paths.socket_path() == str(tmp_path / "env.sock")
    assert paths.socket_path(str(tmp_path / "flag.sock")) == str(tmp_path / "flag.sock")


def test_admin_socket_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("NTX_ADMIN_SOCKET", raising=False)
    assert paths.admin_socket_path(user_socket=str(tmp_path / "d.sock")) == \
        paths.default_admin_socket(str(tmp_path / "d.sock"))
    monkeypatch.setenv("NTX_ADMIN_SOCKET", "/x/a.sock")
    assert paths.admin_socket_path() == "/x/a.sock"
    assert paths.admin_socket_path("/y/b.sock") == "/y/b.sock"


def test_as_root_the_admin_socket_sits_next_to_the_user_socket(tmp_path):
    run = {"XDG_RUNTIME_DIR": "/run/user/0"}
    assert paths.default_admin_socket(str(tmp_path / "d.sock"), euid=0, environ=run) == str(tmp_path / "admin.sock")
    assert paths.default_admin_socket(paths.SYSTEM_SOCKET, euid=0, environ={}) == paths.SYSTEM_ADMIN_SOCKET


def test_as_a_user_the_admin_socket_is_in_the_runtime_directory_or_none(monkeypatch, tmp_path):
    """A daemon started by hand from a project directory leaves no admin.sock there."""
    monkeypatch.chdir(tmp_path)
    run = {"XDG_RUNTIME_DIR": "/run/user/1000"}
    here = paths.default_admin_socket("ntx.sock", euid=1000, environ=run)
    assert os.path.dirname(here) == "/run/user/1000/ntransformer" and re.fullmatch(r"admin-[0-9a-f]{16}\.sock",
                                                                                     os.path.basename(here))
    assert paths.default_admin_socket(str(tmp_path / "ntx.sock"), euid=1000, environ=run) == here  # one socket
    assert paths.default_admin_socket(str(tmp_path / "other.sock"), euid=1000, environ=run) != here  # two daemons
    assert paths.default_admin_socket("ntx.sock", euid=1000, environ={}) == ""  # no runtime directory: none
    assert paths.default_admin_socket("ntx.sock", euid=1000, environ={"XDG_RUNTIME_DIR": "rel"}) == ""


def test_daemon_config_uses_the_same_resolution(monkeypatch, tmp_path):
    from ntransformerd import config
    monkeypatch.setenv("NTX_SOCKET", str(tmp_path / "env.sock"))
    monkeypatch.delenv("NTX_ADMIN_SOCKET", raising=False)
    cfg = config.load(["--config", "/dev/null"])
    assert cfg.socket == paths.socket_path() and cfg.admin_socket == paths.admin_socket_path()
    assert cfg.admin_socket == (str(tmp_path / "admin.sock") if os.geteuid() == 0 else
                                paths.default_admin_socket(str(tmp_path / "env.sock")))
