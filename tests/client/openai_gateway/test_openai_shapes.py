"""What OpenAI's clients expect of ids, log-probabilities, structured output, tools and errors,
through ntx-openai on a real daemon (the default model) with the official `openai` package: model
ids that are slugs, logprobs with bytes that join to the content, JSON numbers that end, strict
schemas refused as OpenAI refuses them, calls that end, and errors with `param` and `code`."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import openai
import pytest

from ntx_client import Client
from ntx_client.openai_gateway import tools as tools_
from ntransformerd.engine.generation import chat

API_KEY = "sk-test-shapes"
CTX = 1024
CJK_EMOJI = "日本語の文章を書いてください 😀🎉🧑‍🚀 naïve café"


@pytest.fixture(scope="module")
def stack(stack_with):
    with stack_with(API_KEY, "--max-ctx", str(CTX), "--speculative", "off") as s:
        yield s


@pytest.fixture(scope="module")
def oai(stack):
    return openai.OpenAI(base_url=stack[1].url, api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


def _post(gw, body: dict):
    return gw.request("POST", "/v1/chat/completions", json.dumps(body).encode(),
                      {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})


# ---- model ids -------------------------------------------------------------------------------------------

def test_model_ids_are_slugs_and_the_file_names_work_too(oai, model, stack):
    assert re.fullmatch(r"[a-z0-9][a-z0-9._-]*", model) and model == "smollm2-135m-instruct"
    with Client(stack[0].socket) as c:
        info = c.model()
    assert info.name == model  # the daemon, the gateway and the CLI say the same id
    for name in (model, "SmolLM2-135M-Instruct.Q4_1", "SmolLM2-135M-Instruct.Q4_1.gguf", model.upper()):
        assert oai.models.retrieve(name).id == model
        r = oai.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
        assert r.model == model
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=1)


# ---- log-probabilities -------------------------------------------------------------------------------------

def _check_logprobs(content: str, tokens) -> None:
    """OpenAI's shape: bytes on every token and alternative, the chosen tokens' bytes joined are
    the content, and U+FFFD only where the bytes are U+FFFD."""
    assert b"".join(bytes(t.bytes) for t in tokens) == content.encode()
    for t in tokens:
        for x in [t, *t.top_logprobs]:
            assert isinstance(x.bytes, list) and x.bytes, x
            if "\ufffd" in x.token:
                assert "\ufffd".encode() in bytes(x.bytes), x
            if x.token.startswith("bytes:"):  # part of a character: its bytes, escaped
                assert x.token == "bytes:" + "".join(f"\\x{b:02x}" for b in x.bytes)
            else:
                assert bytes(x.bytes).decode() == x.token


def test_chat_logprobs_on_cjk_and_emoji_have_bytes_that_join_to_the_content(oai, model):
    """The content is forced: a schema whose one value is CJK_EMOJI, so it holds these characters
    whatever the CPU's rounding makes of a free greedy answer (the constraint allows one token at
    each step). The vocabulary has no token for 日, 語 or 😀 whole, so some chosen tokens are parts
    of characters, shown as their bytes, and only the bytes joined give the content."""
    fmt = {"type": "json_schema", "json_schema": {"name": "Echo", "schema": {"enum": [CJK_EMOJI]}}}
    req = dict(model=model, messages=[{"role": "user", "content": f"Repeat exactly: {CJK_EMOJI}"}], max_tokens=120,
               temperature=0, logprobs=True, top_logprobs=5, response_format=fmt)
    r = oai.chat.completions.create(**req).choices[0]
    assert r.finish_reason == "stop" and json.loads(r.message.content) == CJK_EMOJI, r.message.content
    tokens = r.logprobs.content
    _check_logprobs(r.message.content, tokens)
    assert any(t.token.startswith("bytes:") for t in tokens)  # chosen tokens that are parts of characters
    streamed = list(oai.chat.completions.create(stream=True, **req))
    flat = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == r.message.content and [t.token for t in flat] == [t.token for t in tokens]
    _check_logprobs(text, flat)


def test_completion_logprobs_show_parts_of_characters_as_bytes(oai, model):
    r = oai.completions.create(model=model, prompt=CJK_EMOJI, max_tokens=1, temperature=0, logprobs=2, echo=True)
    lp = r.choices[0].logprobs
    assert not any("\ufffd" in t for t in lp.tokens) and any(t.startswith("bytes:") for t in lp.tokens)
    # offsets count characters: a part of a character starts where the character does
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(r.choices[0].text)


# ---- structured output that ends ---------------------------------------------------------------------------

LONG_NUMBER = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
               "additionalProperties": False}


def test_a_100_digit_integer_is_impossible_by_default(oai, model, stack):
    fmt = {"type": "json_schema", "json_schema": {"name": "Number", "schema": LONG_NUMBER, "strict": True}}
    ask = [{"role": "user", "content": "Write a number with a hundred digits."}]
    for seed in range(3):
        r = oai.chat.completions.create(model=model, messages=ask, response_format=fmt, temperature=1.5, top_p=1.0,
                                        seed=seed, max_tokens=120).choices[0]
        n = json.loads(r.message.content)["n"]
        assert r.finish_reason == "stop" and len(str(abs(n))) <= 16, r.message.content
    # more digits, where the request asks for them (ours: max_digits)
    code, _, reply = _post(stack[1], {"model": model, "messages": ask, "response_format": fmt, "temperature": 1.5,
                                      "seed": 0, "max_tokens": 120, "max_digits": 0})
    assert code == 200 and re.search(r"[0-9]{17}", reply["choices"][0]["message"]["content"]), reply
    code, _, reply = _post(stack[1], {"model": model, "messages": ask, "max_digits": 40})
    assert code == 400 and reply["error"]["param"] == "max_digits", reply


OPEN_CITY = {"type": "object", "properties": {"name": {"type": "string"}, "population": {"type": "integer"},
                                              "address": {"type": "object", "properties": {"street": {"type": "string"}},
                                                          "additionalProperties": False}},
             "required": ["name", "population"]}


def test_a_strict_schema_with_open_objects_gets_openais_400(oai, model):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "A city?"}], max_tokens=40,
                                    response_format={"type": "json_schema", "json_schema": {
                                        "name": "City", "schema": OPEN_CITY, "strict": True}})
    err = e.value.body
    assert err["param"] == "response_format" and err["code"] == "invalid_json_schema"
    assert err["message"] == ("Invalid schema for response_format 'City': In context=(), 'additionalProperties' is "
                              "required to be supplied and to be false.")
    nested = {**OPEN_CITY, "additionalProperties": False, "properties": {
        **OPEN_CITY["properties"], "address": {"type": "object", "properties": {"street": {"type": "string"}}}}}
    with pytest.raises(openai.BadRequestError, match=r"In context=\('properties', 'address'\), 'additionalProperties'"):
        oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "A city?"}], max_tokens=40,
                                    response_format={"type": "json_schema", "json_schema": {
                                        "name": "City", "schema": nested, "strict": True}})
    tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], tools=[tool],
                                    max_tokens=4)
    assert e.value.body["param"] == "tools[0].function.parameters"
    assert e.value.body["code"] == "invalid_function_parameters"


def test_a_schema_that_leaves_objects_open_gets_no_other_keys(oai, model):
    """Not strict: the same schema is served, and its objects allow only their properties."""
    for seed in range(3):
        r = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Describe a city as JSON."}],
                                        response_format={"type": "json_schema", "json_schema": {
                                            "name": "City", "schema": OPEN_CITY}},
                                        temperature=0.8, seed=seed, max_tokens=200).choices[0]
        doc = json.loads(r.message.content)
        assert r.finish_reason == "stop" and set(doc) <= set(OPEN_CITY["properties"]), doc


# ---- tools ------------------------------------------------------------------------------------------------

def _weather(extra: dict) -> dict:
    params = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
              "required": ["city"], **extra}
    return {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                             "parameters": params}}


@pytest.mark.parametrize("extra", [{}, {"additionalProperties": False}], ids=["open", "closed"])
def test_forced_and_required_calls_end_with_valid_arguments(oai, model, extra):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        for seed in range(3):
            r = oai.chat.completions.create(model=model, messages=ask, tools=[_weather(extra)], tool_choice=choice,
                                            temperature=0.8, seed=seed, max_tokens=200).choices[0]
            assert r.finish_reason == "tool_calls" and r.message.tool_calls, (choice, seed, r.message)
            for call in r.message.tool_calls:
                args = json.loads(call.function.arguments)
                assert call.function.name == "get_weather" and "city" in args and set(args) <= {"city", "unit"}


def test_auto_may_call_after_text_and_streams_the_text_before_the_call(oai, model):
    """Whatever the model chooses with auto, the answer is text, or a call (maybe after some
    text), never a half-written call; streamed, the same."""
    ask = [{"role": "user", "content": "Use the weather tool to get the weather in Berlin."}]
    for seed in range(3):
        kw = dict(model=model, messages=ask, tools=[_weather({})], tool_choice="auto", temperature=0.8, seed=seed,
                  max_tokens=80)
        m = oai.chat.completions.create(**kw).choices[0]
        if m.message.tool_calls:
            assert m.finish_reason == "tool_calls" and "<tool_call>" not in (m.message.content or "")
        else:
            assert "<tool_call>" not in m.message.content
        chunks = list(oai.chat.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        calls = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
        assert bool(calls) == bool(m.message.tool_calls) and text == (m.message.content or "")


def _chunk(text: str, finish=None):
    return SimpleNamespace(text=text, logprobs=[], finish_reason=finish)


def test_call_watch_holds_only_what_could_begin_a_call():
    w = tools_.CallWatch(forced=False)
    assert [c.text for c in w.push(_chunk("Sure"))] == ["Sure"]
    assert w.push(_chunk(", checking <tool")) == []  # "<tool" may begin a call
    assert w.push(_chunk("_call>[{\"name\": \"f\", ")) == []
    w.push(_chunk("\"arguments\": {}}]</tool_call>", "tool_calls"))
    head, calls, rest = w.finish()
    assert head == ", checking" and rest == [] and calls[0]["function"] == {"name": "f", "arguments": "{}"}
    w = tools_.CallWatch(forced=False)
    assert [c.text for c in w.push(_chunk("a < b"))] == ["a < b"]
    assert w.push(_chunk(" and <to")) == []
    assert [c.text for c in w.push(_chunk("p>"))] == [" and <to", "p>"]  # it was not a call after all
    assert w.finish() == (None, None, [])
    assert tools_.CALL_OPEN == chat.CALL_OPEN and tools_.CALL_CLOSE == chat.CALL_CLOSE  # the daemon's format


# ---- errors: one range for max_tokens, param and code everywhere ----------------------------------------------

@pytest.mark.parametrize("value", [-1, 0, CTX + 1, 1 << 31, (1 << 63) - 1, 1 << 64])
def test_max_tokens_has_one_range_and_one_message(stack, model, value):
    daemon, gw = stack
    code, _, reply = _post(gw, {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": value})
    want = f"max_tokens {value} is out of range: use 1..{CTX} (the context length)"
    assert code == 400 and reply["error"] == {"message": want, "type": "invalid_request_error", "param": "max_tokens",
                                              "code": "invalid_value"}
    if 1 <= value < 1 << 63:  # the daemon's own refusal says the same
        with Client(daemon.socket) as c, pytest.raises(Exception, match=re.escape(want)):
            c.complete("Hi", max_tokens=value)
    code, _, reply = _post(gw, {"model": model, "messages": [{"role": "user", "content": "Hi"}],
                                "max_completion_tokens": value})
    assert code == 400 and reply["error"]["param"] == "max_completion_tokens"


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "word " * 1500}]}, "messages"),
    ({"messages": [{"role": "user", "content": "Hi"}], "speculative": "warp"}, "speculative"),
    ({"messages": [{"role": "user", "content": "Hi"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"messages": [{"role": "user", "content": "Hi"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "a": {"type": "nope"}}}}}]}, "tools"),
], ids=["prompt past the context", "speculative mode", "schema", "tool schema"])
def test_the_daemons_refusals_name_the_param_and_code(stack, model, body, param):
    code, _, reply = _post(stack[1], {"model": model, "max_tokens": 4, **body})
    assert code == 400 and reply["error"]["param"] == param and reply["error"]["code"] == "invalid_value", reply
