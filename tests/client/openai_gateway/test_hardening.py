"""ntx-openai against a hostile client: nothing one sends grows the gateway, crashes a handler,
reaches the daemon past its limits or holds a connection for ever.

Every request here is refused before the daemon is asked, so the gateways run with no daemon
behind them (their /health answers 503), and each test takes seconds; the slowest, 20,000
anonymous requests that must not grow /metrics, takes 10-30 s: the number is the issue's own.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import tempfile
import time

import openai
import pytest

API_KEY = "sk-test-hardening"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 3.0
MAX_CONNECTIONS = 6


@pytest.fixture(scope="module")
def no_daemon():
    return os.path.join(tempfile.mkdtemp(prefix="ntx-openai-nodaemon-"), "none.sock")


@pytest.fixture(scope="module")
def gw(processes, no_daemon):
    """A gateway with keys, short request timeouts and few connections."""
    g = processes[1]("--socket", no_daemon, "--header-timeout", str(HEADER_TIMEOUT_S), "--body-timeout",
                     str(BODY_TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS), api_key=API_KEY)
    try:
        yield g.wait_ready(status=503)
    finally:
        g.stop()


@pytest.fixture(scope="module")
def open_gw(processes, no_daemon):
    """A gateway with keys whose monitoring routes are open, answering one more host name."""
    g = processes[1]("--socket", no_daemon, "--open-monitoring", "--allowed-host", "gw.example", api_key=API_KEY)
    try:
        yield g.wait_ready(status=503)
    finally:
        g.stop()


def _post(gw, path: str, raw: bytes, content_type: str | None = "application/json", headers: dict | None = None):
    h = {**AUTH, **({"Content-Type": content_type} if content_type else {}), **(headers or {})}
    return gw.request("POST", path, raw, h)


def _samples(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _assert_error_object(reply, status: int, code: int, *needles: str) -> dict:
    assert code == status, reply
    err = reply["error"]
    assert set(err) == {"message", "type", "param", "code"} and "Traceback" not in err["message"], err
    for n in needles:
        assert n in err["message"], err
    return err


# ---- metrics and monitoring ------------------------------------------------------------------------

def test_20000_anonymous_401s_leave_metrics_small(gw):
    """Each 401 on /v1/models/<random> is counted under the route's name, not its path."""
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=30)
    n = 20_000
    try:
        for i in range(n):
            conn.request("GET", f"/v1/models/{os.urandom(12).hex()}-{i}")
            r = conn.getresponse()
            r.read()
            assert r.status == 401
    finally:
        conn.close()
    code, _, text = gw.request("GET", "/metrics", headers=AUTH)
    assert code == 200
    assert len(text.encode()) < 20_000, f"/metrics is {len(text.encode())} bytes"
    samples = _samples(text)
    assert samples[("ntx_openai_requests_total", (("endpoint", "model"), ("status", "401")))] == n
    endpoints = {dict(k[1]).get("endpoint") for k in samples if k[0] == "ntx_openai_requests_total"}
    assert endpoints <= {"models", "model", "chat", "completions", "health", "metrics", "other"}, endpoints


def test_unknown_urls_are_counted_as_other(gw):
    for i in range(3):
        code, _, reply = gw.request("GET", f"/no/such/{i}", headers=AUTH)
        assert code == 404 and reply["error"]["code"] == "unknown_url"
    samples = _samples(gw.request("GET", "/metrics", headers=AUTH)[2])
    assert samples[("ntx_openai_requests_total", (("endpoint", "other"), ("status", "404")))] >= 3
    assert not any("/no/such" in str(k) for k in samples)


def test_health_and_metrics_need_the_key(gw, open_gw):
    for path in ("/health", "/metrics"):
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
            code, _, reply = gw.request("GET", path, headers=headers)
            _assert_error_object(reply, 401, code)
            assert "socket" not in json.dumps(reply) and "none.sock" not in json.dumps(reply)
    code, _, h = gw.request("GET", "/health", headers=AUTH)
    assert code == 503 and h["daemons"][0]["state"] == "unreachable"
    assert gw.request("GET", "/metrics", headers=AUTH)[0] == 200
    # --open-monitoring: both answer without a key; the API itself still needs one
    code, _, h = open_gw.request("GET", "/health")
    assert code == 503 and h["daemons"][0]["state"] == "unreachable"
    code, _, text = open_gw.request("GET", "/metrics")
    assert code == 200 and "ntx_daemon_up" in text
    assert open_gw.request("GET", "/v1/models")[0] == 401


# ---- bodies -------------------------------------------------------------------------------------

def _answered(gw, endpoint: str) -> float:
    """Requests the gateway answered on `endpoint`, whatever their status."""
    return sum(v for (name, labels), v in _samples(gw.request("GET", "/metrics", headers=AUTH)[2]).items()
               if name == "ntx_openai_requests_total" and dict(labels)["endpoint"] == endpoint)


def test_8mb_prompt_is_413_and_the_openai_package_does_not_retry(gw):
    client = openai.OpenAI(base_url=gw.url, api_key=API_KEY, max_retries=3, timeout=60)
    prompt = "a" * 8_000_000
    before = _answered(gw, "completions")
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="m", prompt=prompt, max_tokens=1)
    assert e.value.status_code == 413 and "1 MiB" in e.value.message, e.value.message
    assert _answered(gw, "completions") == before + 1  # once: 413 is no status the package retries
    before = _answered(gw, "chat")
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt[:700_000]}] * 2,
                                       max_tokens=1)
    assert e.value.status_code == 413 and "messages" in e.value.message
    assert _answered(gw, "chat") == before + 1
    client.close()
    # token ids (sent plainly: the package takes seconds to prepare 300k of them)
    code, _, reply = _post(gw, "/v1/completions", json.dumps({"model": "m", "prompt": list(range(300_000))}).encode())
    _assert_error_object(reply, 413, code, "token ids")


def test_body_over_the_limit_is_413_before_it_is_read(gw):
    s = socket.create_connection(("127.0.0.1", gw.port), timeout=10)
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: " + str(9 << 20).encode() +
                  b"\r\n\r\n")
        head = s.recv(65536)
    finally:
        s.close()
    assert head.startswith(b"HTTP/1.1 413 "), head


def _nested(n: int) -> bytes:
    return b'{"model": "m", "prompt": ' + b"[" * n + b"]" * n + b"}"


MALFORMED = [  # (what, path, raw body)
    ("lone surrogate in a prompt", "/v1/completions", b'{"model": "m", "prompt": "\\ud800"}'),
    ("lone surrogate in a message", "/v1/chat/completions",
     b'{"model": "m", "messages": [{"role": "user", "content": "hi \\udfff"}]}'),
    ("lone surrogate in a key", "/v1/completions", b'{"model": "m", "prompt": "hi", "\\ud800": 1}'),
    ("100k nested [", "/v1/completions", _nested(100_000)),
    ("100k nested [ unclosed", "/v1/chat/completions", b"[" * 100_000),
    ("100k nested objects", "/v1/completions", b'{"a":' * 100_000 + b"1" + b"}" * 100_000),
    ("token id 10**30", "/v1/completions", b'{"model": "m", "prompt": [' + str(10 ** 30).encode() + b"]}"),
    ("token id -1", "/v1/completions", b'{"model": "m", "prompt": [1, -1]}'),
    ("token id 2**63", "/v1/completions", b'{"model": "m", "prompt": [' + str(2 ** 63).encode() + b"]}"),
    ("a 5000-digit number", "/v1/completions", b'{"model": "m", "prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}"),
    ("temperature NaN", "/v1/completions", b'{"model": "m", "prompt": "hi", "temperature": NaN}'),
    ("temperature 1e400", "/v1/completions", b'{"model": "m", "prompt": "hi", "temperature": 1e400}'),
    ("a role that is an array", "/v1/chat/completions",
     b'{"model": "m", "messages": [{"role": ["user"], "content": "hi"}]}'),
    ("a content part type that is an object", "/v1/chat/completions",
     b'{"model": "m", "messages": [{"role": "user", "content": [{"type": {"a": 1}}]}]}'),
    ("stop of numbers", "/v1/completions", b'{"model": "m", "prompt": "hi", "stop": [1, 2]}'),
    ("invalid UTF-8", "/v1/completions", b'{"model": "m", "prompt": "\xff\xfe"}'),
    ("null", "/v1/completions", b"null"),
    ("empty", "/v1/chat/completions", b""),
]


@pytest.mark.parametrize("what,path,raw", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_bodies_get_400(gw, what, path, raw):
    code, _, reply = _post(gw, path, raw)
    _assert_error_object(reply, 400, code)
    assert len(json.dumps(reply)) < 1000  # nothing of the input beyond a short prefix is echoed


def test_no_traceback_in_the_log(gw):
    """The hostile requests of this module (and these again) left no traceback in the log."""
    for what, path, raw in MALFORMED[:3]:
        _post(gw, path, raw)
    log = gw.log()
    assert "Traceback" not in log and "unexpected error" not in log, log[-3000:]


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonx"])
def test_a_body_that_is_not_declared_json_is_415(gw, content_type):
    code, _, reply = _post(gw, "/v1/completions", b'{"model": "m", "prompt": "hi"}', content_type=content_type)
    _assert_error_object(reply, 415, code, "application/json")


def test_json_with_a_charset_is_json(gw):
    code, _, reply = _post(gw, "/v1/completions", b'{"prompt": "hi"}', content_type="application/json; charset=utf-8")
    assert code == 400 and reply["error"]["param"] == "model"  # parsed: the model is missing


# ---- hosts ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example", "localhost.evil",
                                  "", "[::2]"])
def test_a_host_that_is_not_the_gateways_is_refused(gw, host):
    code, _, reply = _post(gw, "/v1/completions", b'{"model": "m", "prompt": "hi"}', headers={"Host": host})
    err = _assert_error_object(reply, 400, code, "--allowed-host")
    assert err["code"] == "invalid_host"
    code, _, reply = gw.request("GET", "/health", headers={**AUTH, "Host": host})
    assert code == 400 and reply["error"]["code"] == "invalid_host"


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "LOCALHOST", "[::1]", "localhost:{port}"])
def test_loopback_hosts_are_answered(gw, host):
    code, _, _ = gw.request("GET", "/health", headers={**AUTH, "Host": host.format(port=gw.port)})
    assert code == 503  # served: no daemon behind it


def test_allowed_host_adds_a_name(gw, open_gw):
    assert open_gw.request("GET", "/health", headers={"Host": "gw.example:8000"})[0] == 503
    assert open_gw.request("GET", "/health", headers={"Host": "localhost"})[0] == 503
    assert open_gw.request("GET", "/health", headers={"Host": "other.example"})[0] == 400
    assert gw.request("GET", "/health", headers={**AUTH, "Host": "gw.example"})[0] == 400


# ---- slow clients ---------------------------------------------------------------------------------

def _closed_by_server(s: socket.socket, trickle: bytes | None = None, limit: float = 120) -> bool:
    """Whether the server closes `s` (`limit`: a hang guard), sending one byte of `trickle` every
    0.2 s meanwhile."""
    s.settimeout(0.2)
    end, i = time.monotonic() + limit, 0
    while time.monotonic() < end:
        try:
            if s.recv(65536) == b"":
                return True
        except socket.timeout:
            if trickle and i < len(trickle):
                s.sendall(trickle[i:i + 1])
                i += 1
        except ConnectionResetError:
            return True
    return False


def _cut_off_for(gw, s: socket.socket, what: str) -> bool:
    """The gateway said it closed `s` for its request `what` (head, body) missing its deadline."""
    said = f"closed the connection from 127.0.0.1:{s.getsockname()[1]}: its request {what} did not arrive"
    end = time.monotonic() + 30  # a hang guard: its log line follows the close
    while said not in gw.log() and time.monotonic() < end:
        time.sleep(0.05)
    return said in gw.log()


HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"


@pytest.mark.parametrize("case", ["silent", "partial head", "trickled head"])
def test_a_slow_header_client_is_cut_off(gw, case):
    s = socket.create_connection(("127.0.0.1", gw.port))
    try:
        if case == "partial head":
            s.sendall(HEAD)
        assert _closed_by_server(s, trickle=HEAD + b"X-Slow: " + b"x" * 200 if case == "trickled head" else None)
        assert _cut_off_for(gw, s, "head"), gw.log()[-2000:]
    finally:
        s.close()


def test_a_slow_body_client_is_cut_off(gw):
    s = socket.create_connection(("127.0.0.1", gw.port))
    try:
        s.sendall(HEAD + b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 1000\r\n\r\n{")
        assert _closed_by_server(s, trickle=b'"model": "m", ' * 20)
        assert _cut_off_for(gw, s, "body"), gw.log()[-2000:]
    finally:
        s.close()
    assert "request body did not arrive within 3 s (--body-timeout)" in gw.log()


def test_a_kept_alive_connection_is_not_cut_by_the_request_deadline(gw):
    """Between requests the idle time is uvicorn's keep-alive (5 s), longer than the head's 1 s."""
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=30)
    try:
        for _ in range(2):
            conn.request("GET", "/health", headers=AUTH)
            r = conn.getresponse()
            r.read()
            assert r.status == 503
            sock = conn.sock
            time.sleep(HEADER_TIMEOUT_S + 0.5)
        assert conn.sock is sock  # the same connection served both
    finally:
        conn.close()


def test_half_open_connections_fill_the_limit_only_until_their_deadline(gw):
    """MAX_CONNECTIONS - 1 silent connections: a request gets uvicorn's 503; once the deadline
    has closed them, the next request is served."""
    idle = [socket.create_connection(("127.0.0.1", gw.port)) for _ in range(MAX_CONNECTIONS - 1)]
    try:
        time.sleep(0.2)
        code, _, body = gw.request("GET", "/health", headers=AUTH)
        assert (code, body) == (503, "Service Unavailable")  # uvicorn's own answer, not the app's
        assert all(_closed_by_server(s) for s in idle)  # by their deadline
        end = time.monotonic() + 30  # a hang guard: uvicorn counts a connection gone just after closing it
        while (answer := gw.request("GET", "/health", headers=AUTH))[2] == "Service Unavailable" \
                and time.monotonic() < end:
            time.sleep(0.05)
        code, _, body = answer
        assert code == 503 and body["daemons"][0]["state"] == "unreachable", body  # the app's answer
    finally:
        for s in idle:
            s.close()


# ---- flags --------------------------------------------------------------------------------------

def test_the_flags_are_in_help_and_checked():
    from ntx_client.openai_gateway.main import config_from_args, parser

    text = parser().format_help()
    for flag in ("--open-monitoring", "--allowed-host", "--header-timeout", "--body-timeout", "--max-connections"):
        assert flag in text
    config = config_from_args(parser().parse_args(["--host", "10.0.0.5", "--allowed-host", "gw.example"]))
    assert config.allowed_hosts == {"localhost", "127.0.0.1", "::1", "10.0.0.5", "gw.example"}
    assert not config.open_monitoring
    assert config_from_args(parser().parse_args(["--host", "0.0.0.0"])).allowed_hosts == \
        {"localhost", "127.0.0.1", "::1"}
    for argv, says in ((["--header-timeout", "0"], "--header-timeout 0 is not a time"),
                       (["--body-timeout", "nan"], "--body-timeout nan is not a time"),
                       (["--max-connections", "1"], "--max-connections 1 leaves no room")):
        with pytest.raises(SystemExit) as e:
            config_from_args(parser().parse_args(argv))
        assert says in str(e.value)
