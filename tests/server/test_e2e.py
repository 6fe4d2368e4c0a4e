"""End to end with real processes: ntransformerd on a temporary socket, ntx-client as a user runs it."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import grpc
import pytest

from ntx_client import Client
from ntx_client.client import CHAT_REPETITION_PENALTY
from ntx_proto.ntransformer.v1 import inference_pb2 as pb, inference_pb2_grpc

PY = sys.executable
PROMPT = "The quick brown fox"


def cli(daemon, *args, user: list[str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [*(user or []), PY, "-m", "ntx_client.cli", "--socket", daemon.socket, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_cli_generate_json_equals_a_direct_engine_run(daemon, engine, solo):
    r = cli(daemon, "generate", "--raw", "--temperature", "0", "--ignore-eos", "--max-tokens", "64", "--json", PROMPT)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    last = lines[-1]
    prompt_ids = engine.tokenizer.encode(PROMPT)
    assert last["prompt_ids"] == prompt_ids
    assert last["ids"] == solo(engine, prompt_ids, 64, ignore_eos=True)
    assert len(last["ids"]) == 64 and last["finish_reason"] == "length"
    assert "".join(c["text"] for c in lines[:-1]) == last["text"]
    assert [i for c in lines[:-1] for i in c["ids"]] == last["ids"]


def test_cli_generate_equals_ntx_model_run(daemon):
    args = ["--temperature", "0", "--ignore-eos", "--max-tokens", "16", "--json"]
    ref = subprocess.run([PY, "-m", "ntransformerd.tools.ntx_model", "run", "--backend", "cpu", "--prompt", PROMPT,
                          *args], capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr
    r = cli(daemon, "generate", "--raw", *args, PROMPT)
    assert r.returncode == 0, r.stderr
    ids = json.loads(r.stdout.splitlines()[-1])["ids"]
    assert len(ids) == 16 and ids == json.loads(ref.stdout.splitlines()[-1])["ids"]


def test_cli_chat_generate_equals_ntx_model_run_chat(daemon, engine, solo):
    r = cli(daemon, "generate", "--system", "Be brief.", "--temperature", "0", "--max-tokens", "8", "--json",
            "What is 2+2?")
    assert r.returncode == 0, r.stderr
    last = json.loads(r.stdout.splitlines()[-1])
    prompt_ids = engine.encode_chat([{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "What is 2+2?"}])
    assert last["prompt_ids"] == prompt_ids
    assert last["ids"] == solo(engine, prompt_ids, 8, repetition_penalty=CHAT_REPETITION_PENALTY)


def test_cli_chat_keeps_history(daemon):
    r = subprocess.run([PY, "-m", "ntx_client.cli", "--socket", daemon.socket, "chat", "--temperature", "0",
                        "--max-tokens", "4"], input="Hi, I am Ada.\nWhat is my name?\n/bye\n",
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    with Client(daemon.socket) as c:
        s = c.status()
    assert len(r.stdout.splitlines()) == 2 and s.requests_total >= 2  # one reply per line; history: test_cli.py


def test_cli_status_models_tokenize(daemon, engine):
    r = cli(daemon, "status")
    assert r.returncode == 0, r.stderr
    assert "MODEL" in r.stdout and "serving" in r.stdout and "tier ram: 30 layers" in r.stdout
    r = cli(daemon, "models")
    assert r.returncode == 0 and "llama" in r.stdout, r.stderr
    r = cli(daemon, "tokenize", "Hello world")
    assert r.returncode == 0 and json.loads(r.stdout) == engine.tokenizer.encode("Hello world")


def test_cli_unreachable_socket_names_cause_and_fix(tmp_path):
    r = subprocess.run([PY, "-m", "ntx_client.cli", "--socket", str(tmp_path / "none.sock"), "status"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "cannot reach ntransformerd" in r.stderr and "systemctl status ntransformerd" in r.stderr


# 8 distinct requests of mixed prompt lengths and max_tokens; each client sends 4 of them
SPECS = [(PROMPT, 4), ("Hi", 2), ("1, 2, 3, 4,", 5), ("Paris is the capital of", 3),
         ("def fibonacci(n):\n    " * 2, 4), ("Once upon a time, " * 4, 5), ("<|im_start|>user\nhello", 2),
         ("The weather today is", 4)]


def test_32_clients_x_4_requests_none_lost_none_crossed(daemon, engine, solo):
    expected = {i: solo(engine, engine.tokenizer.encode(p), n, ignore_eos=True) for i, (p, n) in enumerate(SPECS)}

    def client(k: int) -> list[tuple[int, list[int], str]]:
        out = []
        with Client(daemon.socket) as c:
            for j in range(4):
                i = (k + 3 * j) % len(SPECS)
                p, n = SPECS[i]
                r = c.complete(p, max_tokens=n, temperature=0, ignore_eos=True)
                out.append((i, r.ids, r.finish_reason))
        return out

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(client, range(32)))
    assert sum(len(r) for r in results) == 128
    for k, rs in enumerate(results):
        for i, ids, reason in rs:
            assert ids == expected[i], f"client {k} request {i}: {ids} != solo {expected[i]}"
            assert reason == "length"
    with Client(daemon.socket) as c:
        s = c.status()
    assert s.live_requests == 0 and s.queued_requests == 0 and s.free_slots == daemon.max_batch


def test_killed_client_frees_its_slot_within_a_step(daemon):
    proc = subprocess.Popen([PY, "-m", "ntx_client.cli", "--socket", daemon.socket, "generate", "--raw",
                             "--max-tokens", "500", "--ignore-eos", "--json", "Tell me a long story"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline()  # the first chunk: the request is live
    with Client(daemon.socket) as c:
        s = c.status()
        assert s.live_requests == 1 and s.free_slots == daemon.max_batch - 1
        proc.kill()
        proc.wait()
        steps_at_kill = s.steps
        end = time.monotonic() + 10
        while (s := c.status()).live_requests and time.monotonic() < end:
            time.sleep(0.02)
    assert s.live_requests == 0 and s.free_slots == daemon.max_batch
    # the loop checks cancellations before every step: at most the step in flight plus one
    assert s.steps - steps_at_kill <= 3, f"{s.steps - steps_at_kill} steps ran after the kill"


def test_health_reflection_and_load_progress_then_sigterm_with_8_live_streams(new_daemon):
    import socket as so
    import threading
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    notify_path = tempfile.mktemp(prefix="ntx-notify-")
    notify = so.socket(so.AF_UNIX, so.SOCK_DGRAM)
    notify.bind(notify_path)
    notes: list[str] = []

    def listen():
        try:
            while True:
                notes.append(notify.recv(4096).decode())
        except OSError:
            pass  # closed at the end of the test
    threading.Thread(target=listen, daemon=True).start()
    d = new_daemon("--max-batch", "8", "--drain-timeout", "2",
                   env={"NOTIFY_SOCKET": notify_path, "WATCHDOG_USEC": "2000000"})
    try:
        while not os.path.exists(d.socket):
            assert d.proc.poll() is None, d.log()
            time.sleep(0.01)
        ch = grpc.insecure_channel(f"unix:{d.socket}")
        hs = health_pb2_grpc.HealthStub(ch)
        stub = inference_pb2_grpc.InferenceStub(ch)
        seen = set()
        while True:
            h = hs.Check(health_pb2.HealthCheckRequest(service="ntransformer.v1.Inference")).status
            s = stub.Status(pb.StatusRequest())
            seen.add((s.state, h))
            if s.state == pb.SERVING_STATE_LOADING:
                assert s.load_progress and h == health_pb2.HealthCheckResponse.NOT_SERVING
                try:
                    list(stub.Generate(pb.GenerateRequest(prompt="x", max_tokens=1)))
                    assert stub.Status(pb.StatusRequest()).state == pb.SERVING_STATE_SERVING  # loaded meanwhile
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "loading" in e.details()
            if h == health_pb2.HealthCheckResponse.SERVING:  # flips only after the model is attached
                assert s.state == pb.SERVING_STATE_SERVING
                break
            time.sleep(0.05)
        assert (pb.SERVING_STATE_LOADING, health_pb2.HealthCheckResponse.NOT_SERVING) in seen
        # reflection lists the services
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
        rs = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(rs.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in resp.list_services_response.service}
        assert {"ntransformer.v1.Inference", "grpc.health.v1.Health"} <= names

        streams = [stub.Generate(pb.GenerateRequest(prompt=f"Story {i}:", max_tokens=1000, ignore_eos=True))
                   for i in range(8)]
        firsts = [next(s) for s in streams]
        assert all(f.token_ids for f in firsts)
        d.proc.send_signal(signal.SIGTERM)
        codes = []
        for s in streams:
            try:
                for _ in s:
                    pass
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                codes.append(e.code())
                assert "shutting down" in e.details(), e.details()
        rc = d.proc.wait(60)  # a hang guard: the drain itself is bounded by drain_timeout
        assert rc == 0, d.log()
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}
        assert not os.path.exists(d.socket) and not os.path.exists(d.admin_socket)
        assert "drained" in d.log()
        # sd_notify: load progress, then READY, watchdog pings from the loop, STOPPING on SIGTERM
        ready = next(i for i, n in enumerate(notes) if n.startswith("READY=1"))
        assert any(n.startswith("STATUS=loading layer") for n in notes[:ready]), notes
        assert "WATCHDOG=1" in notes
        assert any(n.startswith("STOPPING=1") for n in notes[ready:]), notes
    finally:
        d.cleanup()
        notify.close()
        os.unlink(notify_path)


def _setpriv(uid: int, gid: int, groups: list[int]) -> list[str]:
    g = ["--groups", ",".join(map(str, groups))] if groups else ["--clear-groups"]
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", *g, "--"]


@pytest.mark.root
def test_permissions_group_member_ok_others_refused_admin_root_only(daemon):
    import grp
    if os.geteuid() != 0 or shutil.which("setpriv") is None or not daemon.group:
        pytest.skip("needs root, setpriv and the group 'users'")
    st = os.stat(daemon.socket)
    assert oct(st.st_mode & 0o777) == "0o660" and st.st_gid == grp.getgrnam(daemon.group).gr_gid
    assert oct(os.stat(daemon.admin_socket).st_mode & 0o777) == "0o600"
    nobody = 65534
    outsider = cli(daemon, "generate", "--raw", "--max-tokens", "2", "hi", user=_setpriv(nobody, nobody, []))
    assert outsider.returncode == 1
    assert "permission denied" in outsider.stderr and f"group {daemon.group} and" in outsider.stderr
    member = _setpriv(nobody, nobody, [grp.getgrnam(daemon.group).gr_gid])
    ok = cli(daemon, "generate", "--raw", "--temperature", "0", "--max-tokens", "2", "hi", user=member)
    assert ok.returncode == 0, ok.stderr
    admin = subprocess.run([*member, PY, "-c", "import sys; from ntx_client import AdminClient\n"
                            f"AdminClient({daemon.admin_socket!r}).resume()"],
                           capture_output=True, text=True, timeout=60)
    assert admin.returncode != 0 and "permission denied" in admin.stderr.lower()


def test_admin_verbs_drain_resume_unload_load(daemon):
    from ntx_client import AdminClient, NtxError
    with AdminClient(daemon.admin_socket, timeout=120) as admin, Client(daemon.socket) as c:
        assert admin.drain(0.5).cancelled == 0
        with pytest.raises(NtxError) as e:
            c.complete("hi", max_tokens=1)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE and "draining" in str(e.value)
        admin.resume()
        assert c.complete("hi", max_tokens=1).ids
        with pytest.raises(NtxError) as e:
            admin.load_model("/nonexistent.gguf")
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        admin.unload_model()
        with pytest.raises(NtxError) as e:
            c.complete("hi", max_tokens=1)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "no model" in str(e.value)
        info = admin.load_model()  # the default model again
        assert info.n_layers == 30 and c.health() == "SERVING"
        assert c.complete("hi", max_tokens=1).ids
