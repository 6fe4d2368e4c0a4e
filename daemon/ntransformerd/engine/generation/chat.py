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

Tools (functions the model may call) reach the model in one of two ways:

* a template that reads a ``tools`` variable (its source uses it: ``knows_tools``) renders them
  itself, as Hugging Face's ``apply_chat_template`` passes them: ``tools`` is OpenAI's list of
  ``{"type": "function", "function": {"name", "description", "parameters"}}``, an assistant
  message carries ``tool_calls`` (``[{"id", "type": "function", "function": {"name",
  "arguments"}}]``, the arguments a parsed JSON object) and a ``role: "tool"`` message its
  ``tool_call_id`` and the ``name`` of the function it answers;
* any other template gets the generic format (``generic_tool_messages``; README "The OpenAI
  API"), SmolLM2's own (the format its function-calling data taught it, as its model card and
  Ollama's template for it write it): the tools as a JSON list inside ``<tools>…</tools>`` in a
  system message, an assistant's calls as ``<tool_call>[{"name", "arguments"}, …]</tool_call>``,
  and the tools' results as a user turn of ``<tool_response>…</tool_response>`` blocks.

Either way every string of the tools and of the calls is message text, marked like content:
a tool's description or result containing ``<|im_end|>`` stays those characters.

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
import jinja2.meta
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["CALL_CLOSE", "CALL_OPEN", "ChatTemplate", "ChatTemplateError", "CHATML_TEMPLATE", "RESULT_CLOSE",
           "RESULT_OPEN", "TOOL_INSTRUCTIONS", "TOOLS_HERE", "generic_tool_messages",
           "split_literal", "validate_messages", "validate_tools"]

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

MAX_TOOLS = 128  # OpenAI's own limit
MAX_TOOL_DEPTH = 64  # nesting of a tool's parameters or a call's arguments (as constraints.MAX_JSON_DEPTH)
# The generic tool format (README "The OpenAI API"): the system text that lists the tools, and
# how a call and a result are written. The model's reply is forced into the call's shape by the
# request's constraint (the OpenAI gateway's tools.py, which reads CALL_OPEN…CALL_CLOSE back).
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESULT_OPEN, RESULT_CLOSE = "<tool_response>\n", "\n</tool_response>"
# SmolLM2's own words where they matter: its first sentence and its example of the format make
# it far likelier to open a call than a plain description does (bench/RESULTS.md, "Structured
# output that ends"). The tools' JSON list replaces TOOLS_HERE.
TOOLS_HERE = "{tools}"
TOOL_INSTRUCTIONS = (
    "You are an expert in composing functions. You are given a question and a set of possible functions.\n"
    "Based on the question, make one or more function calls to achieve the purpose. If none of the functions "
    "fits, answer in plain text.\n\n"
    "You have access to the following tools:\n<tools>" + TOOLS_HERE + "</tools>\n\n"
    "The output must follow this format, with no other text:\n"
    '<tool_call>[\n{"name": "func_name1", "arguments": {"argument1": "value1", "argument2": "value2"}},\n'
    "... (more tool calls as required)\n]</tool_call>")

# Noncharacters: Unicode keeps them for a program's internal use, so no text needs them, and
# messages containing them are refused.
LITERAL_OPEN, LITERAL_CLOSE = "\ufdd0", "\ufdd1"
_MARKS = re.compile(f"[{LITERAL_OPEN}{LITERAL_CLOSE}]")


class ChatTemplateError(ValueError):
    """The chat template could not be rendered; the message says why (for the client)."""


class _Interrupted(BaseException):
    """Raised inside the render thread when it overruns its time (BaseException, so a
    template's own error handling cannot swallow it)."""


def validate_messages(messages: Any, *, tool_chars: int = 0) -> list[dict[str, Any]]:
    """Check the conversation shape and return plain-dict copies for the template:
    a non-empty list of mappings, each with string ``role`` and ``content``; an assistant's
    ``tool_calls`` (OpenAI's shape; arguments as JSON text or an object) come back with their
    arguments parsed, and a tool message's ``tool_call_id`` must answer one of them (its
    ``name`` is then filled in). tool_chars: what the request's tools hold, counted with the
    messages against MAX_CHAT_CHARS."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ChatTemplateError(f"messages must be a list, not {type(messages).__name__}")
    if not messages:
        raise ChatTemplateError("messages is empty: a chat needs at least one message")
    if len(messages) > MAX_MESSAGES:
        raise ChatTemplateError(f"too many messages: {len(messages)} (at most {MAX_MESSAGES})")
    out, total, called = [], tool_chars, {}  # called: tool call id → function name
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be an object with role and content, not {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"messages[{i}].role must be a non-empty string, got {role!r}")
        if not isinstance(content, str):
            raise ChatTemplateError(f"messages[{i}].content must be a string, got {type(content).__name__}")
        m = dict(m)
        for key, value in m.items():
            if key != "tool_calls":
                total += _size(value, f"messages[{i}].{key}")
        if m.get("tool_calls") is not None:
            m["tool_calls"], size = _tool_calls(m["tool_calls"], i)
            total += size
            called.update((c["id"], c["function"]["name"]) for c in m["tool_calls"] if c["id"])
        call_id = m.get("tool_call_id")
        if call_id is not None:
            if not isinstance(call_id, str):
                raise ChatTemplateError(f"messages[{i}].tool_call_id must be a string, got {type(call_id).__name__}")
            if call_id not in called:
                raise ChatTemplateError(f"messages[{i}].tool_call_id {_shown(call_id)!r} answers no tool call of an "
                                        "earlier assistant message: give the id of the call this result is for")
            m.setdefault("name", called[call_id])
        if total > MAX_CHAT_CHARS:
            raise ChatTemplateError(f"the chat's messages{' and tools' if tool_chars else ''} hold over "
                                    f"{MAX_CHAT_CHARS:,} characters (at messages[{i}]); a conversation may have "
                                    "at most that: shorten or split it (the model's context holds far fewer "
                                    "tokens anyway)")
        out.append(m)
    return out


def validate_tools(tools: Any) -> tuple[list[dict[str, Any]], int]:
    """OpenAI's list of tools as plain copies, each ``{"type": "function", "function": {"name",
    "description", "parameters"}}`` with the parameters (JSON text or an object) parsed; and the
    characters they hold (counted with the messages' against MAX_CHAT_CHARS)."""
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
        raise ChatTemplateError(f"tools must be a list, not {type(tools).__name__}")
    if len(tools) > MAX_TOOLS:
        raise ChatTemplateError(f"too many tools: {len(tools)} (at most {MAX_TOOLS})")
    out, total, names = [], 0, set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        fn = t.get("function") if isinstance(t, Mapping) and t.get("type", "function") == "function" else None
        if not isinstance(fn, Mapping):
            raise ChatTemplateError(f"{where} must be an object {{\"type\": \"function\", \"function\": {{...}}}}")
        name, desc = fn.get("name"), fn.get("description", "")
        if not isinstance(name, str) or not name:
            raise ChatTemplateError(f"{where}.function.name must be a non-empty string, got {_shown(repr(name))}")
        if name in names:
            raise ChatTemplateError(f"{where}.function.name {_shown(name)!r} is given twice: tool names must differ")
        names.add(name)
        if not isinstance(desc, str):
            raise ChatTemplateError(f"{where}.function.description must be a string, got {type(desc).__name__}")
        params = _json_value(fn.get("parameters", {"type": "object", "properties": {}}), f"{where}.function.parameters")
        if not isinstance(params, dict):
            raise ChatTemplateError(f"{where}.function.parameters must be a JSON Schema object")
        total += _size(name, where) + _size(desc, where) + _size(params, where)
        out.append({"type": "function", "function": {"name": name, "description": desc, "parameters": params}})
    return out, total


def _tool_calls(calls: Any, i: int) -> tuple[list[dict[str, Any]], int]:
    if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes)) or not calls:
        raise ChatTemplateError(f"messages[{i}].tool_calls must be a non-empty list of calls")
    out, total = [], 0
    for j, c in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatTemplateError(f"{where} must be an object {{\"id\", \"type\": \"function\", \"function\": "
                                    "{\"name\", \"arguments\"}}")
        call_id = c.get("id") or ""
        if not isinstance(call_id, str):
            raise ChatTemplateError(f"{where}.id must be a string, got {type(call_id).__name__}")
        args = _json_value(fn.get("arguments", {}), f"{where}.function.arguments")
        total += _size(call_id, where) + _size(fn["name"], where) + _size(args, where)
        out.append({"id": call_id, "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out, total


def _json_value(value: Any, where: str) -> Any:
    """A JSON value given as text (parsed) or as Python data, at most MAX_TOOL_DEPTH deep."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except RecursionError:
            raise ChatTemplateError(f"{where} is nested too deeply to read: flatten it") from None
        except ValueError as e:
            raise ChatTemplateError(f"{where} is not JSON ({e}): send a JSON object") from None
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_TOOL_DEPTH:
            raise ChatTemplateError(f"{where} nests more than {MAX_TOOL_DEPTH} levels deep: flatten it")
        if isinstance(node, Mapping):
            stack += [(v, depth + 1) for v in node.values()]
        elif isinstance(node, (list, tuple)):
            stack += [(v, depth + 1) for v in node]
        elif not (node is None or isinstance(node, (str, int, float, bool))):
            raise ChatTemplateError(f"{where} holds a {type(node).__name__}, which is not JSON")
    return value


def _size(value: Any, where: str) -> int:
    """Characters of the strings in `value` (keys included); refuses the literal marks."""
    total, stack = 0, [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            if _MARKS.search(node):
                raise ChatTemplateError(f"{where} contains U+FDD0 or U+FDD1, noncharacters that text may not carry "
                                        "here: remove them")
            total += len(node)
        elif isinstance(node, Mapping):
            stack += [*node.keys(), *node.values()]
        elif isinstance(node, (list, tuple)):
            stack += node
    return total


def _shown(text: str, limit: int = 64) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def generic_tool_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation in the generic tool format (module docstring), for a template that knows
    no tools: the tools listed in the system message (after the client's own, if any), each
    assistant's calls as the ``<tool_call>[…]</tool_call>`` it is asked to write (after its text,
    if any), the results of one turn's calls as one user message of ``<tool_response>`` blocks.
    ``messages`` and ``tools`` as validate_messages / validate_tools return them."""
    out: list[dict[str, Any]] = []
    results = False  # the last message of out holds tool results
    for m in messages:
        if m["role"] == "tool":
            result = RESULT_OPEN + m["content"] + RESULT_CLOSE
            if results:  # the results of one turn's calls: one user turn
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + result}
            else:
                out.append({"role": "user", "content": result})
            results = True
            continue
        results = False
        if m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in m["tool_calls"]]
            call = CALL_OPEN + json.dumps(calls, ensure_ascii=False) + CALL_CLOSE
            out.append({"role": m["role"], "content": f"{m['content']}\n{call}" if m["content"] else call})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools:
        text = TOOL_INSTRUCTIONS.replace(TOOLS_HERE, json.dumps([t["function"] for t in tools], ensure_ascii=False))
        if out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _marked(value: Any) -> Any:
    """`value` with every string in it marked, dictionary keys included (a tool's parameter
    names are the client's text as much as its description)."""
    if isinstance(value, str):
        return value if isinstance(value, _Literal) else _Literal(value)
    if isinstance(value, Mapping):
        return {_marked(k): _marked(v) for k, v in value.items()}
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
            # reads `tools` (not set by the template itself): it renders tools its own way
            self.knows_tools = "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
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

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text for ``messages`` (and ``tools``: see render_parts). ``extra``
        variables (``date_string``...) are passed to the template as they are."""
        return "".join(t for t, _ in self.render_parts(messages, tools=tools,
                                                       add_generation_prompt=add_generation_prompt, **extra))

    def render_parts(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
                     add_generation_prompt: bool = True, **extra: Any) -> list[tuple[str, bool]]:
        """The prompt as (text, literal) parts: literal parts are the messages' own strings
        (the tools' and the calls' included), the rest is what the template wrote (where its
        special tokens are). tools: OpenAI's list of function tools, for the template's
        ``tools`` variable where it has one, else in the generic format (module docstring)."""
        tool_list, size = validate_tools(tools) if tools else ([], 0)
        plain = validate_messages(messages, tool_chars=size)
        if self.knows_tools:
            extra["tools"] = _marked(tool_list) if tool_list else None  # None when absent, as transformers passes
        else:
            plain = generic_tool_messages(plain, tool_list)
        marked = [{k: _marked(v) for k, v in m.items()} for m in plain]
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
