"""Constrained decoding on the default model: the compiler's refusals (each named, hostile ones
included), valid output greedy and sampled, and speculation that stays lossless under a
constraint (ngram drafts cut where the constraint refuses them, a self-draft drawing masked)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from ntransformerd.engine.generation import constraints, speculative
from ntransformerd.engine.generation.constraints import InvalidConstraint
from ntransformerd.engine.runtime.engine import Engine, EngineConfig, generate
from ntransformerd.engine.generation.sampler import SamplingParams

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


# ---- JSON that ends: llama.cpp's bounds on numbers and whitespace, closed objects ----------------

NUMBERS = {"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": "number"}}, "required": ["n", "x"]}


def allows(compiler, engine, kind: str, constraint: str, text: str, **kw) -> bool:
    """The constraint lets `text` (as the tokenizer splits it) through, token by token."""
    c = compiler.compile(kind, constraint, **kw)
    ids = engine.tokenizer.encode(text, parse_special=False, add_special=False)
    ok = c.valid_prefix(ids) == len(ids)
    if ok:
        for t in ids:
            c.consume(t)
    return ok


def test_a_number_holds_at_most_16_digits_in_a_row_by_default(engine, compiler):
    schema = json.dumps(NUMBERS)
    assert allows(compiler, engine, "json_schema", schema, '{"n": ' + "1" * 16 + ', "x": -1' + "2" * 15 + ".5e+10}")
    assert allows(compiler, engine, "json_schema", schema, '{"n": 1, "x": 0.' + "5" * 16 + "}")
    for bad in ('{"n": ' + "1" * 100, '{"n": ' + "9" * 17, '{"n": 1, "x": 0.' + "5" * 17, '{"n": 1, "x": 1e' + "1" * 17):
        assert not allows(compiler, engine, "json_schema", schema, bad), bad
    # digits inside strings are text, not numbers
    assert allows(compiler, engine, "json_schema", json.dumps({"type": "string"}), '"' + "1" * 60 + '"')
    # a schema that only a longer number satisfies ends with an error that names the way out
    c = compiler.compile("json_schema", json.dumps({"type": "integer", "minimum": 10 ** 17}))
    for t in engine.tokenizer.encode("1" * 16, parse_special=False, add_special=False):
        c.consume(t)
    with pytest.raises(constraints.ConstraintFailed, match="more than 16 digits in a row; allow more with the "
                                                           "constraint's max_digits"):
        c.mask()


def test_max_digits_allows_more_or_no_bound(engine, compiler):
    schema, long = json.dumps(NUMBERS), '{"n": ' + "1" * 40 + ', "x": 1}'
    assert not allows(compiler, engine, "json_schema", schema, long)
    assert allows(compiler, engine, "json_schema", schema, long, max_digits=40)
    assert not allows(compiler, engine, "json_schema", schema, long, max_digits=39)
    assert allows(compiler, engine, "json_schema", schema, '{"n": ' + "1" * 100, max_digits=0)
    # a regex or grammar has no bound unless it asks for one
    assert allows(compiler, engine, "regex", "[0-9]+", "1" * 40)
    assert not allows(compiler, engine, "regex", "[0-9]+", "1" * 40, max_digits=16)
    with pytest.raises(InvalidConstraint, match=r"max_digits 5000 is out of range: use 1\.\.4096, or 0"):
        compiler.compile("json_schema", schema, max_digits=5000)


def test_json_is_laid_out_on_one_line_or_within_llama_cpps_bound(engine, compiler):
    schema = json.dumps(NUMBERS)
    assert allows(compiler, engine, "json_schema", schema, '{"n": 1, "x": 2}')  # as json.dumps writes it
    for bad in ('{"n":1', '{ "n"', '{\n"n"', '{"n":  1'):
        assert not allows(compiler, engine, "json_schema", schema, bad), bad
    # llama.cpp's bound, asked for in the schema: one space, or one newline and an indent of up to 20
    llama = json.dumps({**NUMBERS, "x-guidance": constraints.LLAMA_CPP_LAYOUT})
    for good in ('{"n":1,"x":2}', '{"n": 1, "x": 2}', '{\n  "n": 1,\n\t"x": 2\n}', '{ "n" : 1 , "x" : 2 }'):
        assert allows(compiler, engine, "json_schema", llama, good), good
    for bad in ('{"n":  1', '{\n\n"n"', '{\n' + " " * 21 + '"n"', ' {"n"'):
        assert not allows(compiler, engine, "json_schema", llama, bad), bad
    # or any whitespace, where the schema says so
    free = json.dumps({**NUMBERS, "x-guidance": {"whitespace_flexible": True}})
    assert allows(compiler, engine, "json_schema", free, '{\n\n\n    "n":    1, "x": 2}')


def test_objects_that_say_nothing_of_additional_properties_are_closed(engine, compiler):
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}}}
    text = json.dumps(schema)
    assert allows(compiler, engine, "json_schema", text, '{"a": {"b": 1}}')
    assert not allows(compiler, engine, "json_schema", text, '{"a": {"b": 1, "c"')
    assert not allows(compiler, engine, "json_schema", text, '{"a": {"b": 1}, "z"')
    opened = {**schema, "additionalProperties": True}
    assert allows(compiler, engine, "json_schema", json.dumps(opened), '{"a": {"b": 1}, "z": [1, "two"]}')
    # a free object (no properties: a map, json_object) stays free; parts of an allOf are merged, not closed
    assert allows(compiler, engine, "json_schema", '{"type": "object"}', '{"any": {"thing": 1}}')
    merged = {"allOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {"type": "integer"}}}]}
    assert allows(compiler, engine, "json_schema", json.dumps(merged), '{"a": 1, "b": 2}')


def test_the_rules_hold_in_a_grammars_json_blocks(engine, compiler):
    grammar = 'start: "call " %json ' + json.dumps(NUMBERS)
    assert allows(compiler, engine, "grammar", grammar, 'call {"n": 1, "x": 2}')
    assert not allows(compiler, engine, "grammar", grammar, 'call {"n": 1, "x": 2, "y"')
    assert not allows(compiler, engine, "grammar", grammar, 'call {"n":  1')
    assert not allows(compiler, engine, "grammar", grammar, 'call {"n": ' + "1" * 17, max_digits=16)


def test_digit_runs_agree_with_a_byte_by_byte_count(compiler, engine):
    """DigitRuns' per-token summaries give the same verdict as walking the bytes, for random
    token sequences from random states."""
    rng = np.random.default_rng(0)
    d = compiler.digits
    tok = engine.tokenizer
    pool = [i for i in range(tok.vocab_size) if any(48 <= b <= 57 or b in (34, 92) for b in tok.token_bytes(i))]
    pool += list(rng.integers(0, tok.vocab_size, 200))
    for _ in range(300):
        where, bound = int(rng.integers(0, 3)), int(rng.integers(1, 8))
        run = int(rng.integers(0, bound + 1)) if where == constraints.OUTSIDE else 0
        ids = [int(pool[i]) for i in rng.integers(0, len(pool), 6)]
        ref_where, ref_run, ok = where, run, True
        state = (where, run)
        for t in ids:
            allowed = bool(d.allowed(*state, bound)[t])
            data = b"" if tok.is_control(t) else tok.token_bytes(t)
            for b in data:  # the reference: byte by byte
                if ref_where == constraints.OUTSIDE:
                    if 48 <= b <= 57:
                        ref_run += 1
                        ok &= ref_run <= bound
                        continue
                    ref_run, ref_where = 0, constraints.STRING if b == 34 else constraints.OUTSIDE
                elif ref_where == constraints.STRING:
                    ref_where = {92: constraints.ESCAPE, 34: constraints.OUTSIDE}.get(b, constraints.STRING)
                else:
                    ref_where = constraints.STRING
            assert allowed == ok, (ids, t)
            if not ok:
                break
            state = d.after(*state, t)
            assert state == (ref_where, ref_run if ref_where == constraints.OUTSIDE else 0), (ids, t)


def test_sampled_numbers_end(engine, compiler):
    """An integer at temperature 1.5: without the bound the model runs on in digits; with it
    every answer is a number of at most 16 digits."""
    for seed in range(3):
        params = SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=seed, max_tokens=40)
        text, _, reason = run(engine, compiler, "json_schema", '{"type": "integer"}', params,
                              prompt="Write a very long number.")
        assert reason in ("stop", "eos") and len(text.lstrip("-")) <= 16 and int(text) is not None, text
