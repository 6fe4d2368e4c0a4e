"""Who a call is from: the relay's uid for unix peers (its primary group where asked), the client
certificate's subject on TLS (two certificates: two callers), a fixed caller for the admin
socket, nobody for a peer none of these names; and what a sender may name below itself."""

from __future__ import annotations

import concurrent.futures
import datetime
import os
import pwd

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ntransformerd.server.callers import Caller, Identify, tls_caller, unix_caller
from ntransformerd.server.errors import InvalidRequest


class Context:
    def __init__(self, peer: str, auth: dict | None = None):
        self._peer, self._auth = peer, auth or {"transport_security_type": [b"insecure"]}

    def peer(self):
        return self._peer

    def auth_context(self):
        return self._auth


class Relay:
    def __init__(self, uids: dict[str, int]):
        self.uids = uids

    def uid_of(self, peer):
        return self.uids.get(peer)


def test_a_unix_peer_is_the_uid_the_relay_saw_and_only_that():
    identify = Identify(relay=Relay({"unix-abstract:0a1b2": 1001}))
    assert identify(Context("unix-abstract:0a1b2")) == Caller("uid:1001", uid=1001)
    assert identify(Context("unix-abstract:ffff0")) is None  # not one of the relay's
    assert identify(Context("unix:")) is None  # an unbound client past the relay
    assert identify(Context("ipv4:127.0.0.1:5000")) is None  # TCP without a certificate


def test_group_sharing_takes_the_primary_group_from_the_user_database():
    root = pwd.getpwuid(0)
    assert unix_caller(0, group=True).gid == root.pw_gid
    assert unix_caller(0, group=False).gid is None
    unknown = max(p.pw_uid for p in pwd.getpwall()) + 12345
    assert unix_caller(unknown, group=True).gid is None  # no entry: no group to share with


def test_the_admin_socket_names_a_fixed_caller():
    me = unix_caller(os.geteuid(), group=False)
    assert Identify(fixed=me)(Context("unix:")) is me and me.privileged


def test_what_a_sender_names_lives_below_it():
    gw = Caller("uid:1001", uid=1001)
    k = gw.below("key:3fa1c2")
    assert k.id == "uid:1001/key:3fa1c2" and k.principal == gw.principal and gw.below("") is gw
    for bad in ("a/b", "x" * 129, "key 1", "é"):
        with pytest.raises(InvalidRequest, match="on_behalf_of"):
            gw.below(bad)
    assert not gw.privileged and not Caller("tls:CN=x").privileged and Caller("uid:0", uid=0).privileged


def test_tls_caller_needs_a_certificate():
    assert tls_caller({"transport_security_type": [b"insecure"]}) is None
    assert tls_caller({"transport_security_type": [b"ssl"]}) is None  # no client certificate
    assert tls_caller({"transport_security_type": [b"ssl"], "x509_subject": [b"CN=alice,O=example"]}) == \
        Caller("tls:CN=alice,O=example")


# ---- a real TLS connection -----------------------------------------------------------------------

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402


def _pem(obj) -> bytes:
    if isinstance(obj, x509.Certificate):
        return obj.public_bytes(serialization.Encoding.PEM)
    return obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _signed(cn: str, ca_key, ca_name, *, ca=False, dns=None):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    b = (x509.CertificateBuilder().subject_name(name).issuer_name(ca_name or name).public_key(key.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(hours=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if dns:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName(dns)]), critical=False)
    return b.sign(ca_key or key, hashes.SHA256()), key


class Who(health.HealthServicer):
    def __init__(self):
        super().__init__()
        self.callers = []

    def Check(self, request, context):
        self.callers.append(Identify()(context))
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def test_two_client_certificates_are_two_callers():
    ca, ca_key = _signed("test CA", None, None, ca=True)
    server_cert, server_key = _signed("ntransformerd", ca_key, ca.subject, dns="ntransformerd")
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
    who = Who()
    health_pb2_grpc.add_HealthServicer_to_server(who, server)
    creds = grpc.ssl_server_credentials([(_pem(server_key), _pem(server_cert))], root_certificates=_pem(ca),
                                        require_client_auth=True)
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    try:
        for cn in ("alice", "bob", "alice"):
            cert, key = _signed(cn, ca_key, ca.subject)
            ch = grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(_pem(ca), _pem(key), _pem(cert)),
                                     options=[("grpc.ssl_target_name_override", "ntransformerd")])
            with ch:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    finally:
        server.stop(0)
    a, b, a2 = who.callers
    assert a.principal == "tls:CN=alice" and b.principal == "tls:CN=bob" and a2 == a
