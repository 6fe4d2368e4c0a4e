"""Constrained decoding: the output must be JSON valid against a schema, a match of a regular
expression, or a sentence of a grammar (Lark, or GBNF as llama.cpp writes it).

    compiler = compiler_for(engine.tokenizer, engine.cfg.vocab_size)   # once per tokenizer
    c = compiler.compile("json_schema", text)     # InvalidConstraint naming the fault
    mask = c.mask()                               # bool (V,): ids that may come next
    c.consume(token)                              # after each drawn token
    c.stopped                                     # complete, and nothing more may follow

llguidance (bench/RESULTS.md, "Constrained decoding: the library") compiles the constraint
lazily against a token trie of the vocabulary, so a mask costs tens of microseconds and
compiling a large schema a few milliseconds; its parser limits bound the work per compile and
per token, so a hostile schema, regex or grammar costs a bounded time and ends as an error.

End of generation: the model's end-of-generation ids are allowed exactly where the constraint
may end. Speculation: `valid_prefix` cuts a deterministic draft at its first token the
constraint refuses, and `masks` gives the mask after each draft token for the verify step, so
the verified tokens are drawn from the same masked distributions as plain decoding.

JSON that ends. Every JSON schema compiled here, a json_schema constraint or a `%json {...}`
block inside a grammar, gets the bounds llama.cpp's JSON grammar has, so a sampled small model
cannot wander on until max_tokens:
- whitespace: JSON on one line as json.dumps writes it (a space after "," and ":"), within
  llama.cpp's bound (at most one " ", or a newline and up to 20 spaces or tabs). A schema's own
  "x-guidance" options (llguidance's whitespace_flexible, whitespace_pattern, separators; the
  values of LLAMA_CPP_LAYOUT give llama.cpp's own) replace it;
- numbers: at most MAX_DIGITS (16) digits in a row outside strings: an integral part, a fraction
  and an exponent of up to 16 digits each. llguidance has no option for it, so DigitRuns masks
  it beside the grammar. Constraint.max_digits in the API sets another bound, 0 none;
- objects: a schema with "properties" and no "additionalProperties" gets none (closed, as in
  llama.cpp's grammar), so the model cannot add keys without end; say
  `"additionalProperties": true` to allow them.

Thread rule: a Compiler may be shared by threads (it is read-only after construction); a
Constraint belongs to one sequence and to the thread that owns it (the scheduler's).
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Sequence

import llguidance
import numpy as np

from ntransformerd.engine.generation.sampler import RequestCannotGoOn

KINDS = ("json_schema", "regex", "grammar")
# A schema, regex or grammar; a larger one is refused before compiling. The API's limit (proto
# Constraint): the client library (ntx_client.client) and the OpenAI gateway refuse it before sending.
MAX_CONSTRAINT_BYTES = 1 << 20
MAX_JSON_DEPTH = 64  # nesting of a JSON schema document (llguidance's own parser stops at 128)
# llguidance's limits, tighter than its defaults where a request could make the daemon work long:
# lexer fuel ~50k/ms to build, ~14k/ms per token; Earley items ~20k/ms per token.
LIMITS = dict(max_items_in_row=2000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
              max_lexer_states=100_000, max_grammar_size=200_000, verbose_errors=False)
# JSON as json.dumps writes it, on one line: one space after "," and ":", none elsewhere, within
# llama.cpp's bound and the layout a small sampled model keeps to best (bench/RESULTS.md). A
# schema's own "x-guidance" options replace it; LLAMA_CPP_LAYOUT is llama.cpp's own bound,
# `| " " | "\n" [ \t]{0,20}` wherever JSON allows whitespace (llguidance matches it once there).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
LLAMA_CPP_LAYOUT = {"whitespace_pattern": r"( |\n[ \t]{0,20})", "item_separator": ",", "key_separator": ":"}
MAX_DIGITS = 16  # digits in a row outside JSON strings (llama.cpp: integral part, fraction, exponent)
MAX_DIGITS_LIMIT = 4096  # the most a request may ask for (Constraint.max_digits)
SPECIAL_PREFIX = b"\xff"  # how llguidance tells a special token's text from plain bytes


class InvalidConstraint(ValueError):
    """A schema, regex or grammar the compiler refuses; the message is the compiler's."""


class Compiler:
    """The model's vocabulary as llguidance sees it, and compilation against it."""

    def __init__(self, tokenizer, vocab_size: int):
        self.vocab_size = vocab_size
        n = min(tokenizer.vocab_size, vocab_size)
        tokens = []
        for i in range(n):
            if tokenizer.is_control(i):  # special: matched only as a whole, never inside text
                tokens.append(SPECIAL_PREFIX + tokenizer.token_text(i).encode())
            else:
                tokens.append(tokenizer.token_bytes(i))
        tokens += [b""] * (vocab_size - n)  # output rows past the tokenizer's ids: never allowed
        eog = sorted(i for i in tokenizer.eog_ids if i < vocab_size)
        wrapper = _Vocabulary(tokens, eog[0], tokenizer.bos_id, [i for i in range(n) if tokenizer.is_control(i)],
                              tokenizer)
        self.tokenizer = llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eog)
        self.limits = llguidance.LLParserLimits(**LIMITS)
        self.eog_ids = eog
        self.digits = DigitRuns(tokens)

    def compile(self, kind: str, text: str, *, max_digits: int | None = None) -> "Constraint":
        """A fresh Constraint of `kind` (json_schema | regex | grammar) from its text;
        InvalidConstraint with the reason where it cannot be compiled. max_digits: the most
        digits in a row outside JSON strings (None: MAX_DIGITS for a JSON schema, no bound for a
        regex or grammar; 0: no bound)."""
        if kind not in KINDS:
            raise InvalidConstraint(f"constraint kind {kind!r} is not one of {', '.join(KINDS)}")
        if not isinstance(text, str) or not text.strip():
            raise InvalidConstraint(f"the {_NAMES[kind]} is empty")
        size = len(text.encode())
        if size > MAX_CONSTRAINT_BYTES:
            raise InvalidConstraint(f"the {_NAMES[kind]} is {size:,} bytes; at most {MAX_CONSTRAINT_BYTES >> 20} MiB "
                                    f"({MAX_CONSTRAINT_BYTES:,} bytes) are compiled: shorten or simplify it")
        if max_digits is None:
            max_digits = MAX_DIGITS if kind == "json_schema" else 0
        if not 0 <= max_digits <= MAX_DIGITS_LIMIT:
            raise InvalidConstraint(f"max_digits {max_digits} is out of range: use 1..{MAX_DIGITS_LIMIT}, or 0 for no "
                                    "bound")
        try:
            if kind == "json_schema":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(json_rules(_schema(json.loads(text))))
            elif kind == "regex":
                grammar = llguidance.grammar_from("regex", text)
            else:
                grammar = llguidance.grammar_from("grammar", _json_blocks(text))
        except RecursionError:
            raise InvalidConstraint(f"the {_NAMES[kind]} is nested too deeply to read: flatten it") from None
        except (ValueError, TypeError) as e:  # json.JSONDecodeError included
            if isinstance(e, InvalidConstraint):
                raise
            raise InvalidConstraint(f"the {_NAMES[kind]} cannot be read: {e}") from None
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        if matcher.is_error():
            raise InvalidConstraint(f"the {_NAMES[kind]} cannot be compiled: {matcher.get_error()}")
        return Constraint(matcher, self.vocab_size, kind, self.digits if max_digits else None, max_digits)


_NAMES = {"json_schema": "JSON schema", "regex": "regular expression", "grammar": "grammar"}


def _schema(schema):
    """A parsed JSON schema document, checked: an object (or true/false), at most MAX_JSON_DEPTH deep."""
    depth = _depth(schema)
    if depth > MAX_JSON_DEPTH:
        raise InvalidConstraint(f"the JSON schema nests {depth} levels deep; at most {MAX_JSON_DEPTH} are compiled: "
                                "flatten it (use $defs and $ref for recursion)")
    if not isinstance(schema, (dict, bool)):
        raise InvalidConstraint("the JSON schema must be a JSON object (or true/false)")
    return schema


def json_rules(schema):
    """The schema as compiled (module docstring, "JSON that ends"): objects with properties and
    no additionalProperties closed, JSON_LAYOUT under its own "x-guidance" options."""
    if not isinstance(schema, dict):
        return schema
    schema = _closed(schema)
    own = schema.get("x-guidance")
    own = own if isinstance(own, dict) else {}
    return {**schema, "x-guidance": {**JSON_LAYOUT, **own}}  # a whitespace_pattern of its own overrides ours


# keywords whose value is a schema, a list of schemas, or a map of names to schemas
_ONE = ("additionalProperties", "items", "additionalItems", "contains", "propertyNames", "not", "if", "then", "else",
        "unevaluatedItems", "unevaluatedProperties")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _closed(node, in_all_of: bool = False):
    """A copy of a schema with every object that lists properties, says nothing of
    additionalProperties and is not one part of an allOf (whose parts are merged) closed."""
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = _closed(out[key])
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [_closed(s, key == "allOf") for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(s) for name, s in out[key].items()}
    if "properties" in out and not in_all_of and not any(
            k in out for k in ("additionalProperties", "unevaluatedProperties")):
        out["additionalProperties"] = False
    return out


def _json_blocks(grammar: str) -> str:
    """The grammar with json_rules applied to each `%json {...}` schema in it."""
    out, pos, decoder = [], 0, json.JSONDecoder()
    while (at := grammar.find("%json", pos)) >= 0:
        start = at + len("%json")
        while start < len(grammar) and grammar[start] in " \t\r\n":
            start += 1
        try:
            schema, end = decoder.raw_decode(grammar, start)
        except ValueError:  # not a schema here: llguidance says what is wrong, if anything
            out.append(grammar[pos:start])
            pos = start
            continue
        out += [grammar[pos:start], json.dumps(json_rules(_schema(schema)))]
        pos = end
    out.append(grammar[pos:])
    return "".join(out)


def _depth(doc, limit: int = MAX_JSON_DEPTH + 1) -> int:
    """Nesting depth of a parsed JSON document, counted up to `limit` (without recursion)."""
    deepest, stack = 0, [(doc, 1)]
    while stack:
        node, d = stack.pop()
        deepest = max(deepest, d)
        if d >= limit:
            return d
        if isinstance(node, dict):
            stack += [(v, d + 1) for v in node.values()]
        elif isinstance(node, list):
            stack += [(v, d + 1) for v in node]
    return deepest


class _Vocabulary:
    """What llguidance.LLTokenizer reads from a tokenizer (its TokenizerWrapper protocol)."""

    def __init__(self, tokens: list[bytes], eos: int, bos: int | None, special: list[int], tokenizer):
        self.tokens, self.eos_token_id, self.bos_token_id = tokens, eos, bos
        self.special_token_ids = special
        self.is_tokenizer_wrapper = True  # what LLTokenizer checks for
        self._tok = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tok.encode(text if isinstance(text, str) else text.decode("utf-8", "replace"),
                                parse_special=False, add_special=False)


# Where a byte stream is, for DigitRuns: outside strings (with the digits in a row so far), inside
# a string, or right after a backslash inside one.
OUTSIDE, STRING, ESCAPE = 0, 1, 2


class DigitRuns:
    """What each token does to the runs of digits outside JSON strings, so that a mask can bound
    them in one comparison over the vocabulary.

    For each token and each place it may start (OUTSIDE, STRING, ESCAPE): `lead`, the digits it
    starts with when it starts outside (they continue the run before it); `inner`, the longest
    run it holds after those; `end`, where it leaves the stream; `run`, the digits it ends with
    outside. A token of digits only (`lead` = its length, `whole`) continues the run. Special
    tokens (end of generation) touch nothing. Read-only after construction."""

    def __init__(self, tokens: list[bytes]):
        n = len(tokens)
        self.lead = np.zeros(n, np.int32)
        self.whole = np.zeros(n, bool)
        self.inner = np.zeros((3, n), np.int32)
        self.end = np.zeros((3, n), np.int8)
        self.run = np.zeros((3, n), np.int32)
        for i, t in enumerate(tokens):
            if not t or t.startswith(SPECIAL_PREFIX):
                self.end[:, i] = (OUTSIDE, STRING, ESCAPE)
                self.whole[i] = True  # adds no digit: an outside run goes on unchanged
                continue
            for start in (OUTSIDE, STRING, ESCAPE):
                lead, inner, end, run = _scan(t, start)
                self.inner[start, i], self.end[start, i], self.run[start, i] = inner, end, run
                if start == OUTSIDE:
                    self.lead[i], self.whole[i] = lead, lead == len(t)

    def allowed(self, where: int, run: int, bound: int) -> np.ndarray:
        """bool (V,): the tokens that keep every run within `bound` from (where, run)."""
        ok = self.inner[where] <= bound
        if where == OUTSIDE:
            ok &= self.lead + run <= bound
        return ok

    def after(self, where: int, run: int, token: int) -> tuple[int, int]:
        """(where, run) after `token`."""
        if where == OUTSIDE and self.whole[token]:
            return OUTSIDE, run + int(self.lead[token])
        return int(self.end[where, token]), int(self.run[where, token])


def _scan(data: bytes, where: int) -> tuple[int, int, int, int]:
    """(lead, inner, end, run) of `data` starting at `where` (DigitRuns)."""
    lead, inner, run, leading = 0, 0, 0, where == OUTSIDE
    for b in data:
        if where == OUTSIDE:
            if 48 <= b <= 57:
                if leading:
                    lead += 1
                else:
                    run += 1
                    inner = max(inner, run)
                continue
            leading, run = False, 0
            if b == 34:  # '"'
                where = STRING
        elif where == STRING:
            where = ESCAPE if b == 92 else OUTSIDE if b == 34 else STRING  # '\\', '"'
        else:
            where = STRING
    return lead, inner, where, run if not leading else 0


class ConstraintFailed(RequestCannotGoOn):
    """A token the constraint refuses was pushed (a caller's bug: every path masks first), or
    the output can go on only past the bound on digits."""


class Constraint:
    """One sequence's progress through a compiled constraint (an llguidance matcher), with the
    bound on runs of digits beside it where there is one (DigitRuns' (where, run) after the
    tokens consumed so far)."""

    def __init__(self, matcher, vocab_size: int, kind: str, digits: DigitRuns | None = None, max_digits: int = 0):
        self.matcher, self.vocab_size, self.kind = matcher, vocab_size, kind
        self.digits, self.max_digits = digits, max_digits
        self._state = (OUTSIDE, 0)
        self._words = (vocab_size + 31) // 32
        self._bits = np.zeros((1, self._words), dtype=np.int32)

    def mask(self) -> np.ndarray:
        """bool (V,): the ids that may come next."""
        return self._mask(self._state)

    def masks(self, drafts: Sequence[int]) -> list[np.ndarray]:
        """The mask before each of drafts and after the last: len(drafts) + 1 rows. The drafts
        must be valid (valid_prefix); the state is the same afterwards."""
        out, state, pushed = [self._mask(self._state)], self._state, 0
        try:
            for t in drafts:
                state = self._push(int(t), state)
                pushed += 1
                out.append(self._mask(state))
        finally:
            if pushed:
                self.matcher.rollback(pushed)
        return out

    def mask_after(self, tokens: Sequence[int]) -> np.ndarray:
        """The mask after valid `tokens` (a model draft's own tokens so far); the state is the
        same afterwards."""
        state, pushed = self._state, 0
        try:
            for t in tokens:
                state = self._push(int(t), state)
                pushed += 1
            return self._mask(state)
        finally:
            if pushed:
                self.matcher.rollback(pushed)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of tokens, in order, the constraint allows from here."""
        n = self.matcher.validate_tokens([int(t) for t in tokens]) if len(tokens) else 0
        state = self._state
        for i, t in enumerate(tokens[:n]):
            if not self._within(state, int(t)):
                return i
            state = self._after(state, int(t))
        return n

    def consume(self, token: int) -> None:
        self._state = self._push(int(token), self._state)

    def _push(self, token: int, state: tuple[int, int]) -> tuple[int, int]:
        """Consume `token` in the matcher; the digit state after it (ConstraintFailed if refused)."""
        if not self._within(state, token):
            raise ConstraintFailed(f"token {token} makes a run of more than {self.max_digits} digits")
        if not self.matcher.consume_token(token):
            raise ConstraintFailed(f"token {token} is not allowed by the {_NAMES[self.kind]}: "
                                   f"{self.matcher.get_error()}")
        return self._after(state, token)

    def _within(self, state: tuple[int, int], token: int) -> bool:
        if self.digits is None:
            return True
        where, run = state
        d, bound = self.digits, self.max_digits
        return bool(d.inner[where, token] <= bound and (where != OUTSIDE or d.lead[token] + run <= bound))

    def _after(self, state: tuple[int, int], token: int) -> tuple[int, int]:
        return state if self.digits is None else self.digits.after(*state, token)

    def _mask(self, state: tuple[int, int]) -> np.ndarray:
        """The matcher's mask now, within the digit bound from `state`."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        self._check()
        mask = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:self.vocab_size].astype(bool)
        if self.digits is None:
            return mask
        bounded = mask & self.digits.allowed(*state, self.max_digits)
        if mask.any() and not bounded.any():
            raise ConstraintFailed(f"the {_NAMES[self.kind]} goes on only with more than {self.max_digits} digits "
                                   "in a row; allow more with the constraint's max_digits (0: no bound)")
        return bounded

    @property
    def stopped(self) -> bool:
        """The output is complete and nothing may follow (only end of generation)."""
        return self.matcher.is_stopped()

    def _check(self) -> None:
        if self.matcher.is_error():
            raise ConstraintFailed(f"the {_NAMES[self.kind]} failed: {self.matcher.get_error()}")


_compilers: "weakref.WeakKeyDictionary[object, Compiler]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def compiler_for(tokenizer, vocab_size: int) -> Compiler:
    """The Compiler of a tokenizer, built on first use (about a second for a 50k vocabulary)."""
    with _lock:
        c = _compilers.get(tokenizer)
        if c is None or c.vocab_size != vocab_size:
            c = _compilers[tokenizer] = Compiler(tokenizer, vocab_size)
        return c


__all__ = ["JSON_LAYOUT", "KINDS", "LLAMA_CPP_LAYOUT", "MAX_CONSTRAINT_BYTES", "MAX_DIGITS", "MAX_DIGITS_LIMIT",
           "Compiler", "Constraint", "ConstraintFailed", "DigitRuns", "InvalidConstraint", "compiler_for", "json_rules"]
