"""server/sockets.py: unsafe socket directories are refused, and a socket appears at its path
only with its final mode and group."""

from __future__ import annotations

import concurrent.futures
import grp
import os
import stat
import subprocess
import sys

import grpc
import pytest

from ntransformerd.server import sockets


@pytest.fixture
def server():
    s = grpc.server(concurrent.futures.ThreadPoolExecutor(1))
    yield s
    s.stop(0)


@pytest.fixture
def safe_dir(tmp_path):
    d = tmp_path / "run"
    d.mkdir(mode=0o755)
    return d


def test_a_symlinked_directory_is_refused(server, safe_dir, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(safe_dir)
    with pytest.raises(sockets.SocketError, match="is a symlink"):
        sockets.bind(server, str(link / "d.sock"), mode=sockets.USER_MODE)
    assert os.listdir(safe_dir) == []


@pytest.mark.parametrize("mode,words", [(0o777, "writable by its group and all users"), (0o1777, "all users"),
                                        (0o775, "writable by its group")])
def test_a_directory_others_can_write_is_refused(server, safe_dir, mode, words):
    os.chmod(safe_dir, mode)
    with pytest.raises(sockets.SocketError, match=words) as e:
        sockets.bind(server, str(safe_dir / "d.sock"), mode=sockets.USER_MODE)
    assert "chmod go-w" in str(e.value) and os.listdir(safe_dir) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory owned by another user needs root")
def test_a_directory_owned_by_another_user_is_refused(server, safe_dir):
    os.chown(safe_dir, 65534, 65534)
    with pytest.raises(sockets.SocketError, match="is owned by .*uid 65534"):
        sockets.bind(server, str(safe_dir / "d.sock"), mode=sockets.USER_MODE)


def test_a_directory_above_that_others_can_write_is_refused(server, tmp_path):
    above = tmp_path / "shared"
    above.mkdir()
    (above / "run").mkdir(mode=0o755)
    os.chmod(above, 0o777)  # not sticky: anyone could rename run/ away and put their own there
    with pytest.raises(sockets.SocketError, match="above the socket directory"):
        sockets.bind(server, str(above / "run" / "d.sock"), mode=sockets.USER_MODE)
    os.chmod(above, 0o1777)  # sticky, as /tmp: only the owner may rename run/
    sockets.bind(server, str(above / "run" / "d.sock"), mode=sockets.USER_MODE)


def test_the_socket_appears_only_with_its_final_mode_and_group(server, safe_dir, monkeypatch):
    """Every chmod/chown happens before anything is at the final path, never through it."""
    path = str(safe_dir / "d.sock")
    seen = []
    real_chmod, real_chown = os.chmod, os.chown

    def chmod(p, *a, **kw):
        seen.append(("chmod", os.path.lexists(path), str(p)))
        return real_chmod(p, *a, **kw)

    def chown(p, *a, **kw):
        seen.append(("chown", os.path.lexists(path), str(p)))
        return real_chown(p, *a, **kw)

    monkeypatch.setattr(sockets.os, "chmod", chmod)
    monkeypatch.setattr(sockets.os, "chown", chown)
    # as root: any group but root's own, so that the chown shows
    group = next((g.gr_name for g in grp.getgrall() if g.gr_gid != 0), "") if os.geteuid() == 0 else ""
    sockets.bind(server, path, mode=sockets.USER_MODE, group=group)
    st = os.lstat(path)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == sockets.USER_MODE
    if group:
        assert st.st_gid == grp.getgrnam(group).gr_gid and [c for c, *_ in seen] == ["chmod", "chown"]
    assert seen and all(not at_final and p != path for _, at_final, p in seen), seen
    assert os.listdir(safe_dir) == ["d.sock"]  # the private staging directory is gone
    server.start()
    import socket
    with socket.socket(socket.AF_UNIX) as c:
        c.connect(path)


def test_the_daemon_refuses_an_unsafe_directory_with_a_message(tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)
    r = subprocess.run([sys.executable, "-m", "ntransformerd.main", "--socket", str(d / "d.sock"), "--config",
                        os.devnull, "--socket-group", "", "--backend", "cpu"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and "writable by its group and all users" in r.stderr and "Traceback" not in r.stderr, \
        r.stderr
    assert os.listdir(d) == []
