"""Structured output and tool calls: `response_format` and `tools` as a constraint for the daemon,
and the model's output read back as tool calls.

The tools, the assistant's earlier calls and the tools' results go to the daemon as they are
(proto Chat), and the model's chat template shows them to the model: a template that reads
`tools` in its own way, any other in the generic format (README "The OpenAI API", the daemon's
engine/generation/chat.py: SmolLM2's own). Whichever it is, the model's calls are read in one shape, the
generic format's, which the constraint forces:

    <tool_call>[{"name": "<function name>", "arguments": {<its arguments>}}, ...]</tool_call>

The constraint (the daemon's grammar, llguidance's Lark with `%json` for JSON Schema) forces the
call's shape whatever the model: `required` and a named function allow only the call (one unless
parallel_tool_calls, at most MAX_CALLS), its names the tools' and its arguments valid against
their `parameters` (an object that does not say additionalProperties is closed: the daemon's
rule, proto Constraint), so the call ends; `auto` allows plain text, and wherever the text opens
`<tool_call>` the rest must be the call (the model's own format puts it first); with a JSON
response_format, the response's JSON or the call. `none` lists no tools and allows any text.
With `"strict": true` (a json_schema response_format, a function) every object of the schema
must say `"additionalProperties": false`, as OpenAI asks: a 400 naming the first that does not.
A constraint is at most the client library's MAX_CONSTRAINT_BYTES of text (the daemon's limit):
a larger one is a 400 here, naming the field, before anything is sent.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets

from ntx_client.client import RequestTooLarge, check_constraint_size
from ntx_client.openai_gateway.errors import APIError, bad_request, shown

MAX_TOOLS = 128  # OpenAI's own limit
MAX_CALLS = 8  # calls in one reply with parallel_tool_calls: a small model may repeat a call until max_tokens
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"  # the daemon's generic format (engine/generation/chat.py)
MAX_DIGITS = 16  # digits in a row in a forced call's JSON (the daemon's bound for a json_schema, proto Constraint)
# The model's own format breaks the list of calls over lines ("<tool_call>[\n{...}\n]</tool_call>"),
# which the daemon's one-line JSON would refuse: a call's JSON takes llama.cpp's bound on
# whitespace instead (the daemon's constraints.LLAMA_CPP_LAYOUT).
CALL_LAYOUT = {"whitespace_pattern": r"( |\n[ \t]{0,20})", "item_separator": ",", "key_separator": ":"}


def sized_constraint(kind: str, text: str, param: str) -> dict:
    """{kind: text}, the generate() keyword of a constraint; a 400 naming `param` (what it was
    built from) where it is more text than the daemon takes."""
    try:
        check_constraint_size(kind, text)
    except RequestTooLarge as e:
        raise bad_request(f"'{param}' is too large: {e}", param, "invalid_value") from None
    return {kind: text}


@dataclasses.dataclass
class Tools:
    """What a chat request asked for: its tools, the choice, and the response format's schema."""

    functions: list[dict] = dataclasses.field(default_factory=list)  # {"name", "description", "parameters"}
    choice: str = "none"  # none | auto | required | the name of the one function to call
    parallel: bool = True
    response_schema: dict | None = None  # response_format json_object / json_schema

    @property
    def calls_possible(self) -> bool:
        return bool(self.functions) and self.choice != "none"

    def constraint(self) -> dict:
        """The generate() keywords of the constraint ({} for none): json_schema or grammar."""
        if not self.calls_possible:
            if self.response_schema is None:
                return {}
            return sized_constraint("json_schema", json.dumps(self.response_schema), "response_format")
        calls = f'%json {json.dumps(self._calls_schema())} "{CALL_CLOSE}"'
        if self.choice != "auto":
            return {**sized_constraint("grammar", f'start: "{CALL_OPEN}" {calls}\n', "tools"), "max_digits": MAX_DIGITS}
        if isinstance(self.response_schema, dict):
            grammar = f'start: answer | "{CALL_OPEN}" {calls}\nanswer: %json {json.dumps(self.response_schema)}\n'
        else:  # text, until it opens a call (lazy: the first CALL_OPEN ends the text)
            grammar = (f"start: TEXT | head {calls}\n"
                       f"TEXT: /(?s:.+)/ & ~/(?s:.*){re.escape(CALL_OPEN)}(?s:.*)/\n"
                       f'head[lazy]: /(?s:.*)/ "{CALL_OPEN}"\n')
        return sized_constraint("grammar", grammar, "tools")

    def openai_tools(self) -> list[dict]:
        """The tools for the daemon's chat template (generate()'s tools=), when calls are possible."""
        return [{"type": "function", "function": f} for f in self.functions] if self.calls_possible else []

    def _calls_schema(self) -> dict:
        """The JSON list inside CALL_OPEN … CALL_CLOSE."""
        fns = [f for f in self.functions if self.choice in ("auto", "required") or f["name"] == self.choice]
        call = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                 "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]}} for f in fns]
        parallel = self.parallel and self.choice in ("auto", "required")
        return {"type": "array", "minItems": 1, "maxItems": MAX_CALLS if parallel else 1,
                "items": call[0] if len(call) == 1 else {"anyOf": call}, "x-guidance": CALL_LAYOUT}


def _object(v, where: str) -> dict:
    if not isinstance(v, dict):
        raise bad_request(f"Invalid type for '{where}': expected an object.", where, "invalid_type")
    return v


def parse_response_format(body: dict) -> dict | None:
    """The JSON schema `response_format` asks for; None for text."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    fmt = _object(fmt, "response_format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = _object(fmt.get("json_schema"), "response_format.json_schema")
        name = spec.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise bad_request("Invalid 'response_format.json_schema.name': a string of 1 to 64 letters, digits, "
                              "underscores and dashes is required.", "response_format.json_schema.name",
                              "invalid_value")
        schema = spec.get("schema", {})
        if not isinstance(schema, (dict, bool)):
            raise bad_request("Invalid type for 'response_format.json_schema.schema': expected a JSON Schema object.",
                              "response_format.json_schema.schema", "invalid_type")
        if spec.get("strict") not in (None, True, False):
            raise bad_request("Invalid type for 'response_format.json_schema.strict': expected a boolean.",
                              "response_format.json_schema.strict", "invalid_type")
        if spec.get("strict"):
            strict_schema(schema, f"response_format '{name}'", "response_format", "invalid_json_schema")
        return schema  # enforced whether strict or not: the output always matches it
    raise bad_request(f"Invalid value for 'response_format.type': {shown(repr(kind))}; supported values are 'text', "
                      "'json_object' and 'json_schema'.", "response_format.type", "invalid_value")


def parse_tools(body: dict) -> Tools:
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise bad_request("Invalid type for 'tools': expected an array of tools.", "tools", "invalid_type")
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"Invalid 'tools': at most {MAX_TOOLS} tools, got {len(tools)}.", "tools", "array_above_max_length")
    functions, names = [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        t = _object(t, where)
        if t.get("type") != "function":
            raise bad_request(f"Invalid value for '{where}.type': {shown(repr(t.get('type')))}; only 'function' is "
                              "supported.", f"{where}.type", "invalid_value")
        fn = _object(t.get("function"), f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise bad_request(f"Invalid '{where}.function.name': {shown(repr(name))} must be 1 to 64 letters, digits, "
                              "underscores or dashes.", f"{where}.function.name", "invalid_value")
        if name in names:
            raise bad_request(f"Invalid 'tools': the function name {name!r} is given twice.", f"{where}.function.name",
                              "invalid_value")
        names.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise bad_request(f"Invalid schema for function '{name}': '{where}.function.parameters' must be a JSON "
                              "Schema of type 'object'.", f"{where}.function.parameters", "invalid_function_parameters")
        desc = fn.get("description", "")
        if not isinstance(desc, str):
            raise bad_request(f"Invalid type for '{where}.function.description': expected a string.",
                              f"{where}.function.description", "invalid_type")
        if fn.get("strict") not in (None, True, False):
            raise bad_request(f"Invalid type for '{where}.function.strict': expected a boolean.",
                              f"{where}.function.strict", "invalid_type")
        if fn.get("strict"):
            strict_schema(params, f"function '{name}'", f"{where}.function.parameters", "invalid_function_parameters")
        functions.append({"name": name, "description": desc, "parameters": params})
    if choice is None:
        choice = "auto" if functions else "none"
    elif isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise bad_request(f"Invalid value for 'tool_choice': the function {shown(repr(name))} is not among the "
                              "'tools'.", "tool_choice", "invalid_value")
        choice = name
    elif choice not in ("none", "auto", "required"):
        raise bad_request(f"Invalid value for 'tool_choice': {shown(repr(choice))}; use 'none', 'auto', 'required' or "
                          '{"type": "function", "function": {"name": ...}}.', "tool_choice", "invalid_value")
    if choice in ("auto", "required") and not functions:
        raise bad_request(f"Invalid value for 'tool_choice': '{choice}' needs 'tools'.", "tool_choice",
                          "invalid_value")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad_request("Invalid type for 'parallel_tool_calls': expected a boolean.", "parallel_tool_calls",
                          "invalid_type")
    return Tools(functions, choice, parallel, parse_response_format(body))


# keywords whose value is a schema, a list of schemas, or a map of names to schemas
_ONE = ("additionalProperties", "items", "contains", "not", "if", "then", "else")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "$defs", "definitions")


def strict_schema(schema, what: str, param: str, code: str) -> None:
    """OpenAI's rule for a strict schema: every object says "additionalProperties": false; a 400
    in OpenAI's words naming the first object that does not (by its path in the schema)."""
    stack = [(schema, ())]
    while stack:
        node, at = stack.pop()
        if not isinstance(node, dict):
            continue
        types = node.get("type")
        is_object = types == "object" or (isinstance(types, list) and "object" in types) or "properties" in node
        if is_object and node.get("additionalProperties") is not False:
            raise bad_request(f"Invalid schema for {what}: In context={at}, 'additionalProperties' is required to be "
                              "supplied and to be false.", param, code)
        for key in reversed(_MAP):
            if isinstance(node.get(key), dict):
                stack += [(v, at + (key, k)) for k, v in reversed(node[key].items())]
        for key in reversed(_LIST):
            if isinstance(node.get(key), list):
                stack += [(v, at + (key, str(i))) for i, v in reversed(list(enumerate(node[key])))]
        for key in reversed(_ONE):
            if isinstance(node.get(key), dict):
                stack.append((node[key], at + (key,)))


def tool_calls(calls, i: int) -> list[dict]:
    """An assistant message's tool calls, checked: OpenAI's shape, each call's arguments JSON text."""
    if not isinstance(calls, list) or not calls:
        raise bad_request(f"Invalid type for 'messages[{i}].tool_calls': expected a non-empty array.",
                          f"messages[{i}].tool_calls", "invalid_type")
    out = []
    for j, c in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        fn = _object(_object(c, where).get("function"), f"{where}.function")
        name, args = fn.get("name"), fn.get("arguments", "{}")
        if not isinstance(name, str) or not name or not isinstance(args, str):
            raise bad_request(f"Invalid '{where}.function': 'name' and 'arguments' (a JSON string) are required.",
                              f"{where}.function", "invalid_value")
        try:
            json.loads(args)
        except (ValueError, RecursionError):
            raise bad_request(f"Invalid '{where}.function.arguments': not JSON ({shown(args)}).",
                              f"{where}.function.arguments", "invalid_value") from None
        call_id = c.get("id")
        out.append({"id": call_id if isinstance(call_id, str) else "", "type": "function",
                    "function": {"name": name, "arguments": args}})
    return out


def read_calls(text: str) -> tuple[str | None, list[dict]] | None:
    """(the text before the call or None, the tool calls in OpenAI's shape with new ids) of a
    model's output; None if it holds no whole call."""
    head, found, rest = text.partition(CALL_OPEN)
    rest = rest.rstrip()
    if not found or not rest.endswith(CALL_CLOSE):
        return None
    try:
        calls = json.loads(rest[:-len(CALL_CLOSE)])
    except (ValueError, RecursionError):
        return None
    if not isinstance(calls, list) or not calls:
        return None
    out = []
    for c in calls:
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            return None
        out.append({"id": "call_" + secrets.token_hex(12), "type": "function",
                    "function": {"name": c["name"], "arguments": json.dumps(c.get("arguments", {}),
                                                                           ensure_ascii=False)}})
    return head.strip() or None, out


class CallWatch:
    """A streamed reply that may hold calls: its chunks go out as content once their text can no
    longer be the start of a call; from CALL_OPEN on (a forced call: from the start) they are
    held, and read as calls at the end (finish).

    Thread rule: one per streamed reply, on the event loop that streams it."""

    def __init__(self, forced: bool):
        self.forced = forced
        self.held: list = []  # chunks not sent yet
        self._text, self._sent = "", 0  # all text so far; how much of it went out

    def push(self, chunk) -> list:
        """The chunks (client library Chunks) that may go out as content now."""
        self.held.append(chunk)
        self._text += chunk.text
        if self.forced or CALL_OPEN in self._text:
            return []
        end = len(self._text) - _open_tail(self._text)
        out = []
        while self.held and self._sent + len(self.held[0].text) <= end:
            c = self.held.pop(0)
            self._sent += len(c.text)
            out.append(c)
        return out

    def finish(self) -> tuple[str | None, list[dict] | None, list]:
        """At the end: (the text before the call, the calls, []) where the held text is a call;
        else (None, None, the held chunks, content after all)."""
        found = read_calls("".join(c.text for c in self.held))
        if found is None:
            return None, None, self.held
        return found[0], found[1], []


def _open_tail(text: str) -> int:
    """How many of text's last characters could begin CALL_OPEN."""
    for n in range(min(len(text), len(CALL_OPEN) - 1), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


__all__ = ["APIError", "CALL_CLOSE", "CALL_OPEN", "MAX_CALLS", "MAX_TOOLS", "CallWatch", "Tools",
           "parse_response_format", "parse_tools", "read_calls", "sized_constraint", "strict_schema", "tool_calls"]
