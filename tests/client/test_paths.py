"""The socket path is resolved in one place: explicit > $NTX_SOCKET > the system default."""

from ntx_client import paths


def test_socket_path_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("NTX_SOCKET", raising=False)
    assert paths.socket_path() == "/run/ntransformer/ntransformerd.sock"
    monkeypatch.setenv("NTX_SOCKET", str(tmp_path / "env.sock"))
    assert paths.socket_path() == str(tmp_path / "env.sock")
    assert paths.socket_path(str(tmp_path / "flag.sock")) == str(tmp_path / "flag.sock")


def test_admin_socket_sits_next_to_the_user_socket(monkeypatch, tmp_path):
    monkeypatch.delenv("NTX_ADMIN_SOCKET", raising=False)
    assert paths.admin_socket_path(user_socket=str(tmp_path / "d.sock")) == str(tmp_path / "admin.sock")
    monkeypatch.setenv("NTX_ADMIN_SOCKET", "/x/a.sock")
    assert paths.admin_socket_path() == "/x/a.sock"


def test_daemon_config_uses_the_same_resolution(monkeypatch, tmp_path):
    from ntransformerd import config
    monkeypatch.setenv("NTX_SOCKET", str(tmp_path / "env.sock"))
    cfg = config.load(["--config", "/dev/null"])
    assert cfg.socket == paths.socket_path() and cfg.admin_socket == str(tmp_path / "admin.sock")
