"""ntx-client and ntx-admin against a real daemon: chat in a terminal, status numbers, the chat
default that keeps greedy replies out of loops, --wait, and the admin verbs."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import sys
import time

import pytest

from ntx_client import Client, NtxError, cli
from ntx_proto.ntransformer.v1 import inference_pb2 as pb

PY = sys.executable


class Terminal:
    """A command on a pseudo-terminal: send keys, read what the terminal shows."""

    def __init__(self, *argv: str):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the terminal is its stdin, stdout and stderr
            # as a login shell starts it: Ctrl-C interrupts. A test run started in the background
            # of a non-interactive shell inherits SIGINT ignored, and Python keeps it ignored.
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execve(PY, [PY, *argv], {**os.environ, "TERM": "xterm", "INPUTRC": "/dev/null"})
        self.seen = ""

    def send(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def read_until(self, needle: str, timeout: float = 60, *, after: int = 0) -> str:
        end = time.monotonic() + timeout
        while needle not in self.seen[after:]:
            left = end - time.monotonic()
            assert left > 0, f"no {needle!r} on the terminal; it shows:\n{self.seen[after:]!r}"
            if select.select([self.fd], [], [], left)[0]:
                try:
                    self.seen += os.read(self.fd, 4096).decode(errors="replace")
                except OSError:  # the child closed the terminal
                    assert needle in self.seen[after:], self.seen[after:]
        return self.seen

    def read_chars(self, n: int, timeout: float = 60) -> None:
        start, end = len(self.seen), time.monotonic() + timeout
        while len(self.seen) - start < n:
            assert time.monotonic() < end, f"fewer than {n} characters came:\n{self.seen[start:]!r}"
            if select.select([self.fd], [], [], 1)[0]:
                self.seen += os.read(self.fd, 4096).decode(errors="replace")

    def wait(self, timeout: float = 30) -> int:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
            if select.select([self.fd], [], [], 0.1)[0]:
                try:
                    self.seen += os.read(self.fd, 4096).decode(errors="replace")
                except OSError:
                    pass
        os.kill(self.pid, signal.SIGKILL)
        raise AssertionError(f"still running after {timeout} s:\n{self.seen}")


LEFT, UP, END, BACKSPACE, CTRL_C = "\x1b[D", "\x1b[A", "\x05", "\x7f", "\x03"


def test_chat_in_a_terminal(daemon):
    t = Terminal("-m", "ntx_client.cli", "--socket", daemon.socket, "chat", "--temperature", "0",
                 "--max-tokens", "900", "--ignore-eos")
    try:
        t.read_until(">>> ")
        banner = [line for line in t.seen.splitlines() if "ntx-client chat" in line]
        assert len(banner) == 1 and "/exit" in banner[0] and "/help" in banner[0]
        # "/hepl", two steps left, an "l", to the end, rub out the last: "/help"
        t.send("/hepl" + LEFT + LEFT + "l" + END + BACKSPACE + "\r")
        mark = len(t.seen)
        t.read_until(">>> ", after=mark)
        assert "/system TEXT" in t.seen[mark:] and "unknown command" not in t.seen[mark:]
        t.send(UP + "\r")  # history: /help again
        mark = len(t.seen)
        t.read_until("/system TEXT", after=mark)
        t.read_until(">>> ", after=mark)
        t.send("Tell me a long story about a dragon.\r")
        mark = len(t.seen)
        t.read_until("\n", after=mark)  # the echoed line
        start = len(t.seen)
        t.read_chars(40)  # some of the reply, then Ctrl-C in the middle of it
        t.send(CTRL_C)
        t.read_until("(stopped)", after=start)
        t.read_until(">>> ", after=start)
        with Client(daemon.socket) as c:  # the cancelled reply frees its slot
            end = time.monotonic() + 10
            while c.status().live_requests and time.monotonic() < end:
                time.sleep(0.1)
            assert c.status().live_requests == 0
        t.send("/exit\r")
        assert t.wait() == 0
    finally:
        try:
            os.kill(t.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_status_tokens_per_second_decays_to_zero_and_json_numbers(daemon, capsys):
    """The rate covers the last RATE_WINDOW_S: once that long has passed with no step, it is 0,
    not the last figure left standing."""
    from ntransformerd.server.metrics import RATE_WINDOW_S

    with Client(daemon.socket) as c:
        c.complete("Once upon a time", max_tokens=16, temperature=0, ignore_eos=True)
        time.sleep(RATE_WINDOW_S + 0.5)
        assert c.status().tokens_per_second == 0.0
    assert cli.main(["--socket", daemon.socket, "status", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert isinstance(d["steps"], int) and d["steps"] > 0 and isinstance(d["tokens_generated_total"], int)
    assert d["tokens_per_second"] == 0.0 and d["vram_bytes"] == 0 and d["pinned_bytes"] == 0
    assert d["state"] == "SERVING_STATE_SERVING" and d["queued_requests"] == 0
    assert cli.main(["--socket", daemon.socket, "status"]) == 0
    head, row = capsys.readouterr().out.splitlines()[:2]
    assert "RSS" in head and "VRAM" in head and "PINNED" in head


def _distinct_at_the_end(ids: list[int]) -> int:
    return len(set(ids[-24:]))


def test_greedy_chat_does_not_loop(daemon, capsys):
    """A message of one emoji twelve times over: greedy and without a penalty, the default model
    copies it on and on, and the chat default penalty keeps it talking. Both are wide decisions,
    not near ties, so another CPU's rounding cannot flip them: the loop is the model's strong prior
    (the whole message is one character repeated), its next token ahead of the runner-up by over a
    logit at every step, and under the penalty the reply's first word leads the emoji by as much,
    about three times the most that the kernels' different orders of summing were seen to move one."""
    def ids(*flags):
        argv = ["--socket", daemon.socket, "generate", "--temperature", "0", "--max-tokens", "40", "--json", *flags,
                "🐶" * 12]
        assert cli.main(argv) == 0
        return json.loads(capsys.readouterr().out.splitlines()[-1])["ids"]
    assert _distinct_at_the_end(ids("--repeat-penalty", "1")) <= 4  # the loop: the emoji's three tokens
    assert _distinct_at_the_end(ids()) >= 12


def test_wait_for_a_loading_daemon_and_the_admin_verbs(new_daemon, synth_model, capsys):
    from ntx_system import admin

    model = synth_model("tiny", "q8_0")
    d = new_daemon("--model", model, "--max-ctx", "128")
    try:
        # straight away: the socket is not there yet, then the model loads
        assert cli.main(["--socket", d.socket, "generate", "--wait", "--wait-timeout", "120", "--raw", "--temperature", "0",
                         "--max-tokens", "3", "--ignore-eos", "Hello"]) == 0
        assert capsys.readouterr().out.strip()
        verb = ["--admin-socket", d.admin_socket, "--timeout", "60"]
        assert admin.main(["model", "unload", *verb]) == 0
        assert capsys.readouterr().out == "model unloaded\n"
        with Client(d.socket) as c:
            assert c.status().state == pb.SERVING_STATE_NO_MODEL
            with pytest.raises(NtxError, match="no model"):
                c.complete("hi", max_tokens=1)
        assert admin.main(["model", "load", os.path.join(os.path.dirname(model), "missing.gguf"), *verb]) == 2
        assert "no model file" in capsys.readouterr().err
        assert admin.main(["model", "load", model, "--backend", "cpu", *verb]) == 0
        assert capsys.readouterr().out == f"loaded {model} (2 layers, cpu backend)\n"
        assert admin.main(["drain", *verb]) == 0
        assert capsys.readouterr().out.startswith("draining: 0 requests finished, 0 cancelled")
        with Client(d.socket) as c:
            with pytest.raises(NtxError, match="draining"):
                c.complete("hi", max_tokens=1)
            assert admin.main(["resume", *verb]) == 0
            assert c.complete("hi", max_tokens=1, temperature=0).ids
        assert admin.main(["shutdown", *verb]) == 0
        assert d.proc.wait(30) == 0
        assert not os.path.exists(d.socket)
    finally:
        d.cleanup()
