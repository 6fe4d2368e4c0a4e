"""Structured output and tool calls: `response_format` and `tools` as a constraint for the daemon,
and the model's output read back as tool calls.

The tools, the assistant's earlier calls and the tools' results go to the daemon as they are
(proto Chat), and the model's chat template shows them to the model: a template that reads
`tools` in its own way, any other in the generic format (README "The OpenAI API", the daemon's
engine/chat.py). Whichever it is, the model's reply is read in one shape, which the constraint
forces: a JSON object

    {"tool_calls": [{"name": "<function name>", "arguments": {<its arguments>}}]}

The constraint (the daemon's grammar, llguidance's Lark with `%json` for JSON Schema) forces the
call's shape whatever the model: `required` and a named function allow only the call object
(one call unless parallel_tool_calls), its names the tools' and its arguments valid against
their `parameters`; `auto` allows the call object or plain text that does not start with "{"
(or, with a JSON response_format, the response's JSON); `none` lists no tools and allows any text.
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
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
CALL_KEY = "tool_calls"
# JSON on one line, as the daemon lays out a json_schema constraint (llguidance's option, which
# the daemon's grammar reads inside %json)
JSON_LAYOUT = {"x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}


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
        """The generate() keyword of the constraint ({} for none): json_schema or grammar."""
        if not self.calls_possible:
            if self.response_schema is None:
                return {}
            return sized_constraint("json_schema", json.dumps(self.response_schema), "response_format")
        call = self._call_schema()
        if self.choice != "auto":
            return sized_constraint("json_schema", json.dumps(call), "tools")
        call = json.dumps({**call, **JSON_LAYOUT})
        other = (f"%json {json.dumps({**self.response_schema, **JSON_LAYOUT})}"
                 if isinstance(self.response_schema, dict) else "TEXT\nTEXT: /[^{](?s:.*)/")
        return sized_constraint("grammar", f"start: call | other\ncall: %json {call}\nother: {other}\n", "tools")

    def openai_tools(self) -> list[dict]:
        """The tools for the daemon's chat template (generate()'s tools=), when calls are possible."""
        return [{"type": "function", "function": f} for f in self.functions] if self.calls_possible else []

    def _call_schema(self) -> dict:
        fns = [f for f in self.functions if self.choice in ("auto", "required") or f["name"] == self.choice]
        call = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                 "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]}} for f in fns]
        calls = {"type": "array", "minItems": 1, "items": call[0] if len(call) == 1 else {"anyOf": call}}
        if not self.parallel or self.choice not in ("auto", "required"):
            calls["maxItems"] = 1
        return {"type": "object", "additionalProperties": False, "required": [CALL_KEY], "properties": {CALL_KEY: calls}}


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


def read_calls(text: str) -> list[dict] | None:
    """The tool calls (OpenAI's shape, with new ids) in a model's output, None if it is not a call."""
    if not text.lstrip().startswith("{"):
        return None
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    calls = doc.get(CALL_KEY) if isinstance(doc, dict) and set(doc) == {CALL_KEY} else None
    if not isinstance(calls, list) or not calls:
        return None
    out = []
    for c in calls:
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            return None
        out.append({"id": "call_" + secrets.token_hex(12), "type": "function",
                    "function": {"name": c["name"], "arguments": json.dumps(c.get("arguments", {}),
                                                                           ensure_ascii=False)}})
    return out


__all__ = ["APIError", "MAX_TOOLS", "Tools", "parse_response_format", "parse_tools", "read_calls", "sized_constraint",
           "tool_calls"]
