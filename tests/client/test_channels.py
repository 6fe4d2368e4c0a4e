"""Targets: a unix socket stays on gRPC's defaults; TCP targets become one balanced channel."""

from __future__ import annotations

import json

import pytest

from ntx_client import channels
from ntx_client.channels import TLS, TargetError


def test_a_socket_path_is_a_unix_target_without_a_service_config(tmp_path):
    path = str(tmp_path / "d.sock")
    assert channels.grpc_target([path]) == f"unix:{path}"
    assert channels.grpc_target([f"unix:{path}"]) == f"unix:{path}"
    assert dict(channels.channel_options([path], None)).get("grpc.service_config") is None


def test_several_tcp_targets_are_one_address_list_with_round_robin_and_health_checks():
    uri = channels.grpc_target(["127.0.0.1:7001", "localhost:7002", "127.0.0.1:7003"])
    assert uri.startswith("ipv4:") and set(uri[5:].split(",")) >= {"127.0.0.1:7001", "127.0.0.1:7002",
                                                                     "127.0.0.1:7003"}
    opts = dict(channels.channel_options(["a:1", "b:2"], TLS("ca", "c", "k", server_name="ntransformerd")))
    config = json.loads(opts["grpc.service_config"])
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    assert config["healthCheckConfig"]["serviceName"] == "ntransformer.v1.Inference"
    assert opts["grpc.ssl_target_name_override"] == "ntransformerd"
    assert channels.grpc_target(["gpu1.lan:7443"]) == "dns:///gpu1.lan:7443"


@pytest.mark.parametrize("targets,message", [
    ([], "no target"),
    (["gpu1"], "neither a socket path nor host:port"),
    (["gpu1:99999"], "neither a socket path nor host:port"),
    (["/run/a.sock", "gpu1:7443"], "a unix socket serves one host"),
    (["no-such-host.invalid:7443", "127.0.0.1:1"], "cannot resolve"),
])
def test_bad_targets_name_the_fix(targets, message):
    with pytest.raises(TargetError, match=message):
        channels.grpc_target(targets)


def test_tcp_without_tls_and_unreadable_tls_files_are_refused(tmp_path):
    with pytest.raises(TargetError, match="--tls-ca, --tls-cert, --tls-key"):
        channels.open_channel(["127.0.0.1:7443"])
    with pytest.raises(TargetError, match="cannot read the TLS CA certificate"):
        channels.open_channel(["127.0.0.1:7443"], TLS(str(tmp_path / "ca.pem"), "c", "k"))
