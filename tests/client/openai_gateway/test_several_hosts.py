"""Several daemons behind one gateway: three ntransformerd on loopback TCP with TLS certificates
made here, one `ntx-openai` spreading requests over them with gRPC's round_robin."""

from __future__ import annotations

import datetime
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import tempfile

import grpc
import openai
import pytest

from ntx_client import Client, TLS
from ntx_proto.ntransformer.v1 import inference_pb2 as pb, inference_pb2_grpc

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID  # noqa: E402

SERVER_NAME = "ntransformerd"  # the one name every daemon's certificate carries
API_KEY = "sk-test-hosts"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cert(subject: str, issuer_key, issuer_name, *, key, ca=False, server=False, client=False):
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
         .issuer_name(issuer_name or x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName(SERVER_NAME), x509.DNSName("localhost"),
                                                         x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                            critical=False)
    usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + ([ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])
    if usages:
        b = b.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    return b.sign(issuer_key or key, hashes.SHA256())


def _write(path, obj) -> str:
    with open(path, "wb") as f:
        if isinstance(obj, x509.Certificate):
            f.write(obj.public_bytes(serialization.Encoding.PEM))
        else:
            f.write(obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
    return path


def make_pki(d: str, name: str = "test CA") -> dict[str, str]:
    """A CA, a server certificate for SERVER_NAME / 127.0.0.1, and a client certificate."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert(name, None, None, key=ca_key, ca=True)
    out = {"ca": _write(os.path.join(d, "ca.pem"), ca)}
    for role in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _cert(f"{role} of {name}", ca_key, ca.subject, key=key, server=role == "server",
                     client=role == "client")
        out[role] = _write(os.path.join(d, f"{role}.pem"), cert)
        out[f"{role}_key"] = _write(os.path.join(d, f"{role}.key"), key)
    return out


@pytest.fixture(scope="module")
def pki():
    d = tempfile.mkdtemp(prefix="ntx-pki-")
    return make_pki(d), make_pki(tempfile.mkdtemp(prefix="ntx-pki-other-"), "another CA")


@pytest.fixture(scope="module")
def hosts(processes, pki):
    """Three daemons on 127.0.0.1 with TLS, and one gateway over all three: (daemons, ports, gateway)."""
    DaemonProcess, GatewayProcess = processes
    ours, _ = pki
    daemons, ports, gw = [], [], None
    try:
        for _ in range(3):
            port = free_port()
            daemons.append(DaemonProcess("--max-ctx", "256", "--tcp-listen", f"127.0.0.1:{port}",
                                         "--tls-cert", ours["server"], "--tls-key", ours["server_key"],
                                         "--tls-client-ca", ours["ca"]))
            ports.append(port)
        for d in daemons:
            d.wait_ready()
        gw = GatewayProcess(*[a for p in ports for a in ("--target", f"127.0.0.1:{p}")], "--tls-ca", ours["ca"],
                            "--tls-cert", ours["client"], "--tls-key", ours["client_key"],
                            "--tls-server-name", SERVER_NAME, api_key=API_KEY).wait_ready()
        yield daemons, ports, gw
    finally:
        if gw is not None:
            gw.stop()
        for d in daemons:
            d.cleanup()


def _requests_total(d) -> int:
    with Client(d.socket) as c:  # each daemon's own count, over its unix socket
        return c.status().requests_total


def test_30_requests_spread_over_three_daemons_then_one_killed_the_rest_succeed(hosts):
    daemons, _, gw = hosts
    ai = openai.OpenAI(base_url=gw.url, api_key=API_KEY, max_retries=0, timeout=60)
    model = ai.models.list().data[0].id
    before = [_requests_total(d) for d in daemons]
    for i in range(30):
        r = ai.completions.create(model=model, prompt=f"{i} apples and", max_tokens=2, temperature=0)
        assert r.usage.completion_tokens >= 1
    spread = [_requests_total(d) - b for d, b in zip(daemons, before)]
    assert sum(spread) == 30 and min(spread) >= 5, f"requests per daemon: {spread}"

    victim = daemons[1]
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait()
    survivors = [daemons[0], daemons[2]]
    before = [_requests_total(d) for d in survivors]
    for i in range(30):  # every one succeeds: gRPC takes the dead daemon out of the rotation
        r = ai.chat.completions.create(model=model, messages=[{"role": "user", "content": f"Say {i}"}],
                                       max_tokens=2, temperature=0)
        assert r.usage.completion_tokens >= 1
    spread = [_requests_total(d) - b for d, b in zip(survivors, before)]
    assert sum(spread) == 30 and min(spread) >= 5, f"requests per surviving daemon: {spread}"
    health = gw.request("GET", "/health", headers={"Authorization": f"Bearer {API_KEY}"})[2]
    assert sorted(h["state"] for h in health["daemons"]) == ["serving", "serving", "unreachable"]


def test_client_library_balances_and_a_client_without_certificate_is_refused(hosts, pki):
    daemons, ports, _ = hosts
    ours, other = pki
    live = [p for d, p in zip(daemons, ports) if d.proc.poll() is None]
    target = f"127.0.0.1:{live[0]}"
    tls = TLS(ca=ours["ca"], cert=ours["client"], key=ours["client_key"], server_name=SERVER_NAME)
    with Client(targets=[target], tls=tls, timeout=30) as c:
        assert c.status().state == pb.SERVING_STATE_SERVING
        assert c.complete("Hi", max_tokens=1, temperature=0).usage["completion_tokens"] == 1

    def status_with(creds):
        ch = grpc.secure_channel(target, creds, options=[("grpc.ssl_target_name_override", SERVER_NAME)])
        try:
            return inference_pb2_grpc.InferenceStub(ch).Status(pb.StatusRequest(), timeout=10)
        finally:
            ch.close()

    with open(ours["ca"], "rb") as f:
        ca = f.read()
    with pytest.raises(grpc.RpcError) as e:  # TLS without a client certificate
        status_with(grpc.ssl_channel_credentials(root_certificates=ca))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with open(other["client"], "rb") as f, open(other["client_key"], "rb") as k:
        foreign = grpc.ssl_channel_credentials(root_certificates=ca, private_key=k.read(), certificate_chain=f.read())
    with pytest.raises(grpc.RpcError) as e:  # a certificate from a CA the daemons do not trust
        status_with(foreign)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    ch = grpc.insecure_channel(target)  # no TLS at all
    with pytest.raises(grpc.RpcError) as e:
        inference_pb2_grpc.InferenceStub(ch).Status(pb.StatusRequest(), timeout=10)
    ch.close()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    # the client library without TLS says what to pass
    from ntx_client.channels import TargetError
    with pytest.raises(TargetError, match="--tls-ca"):
        Client(targets=[target])


def test_ntx_client_cli_takes_several_targets(hosts, pki):
    daemons, ports, _ = hosts
    ours, _ = pki
    live = [p for d, p in zip(daemons, ports) if d.proc.poll() is None]
    args = [a for p in live for a in ("--target", f"127.0.0.1:{p}")]
    r = subprocess.run([sys.executable, "-m", "ntx_client.cli", *args, "--tls-ca", ours["ca"], "--tls-cert",
                        ours["client"], "--tls-key", ours["client_key"], "--tls-server-name", SERVER_NAME,
                        "generate", "--raw", "--temperature", "0", "--max-tokens", "2", "Hello"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    r = subprocess.run([sys.executable, "-m", "ntx_client.cli", *args, "status"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and "--tls-ca" in r.stderr
