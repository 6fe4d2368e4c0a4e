"""ntx-client's arguments (the end-to-end runs are in tests/server/test_e2e.py)."""

import json
import types

import pytest

from ntx_client import cli


def test_generate_flags_parse():
    a = cli.parser().parse_args(["--socket", "/s", "generate", "--raw", "--temperature", "0", "--max-tokens", "64",
                                 "--ignore-eos", "--json", "--stop", "a", "--stop", "b", "--top-k", "5", "hi"])
    assert a.socket == "/s" and a.raw and a.json and a.ignore_eos and a.stop == ["a", "b"] and a.top_k == 5
    assert cli.sampling_options(a)["max_tokens"] == 64


def test_raw_and_chat_exclude_each_other(capsys):
    assert cli.main(["--socket", "/nonexistent.sock", "generate", "--raw", "--chat", "x"]) == 2


@pytest.mark.parametrize("command", [["status"], ["models"], ["tokenize", "x"], ["generate", "x"]])
def test_unreachable_daemon_is_one_line_and_exit_1(command, capsys, tmp_path):
    assert cli.main(["--socket", str(tmp_path / "none.sock"), *command]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ntx-client: cannot reach ntransformerd") and "Traceback" not in err


def test_chat_sends_the_whole_history(monkeypatch, capsys):
    import io
    from ntx_client.client import Chunk

    sent = []

    class FakeClient:
        def chat(self, messages, **kw):
            sent.append([dict(m) for m in messages])
            yield Chunk(f"reply {len(sent)}", [1])

    monkeypatch.setattr("sys.stdin", io.StringIO("Hi, I am Ada.\nWhat is my name?\n/bye\nignored\n"))
    args = cli.parser().parse_args(["chat", "--system", "Be brief."])
    assert cli.cmd_chat(FakeClient(), args) == 0
    assert sent[1] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi, I am Ada."},
                       {"role": "assistant", "content": "reply 1"}, {"role": "user", "content": "What is my name?"}]
    assert capsys.readouterr().out == "reply 1\nreply 2\n"


def test_penalty_flags_parse():
    a = cli.parser().parse_args(["generate", "--repeat-penalty", "1.2", "--frequency-penalty", "0.5",
                                 "--presence-penalty", "-0.5", "hi"])
    kw = cli.sampling_options(a, chat=True)
    assert (kw["repetition_penalty"], kw["frequency_penalty"], kw["presence_penalty"]) == (1.2, 0.5, -0.5)
    from ntx_client.client import generate_request
    r = generate_request("hi", **kw)
    assert r.sampling.repetition_penalty == 1.2 and r.sampling.presence_penalty == -0.5


class _TTY(list):
    def isatty(self):
        return True

    def write(self, text):
        self.append(text)

    def flush(self):
        pass


class _Status:
    def __init__(self, state, progress="", fraction=0.0, error=""):
        self.state, self.load_progress, self.load_fraction, self.error = state, progress, fraction, error


class _Waiting:
    """status() answers in turn: an exception is raised, a state returned."""

    def __init__(self, *answers):
        self.answers = list(answers)

    def status(self):
        a = self.answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a


def test_wait_shows_the_load_progress_until_serving():
    from ntx_client.errors import ConnectionFailed
    out = _TTY()
    client = _Waiting(ConnectionFailed("no socket yet"), _Status(2, "loading layer 3/30", 0.14),
                      _Status(2, "loading layer 30/30", 0.95), _Status(3))
    cli.wait_until_serving(client, 60, line=cli.StatusLine(out), sleep=lambda s: None)
    text = "".join(out)
    assert "waiting for ntransformerd to start" in text and "loading layer 3/30 (14%)" in text
    assert "loading layer 30/30 (95%)" in text and text.endswith("\r") and not client.answers


def test_wait_goes_through_every_state_that_becomes_serving():
    import grpc
    from ntx_client.errors import ConnectionFailed, NtxError
    out = _TTY()
    client = _Waiting(ConnectionFailed("no socket yet"), NtxError("Socket closed", grpc.StatusCode.UNAVAILABLE),
                      _Status(2, "starting"), _Status(2, "loading layer 1/30", 0.05),
                      _Status(4, "switching to SmolLM2"), _Status(3))
    cli.wait_until_serving(client, 60, line=cli.StatusLine(out), sleep=lambda s: None)
    assert "waiting for ntransformerd: starting" in "".join(out) and not client.answers
    for other in (NtxError("permission denied", grpc.StatusCode.PERMISSION_DENIED),):
        with pytest.raises(NtxError, match="permission denied"):
            cli.wait_until_serving(_Waiting(other), 60, line=cli.StatusLine(_TTY()), sleep=lambda s: None)
    with pytest.raises(NtxError, match="no model loaded: load one with sudo ntx-admin model load PATH"):
        cli.wait_until_serving(_Waiting(_Status(1)), 60, line=cli.StatusLine(_TTY()), sleep=lambda s: None)


def test_wait_gives_up_on_a_failed_load_and_on_time():
    from ntx_client.errors import ConnectionFailed, NtxError
    with pytest.raises(NtxError, match="not serving: the model failed to load: no such file"):
        cli.wait_until_serving(_Waiting(_Status(5, error="the model failed to load: no such file")), 60,
                               line=cli.StatusLine(_TTY()),
                               sleep=lambda s: None)
    t = iter(range(100))
    with pytest.raises(ConnectionFailed, match="no socket"):
        cli.wait_until_serving(_Waiting(*[ConnectionFailed("no socket")] * 10), 3, line=cli.StatusLine(_TTY()),
                               sleep=lambda s: None, clock=lambda: next(t))


def test_status_json_keeps_zeros_and_numbers_as_numbers():
    from ntx_proto.ntransformer.v1 import inference_pb2 as pb
    s = pb.StatusResponse(state=pb.SERVING_STATE_SERVING, memory_bytes=123 << 20, steps=12,
                          tokens_generated_total=1 << 40, tiers=[pb.TierStatus(name="ram", layers=30)])
    d = cli.as_dict(s)
    assert d["memory_bytes"] == 123 << 20 and d["tokens_generated_total"] == 1 << 40 and d["steps"] == 12
    assert d["tokens_per_second"] == 0.0 and d["live_requests"] == 0 and d["vram_bytes"] == 0
    assert d["pinned_bytes"] == 0 and d["state"] == "SERVING_STATE_SERVING" and d["tiers"][0]["bytes"] == 0
    assert json.loads(json.dumps(d)) == d


def test_models_table_shows_the_id_the_file_and_the_gguf_name(capsys):
    from ntx_proto.ntransformer.v1 import inference_pb2 as pb
    info = pb.ModelInfo(name="smollm2-135m-instruct", path="/m/SmolLM2-135M-Instruct.Q4_1.gguf",
                        architecture="llama", n_layers=30, context_length=4096, backend="cpu", file_bytes=98 << 20,
                        metadata={"general.name": "Smollm2 135M 8k Lc100K Mix1 Ep2"},
                        aliases=["SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct.Q4_1"])

    class C:
        def model(self):
            return info

    assert cli.cmd_models(C(), cli.parser().parse_args(["models"])) == 0
    head, row, detail, aliases = capsys.readouterr().out.splitlines()[:4]
    assert row.split()[0] == "smollm2-135m-instruct" and head.index("ARCH") == row.index("llama")
    assert row.split()[-1] == "/m/SmolLM2-135M-Instruct.Q4_1.gguf" and head.split()[-1] == "FILE"
    assert detail.strip() == "name in the file: Smollm2 135M 8k Lc100K Mix1 Ep2"
    assert aliases.strip() == "requests may also name it: SmolLM2-135M-Instruct.Q4_1.gguf, SmolLM2-135M-Instruct.Q4_1"


def test_chat_commands_are_local(monkeypatch, capsys):
    import io
    from ntx_client.client import Chunk

    sent = []

    class FakeClient:
        def chat(self, messages, **kw):
            sent.append([dict(m) for m in messages])
            yield Chunk("ok", [1])

    lines = ["/help", "/system Be terse.", "hi", "/clear", "again", "/nonsense", " /not a command", "/system",
             "last", "/exit", "never sent"]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines) + "\n"))
    assert cli.cmd_chat(FakeClient(), cli.parser().parse_args(["chat"])) == 0
    assert sent == [[{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}],
                    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "again"}],
                    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "again"},
                     {"role": "assistant", "content": "ok"}, {"role": "user", "content": " /not a command"}],
                    [{"role": "user", "content": "last"}]]
    out = capsys.readouterr().out
    assert "/system TEXT" in out and "unknown command /nonsense" in out and "(conversation cleared)" in out


def test_status_shows_the_storage_tier_counters(capsys):
    from ntx_proto.ntransformer.v1 import inference_pb2 as pb
    storage = pb.TierStatus(name="storage", layers=29, bytes=64 << 20, bytes_per_second=1 << 20,
                            source="nvme ntxdata at 0000:00:04.0", read_bytes=3 << 30, reads=870,
                            read_bytes_per_second=1.5e9, commands=12000, commands_in_flight=7,
                            max_commands_in_flight=32, read_errors=1, last_error="unrecovered read error")
    pinned = pb.TierStatus(name="pinned", layers=1, bytes=1 << 20)
    status = pb.StatusResponse(model="m", tiers=[storage, pinned])
    assert cli.cmd_status(types.SimpleNamespace(status=lambda: status), types.SimpleNamespace(json=False)) == 0
    out = capsys.readouterr().out
    text, other = out[out.index("tier storage"):out.index("tier pinned")], out[out.index("tier pinned"):]
    assert "tier storage: 29 layers, 64.0 MiB" in text
    assert "source nvme ntxdata at 0000:00:04.0: read 3.0 GiB in 870 reads" in text
    assert "12000 commands, 7 in flight (max 32), 1 errors" in text and "last error: unrecovered" in text
    assert "tier pinned" in other and "source" not in other
