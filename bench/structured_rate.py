"""Structured output and tool calls that end: how often answers finish with "stop" and parse.

    python bench/structured_rate.py                      # a CPU daemon and ntx-openai on the default model
    python bench/structured_rate.py --code /tmp/old      # the same programs from another checkout (before/after)
    python bench/structured_rate.py --layout llama       # each schema asks for llama.cpp's whitespace
    python bench/structured_rate.py --smoke              # a tiny synthetic model, one of each: does it run?

Through the OpenAI gateway, as a client sees it, sampled at --temperature (0.8) with seeds 0..4:
- schemas: ten response_format json_schema requests, five strict with closed objects (as
  Pydantic writes them), five not strict with open ones (as schemas are often written by hand),
  and one json_object; an answer counts when it ends with finish_reason "stop" and its content
  is JSON that holds the schema's required keys;
- tools, tool_choice "auto": prompts that ask for the tool and prompts that do not; the rate of
  answers that call it (for the first set, the higher the better; for the second, the lower);
- tools, tool_choice "required": a function whose parameters leave additionalProperties open;
  an answer counts when it ends with "tool_calls" and its arguments parse;
- the call's opening: the log-probability the model gives the first characters of a call in the
  checkout's own format (`<tool_call>[`, or `{"tool_calls": [` before it), right after each
  prompt (the daemon's prompt log-probabilities): how likely the model is to choose a call.

The checkout's own programs run (PYTHONPATH=<code>/daemon:<code>/client:<code>/proto), so one script measures
the code before and after a change. Prints a table per set and writes JSON
(bench/out/structured_rate.json by default).
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import common
from ntx_client import Client


def _obj(props: dict, *, closed: bool = True) -> dict:
    """An object schema with every property required: closed, as Pydantic writes it for
    chat.completions.parse, or open (no additionalProperties), as schemas are often written by hand."""
    return {"type": "object", "properties": props, "required": list(props),
            **({"additionalProperties": False} if closed else {})}


STR, INT, NUM, BOOL = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
# (name, the user's request, the schema, strict): five closed and sent strict, five open and not
SCHEMAS = [
    ("city", "Describe a large city as JSON.", _obj({"name": STR, "population": {"type": "integer", "minimum": 0},
                                                      "capital": BOOL}), True),
    ("book", "Recommend a book, as JSON.", _obj({"title": STR, "author": STR, "year": INT, "rating": NUM}), True),
    ("point", "Give a point in 3D space as JSON.", _obj({"x": NUM, "y": NUM, "z": NUM}), True),
    ("order", "Write an example shop order as JSON.",
     _obj({"id": INT, "items": {"type": "array", "items": _obj({"sku": STR, "qty": INT, "price": NUM})},
           "total": NUM}), True),
    ("movie", "Describe a famous movie as JSON.",
     _obj({"title": STR, "year": INT, "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "action",
                                                                                       "horror", "sci-fi"]}},
           "rating": NUM}), True),
    ("person", "Invent a person and give their details as JSON.", _obj({"name": STR, "age": INT, "email": STR},
                                                                        closed=False), False),
    ("recipe", "Give me a simple recipe as JSON.", _obj({"name": STR, "ingredients": {"type": "array", "items": STR},
                                                         "minutes": INT}, closed=False), False),
    ("weather", "Report today's weather in Paris as JSON.",
     _obj({"city": STR, "temperature_c": NUM, "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]}},
          closed=False), False),
    ("planet", "Describe a planet of the solar system as JSON.",
     _obj({"name": STR, "moons": INT, "mass_kg": NUM, "has_rings": BOOL}, closed=False), False),
    ("measurement", "Give a lab measurement with its uncertainty as JSON.",
     _obj({"quantity": STR, "value": NUM, "uncertainty": NUM, "unit": STR}, closed=False), False),
]
OPEN_OBJECT = ("json_object", "Describe your favourite animal as a JSON object.", None, False)
# llguidance's layout options for llama.cpp's JSON whitespace, `| " " | "\n" [ \t]{0,20}`
LAYOUTS = {"default": None, "llama": {"whitespace_pattern": r"( |\n[ \t]{0,20})", "item_separator": ",",
                                      "key_separator": ":"}}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": STR, "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}  # additionalProperties left open, as many clients write it
ASK_TOOL = ["What's the weather in Paris right now?", "Is it raining in Tokyo? Check the weather for me.",
            "Use the weather tool to get the weather in Berlin.", "How warm is it in New York, in fahrenheit?",
            "Check the current weather in Madrid."]
NO_TOOL = ["Write a haiku about autumn.", "What is 2 + 2?", "Tell me a short joke about cats.",
           "Translate 'good morning' into French.", "Who wrote Hamlet?"]


class Gateway:
    """ntx-openai of `code` on a free port, in front of `sock`."""

    def __init__(self, code: str, sock: str, directory: str, env: dict):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen([sys.executable, "-m", "ntx_client.openai_gateway.main", "--socket", sock,
                                      "--port", str(self.port), "--log-level", "warning"],
                                     stderr=open(os.path.join(directory, "gateway.log"), "w"), env=env)
        end = time.monotonic() + 60
        while True:
            try:
                if self.request("GET", "/health")[0] == 200:
                    break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > end:
                raise SystemExit(f"ntx-openai did not come up; see {directory}/gateway.log")
            time.sleep(0.2)

    def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=900)
        try:
            conn.request(method, path, body=None if body is None else json.dumps(body),
                         headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            return r.status, json.loads(r.read() or b"null")
        finally:
            conn.close()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def _has_keys(text: str, schema: dict | None) -> bool:
    try:
        doc = json.loads(text)
    except (TypeError, ValueError):
        return False
    if schema is None:
        return isinstance(doc, dict)
    return isinstance(doc, dict) and set(schema["required"]) <= set(doc)


def schema_job(gw: Gateway, model: str, case, seed: int, args) -> dict:
    name, prompt, schema, strict = case
    layout = LAYOUTS[args.layout]
    sent = schema if layout is None or schema is None else {**schema, "x-guidance": layout}
    fmt = ({"type": "json_object"} if schema is None else
           {"type": "json_schema", "json_schema": {"name": name, "schema": sent, "strict": strict}})
    status, r = gw.request("POST", "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": prompt}], "response_format": fmt,
        "temperature": args.temperature, "seed": seed, "max_tokens": args.max_tokens})
    if status != 200:
        return dict(schema=name, seed=seed, status=status, error=r.get("error", {}).get("message"), ok=False)
    choice = r["choices"][0]
    text = choice["message"]["content"]
    ok = choice["finish_reason"] == "stop" and _has_keys(text, schema)
    return dict(schema=name, seed=seed, status=status, finish=choice["finish_reason"], ok=ok,
                tokens=r["usage"]["completion_tokens"], text=text if not ok else text[:200])


def tool_job(gw: Gateway, model: str, prompt: str, seed: int, choice: str, args) -> dict:
    status, r = gw.request("POST", "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": prompt}], "tools": [WEATHER], "tool_choice": choice,
        "temperature": args.temperature, "seed": seed, "max_tokens": args.max_tokens})
    if status != 200:
        return dict(prompt=prompt, seed=seed, status=status, error=r.get("error", {}).get("message"), called=False,
                    valid=False)
    c = r["choices"][0]
    calls = c["message"].get("tool_calls") or []
    valid = bool(calls) and c["finish_reason"] == "tool_calls"
    for call in calls:
        try:
            valid = valid and isinstance(json.loads(call["function"]["arguments"]), dict)
        except ValueError:
            valid = False
    return dict(prompt=prompt, seed=seed, status=status, finish=c["finish_reason"], called=bool(calls), valid=valid,
                tokens=r["usage"]["completion_tokens"], content=(c["message"].get("content") or "")[:200],
                calls=[x["function"] for x in calls])


def opening_logprobs(sock: str, prompts: list[str]) -> tuple[str, list[float]]:
    """(the call's opening in the daemon's generic format, log P of it right after each prompt)."""
    with Client(sock, timeout=600) as c:
        shown = c.detokenize(c.tokenize(messages=[{"role": "user", "content": "x"}], tools=[WEATHER]))
        opening = "<tool_call>[" if "<tool_call>" in shown else '{"tool_calls": ['
        tail = c.tokenize(opening, add_special=False, parse_special=False)
        out = []
        for q in prompts:
            ids = c.tokenize(messages=[{"role": "user", "content": q}], tools=[WEATHER])
            done = c.complete(prompt_ids=ids + tail, max_tokens=1, temperature=0, prompt_logprobs=True, logprobs=0,
                              prefix_cache=False)
            out.append(sum(t.logprob for t in done.prompt_logprobs[-len(tail):]))
    return opening, out


def _rate(rows: list[dict], key: str) -> str:
    n = sum(1 for r in rows if r[key])
    return f"{n}/{len(rows)} ({n / len(rows):.0%})" if rows else "-"


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__file__, __doc__)
    p.add_argument("--code", default=os.path.join(common.HERE, os.pardir),
                   help="the checkout whose daemon and gateway run (default: this one)")
    p.add_argument("--model", help="model for the daemon (default: the default model)")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--clients", type=int, default=8, help="requests in flight at once")
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="default",
                   help="the schemas' JSON layout: the daemon's (default) or llama.cpp's whitespace (x-guidance)")
    p.add_argument("--dir", help="where the daemon's socket and logs go (default: a temporary directory)")
    args = p.parse_args(argv)

    code = os.path.abspath(args.code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(code, "daemon"), os.path.join(code, "client"),
                                                        os.path.join(code, "proto"),
                                                        *filter(None, [os.environ.get("PYTHONPATH")])])}
    directory = args.dir or tempfile.mkdtemp(prefix="ntx-structured-")
    os.makedirs(directory, exist_ok=True)
    schemas, tool_sets = SCHEMAS + [OPEN_OBJECT], (ASK_TOOL, NO_TOOL)
    model_flags = ["--model", args.model] if args.model else []
    if args.smoke:
        model_flags = ["--model", common.synthetic(directory)]
        args.seeds, args.max_tokens = 1, 12
        schemas, tool_sets = [SCHEMAS[0], OPEN_OBJECT], (ASK_TOOL[:1], NO_TOOL[:1])
    os.environ["PYTHONPATH"] = env["PYTHONPATH"]  # start_daemon's child inherits it
    proc, sock = common.start_daemon(directory, ["--backend", "cpu", "--max-batch", str(args.clients),
                                                 "--speculative", "off", *model_flags])
    gw = None
    try:
        gw = Gateway(code, sock, directory, env)
        model = gw.request("GET", "/v1/models")[1]["data"][0]["id"]
        seeds = range(args.seeds)
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
            schema_rows = list(pool.map(lambda a: schema_job(gw, model, *a, args),
                                        [(c, s) for c in schemas for s in seeds]))
            auto_rows = {label: list(pool.map(lambda a: tool_job(gw, model, *a, "auto", args),
                                              [(q, s) for q in prompts for s in seeds]))
                         for label, prompts in zip(("asks", "does_not_ask"), tool_sets)}
            required_rows = list(pool.map(lambda a: tool_job(gw, model, *a, "required", args),
                                          [(q, s) for q in tool_sets[0] for s in seeds]))
        opening = {label: opening_logprobs(sock, prompts) for label, prompts in zip(("asks", "does_not_ask"),
                                                                                    tool_sets)}
        seconds = time.monotonic() - t0
    finally:
        if gw is not None:
            gw.stop()
        common.stop_daemon(proc)
    print(f"code {code}, model {model}, layout {args.layout}, temperature {args.temperature}, "
          f"seeds 0..{args.seeds - 1}, max_tokens {args.max_tokens}, {seconds:.0f} s")
    print(f"{'schema':<12} {'stop+parse':>10}  finish reasons")
    per_schema = {}
    for name in dict.fromkeys(r["schema"] for r in schema_rows):
        rows = [r for r in schema_rows if r["schema"] == name]
        per_schema[name] = sum(r["ok"] for r in rows)
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(
            {f: sum(1 for r in rows if r.get("finish", f"http {r['status']}") == f) for f in
             {r.get("finish", f"http {r['status']}") for r in rows}}.items()))
        print(f"{name:<12} {per_schema[name]:>7}/{len(rows)}  {reasons}")
    print(f"{'all':<12} {_rate(schema_rows, 'ok'):>10}")
    print(f"tools auto, prompts that ask for the tool:  called {_rate(auto_rows['asks'], 'called')}")
    print(f"tools auto, prompts that do not ask:        called {_rate(auto_rows['does_not_ask'], 'called')}")
    print(f"tools required, open parameters:            valid call {_rate(required_rows, 'valid')}")
    for label, (text, lps) in opening.items():
        which = {"asks": "ask for the tool", "does_not_ask": "do not ask"}[label]
        print(f"log P({text}) after the prompts that {which}: mean {sum(lps) / len(lps):.1f} "
              f"({', '.join(f'{x:.1f}' for x in lps)})")
    common.write_json(args.json, dict(
        smoke=args.smoke, code=code, model=model, layout=args.layout, temperature=args.temperature, seeds=args.seeds,
        max_tokens=args.max_tokens, seconds=seconds,
        schemas=dict(ok=sum(r["ok"] for r in schema_rows), total=len(schema_rows), per_schema=per_schema,
                     rows=schema_rows),
        tools_auto={k: dict(called=sum(r["called"] for r in v), total=len(v), rows=v) for k, v in auto_rows.items()},
        tools_required=dict(valid=sum(r["valid"] for r in required_rows), total=len(required_rows),
                            rows=required_rows),
        call_opening={k: dict(text=t, logprobs=v) for k, (t, v) in opening.items()}))
    if not args.dir:
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
