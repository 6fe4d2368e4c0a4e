"""Structured output, tool calls and log-probabilities through ntx-openai with the official `openai`
package: client.chat.completions.parse with Pydantic models, a tool-call round trip streamed and
not with each tool_choice, logprobs on both endpoints (echo against perplexity), and bad input
refused with a clear 400 while the daemon serves on."""

from __future__ import annotations

import concurrent.futures
import enum
import json
from typing import Literal, Optional

import openai
import pydantic
import pytest
from pydantic import BaseModel, Field

from ntransformerd.engine.runtime.engine import Engine, EngineConfig
from ntransformerd.engine.calibration.perplexity import perplexity

API_KEY = "sk-test-structured"


@pytest.fixture(scope="module")
def stack(stack_with):
    with stack_with(API_KEY, "--max-queue", "64", "--max-ctx", "2048", "--prefill-chunk", "128", "--speculative", "off") as s:
        yield s


@pytest.fixture(scope="module")
def oai(stack):
    return openai.OpenAI(base_url=stack[1].url, api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


# ---- twenty Pydantic models: nested objects, arrays, enums, optional fields, bounded numbers ----------

Name = Field(max_length=16)


class Colour(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Point(BaseModel):
    x: int = Field(ge=-100, le=100)
    y: int = Field(ge=-100, le=100)


class Person(BaseModel):
    name: str = Name
    age: int = Field(ge=0, le=120)


class City(BaseModel):
    name: str = Name
    population: int = Field(ge=0)
    capital: bool


class Book(BaseModel):
    title: str = Name
    year: int = Field(ge=1400, le=2030)
    rating: float = Field(ge=0, le=5)


class Pet(BaseModel):
    name: str = Name
    kind: Literal["cat", "dog", "fish"]


class Owner(BaseModel):
    person: Person
    pets: list[Pet] = Field(max_length=2)


class Paint(BaseModel):
    colour: Colour
    litres: float = Field(gt=0, le=20)


class Line(BaseModel):
    start: Point
    end: Point


class Weather(BaseModel):
    city: str = Name
    celsius: float = Field(ge=-60, le=60)
    sky: Literal["clear", "cloudy", "rain", "snow"]


class Tags(BaseModel):
    tags: list[str] = Field(max_length=3)


class Nickname(BaseModel):
    name: str = Name
    nickname: Optional[str] = Field(default=None, max_length=12)


class Order(BaseModel):
    item: str = Name
    quantity: int = Field(ge=1, le=10)
    express: bool


class Team(BaseModel):
    name: str = Name
    members: list[Person] = Field(max_length=2)


class Score(BaseModel):
    home: int = Field(ge=0, le=20)
    away: int = Field(ge=0, le=20)


class Flag(BaseModel):
    country: str = Name
    colours: list[Colour] = Field(max_length=3)


class Meal(BaseModel):
    dish: str = Name
    vegetarian: bool
    calories: int = Field(ge=0, le=3000)


class Temperature(BaseModel):
    unit: Literal["C", "F"]
    value: float = Field(ge=-100, le=150)


class Polygon(BaseModel):
    corners: list[Point] = Field(max_length=3)


class Address(BaseModel):
    street: str = Name
    number: int = Field(ge=1, le=999)
    city: City


class Review(BaseModel):
    book: Book
    stars: int = Field(ge=1, le=5)
    comment: Optional[str] = Field(default=None, max_length=20)


MODELS = [Point, Person, City, Book, Pet, Owner, Paint, Line, Weather, Tags, Nickname, Order, Team, Score, Flag,
          Meal, Temperature, Polygon, Address, Review]


def parse(oai, model, cls, **kw):
    return oai.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": f"Give an example of a {cls.__name__} as JSON."}],
        response_format=cls, max_tokens=200, **kw)


def test_twenty_pydantic_models_parse_sampled(oai, model):
    assert len(MODELS) == 20
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        futs = {cls: pool.submit(parse, oai, model, cls, temperature=0.8, seed=i) for i, cls in enumerate(MODELS)}
        for cls, f in futs.items():
            r = f.result()
            parsed = r.choices[0].message.parsed
            assert isinstance(parsed, cls), (cls, r.choices[0].message.content)
            cls.model_validate_json(r.choices[0].message.content)  # the text itself is valid too
            assert r.choices[0].finish_reason == "stop"


def test_speculative_ngram_gives_the_same_greedy_structured_output(oai, model):
    def both(cls):
        plain = parse(oai, model, cls, temperature=0)
        spec = parse(oai, model, cls, temperature=0, extra_body={"speculative": "ngram"})
        return plain.choices[0].message.content, spec.choices[0].message.content
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        for cls, (plain, spec) in zip(MODELS, pool.map(both, MODELS)):
            assert plain == spec, cls
            cls.model_validate_json(plain)


def test_json_object_mode(oai, model):
    ask = [{"role": "user", "content": "Reply with a JSON object with a cat's name and age."}]
    r = oai.chat.completions.create(model=model, messages=ask, response_format={"type": "json_object"},
                                    max_tokens=200, temperature=0)
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)


# ---- tool calls -----------------------------------------------------------------------------------------

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 20}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def get_weather(city: str, unit: str = "celsius") -> str:
    return json.dumps({"city": city, "temperature": 18, "unit": unit, "sky": "clear"})


def call_weather(oai, model, stream: bool, max_tokens: int = 60, **kw):
    """(tool_calls as (id, name, arguments), finish_reason, text) of one request."""
    req = dict(model=model, messages=ASK, tools=[WEATHER_TOOL, TIME_TOOL], max_tokens=max_tokens, temperature=0, **kw)
    if not stream:
        r = oai.chat.completions.create(**req)
        m = r.choices[0].message
        return [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or []], \
            r.choices[0].finish_reason, m.content
    calls, finish, text = {}, None, []
    for chunk in oai.chat.completions.create(stream=True, **req):
        ch = chunk.choices[0]
        text.append(ch.delta.content or "")
        for d in ch.delta.tool_calls or []:
            c = calls.setdefault(d.index, ["", "", ""])
            c[0] += d.id or ""
            c[1] += d.function.name or ""
            c[2] += d.function.arguments or ""
        finish = ch.finish_reason or finish
    return [tuple(c) for _, c in sorted(calls.items())], finish, "".join(text) or None


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_call_round_trip(oai, model, stream):
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        calls, finish, text = call_weather(oai, model, stream, tool_choice=choice, parallel_tool_calls=False)
        assert finish == "tool_calls" and text is None and len(calls) == 1, (choice, calls, text)
        call_id, name, args = calls[0]
        assert call_id.startswith("call_") and name == "get_weather"
        parsed = json.loads(args)
        assert set(parsed) <= {"city", "unit"} and isinstance(parsed["city"], str) and len(parsed["city"]) <= 20
        assert parsed.get("unit", "celsius") in ("celsius", "fahrenheit")
    # our function's result goes back as role "tool"; the final answer is text
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}]},
        {"role": "tool", "tool_call_id": call_id, "content": get_weather(**parsed)}]
    req = dict(model=model, messages=history, tools=[WEATHER_TOOL], tool_choice="none", max_tokens=16, temperature=0)
    if stream:
        pieces = list(oai.chat.completions.create(stream=True, **req))
        answer = "".join(p.choices[0].delta.content or "" for p in pieces if p.choices)
        assert not any(p.choices[0].delta.tool_calls for p in pieces if p.choices)
    else:
        m = oai.chat.completions.create(**req).choices[0].message
        answer = m.content
        assert not m.tool_calls
    assert isinstance(answer, str) and answer.strip()
    # auto: a call that parses, or plain text (which never holds half a call); never anything else
    calls, finish, text = call_weather(oai, model, stream, tool_choice="auto", max_tokens=40)
    if calls:
        assert finish == "tool_calls" and all(n in ("get_weather", "get_time") and isinstance(json.loads(a), dict)
                                              for _, n, a in calls)
    else:
        assert finish in ("stop", "length") and text and "<tool_call>" not in text


def test_parallel_calls_and_none(oai, model):
    calls, finish, _ = call_weather(oai, model, False, tool_choice="required")
    assert finish == "tool_calls" and len(calls) >= 1
    calls, finish, text = call_weather(oai, model, False, tool_choice="none", max_tokens=12)
    assert not calls and finish in ("stop", "length") and text


# ---- log-probabilities ------------------------------------------------------------------------------------

def test_chat_logprobs_streamed_and_not(oai, model):
    req = dict(model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0,
               logprobs=True, top_logprobs=3)
    whole = oai.chat.completions.create(**req).choices[0]
    content = whole.logprobs.content
    assert len(content) == 8 and "".join(t.token for t in content) == whole.message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob)  # greedy: the chosen one is the likeliest
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token
    streamed = [c.choices[0].logprobs.content for c in oai.chat.completions.create(stream=True, **req)
                if c.choices and c.choices[0].logprobs]
    flat = [t for part in streamed for t in part]
    assert [(t.token, round(t.logprob, 6)) for t in flat] == [(t.token, round(t.logprob, 6)) for t in content]


def test_completion_echo_logprobs_sum_to_perplexity(oai, model, stack):
    text = ("The river runs past the mill and under the old stone bridge, where children throw sticks into "
            "the water and race to see whose stick comes out first.")
    r = oai.completions.create(model=model, prompt=text, max_tokens=1, temperature=0, logprobs=1, echo=True)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(text)
    engine = Engine.load(None, config=EngineConfig(backend="cpu", max_batch=1, max_ctx=512, prefill_chunk=128))
    ids = engine.tokenizer.encode(text, parse_special=False, add_special=True)
    n = len(ids)
    assert len(lp.tokens) == n + 1 and lp.token_logprobs[0] is None and all(x is not None for x in lp.token_logprobs[1:])
    ppl = perplexity(engine, ids, ctx=n)
    scored = lp.token_logprobs[n // 2 + 1:n]
    assert len(scored) == ppl.tokens_scored
    assert -sum(scored) == pytest.approx(ppl.nll * ppl.tokens_scored, rel=1e-3)
    streamed = list(oai.completions.create(model=model, prompt=text, max_tokens=3, temperature=0, logprobs=2,
                                           echo=True, stream=True))
    assert "".join(c.choices[0].text for c in streamed).startswith(text)
    tokens = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert len(tokens) == n + 3 and tokens[0] is None
    offsets = [o for c in streamed if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    pieces = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert offsets == [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]


# ---- bad input --------------------------------------------------------------------------------------------

def test_bad_schemas_are_a_clear_400(stack, oai, model):
    _, gw = stack
    nested = '{"type": "object", "properties": {"a": ' * 10_000 + '{"type": "object"}' + "}}" * 10_000
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "JSON schema cannot be compiled"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "nope"}}}}}], "tool_choice": "required"},
         "cannot be compiled"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "string", "pattern": "(a"}}}}}]}, "cannot be compiled"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100}
                                             for i in range(12_000)}}}}]},
         r"'tools' is too large: constraint.grammar is [\d,]+ bytes; the daemon takes at most 1 MiB"),
    ]
    for extra, message in cases:
        with pytest.raises(openai.BadRequestError, match=message):
            oai.chat.completions.create(model=model, messages=ASK, max_tokens=4, **extra)
    body = (json.dumps({"model": model, "messages": ASK, "response_format": {
        "type": "json_schema", "json_schema": {"name": "deep", "schema": "SCHEMA"}}}).replace('"SCHEMA"', nested))
    status, _, reply = gw.request("POST", "/v1/chat/completions", body.encode(),
                                  {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    assert status == 400 and "nested too deeply" in reply["error"]["message"], reply
    r = oai.chat.completions.create(model=model, messages=ASK, max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


def test_a_schema_over_one_mib_is_a_400_naming_the_field_and_the_limit(stack, oai, model):
    """5 MB of schema (under the 8 MiB body limit, over gRPC's 4 MiB message limit): refused here by
    name, as the daemon would refuse anything over 1 MiB, on both endpoints."""
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 90}
                                            for i in range(50_000)}}
    assert len(json.dumps(big)) > 5_000_000
    fmt = {"type": "json_schema", "json_schema": {"name": "big", "schema": big}}
    message = (r"'response_format' is too large: constraint.json_schema is [\d,]+ bytes; the daemon takes at most "
               r"1 MiB \(1,048,576 bytes\) of constraint text: shorten or simplify it")
    for create in (lambda: oai.chat.completions.create(model=model, messages=ASK, max_tokens=2, response_format=fmt),
                   lambda: oai.completions.create(model=model, prompt="Hi", max_tokens=2,
                                                  extra_body={"response_format": fmt})):
        with pytest.raises(openai.BadRequestError, match=message) as e:
            create()
        assert e.value.body["param"] == "response_format"
    r = oai.chat.completions.create(model=model, messages=ASK, max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2
