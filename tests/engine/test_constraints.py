"""Constrained decoding on the default model: the compiler's refusals (each named, hostile ones
included), valid output greedy and sampled, and speculation that stays lossless under a
constraint (ngram drafts cut where the constraint refuses them, a self-draft drawing masked)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from ntransformerd.engine import constraints, speculative
from ntransformerd.engine.constraints import InvalidConstraint
from ntransformerd.engine.engine import Engine, EngineConfig, generate
from ntransformerd.engine.sampler import SamplingParams

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pets"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pets": {"type": "array", "maxItems": 3, "items": {"enum": ["cat", "dog", "fish"]}}}}


@pytest.fixture(scope="module")
def engine(default_model):
    return Engine(default_model, config=EngineConfig(backend="cpu", max_batch=4, max_ctx=512))


@pytest.fixture(scope="module")
def compiler(engine):
    return constraints.compiler_for(engine.tokenizer, engine.cfg.vocab_size)


def chat(engine, text: str) -> list[int]:
    return engine.encode_chat([{"role": "user", "content": text}])


def run(engine, compiler, kind, text, params, prompt="Describe a person as JSON.", spec=None) -> tuple[str, list, str]:
    c = compiler.compile(kind, text)
    ids = chat(engine, prompt)
    events = list(generate(engine, ids, params, constraint=c) if spec is None
                  else speculative.generate(engine, ids, params, spec, constraint=c))
    return "".join(e.text for e in events), [e.token for e in events], events[-1].finish_reason


def check_person(doc: dict) -> None:
    assert set(doc) == {"name", "age", "pets"} and isinstance(doc["name"], str) and len(doc["name"]) <= 20
    assert isinstance(doc["age"], int) and 0 <= doc["age"] <= 120
    assert len(doc["pets"]) <= 3 and set(doc["pets"]) <= {"cat", "dog", "fish"}


def test_compiler_refusals_name_the_cause(compiler):
    cases = [("json_schema", '{"type": "nope"}', r"JSON schema cannot be compiled: .*nope"),
             ("json_schema", '{"type": ', r"JSON schema cannot be read"),
             ("json_schema", "[1, 2]", r"must be a JSON object"),
             ("regex", "(a", r"(?s)regular expression cannot be compiled: .*unclosed group"),
             ("grammar", "start: undefined_rule", r"grammar cannot be compiled"),
             ("grammar", "root ::= (", r"grammar"),
             ("regex", "   ", r"regular expression is empty"),
             ("xml", "<a/>", r"kind 'xml' is not one of json_schema, regex, grammar")]
    for kind, text, message in cases:
        with pytest.raises(InvalidConstraint, match=message):
            compiler.compile(kind, text)


@pytest.mark.timeout(300)  # a hang guard: an unbounded compile would never end
def test_hostile_constraints_are_refused_or_compiled(compiler):
    nested = '{"type": "object", "properties": {"a": ' * 10_000 + '{"type": "string"}' + "}}" * 10_000
    huge = "start: " + " | ".join(f'"word{i}"' for i in range(600_000))  # over 5 MB of grammar
    assert len(huge) > 5_000_000
    for kind, text, message in [("json_schema", nested, r"nest|deep"),
                                ("grammar", huge, r"is [\d,]+ bytes; at most 1 MiB \(1,048,576 bytes\)")]:
        with pytest.raises(InvalidConstraint, match=message):
            compiler.compile(kind, text)
    # exponential as a backtracking regex; compiled lazily it is cheap: refused or compiled, it ends
    for regex in ("(a|aa)*(a|aa)*(a|aa)*b", "((x+x+)+y)" * 50, "(a{1,100}){1,100}{1,100}"):
        try:
            c = compiler.compile("regex", regex)
            for _ in range(3):
                c.mask()
        except InvalidConstraint:
            pass


def test_greedy_json_schema_output_is_valid_and_ends(engine, compiler):
    text, tokens, reason = run(engine, compiler, "json_schema", json.dumps(PERSON), SamplingParams.greedy(max_tokens=80))
    check_person(json.loads(text))
    assert reason in ("stop", "eos")


def test_sampled_outputs_are_valid_for_every_seed(engine, compiler):
    for seed in range(3):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=80)
        text, _, reason = run(engine, compiler, "json_schema", json.dumps(PERSON), params)
        check_person(json.loads(text))


def test_regex_and_gbnf_grammar(engine, compiler):
    text, _, _ = run(engine, compiler, "regex", r"[0-9]{3}-[0-9]{4}", SamplingParams.greedy(max_tokens=20),
                     prompt="Give me a phone number.")
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", text), text
    gbnf = 'root ::= "The answer is " ("yes" | "no") "."'
    text, _, reason = run(engine, compiler, "grammar", gbnf, SamplingParams.greedy(max_tokens=20),
                          prompt="Is the sky blue?")
    assert text in ("The answer is yes.", "The answer is no."), text
    assert reason == "stop"


def test_speculation_under_a_constraint_is_lossless(engine, compiler):
    """Greedy with ngram drafts (cut where the constraint refuses) and with a self-draft of the
    first layers (drawing masked) gives plain constrained greedy's tokens."""
    schema = json.dumps(PERSON)
    params = SamplingParams.greedy(max_tokens=60)
    _, plain, _ = run(engine, compiler, "json_schema", schema, params)
    for mode in ("ngram", "prefix:10"):
        spec = speculative.Speculator(engine, speculative.make_draft(mode, engine),
                                      costs=speculative.StepCosts({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0, 16: 1.0}))
        _, tokens, _ = run(engine, compiler, "json_schema", schema, params, spec=spec)
        assert tokens == plain, mode
        assert spec.passes > 0 and spec.proposed > 0, mode


def test_drafts_are_cut_at_the_first_refused_token(engine, compiler):
    c = compiler.compile("regex", r"[0-9]+")
    tok = engine.tokenizer
    digits = tok.encode("123", parse_special=False, add_special=False)
    word = tok.encode("abc", parse_special=False, add_special=False)
    assert c.valid_prefix(digits + word + digits) == len(digits)
    masks = c.masks(digits)
    assert len(masks) == len(digits) + 1 and all(m[d] for m, d in zip(masks, digits))
    assert not masks[0][word[0]]
    assert c.mask()[digits[0]]  # the state is where it was
