"""Constraints through the daemon: constrained and free requests batched in one step each get
their solo output; `ntx-client generate --json-schema | --regex | --grammar`; refusals are
INVALID_ARGUMENT with the compiler's message, within a bounded time, and the daemon serves on."""

from __future__ import annotations

import concurrent.futures
import json
import re
import subprocess
import sys
import time

import grpc
import pytest

from ntx_client import Client, NtxError

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "population"],
          "properties": {"city": {"type": "string", "maxLength": 24},
                         "population": {"type": "integer", "minimum": 0}}}
CHAT = [{"role": "user", "content": "Name a big city and its population as JSON."}]


def greedy(c: Client, **kw):
    return c.complete(messages=CHAT, temperature=0, max_tokens=40, **kw)


def test_constrained_and_free_rows_in_one_batch_match_their_solo_runs(daemon):
    with Client(daemon.socket, timeout=300) as c:
        solo_c = greedy(c, json_schema=SCHEMA)
        solo_f = greedy(c)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futs = [pool.submit(greedy, c, **({"json_schema": SCHEMA} if i % 2 == 0 else {})) for i in range(4)]
            outs = [f.result() for f in futs]
    doc = json.loads(solo_c.text)
    assert set(doc) == {"city", "population"} and isinstance(doc["population"], int)
    assert solo_f.text != solo_c.text
    for i, o in enumerate(outs):
        assert o.ids == (solo_c if i % 2 == 0 else solo_f).ids, i


def cli(daemon, *args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ntx_client.cli", "--socket", daemon.socket, "generate",
                           "--temperature", "0", "--max-tokens", "30", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_cli_constraint_options(daemon, tmp_path):
    schema = tmp_path / "city.json"
    schema.write_text(json.dumps(SCHEMA))
    r = cli(daemon, "--json-schema", str(schema), "--json", "Name a big city and its population as JSON.")
    assert r.returncode == 0, r.stderr
    doc = json.loads(json.loads(r.stdout.splitlines()[-1])["text"])
    assert set(doc) == {"city", "population"}
    r = cli(daemon, "--regex", "[A-Z][a-z]+ [0-9]{4}", "In which year did the war end?")
    assert r.returncode == 0 and re.fullmatch(r"[A-Z][a-z]+ [0-9]{4}\n", r.stdout), (r.stdout, r.stderr)
    gbnf = tmp_path / "answer.gbnf"
    gbnf.write_text('root ::= ("yes" | "no") "!"\n')
    r = cli(daemon, "--grammar", str(gbnf), "Is water wet?")
    assert r.returncode == 0 and r.stdout in ("yes!\n", "no!\n"), (r.stdout, r.stderr)
    r = cli(daemon, "--regex", "[0-9]+", "--grammar", str(gbnf), "x")
    assert r.returncode == 2 and "not allowed with argument" in r.stderr
    r = cli(daemon, "--json-schema", str(tmp_path / "missing.json"), "x")
    assert r.returncode == 1 and "--json-schema" in r.stderr and "cannot read it" in r.stderr


def test_refusals_are_invalid_argument_in_bounded_time_and_the_daemon_serves_on(daemon):
    nested = '{"type": "object", "properties": {"a": ' * 10_000 + '{"type": "string"}' + "}}" * 10_000
    cases = [({"json_schema": '{"type": "nope"}'}, "bad constraint: the JSON schema cannot be compiled"),
             ({"json_schema": nested}, "bad constraint: the JSON schema"),
             ({"regex": "(a|aa)*(a|aa)*b{"}, "bad constraint: the regular expression cannot be compiled"),
             ({"grammar": "start: " + " | ".join(f'"w{i}"' for i in range(150_000))},
              r"bad constraint: the grammar is \d+ bytes; at most 1024 KiB")]
    with Client(daemon.socket, timeout=60) as c:
        for kw, message in cases:
            t = time.monotonic()
            with pytest.raises(NtxError, match=message) as e:
                c.complete("Hi", max_tokens=4, **kw)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert time.monotonic() - t < 10
        with pytest.raises(NtxError) as e:  # past gRPC's 4 MiB message limit: refused by the transport
            c.complete("Hi", max_tokens=4, grammar="start: " + " | ".join(f'"w{i}"' for i in range(600_000)))
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert c.complete("Hi", max_tokens=2, temperature=0).usage["completion_tokens"] == 2
