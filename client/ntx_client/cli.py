"""ntx-client: talk to ntransformerd from a shell. Uses only ntx_client's public API.

    ntx-client generate "Why is the sky blue?"            # through the model's chat template
    ntx-client generate --raw --temperature 0 --max-tokens 32 --json "Once upon a time"
    ntx-client generate --wait "Hello"                    # waits for a loading daemon
    ntx-client generate --json-schema person.json "Describe a person"   # output valid against it
    ntx-client chat | status | models | tokenize TEXT

Sampling defaults are shared with `ntx-model run`: temperature 0.8 (the daemon's own default),
and through the chat template a repetition penalty of 1.1, which keeps greedy or low-temperature
chats out of loops; --repeat-penalty 1 turns it off.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import grpc

from ntx_client.channels import TLS, TargetError
from ntx_client.client import Client, collect
from ntx_proto.cli import CHAT_REPETITION_PENALTY, DEFAULT_TEMPERATURE, StatusLine  # noqa: F401 - StatusLine: cli.StatusLine
from ntx_client.errors import ConnectionFailed, NtxError
from ntx_proto.states import ServingState



def sampling_options(args, *, chat: bool = False) -> dict:
    """The Client call's sampling keywords from parsed generate/chat flags: the defaults of
    every command line (DEFAULT_TEMPERATURE; through the chat template CHAT_REPETITION_PENALTY)."""
    penalty = args.repeat_penalty
    if penalty is None and chat:
        penalty = CHAT_REPETITION_PENALTY
    return dict(max_tokens=args.max_tokens,
                temperature=DEFAULT_TEMPERATURE if args.temperature is None else args.temperature,
                top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, repetition_penalty=penalty,
                frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty,
                seed=args.seed, stop=args.stop or (), ignore_eos=args.ignore_eos,
                speculative=args.speculative or "")


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, help="most tokens to generate (default: the daemon's)")
    p.add_argument("--temperature", type=float,
                   help=f"0 (or below 1e-5) = greedy (default {DEFAULT_TEMPERATURE}, as ntx-model run and the daemon)")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--min-p", type=float)
    p.add_argument("--repeat-penalty", "--repetition-penalty", type=float, dest="repeat_penalty",
                   help=f"divide the logits of recent tokens, 0.01..100; 1 = off (default 1, or "
                        f"{CHAT_REPETITION_PENALTY} through the chat template)")
    p.add_argument("--frequency-penalty", type=float, help="subtract per occurrence of a token (-2..2, default 0)")
    p.add_argument("--presence-penalty", type=float, help="subtract once for any token seen (-2..2, default 0)")
    p.add_argument("--seed", type=int, help="same seed, same output")
    p.add_argument("--stop", action="append", metavar="S", help="stop at this string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-generation")
    p.add_argument("--speculative", metavar="MODE", help="speculative decoding: off, auto, ngram, draft, skip, "
                   "prefix (default: the daemon's); lossless, it changes only the speed")
    p.add_argument("--wait", action="store_true",
                   help="wait for a starting or loading daemon, showing its load progress on a terminal")
    p.add_argument("--wait-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="how long --wait waits (default 600)")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def wait_until_serving(client: Client, timeout: float, *, line: StatusLine | None = None,
                       sleep=time.sleep, clock=time.monotonic) -> None:
    """Return once the daemon serves; meanwhile show its load progress. Every state that becomes
    serving by itself is waited through: no socket yet (or one not answering yet), starting,
    loading, draining (a model being replaced, a restart). A failed model, no model (both need
    `ntx-admin model load`) or running out of time raise."""
    line = line or StatusLine()
    end, last = clock() + timeout, None
    try:
        while True:
            try:
                s = client.status()
            except NtxError as e:  # not started yet, still binding, or going away for a restart
                if not isinstance(e, ConnectionFailed) and e.code != grpc.StatusCode.UNAVAILABLE:
                    raise
                s, last = None, e
                line.show("waiting for ntransformerd to start")
            if s is not None:
                state = ServingState(s.state)
                if state is ServingState.SERVING:
                    return
                if state is ServingState.FAILED:
                    raise NtxError(f"ntransformerd is not serving: {s.error or 'see its log (journalctl -u ntransformerd)'}")
                if state is ServingState.NO_MODEL:
                    raise NtxError("ntransformerd has no model loaded: load one with sudo ntx-admin model load PATH")
                line.show(f"waiting for ntransformerd: {s.load_progress or state}"
                          + (f" ({s.load_fraction:.0%})" if state is ServingState.LOADING else ""))
            if clock() >= end:
                raise last or NtxError(f"ntransformerd did not finish loading within {timeout:g} s")
            sleep(0.25)
    finally:
        line.close()


def _stream(chunks, out=None) -> list[str]:
    """Write chunks' text as it comes; return it. Closing the iterator cancels the request."""
    out = out or sys.stdout
    text = []
    try:
        for c in chunks:
            out.write(c.text)
            out.flush()
            text.append(c.text)
    finally:
        chunks.close()
    return text


def _read_file(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise SystemExit(f"ntx-client: {flag} {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None


def _constraint(args) -> dict:
    """--json-schema FILE | --regex RE | --grammar FILE as generate()'s keywords."""
    if args.json_schema:
        return {"json_schema": _read_file(args.json_schema, "--json-schema")}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.grammar:
        return {"grammar": _read_file(args.grammar, "--grammar")}
    return {}


def cmd_generate(client: Client, args) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.wait:
        wait_until_serving(client, args.wait_timeout)
    extra = _constraint(args) | ({"logprobs": args.logprobs} if args.logprobs is not None else {})
    if args.raw:
        if args.system:
            raise SystemExit("ntx-client: --system needs the chat template: drop --raw")
        chunks = client.generate(prompt, **sampling_options(args), **extra)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}]
        chunks = client.chat(messages, **sampling_options(args, chat=True), **extra)
    if args.json:
        def tee():
            for c in chunks:
                print(json.dumps({"text": c.text, "ids": c.ids}, ensure_ascii=False), flush=True)
                yield c
        done = collect(tee())
        out = {"ids": done.ids, "text": done.text, "prompt_ids": done.prompt_ids,
               "finish_reason": done.finish_reason, "usage": done.usage}
        if args.logprobs is not None:
            out["logprobs"] = [{"id": t.id, "logprob": t.logprob, "top": [[a.id, a.logprob] for a in t.top]}
                               for t in done.logprobs]
        print(json.dumps(out, ensure_ascii=False))
        return 0
    _stream(chunks)
    sys.stdout.write("\n")
    return 0


CHAT_HELP = """\
  /help           this help
  /system TEXT    set the system message and start the conversation over (/system alone: none)
  /clear          forget the conversation (the system message stays)
  /exit           leave (also /bye, /quit, Ctrl-D)
  Ctrl-C stops a reply and keeps the conversation; arrow keys edit the line and recall history."""


def _line_editing() -> None:
    """Arrow keys and history for input(): readline takes over the terminal once imported."""
    try:
        import readline  # noqa: F401  # lazy: importing it takes over the terminal, for the chat only
    except ImportError:  # a Python built without it still chats, without editing
        pass


def cmd_chat(client: Client, args) -> int:
    system = args.system
    history: list[dict] = []
    interactive = sys.stdin.isatty()
    if interactive:
        _line_editing()
        print("ntx-client chat: type a message; /help for commands, /exit or Ctrl-D to leave.", file=sys.stderr)
    if args.wait:
        wait_until_serving(client, args.wait_timeout)
    while True:
        try:
            line = input(">>> " if interactive else "")
        except EOFError:
            if interactive:
                sys.stdout.write("\n")
            return 0
        except KeyboardInterrupt:  # at the prompt: a fresh line, as in a shell
            sys.stdout.write("\n")
            continue
        if not line.strip():
            continue
        if line.startswith("/"):
            word, _, rest = line.strip().partition(" ")
            if word in ("/exit", "/bye", "/quit"):
                return 0
            if word == "/help":
                print(CHAT_HELP)
            elif word == "/clear":
                history.clear()
                print("(conversation cleared)")
            elif word == "/system":
                system, history = rest.strip() or None, []
                print(f"(system message {'set' if system else 'removed'}; conversation cleared)")
            else:
                print(f"unknown command {word}: /help lists them (start the line with a space to send it as text)")
            continue
        history.append({"role": "user", "content": line})
        messages = ([{"role": "system", "content": system}] if system else []) + history
        reply: list[str] = []
        try:
            reply = _stream(client.chat(messages, **sampling_options(args, chat=True)))
        except KeyboardInterrupt:  # the request is cancelled; the conversation goes on
            print("\n(stopped)")
            history.pop()  # the turn was not answered: as if not asked
            continue
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(reply)})


def as_dict(m) -> dict:
    """A proto message as a dict for JSON: every field, zero ones too, numbers as numbers
    (json_format writes 64-bit integers as strings and leaves zeros out), enums by name."""
    out = {}
    for f in m.DESCRIPTOR.fields:
        v = getattr(m, f.name)
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            value_field = f.message_type.fields_by_name["value"]
            out[f.name] = {k: as_dict(x) if value_field.message_type else x for k, x in v.items()}
        elif f.is_repeated:
            out[f.name] = [as_dict(x) if f.message_type else _scalar(f, x) for x in v]
        elif f.message_type is not None:
            out[f.name] = as_dict(v)
        else:
            out[f.name] = _scalar(f, v)
    return out


def _scalar(f, v):
    if f.enum_type is not None:
        value = f.enum_type.values_by_number.get(v)
        return value.name if value is not None else v
    return v


def _table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())


def cmd_status(client: Client, args) -> int:
    s = client.status()
    if args.json:
        print(json.dumps(as_dict(s), indent=2))
        return 0
    state = str(ServingState(s.state))
    if s.state == ServingState.LOADING:
        state += f" ({s.load_progress}, {s.load_fraction:.0%})"
    tiers = ", ".join(f"{t.name} {t.layers} layers {_human(t.bytes)}" for t in s.tiers) or "-"
    _table([("MODEL", "BACKEND", "STATE", "TIERS", "RSS", "VRAM", "PINNED", "LIVE", "QUEUED", "BATCH", "SLOTS FREE",
             "TOK/S"),
            (s.model or "-", s.backend or "-", state, tiers, _human(s.memory_bytes), _human(s.vram_bytes),
             _human(s.pinned_bytes), str(s.live_requests), str(s.queued_requests), f"{s.batch_size}/{s.max_batch}",
             str(s.free_slots), f"{s.tokens_per_second:.1f}")])
    for t in s.tiers:
        print(_tier_line(t))
    for p in s.placements:
        measured = f"{p.measured_step_seconds * 1e3:.2f} ms over {p.steps} steps" if p.steps else "no steps yet"
        print(f"  steps of ≤ {p.rows} rows: host {len(p.host_layers)} layers [{_span(p.host_layers)}], link "
              f"{p.link_layers}; predicted {p.predicted_step_seconds * 1e3:.2f} ms (layers only), measured {measured}")
    if s.HasField("kv") and s.kv.dtype:
        print(_kv_line(s.kv))
    if s.skip_layers:
        print(f"  skipped layers: {','.join(map(str, s.skip_layers))}")
    sp = s.speculation
    if sp.passes or sp.default_mode not in ("", "off"):
        print(f"  speculation: default {sp.default_mode or 'off'}{', draft ' + sp.draft_model if sp.draft_model else ''}; "
              f"{sp.passes} passes, acceptance {sp.acceptance:.0%}, {sp.tokens_per_pass:.2f} tokens per pass")
    if s.error:
        print(f"error: {s.error}")
    return 0


def _kv_line(kv) -> str:
    """The KV pool and what the plan weighed: bytes per token, the pool's blocks and tokens, how
    full it is, the layers resident with it and with the other KV types at the same pool."""
    line = f"  KV: {kv.dtype}, {kv.bytes_per_token / 1024:.1f} KiB per token"
    if kv.blocks:
        line += (f"; pool {kv.blocks} blocks x {kv.block_size} = {kv.pool_tokens} tokens ({_human(kv.pool_bytes)}), "
                 f"{kv.used_blocks} in use ({kv.shared_blocks} shared); max_ctx {kv.max_ctx} per sequence")
    line += f"; {kv.resident_layers} layers resident"
    others = [f"{t} {n}" for t, n in sorted(kv.resident_by_dtype.items()) if t != kv.dtype]
    if others:
        line += f" (with {', '.join(others)} at this pool)"
    if kv.spill_limit_bytes:
        line += (f"; spill {_human(kv.spilled_bytes)} of {_human(kv.spill_limit_bytes)}, "
                 f"{kv.spilled_blocks_total} blocks out, {kv.restored_blocks_total} restored")
    return line


def _span(ids) -> str:
    """Sorted layer indices as ranges: 0-3,7,9-10."""
    parts, ids = [], sorted(ids)
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts) or "-"


def _tier_line(t) -> str:
    """One tier of `status`: its plan, and for the storage tier what its source has read."""
    line = f"  tier {t.name}: {t.layers} layers, {_human(t.bytes)}, streamed {_human(t.bytes_per_second)}/s"
    if t.source:
        line += (f"\n    source {t.source}: read {_human(t.read_bytes)} in {t.reads} reads "
                 f"({_human(t.read_bytes_per_second)}/s while reading), {t.commands} commands, "
                 f"{t.commands_in_flight} in flight (max {t.max_commands_in_flight}), {t.read_errors} errors")
        if t.last_error:
            line += f"\n    last error: {t.last_error}"
    return line


def cmd_models(client: Client, args) -> int:
    m = client.model()
    if args.json:
        print(json.dumps(as_dict(m), indent=2))
        return 0
    _table([("ID", "ARCH", "SIZE", "LAYERS", "CONTEXT", "BACKEND", "FILE"),
            (m.name, m.architecture, _human(m.file_bytes), str(m.n_layers), str(m.context_length), m.backend, m.path)])
    general = m.metadata.get("general.name")
    if general:
        print(f"  name in the file: {general}" + (f" ({m.description})" if m.description and m.description != general
                                                  else ""))
    if m.aliases:
        print(f"  requests may also name it: {', '.join(m.aliases)}")
    if m.plan.explanation:
        print(f"  plan: {m.plan.explanation}")
    return 0


def cmd_tokenize(client: Client, args) -> int:
    text = sys.stdin.read() if args.text == "-" else args.text
    print(json.dumps(client.tokenize(text, add_special=not args.no_special)))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ntx-client", description="Talk to ntransformerd.")
    p.add_argument("--socket", help="daemon socket (default $NTX_SOCKET or /run/ntransformer/ntransformerd.sock)")
    p.add_argument("--timeout", type=float, help="seconds before a call gives up")
    p.add_argument("--target", action="append", metavar="HOST:PORT",
                   help="a daemon on TCP with TLS instead of the socket (repeat for several, round-robin)")
    p.add_argument("--tls-ca", help="CA of the daemons' certificates (PEM)")
    p.add_argument("--tls-cert", help="this client's certificate (PEM)")
    p.add_argument("--tls-key", help="the key of --tls-cert (PEM)")
    p.add_argument("--tls-server-name", help="name in the daemons' certificates (default: the first target's host)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    g = sub.add_parser("generate", help="stream a completion")
    g.add_argument("prompt", metavar="PROMPT", help="the prompt ('-' reads stdin)")
    g.add_argument("--chat", action="store_true", help="through the model's chat template (the default)")
    g.add_argument("--raw", action="store_true", help="send PROMPT as is, without the chat template")
    g.add_argument("--system", help="system message (chat)")
    g.add_argument("--json", action="store_true", help="one JSON object per chunk; the last has ids and text")
    k = g.add_mutually_exclusive_group()
    k.add_argument("--json-schema", metavar="FILE", help="the output is JSON valid against the JSON Schema in FILE")
    k.add_argument("--regex", metavar="RE", help="the output matches the regular expression RE as a whole")
    k.add_argument("--grammar", metavar="FILE", help="the output is a sentence of the Lark or GBNF grammar in FILE")
    g.add_argument("--logprobs", type=int, metavar="N",
                   help="with --json: each token's log-probability and its N (0..20) most likely alternatives'")
    _add_sampling(g)
    c = sub.add_parser("chat", help="interactive chat, history kept (/help for commands, /exit to leave)")
    c.add_argument("--system", help="system message")
    _add_sampling(c)
    s = sub.add_parser("status", help="the daemon: model, tiers, memory, throughput")
    s.add_argument("--json", action="store_true")
    m = sub.add_parser("models", help="the loaded model")
    m.add_argument("--json", action="store_true")
    t = sub.add_parser("tokenize", help="print the token ids of TEXT as JSON")
    t.add_argument("text", metavar="TEXT", help="the text ('-' reads stdin)")
    t.add_argument("--no-special", action="store_true", help="no BOS/EOS")
    return p


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "status": cmd_status, "models": cmd_models,
            "tokenize": cmd_tokenize}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "generate" and args.raw and args.chat:
        print("ntx-client: --raw and --chat exclude each other", file=sys.stderr)
        return 2
    tls = TLS(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key, server_name=args.tls_server_name) \
        if args.tls_ca and args.tls_cert and args.tls_key else None
    try:
        with Client(args.socket, targets=args.target, tls=tls, timeout=args.timeout) as client:
            return COMMANDS[args.command](client, args)
    except (NtxError, TargetError) as e:
        print(f"ntx-client: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
