"""Connection errors name the cause and the fix."""

import concurrent.futures
import grp
import os

import grpc
import pytest

from ntx_client import Client, ConnectionFailed, PermissionDenied
from ntx_client.errors import connection_error
from ntx_proto.ntransformer.v1 import admin_pb2_grpc


def test_missing_socket_says_is_it_running(tmp_path):
    e = connection_error(str(tmp_path / "none.sock"))
    assert isinstance(e, ConnectionFailed) and "is it running" in str(e).lower()
    assert "systemctl status ntransformerd" in str(e)


def test_a_missing_admin_socket_says_where_the_admin_socket_is(tmp_path, capsys):
    from ntx_system import admin
    path = str(tmp_path / "admin.sock")
    assert admin.main(["drain", "--admin-socket", path, "--timeout", "5"]) == 1
    err = capsys.readouterr().err
    assert f"cannot reach ntransformerd's admin socket at {path}" in err and "systemctl status ntransformerd" in err
    assert "next to its --socket" in err and "NTX_ADMIN_SOCKET" in err
    assert f"--socket {path}" not in err  # not: start a daemon whose user socket is the admin path


def test_unreadable_socket_names_the_sockets_own_group(tmp_path):
    sock = tmp_path / "d.sock"
    sock.write_bytes(b"")
    if os.geteuid() == 0:
        group = next(g for g in grp.getgrall() if g.gr_gid != 0)
        os.chown(sock, -1, group.gr_gid)
    else:
        group = grp.getgrgid(os.stat(sock).st_gid)
    e = connection_error(str(sock), "connect: Permission denied (13)")
    assert isinstance(e, PermissionDenied) and f"add your user to group {group.gr_name} and" in str(e)
    assert f"usermod -aG {group.gr_name} $USER" in str(e) and e.code == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.skipif(os.geteuid() != 0, reason="a file of group root needs root")
def test_a_root_group_socket_says_use_sudo(tmp_path):
    sock = tmp_path / "d.sock"
    sock.write_bytes(b"")
    os.chown(sock, 0, 0)
    e = connection_error(str(sock), "connect: Permission denied (13)")
    assert "only root may use it" in str(e) and "group root" in str(e) and "usermod" not in str(e)


def test_client_call_on_a_missing_socket_raises_connection_failed(tmp_path):
    with Client(str(tmp_path / "none.sock"), timeout=5) as c:
        with pytest.raises(ConnectionFailed, match="cannot reach ntransformerd"):
            c.status()
        with pytest.raises(ConnectionFailed):
            list(c.generate("hi"))


def test_generate_request_needs_exactly_one_input():
    from ntx_client.client import generate_request
    with pytest.raises(ValueError, match="exactly one"):
        generate_request("a", prompt_ids=[1])
    with pytest.raises(TypeError, match="top_q"):
        generate_request("a", top_q=1)
    r = generate_request("a", max_tokens=3, temperature=0.0, stop=["x"], seed=7)
    assert r.prompt == "a" and r.max_tokens == 3 and r.sampling.HasField("temperature") and r.sampling.seed == 7
    assert not r.sampling.HasField("top_p")


class _RefusingAdmin(admin_pb2_grpc.AdminServicer):
    def LoadModel(self, request, context):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"no model file at {request.path!r}: give the path of a "
                      ".gguf file")


def test_admin_client_errors_say_the_code_once(tmp_path):
    """The code is e.code; the text says what happened, so `f"{e.code.name}: {e}"` names it once."""
    from ntx_client import AdminClient, NtxError
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(1))
    admin_pb2_grpc.add_AdminServicer_to_server(_RefusingAdmin(), server)
    path = str(tmp_path / "admin.sock")
    server.add_insecure_port(f"unix:{path}")
    server.start()
    try:
        with AdminClient(path, timeout=30) as admin, pytest.raises(NtxError) as e:
            admin.load_model("/x.gguf")
    finally:
        server.stop(0)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(e.value) == "no model file at '/x.gguf': give the path of a .gguf file"
    assert f"{e.value.code.name}: {e.value}".count("INVALID_ARGUMENT") == 1
