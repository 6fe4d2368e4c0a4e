"""OpenAI request bodies → generation jobs, and generation results → OpenAI response objects.

Parsing checks every field the gateway uses and refuses, by name, the ones it cannot honour
(n > 1, logit_bias, ...). Tools and response formats are tools.py's. Fields it does not know are ignored, so a client written for a
newer API still works. Nothing here talks to the daemon.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import secrets
import time

from ntx_client.client import piece_text
from ntx_client.openai_gateway import tools as tools_
from ntx_client.openai_gateway.errors import APIError, bad_request, shown

MAX_STOP = 4  # OpenAI's own limit on stop sequences
# A prompt goes to the daemon in one gRPC message, which it takes up to 4 MiB: as text (chat), or
# as token ids of up to 3 bytes each (a completion's text is tokenized here first, at most one
# token per byte). 1 MiB of text stays under that either way and is several times the 128k-token
# context of the largest Llama models; a longer prompt is refused here with 413, not by gRPC.
MAX_PROMPT_BYTES = 1 << 20
MAX_PROMPT_TOKENS = 1 << 18
MAX_TOKEN_ID = (1 << 31) - 1
MAX_STOP_CHARS = 1024
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MAX_TOP_LOGPROBS = 20
MAX_DIGITS_LIMIT = 4096  # the daemon's (proto Constraint.max_digits)
# The daemon's defaults are llama.cpp's (top_k 40, min_p 0.05, ...); an OpenAI request means plain
# softmax sampling at temperature 1 unless it says otherwise.
OPENAI_SAMPLING = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0)
FINISH = {"stop": "stop", "eos": "stop", "length": "length", "tool_calls": "tool_calls"}


@dataclasses.dataclass
class Job:
    """One generation as the client library takes it, plus how to answer."""

    kind: str  # "chat" | "completion"
    model: str
    generate: dict  # keyword arguments of AsyncClient.generate (messages= or prompt_ids=)
    prompt: str | None = None  # completions: the text, tokenized by the gateway without special tokens
    stream: bool = False
    include_usage: bool = False
    tools: tools_.Tools = dataclasses.field(default_factory=tools_.Tools)
    logprobs: int | None = None  # alternatives per token (None: no log-probabilities)
    echo: bool = False  # completions: the prompt (and its log-probabilities) before the completion
    max_tokens_key: str = "max_tokens"  # the name the request gave it by (max_completion_tokens is newer)
    id: str = dataclasses.field(default_factory=lambda: "")
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        if not self.id:
            self.id = ("chatcmpl-" if self.kind == "chat" else "cmpl-") + secrets.token_hex(12)

    def check_max_tokens(self, context_length: int) -> None:
        """A 400 where max_tokens is not 1..the model's context length, in the daemon's words."""
        v = self.generate.get("max_tokens")
        if v is not None and not 1 <= v <= context_length:
            raise bad_request(f"{self.max_tokens_key} {shown(str(v))} is out of range: use 1..{context_length} (the "
                              "context length)", self.max_tokens_key, "invalid_value")

    def param(self, field: str | None) -> str | None:
        """The request parameter behind a daemon's field (ntx_client FieldError.field)."""
        if field is None:
            return None
        if field in ("prompt", "prompt_ids", "chat", "text"):
            return "messages" if self.kind == "chat" else "prompt"
        if field.startswith("constraint."):
            return "tools" if self.tools.calls_possible else "response_format"
        if field == "logprobs":
            return "top_logprobs" if self.kind == "chat" else "logprobs"
        if field == "max_tokens":
            return self.max_tokens_key
        return {"prompt_logprobs": "echo", "model": "model"}.get(field, field.removeprefix("sampling."))


def _type_name(v) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number")


def _number(body: dict, key: str, lo: float, hi: float) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad_request(f"Invalid type for '{key}': expected a number, but got {_type_name(v)} instead.", key,
                          "invalid_type")
    if not lo <= v <= hi:
        raise bad_request(f"Invalid value for '{key}': {shown(str(v))} is not in {lo:g}..{hi:g}.", key, "invalid_value")
    return float(v)


def _integer(body: dict, key: str, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"Invalid type for '{key}': expected an integer, but got {_type_name(v)} instead.", key,
                          "invalid_type")
    if lo is not None and not lo <= v <= hi:
        raise bad_request(f"Invalid value for '{key}': {shown(str(v))} is not in {lo}..{hi}.", key, "invalid_value")
    return v


def _bool(body: dict, key: str) -> bool:
    v = body.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad_request(f"Invalid type for '{key}': expected a boolean, but got {_type_name(v)} instead.", key,
                          "invalid_type")
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("Invalid type for 'stop': expected a string or an array of strings.", "stop", "invalid_type")
    if len(stops) > MAX_STOP:
        raise bad_request(f"Invalid value for 'stop': at most {MAX_STOP} stop sequences, got {len(stops)}.", "stop",
                          "invalid_value")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise bad_request(f"Invalid value for 'stop': each stop sequence must be 1..{MAX_STOP_CHARS} characters.",
                          "stop", "invalid_value")
    return stops


def _unsupported(body: dict, endpoint: str) -> None:
    """Refuse, by name, what the gateway knows but cannot do."""
    n = _integer(body, "n", 1, 128)
    if n is not None and n != 1:
        raise bad_request(f"n = {n}: this server generates one choice per request; send n = 1 (or leave it out) "
                          "and make several requests", "n", "unsupported_value")
    best_of = _integer(body, "best_of", 1, 128)
    if best_of is not None and best_of != 1:
        raise bad_request("best_of > 1 is not supported: leave it out", "best_of", "unsupported_value")
    if body.get("functions"):
        raise bad_request("'functions' (deprecated by OpenAI) is not supported by this server: send 'tools'",
                          "functions", "unsupported_parameter")
    if body.get("function_call") not in (None, "none", "auto"):
        raise bad_request("'function_call' (deprecated by OpenAI) is not supported by this server: send "
                          "'tool_choice'", "function_call", "unsupported_parameter")
    if body.get("logit_bias"):
        raise bad_request("'logit_bias' is not supported by this server: leave it out", "logit_bias",
                          "unsupported_parameter")
    for key in ("audio", "prediction"):
        if body.get(key):
            raise bad_request(f"'{key}' is not supported by this server: leave it out", key, "unsupported_parameter")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise bad_request("'modalities' other than [\"text\"] is not supported by this server", "modalities",
                          "unsupported_parameter")
    if endpoint == "completion":
        if body.get("suffix"):
            raise bad_request("'suffix' (fill in the middle) is not supported by this server: leave it out", "suffix",
                              "unsupported_parameter")


def _common(body: dict, endpoint: str) -> dict:
    """Sampling, length and stop fields shared by both endpoints → AsyncClient.generate keywords."""
    _unsupported(body, endpoint)
    kw = dict(OPENAI_SAMPLING)
    for key, lo, hi in (("temperature", 0, 2), ("top_p", 0, 1), ("presence_penalty", -2, 2),
                        ("frequency_penalty", -2, 2), ("min_p", 0, 1), ("repetition_penalty", 0.01, 10)):
        v = _number(body, key, lo, hi)
        if v is not None:
            kw[key] = v
    if kw["top_p"] == 0:  # OpenAI accepts 0; the engine needs top_p > 0, and 0 means "only the top token"
        kw["top_k"], kw["top_p"] = 1, 1.0
    top_k = _integer(body, "top_k", 0, 1 << 20)
    if top_k is not None:
        kw["top_k"] = top_k
    seed = _integer(body, "seed", -(1 << 63), (1 << 64) - 1)
    if seed is not None:
        kw["seed"] = seed % (1 << 64)
    # max_completion_tokens is the newer name of max_tokens; it wins when both are given. Its range
    # is the model's context (Job.check_max_tokens, once the model is known).
    for key in ("max_tokens", "max_completion_tokens"):
        v = _integer(body, key)
        if v is not None:
            kw["max_tokens"] = v
    kw["stop"] = _stop(body)
    # not OpenAI's, but vLLM's and llama.cpp's servers take it, and benchmarks rely on it
    kw["ignore_eos"] = _bool(body, "ignore_eos")
    # ours (the SDKs send it with extra_body): the most digits in a row of a JSON output's numbers,
    # 16 unless this says otherwise (proto Constraint.max_digits; 0: no bound)
    digits = _integer(body, "max_digits", 0, MAX_DIGITS_LIMIT)
    if digits is not None:
        kw["max_digits"] = digits
    # ours (the SDKs send it with extra_body): the request's speculative mode, as GenerateRequest's
    spec = body.get("speculative")
    if spec is not None:
        if not isinstance(spec, str) or len(spec) > 64:
            raise bad_request("Invalid type for 'speculative': expected a mode such as 'off' or 'ngram'.",
                              "speculative", "invalid_type")
        kw["speculative"] = spec
    return kw


def _check_max_digits(kw: dict, constraint: dict) -> None:
    if "max_digits" in kw and not constraint:
        raise bad_request("Invalid 'max_digits': it bounds the numbers of structured output; send it with "
                          "'response_format' (json_schema or json_object) or 'tools'.", "max_digits", "invalid_value")


def _max_tokens_key(body: dict) -> str:
    return "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"


def _stream(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad_request("Invalid type for 'stream_options': expected an object.", "stream_options",
                              "invalid_type")
        if not stream:
            raise bad_request("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                              "stream_options", "invalid_value")
        include_usage = _bool(opts, "include_usage")
    return stream, include_usage


def _model(body: dict) -> str:
    model = body.get("model")
    if model is None:
        raise bad_request("Missing required parameter: 'model'.", "model", "missing_required_parameter")
    if not isinstance(model, str):
        raise bad_request(f"Invalid type for 'model': expected a string, but got {_type_name(model)} instead.",
                          "model", "invalid_type")
    return model


def _content(m: dict, i: int) -> str:
    """A message's text: a string, or an array of text parts (joined)."""
    c = m.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        parts = []
        for j, p in enumerate(c):
            if not isinstance(p, dict) or not isinstance(p.get("type"), str):
                raise bad_request(f"Invalid content part messages[{i}].content[{j}]: expected an object with a "
                                  "'type'.", f"messages[{i}].content[{j}]", "invalid_type")
            if p["type"] != "text":
                raise bad_request(f"messages[{i}].content[{j}] is of type {shown(repr(p['type']))}: this model reads "
                                  "text only",
                                  f"messages[{i}].content[{j}].type", "unsupported_value")
            if not isinstance(p.get("text"), str):
                raise bad_request(f"Invalid type for 'messages[{i}].content[{j}].text': expected a string.",
                                  f"messages[{i}].content[{j}].text", "invalid_type")
            parts.append(p["text"])
        return "".join(parts)
    raise bad_request(f"Invalid type for 'messages[{i}].content': expected a string or an array of content parts, "
                      f"but got {_type_name(c)} instead.", f"messages[{i}].content", "invalid_type")


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if msgs is None:
        raise bad_request("Missing required parameter: 'messages'.", "messages", "missing_required_parameter")
    if not isinstance(msgs, list):
        raise bad_request(f"Invalid type for 'messages': expected an array, but got {_type_name(msgs)} instead.",
                          "messages", "invalid_type")
    if not msgs:
        raise bad_request("Invalid 'messages': empty array. Expected an array with minimum length 1.", "messages",
                          "empty_array")
    out, called = [], set()  # the ids of the tool calls so far
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad_request(f"Invalid type for 'messages[{i}]': expected an object, but got {_type_name(m)} "
                              "instead.", f"messages[{i}]", "invalid_type")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise bad_request(f"Invalid value for 'messages[{i}].role': {shown(repr(role))}; supported values are "
                              "'system', 'developer', 'user', 'assistant' and 'tool'.", f"messages[{i}].role",
                              "invalid_value")
        msg = {"role": ROLES[role], "content": _content(m, i)}
        if role == "assistant" and m.get("tool_calls") is not None:  # the chat template shows them: tools.py
            msg["tool_calls"] = tools_.tool_calls(m["tool_calls"], i)
            called.update(c["id"] for c in msg["tool_calls"] if c["id"])
        elif role == "assistant" and m.get("function_call") is not None:
            raise bad_request(f"messages[{i}].function_call (deprecated by OpenAI) is not supported: send "
                              "'tool_calls'", f"messages[{i}].function_call", "unsupported_parameter")
        elif role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or call_id not in called:
                raise bad_request(f"Invalid 'messages[{i}].tool_call_id': {shown(repr(call_id))} answers no tool call "
                                  "of an earlier assistant message.", f"messages[{i}].tool_call_id", "invalid_value")
            msg["tool_call_id"] = call_id
        out.append(msg)
    return out


def _text_bytes(messages: list[dict]) -> int:
    """What the messages hold: their text and their calls' arguments, in UTF-8 bytes."""
    return sum(len(m["content"].encode()) + sum(len(c["function"]["arguments"].encode()) for c in
                                                 m.get("tool_calls", ())) for m in messages)


def _too_large(what: str, size: str) -> APIError:
    return APIError(413, f"The {what} is {size}; this server takes at most {MAX_PROMPT_BYTES >> 20} MiB of prompt "
                    f"text or {MAX_PROMPT_TOKENS} token ids per request: shorten it.", code="prompt_too_large")


def parse_chat(body) -> Job:
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", None, "invalid_json")
    model = _model(body)
    messages = _messages(body)
    size = _text_bytes(messages)
    if size > MAX_PROMPT_BYTES:
        raise _too_large("text of the messages", f"{size} bytes")
    stream, include_usage = _stream(body)
    kw = _common(body, "chat")
    tools = tools_.parse_tools(body)
    top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if _bool(body, "logprobs"):
        kw["logprobs"] = top or 0
    elif top:
        raise bad_request("Invalid value for 'top_logprobs': it needs 'logprobs' set to true.", "top_logprobs",
                          "invalid_value")
    constraint = tools.constraint()
    _check_max_digits(kw, constraint)
    gen = {**constraint, **kw, "messages": messages, "tools": tools.openai_tools() or None}
    return Job("chat", model, gen, stream=stream, include_usage=include_usage, tools=tools, logprobs=kw.get("logprobs"),
               max_tokens_key=_max_tokens_key(body))


def parse_completion(body) -> Job:
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", None, "invalid_json")
    model = _model(body)
    p = body.get("prompt")
    if p is None:
        raise bad_request("Missing required parameter: 'prompt'.", "prompt", "missing_required_parameter")
    # one prompt: a string, a one-string array, or an array of token ids
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    prompt, prompt_ids = None, None
    if isinstance(p, str):
        if not p:
            raise bad_request("Invalid value for 'prompt': the prompt is empty.", "prompt", "invalid_value")
        if len(p.encode()) > MAX_PROMPT_BYTES:
            raise _too_large("prompt", f"{len(p.encode())} bytes")
        prompt = p
    elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        if len(p) > MAX_PROMPT_TOKENS:
            raise _too_large("prompt", f"{len(p)} token ids")
        bad = next((t for t in p if not 0 <= t <= MAX_TOKEN_ID), None)
        if bad is not None:  # past int64 the request could not even be encoded for the daemon
            raise bad_request(f"Invalid value for 'prompt': token id {shown(str(bad))} is not in 0..{MAX_TOKEN_ID} "
                              "(ids index the model's vocabulary).", "prompt", "invalid_value")
        prompt_ids = list(p)
    elif isinstance(p, list) and len(p) > 1:
        raise bad_request("Several prompts in one request are not supported by this server: send one prompt per "
                          "request.", "prompt", "unsupported_value")
    else:
        raise bad_request("Invalid type for 'prompt': expected a string, an array of one string, or an array of "
                          "token ids.", "prompt", "invalid_type")
    stream, include_usage = _stream(body)
    kw = _common(body, "completion")
    schema = tools_.parse_response_format(body)  # not OpenAI's on this endpoint; vLLM's and ours
    constraint = {} if schema is None else tools_.sized_constraint("json_schema", json.dumps(schema), "response_format")
    _check_max_digits(kw, constraint)
    kw.update(constraint)
    logprobs = _integer(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    echo = _bool(body, "echo")
    if logprobs is not None:
        kw["logprobs"] = logprobs
    if echo:
        kw["prompt_logprobs"] = logprobs is not None
    job = Job("completion", model, kw, prompt=prompt, stream=stream, include_usage=include_usage, logprobs=logprobs,
              echo=echo, max_tokens_key=_max_tokens_key(body))
    if prompt_ids is not None:
        job.generate["prompt_ids"] = prompt_ids
    return job


# ---- responses -------------------------------------------------------------------------------

def usage_object(usage: dict) -> dict:
    """OpenAI's usage from the daemon's; cached_tokens: prompt tokens the prefix cache held."""
    p, c = usage["prompt_tokens"], usage["completion_tokens"]
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": usage.get("cached_prompt_tokens", 0)}}


def chat_logprobs(entries) -> dict:
    """Chat's logprobs object from the client library's TokenLogprob entries, as OpenAI's: each
    token's text (piece_text: a part of a character is "bytes:\\xe6\\x97") and its bytes, its
    alternatives' too. The end-of-generation token adds no text and is left out, so the chosen
    tokens' bytes, joined, are the content's."""
    def one(t) -> dict:
        return {"token": piece_text(t.piece), "logprob": t.logprob, "bytes": list(t.piece)}
    return {"content": [one(t) | {"top_logprobs": [one(a) for a in t.top]} for t in entries if not t.special],
            "refusal": None}


class TextOffset:
    """Where the next token's text starts in the whole text, in characters: a token that holds
    part of a character starts where that character does."""

    def __init__(self, start: int = 0):
        self.at = start
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def advance(self, piece: bytes) -> int:
        """The offset of the token with bytes `piece`; the next one's follows."""
        at = self.at
        self.at += len(self._decoder.decode(piece))
        return at


def completion_logprobs(entries, offset: TextOffset, *, first=None) -> dict:
    """The legacy completions logprobs object; first: a prompt's first token's bytes, which has
    no log-probability. offset: where the next token's text starts (advanced here). The
    end-of-generation token is left out, as in chat_logprobs."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def add(piece: bytes, lp, top) -> None:
        out["tokens"].append(piece_text(piece))
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset.advance(piece))
    if first is not None:
        add(first, None, None)
    for t in entries:
        if not t.special:
            add(t.piece, t.logprob, {piece_text(a.piece): a.logprob for a in t.top})
    return out


def completion_object(job: Job, model: str, text: str | None, finish_reason: str | None, usage: dict, *,
                      logprobs: dict | None = None, tool_calls: list | None = None) -> dict:
    reason = FINISH.get(finish_reason or "", "stop")
    if job.kind == "chat":
        message = {"role": "assistant", "content": text, "refusal": None}
        if tool_calls:
            message["tool_calls"], reason = tool_calls, "tool_calls"
        choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}
        obj = "text_completion"
    return {"id": job.id, "object": obj, "created": job.created, "model": model, "choices": [choice],
            "usage": usage, "system_fingerprint": None}


def chunk_object(job: Job, model: str, text: str | None, finish_reason: str | None, *, first: bool = False,
                 logprobs: dict | None = None, tool_calls: list | None = None) -> dict:
    """One streamed chunk; `text` None and no finish_reason never happens (nothing to say).
    tool_calls: whole calls, each in one delta (its arguments complete)."""
    reason = FINISH.get(finish_reason) if finish_reason else None
    if job.kind == "chat":
        delta = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(tool_calls)]
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
        obj = "text_completion"
    out = {"id": job.id, "object": obj, "created": job.created, "model": model, "choices": [choice],
           "system_fingerprint": None}
    if job.include_usage:
        out["usage"] = None
    return out


def usage_chunk(job: Job, model: str, usage: dict) -> dict:
    """The last chunk when stream_options.include_usage: no choices, the whole request's usage."""
    obj = "chat.completion.chunk" if job.kind == "chat" else "text_completion"
    return {"id": job.id, "object": obj, "created": job.created, "model": model, "choices": [], "usage": usage,
            "system_fingerprint": None}
