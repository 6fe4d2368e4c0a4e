"""ntx-client's arguments (the end-to-end runs are in tests/server/test_e2e.py)."""

import pytest

from ntx_client import cli


def test_generate_flags_parse():
    a = cli.parser().parse_args(["--socket", "/s", "generate", "--raw", "--temperature", "0", "--max-tokens", "64",
                                 "--ignore-eos", "--json", "--stop", "a", "--stop", "b", "--top-k", "5", "hi"])
    assert a.socket == "/s" and a.raw and a.json and a.ignore_eos and a.stop == ["a", "b"] and a.top_k == 5
    assert cli._sampling(a)["max_tokens"] == 64


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
