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

KINDS = ("json_schema", "regex", "grammar")
# A schema, regex or grammar; a larger one is refused before compiling. The API's limit (proto
# Constraint): the client library (ntx_client.client) and the OpenAI gateway refuse it before sending.
MAX_CONSTRAINT_BYTES = 1 << 20
MAX_JSON_DEPTH = 64  # nesting of a JSON schema document (llguidance's own parser stops at 128)
# llguidance's limits, tighter than its defaults where a request could make the daemon work long:
# lexer fuel ~50k/ms to build, ~14k/ms per token; Earley items ~20k/ms per token.
LIMITS = dict(max_items_in_row=2000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
              max_lexer_states=100_000, max_grammar_size=200_000, verbose_errors=False)
# JSON as json.dumps writes it, one line: flexible whitespace lets a sampled small model wander
# into runs of newlines until max_tokens. A schema may say otherwise in llguidance's "x-guidance".
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
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

    def compile(self, kind: str, text: str) -> "Constraint":
        """A fresh Constraint of `kind` (json_schema | regex | grammar) from its text;
        InvalidConstraint with the reason where it cannot be compiled."""
        if kind not in KINDS:
            raise InvalidConstraint(f"constraint kind {kind!r} is not one of {', '.join(KINDS)}")
        if not isinstance(text, str) or not text.strip():
            raise InvalidConstraint(f"the {_NAMES[kind]} is empty")
        size = len(text.encode())
        if size > MAX_CONSTRAINT_BYTES:
            raise InvalidConstraint(f"the {_NAMES[kind]} is {size:,} bytes; at most {MAX_CONSTRAINT_BYTES >> 20} MiB "
                                    f"({MAX_CONSTRAINT_BYTES:,} bytes) are compiled: shorten or simplify it")
        try:
            if kind == "json_schema":
                schema = json.loads(text)
                depth = _depth(schema)
                if depth > MAX_JSON_DEPTH:
                    raise InvalidConstraint(f"the JSON schema nests {depth} levels deep; at most {MAX_JSON_DEPTH} "
                                            "are compiled: flatten it (use $defs and $ref for recursion)")
                if not isinstance(schema, (dict, bool)):
                    raise InvalidConstraint("the JSON schema must be a JSON object (or true/false)")
                grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
            else:
                grammar = llguidance.grammar_from("regex" if kind == "regex" else "grammar", text)
        except RecursionError:
            raise InvalidConstraint(f"the {_NAMES[kind]} is nested too deeply to read: flatten it") from None
        except (ValueError, TypeError) as e:  # json.JSONDecodeError included
            if isinstance(e, InvalidConstraint):
                raise
            raise InvalidConstraint(f"the {_NAMES[kind]} cannot be read: {e}") from None
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        if matcher.is_error():
            raise InvalidConstraint(f"the {_NAMES[kind]} cannot be compiled: {matcher.get_error()}")
        return Constraint(matcher, self.vocab_size, kind)


_NAMES = {"json_schema": "JSON schema", "regex": "regular expression", "grammar": "grammar"}


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


class ConstraintFailed(ValueError):
    """A token the constraint refuses was pushed (a caller's bug: every path masks first)."""


class Constraint:
    """One sequence's progress through a compiled constraint (an llguidance matcher)."""

    def __init__(self, matcher, vocab_size: int, kind: str):
        self.matcher, self.vocab_size, self.kind = matcher, vocab_size, kind
        self._words = (vocab_size + 31) // 32
        self._bits = np.zeros((1, self._words), dtype=np.int32)

    def mask(self) -> np.ndarray:
        """bool (V,): the ids that may come next."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        self._check()
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:self.vocab_size].astype(bool)

    def masks(self, drafts: Sequence[int]) -> list[np.ndarray]:
        """The mask before each of drafts and after the last: len(drafts) + 1 rows. The drafts
        must be valid (valid_prefix); the state is the same afterwards."""
        out = [self.mask()]
        for i, t in enumerate(drafts):
            if not self.matcher.consume_token(int(t)):
                self.matcher.rollback(i)
                raise ConstraintFailed(f"draft token {t} is not allowed here: {self.matcher.get_error()}")
            out.append(self.mask())
        if drafts:
            self.matcher.rollback(len(drafts))
        return out

    def mask_after(self, tokens: Sequence[int]) -> np.ndarray:
        """The mask after valid `tokens` (a model draft's own tokens so far); the state is the
        same afterwards."""
        if not len(tokens):
            return self.mask()
        if not self.matcher.consume_tokens([int(t) for t in tokens]):
            raise ConstraintFailed(f"draft tokens {list(tokens)} are not allowed here: {self.matcher.get_error()}")
        try:
            return self.mask()
        finally:
            self.matcher.rollback(len(tokens))

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of tokens, in order, the constraint allows from here."""
        return self.matcher.validate_tokens([int(t) for t in tokens]) if len(tokens) else 0

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise ConstraintFailed(f"token {token} is not allowed by the {_NAMES[self.kind]}: "
                                   f"{self.matcher.get_error()}")

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


__all__ = ["KINDS", "MAX_CONSTRAINT_BYTES", "Compiler", "Constraint", "ConstraintFailed", "InvalidConstraint",
           "compiler_for"]
