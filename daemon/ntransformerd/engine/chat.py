"""Chat prompts from the GGUF's ``tokenizer.chat_template`` (a Jinja template).

The template comes with the model file, so it is untrusted: it runs in jinja2's
``ImmutableSandboxedEnvironment`` (no attribute access to internals, no mutation of our
objects), unsafe attribute access fails loudly instead of rendering as "", the operations that
can build huge strings are capped, and a render that runs past ``RENDER_TIMEOUT_S`` is
interrupted. Every failure, the template's own ``raise_exception`` included, comes out as one
``ChatTemplateError`` whose message names the problem.

The environment is configured as Hugging Face transformers' ``apply_chat_template`` (and
llama.cpp's minja) run these templates: trim_blocks, lstrip_blocks, loop controls, a ``tojson``
that does not HTML-escape, ``raise_exception`` and ``strftime_now``.

Message text is never control tokens. The template sees each message's strings marked: a
``_Literal`` whose value carries two Unicode noncharacters around the text, so wherever the
template puts the text, the marks go with it (str methods act on the text and mark what they
return). ``render_parts`` cuts the output at the marks into (text, literal) parts; the tokenizer
then parses special tokens only in the template's own parts (``Tokenizer.encode_parts``), and a
message containing ``<|im_end|>`` stays those characters, not a forged turn.

Thread rule: a ``ChatTemplate`` is immutable once built and can render from any thread.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import re
import threading
from typing import Any, Iterable, Mapping, Sequence

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplate", "ChatTemplateError", "CHATML_TEMPLATE", "validate_messages", "split_literal"]

# Used when the GGUF has no template: ChatML, as llama.cpp falls back to.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

RENDER_TIMEOUT_S = 2.0
MAX_OUTPUT_CHARS = 4_000_000  # far above any context window; a template's own output only
MAX_BUILT_CHARS = 1_000_000  # largest string/list one operation inside the template may build
MAX_RANGE_TOTAL = 1_000_000  # range() items per render, all calls together
MAX_INT_ARG = 100_000  # largest integer argument to a method or filter (widths, counts)
MAX_MESSAGES = 10_000
# The messages' text all together: a template joins them into one string (MAX_BUILT_CHARS), with
# its own markup around them, so a conversation this long still renders.
MAX_CHAT_CHARS = MAX_BUILT_CHARS * 3 // 4

# Noncharacters: Unicode keeps them for a program's internal use, so no text needs them, and
# messages containing them are refused.
LITERAL_OPEN, LITERAL_CLOSE = "\ufdd0", "\ufdd1"
_MARKS = re.compile(f"[{LITERAL_OPEN}{LITERAL_CLOSE}]")


class ChatTemplateError(ValueError):
    """The chat template could not be rendered; the message says why (for the client)."""


class _Interrupted(BaseException):
    """Raised inside the render thread when it overruns its time (BaseException, so a
    template's own error handling cannot swallow it)."""


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check the conversation shape and return plain-dict copies for the template:
    a non-empty list of mappings, each with string ``role`` and ``content``."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ChatTemplateError(f"messages must be a list, not {type(messages).__name__}")
    if not messages:
        raise ChatTemplateError("messages is empty: a chat needs at least one message")
    if len(messages) > MAX_MESSAGES:
        raise ChatTemplateError(f"too many messages: {len(messages)} (at most {MAX_MESSAGES})")
    out, total = [], 0
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be an object with role and content, not {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"messages[{i}].role must be a non-empty string, got {role!r}")
        if not isinstance(content, str):
            raise ChatTemplateError(f"messages[{i}].content must be a string, got {type(content).__name__}")
        total += sum(len(v) for v in m.values() if isinstance(v, str))
        if total > MAX_CHAT_CHARS:
            raise ChatTemplateError(f"the chat's messages hold over {MAX_CHAT_CHARS:,} characters (at "
                                    f"messages[{i}]); a conversation may have at most that: shorten or split "
                                    "it (the model's context holds far fewer tokens anyway)")
        for key, value in m.items():
            if isinstance(value, str) and _MARKS.search(value):
                raise ChatTemplateError(f"messages[{i}].{key} contains U+FDD0 or U+FDD1, noncharacters that "
                                        "text may not carry here: remove them")
        out.append(dict(m))
    return out


def _marked(value: Any) -> Any:
    if isinstance(value, str):
        return value if isinstance(value, _Literal) else _Literal(value)
    if isinstance(value, list):
        return [_marked(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_marked(v) for v in value)
    return value


def _plain(value: Any) -> Any:
    return value._ntx_text if isinstance(value, _Literal) else value


class _Literal(str):
    """A message's string as the template sees it. Its str value is the text between the
    literal marks, so concatenation, output and formatting carry the marks; the str methods
    below act on the text alone and return marked results, so slicing, splitting and trimming
    work as templates expect. (The text itself is in ``_ntx_text``: underscore names are out of
    the sandbox's reach, so a template cannot unmark it.)"""

    def __new__(cls, text: str) -> "_Literal":
        self = super().__new__(cls, LITERAL_OPEN + text + LITERAL_CLOSE)
        self._ntx_text = text
        return self

    def __len__(self) -> int:
        return len(self._ntx_text)

    def __iter__(self):
        return (_Literal(c) for c in self._ntx_text)

    def __contains__(self, item: Any) -> bool:
        return _plain(item) in self._ntx_text

    def __getitem__(self, key: Any) -> "_Literal":
        return _Literal(self._ntx_text[key])

    def __eq__(self, other: Any) -> bool:
        return self._ntx_text == _plain(other)

    def __ne__(self, other: Any) -> bool:
        return self._ntx_text != _plain(other)

    def __hash__(self) -> int:
        return hash(self._ntx_text)

    def __lt__(self, other: Any) -> bool:
        return self._ntx_text < _plain(other)

    def __gt__(self, other: Any) -> bool:
        return self._ntx_text > _plain(other)

    def __le__(self, other: Any) -> bool:
        return self._ntx_text <= _plain(other)

    def __ge__(self, other: Any) -> bool:
        return self._ntx_text >= _plain(other)


def _on_text(name: str):
    method = getattr(str, name)

    def call(self: _Literal, *args: Any, **kwargs: Any) -> Any:
        return _marked(method(self._ntx_text, *(_plain(a) for a in args),
                              **{k: _plain(v) for k, v in kwargs.items()}))
    call.__name__ = name
    return call


for _name in ("strip", "lstrip", "rstrip", "split", "rsplit", "splitlines", "partition", "rpartition", "replace",
              "lower", "upper", "title", "capitalize", "casefold", "swapcase", "center", "ljust", "rjust", "zfill",
              "expandtabs", "removeprefix", "removesuffix", "startswith", "endswith", "find", "rfind", "index",
              "rindex", "count", "isspace", "isalpha", "isalnum", "isdigit", "isnumeric", "isdecimal", "islower",
              "isupper", "istitle", "isascii", "isidentifier", "isprintable"):
    setattr(_Literal, _name, _on_text(_name))


def split_literal(text: str) -> list[tuple[str, bool]]:
    """Cut rendered text at the literal marks into (text, literal) parts, marks removed.

    Unbalanced marks (a template that cut a message in a way the marks could not follow) are
    read so that message text is never taken for the template's: a stray close mark makes
    the text since the previous mark literal, a stray open mark the text up to the end."""
    parts: list[tuple[str, bool]] = []
    literal, start = False, 0
    for m in _MARKS.finditer(text):
        piece = text[start:m.start()]
        if m.group() == LITERAL_OPEN:
            if piece:
                parts.append((piece, literal))
            literal = True
        else:
            if piece:
                parts.append((piece, True))
            literal = False
        start = m.end()
    if text[start:]:
        parts.append((text[start:], literal))
    return parts


class ChatTemplate:
    """A compiled chat template. ``render(messages)`` gives the prompt text.

    bos_token / eos_token: the texts the template sees as ``bos_token`` / ``eos_token``.
    strip_bos / strip_eos: remove one leading ``bos_token`` / trailing ``eos_token`` from the
    result, for vocabularies that add BOS/EOS themselves when the prompt is tokenized with
    add_special=True (as llama.cpp's common_chat_templates_apply does), so there are not two.
    """

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "",
                 strip_bos: bool = False, strip_eos: bool = False) -> None:
        if not isinstance(source, str) or not source.strip():
            raise ChatTemplateError("the chat template is empty")
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token
        self.strip_bos, self.strip_eos = strip_bos, strip_eos
        env = _Sandbox(trim_blocks=True, lstrip_blocks=True,
                       extensions=[jinja2.ext.loopcontrols], undefined=jinja2.Undefined)
        try:
            self._template = env.from_string(source)
        except TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template syntax error at line {e.lineno}: {e.message}") from None
        except Exception as e:  # anything else the compiler raises on odd input
            raise ChatTemplateError(f"chat template does not compile: {type(e).__name__}: {e}") from None

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], tokenizer: Any = None) -> "ChatTemplate":
        """The GGUF's ``tokenizer.chat_template``, or ChatML where there is none.

        tokenizer (a ``tokenizer.Tokenizer``, optional) supplies the BOS/EOS texts and whether
        it adds them itself; without it they are read from the metadata.
        """
        source = metadata.get("tokenizer.chat_template")
        if source is None or (isinstance(source, str) and not source.strip()):
            source = CHATML_TEMPLATE
        elif not isinstance(source, str):
            raise ChatTemplateError("tokenizer.chat_template in the GGUF is not a string")
        if tokenizer is not None:
            bos = tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
            eos = tokenizer.token_text(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
            add_bos, add_eos = tokenizer.add_bos, tokenizer.add_eos
        else:
            tokens = metadata.get("tokenizer.ggml.tokens") or []

            def text(key: str) -> str:
                i = metadata.get(key)
                return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else ""

            bos, eos = text("tokenizer.ggml.bos_token_id"), text("tokenizer.ggml.eos_token_id")
            add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
            add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
        return cls(source, bos_token=bos, eos_token=eos, strip_bos=add_bos, strip_eos=add_eos)

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               **extra: Any) -> str:
        """The prompt text for ``messages``. ``extra`` variables (``tools``, ``date_string``...)
        are passed to the template as they are."""
        return "".join(t for t, _ in self.render_parts(messages, add_generation_prompt=add_generation_prompt, **extra))

    def render_parts(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                     **extra: Any) -> list[tuple[str, bool]]:
        """The prompt as (text, literal) parts: literal parts are the messages' own strings,
        the rest is what the template wrote (where its special tokens are)."""
        marked = [{k: _marked(v) if isinstance(v, str) else v for k, v in m.items()}
                  for m in validate_messages(messages)]
        variables = {
            **extra,
            "messages": marked,
            "add_generation_prompt": bool(add_generation_prompt),
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }
        parts = split_literal(_render_with_deadline(self._template, variables))
        if self.strip_bos and self.bos_token and parts and not parts[0][1] and parts[0][0].startswith(self.bos_token):
            parts[0] = (parts[0][0][len(self.bos_token):], False)
        if self.strip_eos and self.eos_token and parts and not parts[-1][1] and parts[-1][0].endswith(self.eos_token):
            parts[-1] = (parts[-1][0][: -len(self.eos_token)], False)
        return [p for p in parts if p[0]]


# ---- rendering with a deadline ------------------------------------------------------------------

def _render_with_deadline(template: jinja2.Template, variables: dict[str, Any]) -> str:
    """Render in a helper thread; past the deadline, raise _Interrupted inside it (checked
    between bytecodes, so any Python-level loop stops; the caps keep single C calls short)."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["text"] = _render(template, variables)
        except _Interrupted:
            result["error"] = ChatTemplateError(
                f"chat template took longer than {RENDER_TIMEOUT_S:g} s to render (endless loop?)")
        except ChatTemplateError as e:
            result["error"] = e
        except BaseException as e:  # the template must never take the caller down
            result["error"] = ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}")

    worker = threading.Thread(target=run, name="chat-template", daemon=True)
    worker.start()
    worker.join(RENDER_TIMEOUT_S)
    if worker.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(worker.ident), ctypes.py_object(_Interrupted))
        worker.join(1.0)
        if worker.is_alive():  # stuck inside one C call; it is a daemon thread, leave it
            raise ChatTemplateError(f"chat template took longer than {RENDER_TIMEOUT_S:g} s to render")
    if "error" in result:
        raise result["error"]
    return result["text"]


def _render(template: jinja2.Template, variables: dict[str, Any]) -> str:
    budget = {"range": MAX_RANGE_TOTAL}
    try:
        parts, size = [], 0
        for chunk in template.generate(**variables, _ntx_budget=budget):
            size += len(chunk)
            if size > MAX_OUTPUT_CHARS:
                raise ChatTemplateError(f"chat template output exceeds {MAX_OUTPUT_CHARS} characters")
            parts.append(chunk)
        return "".join(parts)
    except ChatTemplateError:
        raise
    except _TemplateRaised as e:
        raise ChatTemplateError(f"chat template rejected the conversation: {e}") from None
    except SecurityError as e:
        raise ChatTemplateError(f"chat template tried something unsafe: {e}") from None
    except RecursionError:
        raise ChatTemplateError("chat template recursed too deeply") from None
    except MemoryError:
        raise ChatTemplateError("chat template ran out of memory") from None
    except TemplateError as e:
        raise ChatTemplateError(f"chat template error: {type(e).__name__}: {e}") from None
    except Exception as e:
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None


# ---- the sandbox ------------------------------------------------------------------------------

class _TemplateRaised(Exception):
    """The template called raise_exception(message)."""


def _raise_exception(message: Any = "") -> None:
    raise _TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(str(fmt))


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # as transformers' chat templates expect: real JSON, no HTML escaping
    if indent is not None and (not isinstance(indent, (int, str)) or (isinstance(indent, int) and indent > 64)):
        raise SecurityError(f"tojson indent {indent!r} is not allowed")
    text = json.dumps(value, ensure_ascii=False, indent=indent, separators=separators,
                      sort_keys=sort_keys, default=str)
    if ensure_ascii:  # escaped by hand, so that the literal marks stay marks
        text = re.sub(r"[^\x00-\x7f]", _json_escape, text)
    _check_size(text)
    return text


def _json_escape(m: re.Match) -> str:
    c = m.group()
    if c in (LITERAL_OPEN, LITERAL_CLOSE):
        return c
    units = c.encode("utf-16-be")
    return "".join(f"\\u{int.from_bytes(units[i:i + 2], 'big'):04x}" for i in range(0, len(units), 2))


def _check_size(value: Any) -> Any:
    if isinstance(value, (str, bytes, list, tuple)) and len(value) > MAX_BUILT_CHARS:
        raise SecurityError(f"the template built a value of {len(value)} items (limit {MAX_BUILT_CHARS})")
    return value


def _check_int_args(what: str, args: Iterable[Any]) -> None:
    for a in args:
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_INT_ARG:
            raise SecurityError(f"{what} called with {a} (integer arguments are limited to {MAX_INT_ARG})")


# a %-format or str.format field with a width or precision of 6 digits or more
_HUGE_PERCENT = re.compile(r"%[-+ #0]*(\*|\d{6,}|\.\d{6,})")
_HUGE_FORMAT = re.compile(r"\{[^{}]*:[^{}]*\d{6,}[^{}]*\}")


def _check_format(fmt: Any) -> None:
    if isinstance(fmt, str) and (_HUGE_PERCENT.search(fmt) or _HUGE_FORMAT.search(fmt)):
        raise SecurityError("format string with a huge width or precision")


class _CodeGenerator(CodeGenerator):
    """Compiles ``a ~ b`` to environment.sized_concat: jinja's own str_join cannot be
    intercepted like the arithmetic operators, and doubling a string in a loop would
    otherwise eat all memory before the deadline hits."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.sized_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _Sandbox(ImmutableSandboxedEnvironment):
    code_generator_class = _CodeGenerator
    intercepted_binops = frozenset(["+", "*", "**", "%"])

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, range=_budgeted_range)
        self.globals.pop("lipsum", None)  # generates text in bulk; no chat template needs it
        self.filters["tojson"] = _tojson
        for name, f in list(self.filters.items()):
            self.filters[name] = _guarded_filter(name, f)

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        # fail loudly: the default renders unsafe access as "", which would hide an attack
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is not allowed")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _check_int_args(getattr(__obj, "__name__", "function"), list(args) + list(kwargs.values()))
        return _check_size(super().call(__context, __obj, *args, **kwargs))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**":
            if isinstance(right, (int, float)) and abs(right) > 64 or (
                    isinstance(left, int) and isinstance(right, int) and left.bit_length() * right > 100_000):
                raise SecurityError(f"exponent {right} is too large")
        elif operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_BUILT_CHARS:
                    raise SecurityError(f"repeating a value {n} times would build {len(seq) * n} items")
        elif operator == "+":
            if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)) \
                    and len(left) + len(right) > MAX_BUILT_CHARS:
                raise SecurityError(f"the template built a value of over {MAX_BUILT_CHARS} items")
        elif operator == "%":
            _check_format(left)
        return _check_size(super().call_binop(context, operator, left, right))

    def wrap_str_format(self, value: Any) -> Any:
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:  # value is some_string.format / .format_map
            _check_format(value.__self__)
        return wrapped

    @staticmethod
    def sized_concat(values: Iterable[Any]) -> str:
        """The ``~`` operator, refusing to build an oversized string (see _CodeGenerator)."""
        parts = [str(v) for v in values]
        if sum(map(len, parts)) > MAX_BUILT_CHARS:
            raise SecurityError(f"the template built a string of over {MAX_BUILT_CHARS} characters")
        return "".join(parts)


@jinja2.pass_context
def _budgeted_range(context: Any, *args: int) -> range:
    """range() with one budget of items per render, so nested loops cannot run for hours."""
    r = range(*args)
    budget = context.get("_ntx_budget")
    if budget is not None:
        budget["range"] -= len(r)
        if budget["range"] < 0:
            raise SecurityError(f"the template asked for more than {MAX_RANGE_TOTAL} loop items in total")
    return r


def _guarded_filter(name: str, f: Any) -> Any:
    """Wrap a built-in filter so that widths and counts are capped and results are sized."""
    passes_extra = hasattr(f, "jinja_pass_arg")  # first argument is the context/environment

    def guarded(*args: Any, **kwargs: Any) -> Any:
        rest = args[2:] if passes_extra else args[1:]
        _check_int_args(f"filter {name}", list(rest) + list(kwargs.values()))
        if name == "format":
            _check_format(args[1] if passes_extra else args[0])
        return _check_size(f(*args, **kwargs))

    if passes_extra:
        guarded.jinja_pass_arg = f.jinja_pass_arg  # keep jinja's pass_context/pass_environment marker
    guarded.__name__ = getattr(f, "__name__", name)
    return guarded
