"""Connection errors name the cause and the fix."""


import grpc
import pytest

from ntx_client import Client, ConnectionFailed, PermissionDenied
from ntx_client.errors import connection_error


def test_missing_socket_says_is_it_running(tmp_path):
    e = connection_error(str(tmp_path / "none.sock"))
    assert isinstance(e, ConnectionFailed) and "is it running" in str(e).lower()
    assert "systemctl status ntransformerd" in str(e)


def test_unreadable_socket_says_join_the_group(tmp_path):
    e = connection_error(str(tmp_path), "connect: Permission denied (13)")
    assert isinstance(e, PermissionDenied) and "add your user to group ntransformer" in str(e)
    assert e.code == grpc.StatusCode.PERMISSION_DENIED


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
