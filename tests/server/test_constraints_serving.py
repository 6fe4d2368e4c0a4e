"""Constraints through the daemon: constrained and free requests batched in one step each get
their solo output; `ntx-client generate --json-schema | --regex | --grammar`; refusals are
INVALID_ARGUMENT with the compiler's message, and the daemon serves on;
constraint text over 1 MiB is refused by name (the daemon, and the client before sending). Tools
and tool calls travel in Chat and reach the model's chat template."""

from __future__ import annotations

import concurrent.futures
import json
import re
import subprocess
import sys

import grpc
import pytest

from ntransformerd.engine.generation import chat, constraints
from ntx_client import Client, NtxError
from ntx_client import client as client_lib
from ntx_client.errors import RequestTooLarge
from ntx_proto.ntransformer.v1 import inference_pb2 as pb, inference_pb2_grpc

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


def test_refusals_are_invalid_argument_and_the_daemon_serves_on(daemon):
    nested = '{"type": "object", "properties": {"a": ' * 10_000 + '{"type": "string"}' + "}}" * 10_000
    cases = [({"json_schema": '{"type": "nope"}'}, "bad constraint: the JSON schema cannot be compiled"),
             ({"json_schema": nested}, "bad constraint: the JSON schema"),
             ({"regex": "(a|aa)*(a|aa)*b{"}, "bad constraint: the regular expression cannot be compiled")]
    with Client(daemon.socket, timeout=60) as c:
        for kw, message in cases:
            with pytest.raises(NtxError, match=message) as e:
                c.complete("Hi", max_tokens=4, **kw)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert c.complete("Hi", max_tokens=2, temperature=0).usage["completion_tokens"] == 2


def _grammar(size: int) -> str:
    """A valid Lark grammar of exactly `size` bytes: a word, then a comment."""
    head = 'start: "w" /[0-9]+/\n// '
    return head + "x" * (size - len(head))


def test_a_constraint_over_one_mib_is_invalid_argument_naming_the_field_and_the_limit(daemon):
    limit = constraints.MAX_CONSTRAINT_BYTES
    assert limit == client_lib.MAX_CONSTRAINT_BYTES == 1 << 20  # the daemon's, the client's, proto Constraint's
    message = (r"constraint.grammar is 1,048,577 bytes; the daemon takes at most 1 MiB \(1,048,576 bytes\) of "
               "constraint text: shorten or simplify it")
    # the daemon: a request built by hand (the client library would not send it)
    req = pb.GenerateRequest(prompt="Hi", max_tokens=2, constraint=pb.Constraint(grammar=_grammar(limit + 1)))
    with grpc.insecure_channel(f"unix://{daemon.socket}") as channel:
        with pytest.raises(grpc.RpcError) as e:
            list(inference_pb2_grpc.InferenceStub(channel).Generate(req, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and re.fullmatch(message, e.value.details()), \
        e.value.details()
    with Client(daemon.socket, timeout=60) as c:
        at_limit = c.complete("Hi", max_tokens=2, grammar=_grammar(limit), temperature=0)
        assert re.fullmatch("w[0-9]+", at_limit.text), at_limit.text  # exactly 1 MiB is taken
        # the client library: refused before sending, a 5 MB grammar too (gRPC alone would answer
        # RESOURCE_EXHAUSTED for its message size, naming neither the field nor the limit)
        for size, shown in ((limit + 1, "1,048,577"), (5_000_000, "5,000,000")):
            with pytest.raises(RequestTooLarge, match=message.replace("1,048,577", shown)) as e:
                c.complete("Hi", max_tokens=2, grammar=_grammar(size))
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and isinstance(e.value, ValueError)
        assert c.complete("Hi", max_tokens=2, temperature=0).usage["completion_tokens"] == 2
    with Client("/nonexistent/ntx.sock") as nowhere:  # nothing is sent: no connection error
        with pytest.raises(RequestTooLarge, match="constraint.json_schema is"):
            nowhere.complete("Hi", json_schema={"description": "x" * limit})


# ---- tools through the chat template ------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city"], "additionalProperties": False,
                   "properties": {"city": {"type": "string", "maxLength": 20}}}}}
ROUND_TRIP = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}<|im_end|>'},
]


def test_tools_and_calls_reach_the_template_over_grpc(daemon, engine):
    """The default model's template knows no tools: the daemon renders the generic format, the
    same ids as the engine's own encode_chat, and the tool result's <|im_end|> stays text."""
    with Client(daemon.socket, timeout=120) as c:
        ids = c.tokenize(messages=ROUND_TRIP, tools=[WEATHER])
        assert ids == engine.encode_chat(ROUND_TRIP, tools=[WEATHER])
        text = c.detokenize(ids)
        assert chat.TOOL_INSTRUCTIONS.replace(chat.TOOLS_HERE, json.dumps([WEATHER["function"]])) in text
        assert '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>' in text
        assert '<|im_start|>user\n<tool_response>\n{"sky": "clear"}<|im_end|>\n</tool_response>' in text
        end = engine.tokenizer.token_id("<|im_end|>")
        assert ids.count(end) == text.count("<|im_end|>") - 1  # the result's own is text
        # a generation with tools and the call's constraint: its prompt is that chat, its output a call
        one = {"type": "object", "required": ["name", "arguments"], "additionalProperties": False,
               "properties": {"name": {"const": "get_weather"}, "arguments": WEATHER["function"]["parameters"]}}
        call = {"type": "array", "minItems": 1, "maxItems": 1, "items": one}
        done = c.complete(messages=ROUND_TRIP[:1], tools=[WEATHER], max_tokens=40, temperature=0,
                          grammar=f'start: "<tool_call>" %json {json.dumps(call)} "</tool_call>"')
        assert done.prompt_ids == engine.encode_chat(ROUND_TRIP[:1], tools=[WEATHER])
        assert done.text.startswith("<tool_call>") and done.text.endswith("</tool_call>"), done.text
        assert json.loads(done.text[len("<tool_call>"):-len("</tool_call>")])[0]["name"] == "get_weather"
        # bad calls are INVALID_ARGUMENT naming the message
        with pytest.raises(NtxError, match=r"messages\[2\].tool_call_id 'call_9' answers no tool call") as e:
            c.tokenize(messages=ROUND_TRIP[:2] + [dict(ROUND_TRIP[2], tool_call_id="call_9")])
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(NtxError, match=r"tools\[0\].function.parameters is not JSON"):
            c.complete(messages=ROUND_TRIP[:1], max_tokens=2,
                       tools=[{"type": "function", "function": {"name": "f", "parameters": "{oops"}}])
        with pytest.raises(ValueError, match="tools go with messages"):
            c.complete("Hi", tools=[WEATHER])


def test_fuzzed_tools_and_calls_are_served_or_invalid_argument(daemon):
    hypothesis = pytest.importorskip("hypothesis", reason="pip install hypothesis (the test extra)")
    st = hypothesis.strategies
    json_text = st.one_of(st.text(max_size=30), st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
        max_leaves=8).map(json.dumps))
    calls = st.lists(st.builds(pb.ToolCall, id=st.sampled_from(["", "c1", "c2"]), name=st.text(max_size=8),
                               arguments=json_text), max_size=2)
    messages = st.lists(st.builds(pb.ChatMessage, role=st.sampled_from(["user", "assistant", "tool", "system"]),
                                  content=st.text(max_size=20), tool_calls=calls,
                                  tool_call_id=st.sampled_from(["", "c1", "c2", "c3"])), max_size=4)
    tools = st.lists(st.builds(pb.Tool, name=st.text(max_size=8), description=st.text(max_size=20),
                               parameters=json_text), max_size=3)

    with grpc.insecure_channel(f"unix://{daemon.socket}") as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)

        @hypothesis.settings(max_examples=80, deadline=None, derandomize=True)
        @hypothesis.given(messages, tools)
        def fuzz(ms, ts):
            try:
                stub.Tokenize(pb.TokenizeRequest(chat=pb.Chat(messages=ms, tools=ts)), timeout=30)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
        fuzz()
    with Client(daemon.socket, timeout=60) as c:
        assert c.complete("Hi", max_tokens=2, temperature=0).usage["completion_tokens"] == 2


def test_a_schema_that_goes_on_only_past_the_digit_bound_is_the_requests_fault(daemon):
    """A constraint that can go on only past max_digits digits in a row: the request ends with
    INVALID_ARGUMENT naming the bound (not INTERNAL), and the daemon serves on."""
    with Client(daemon.socket, timeout=60) as c:
        with pytest.raises(NtxError) as e:
            c.complete("A big number:", max_tokens=64, temperature=0, regex="[0-9]{20}", max_digits=16)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "max_digits" in str(e.value), str(e.value)
        assert c.complete("Hi", max_tokens=2, temperature=0).usage["completion_tokens"] == 2
