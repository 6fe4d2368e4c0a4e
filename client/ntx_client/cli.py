"""ntx-client: talk to ntransformerd from a shell. Uses only ntx_client's public API.

    ntx-client generate "Why is the sky blue?"            # through the model's chat template
    ntx-client generate --raw --temperature 0 --max-tokens 32 --json "Once upon a time"
    ntx-client chat | status | models | tokenize TEXT
"""

from __future__ import annotations

import argparse
import json
import sys

from ntx_client.channels import TLS, TargetError
from ntx_client.client import Client, collect
from ntx_client.errors import NtxError

STATES = {0: "unknown", 1: "no model", 2: "loading", 3: "serving", 4: "draining", 5: "failed"}


def _sampling(args) -> dict:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                min_p=args.min_p, seed=args.seed, stop=args.stop or (), ignore_eos=args.ignore_eos)


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, help="most tokens to generate (default: the daemon's)")
    p.add_argument("--temperature", type=float, help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--min-p", type=float)
    p.add_argument("--seed", type=int, help="same seed, same output")
    p.add_argument("--stop", action="append", metavar="S", help="stop at this string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-generation")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def cmd_generate(client: Client, args) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.raw:
        if args.system:
            raise SystemExit("ntx-client: --system needs the chat template: drop --raw")
        chunks = client.generate(prompt, **_sampling(args))
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}]
        chunks = client.chat(messages, **_sampling(args))
    if args.json:
        seen = []

        def tee():
            for c in chunks:
                print(json.dumps({"text": c.text, "ids": c.ids}, ensure_ascii=False), flush=True)
                seen.append(c)
                yield c
        done = collect(tee())
        print(json.dumps({"ids": done.ids, "text": done.text, "prompt_ids": done.prompt_ids,
                          "finish_reason": done.finish_reason, "usage": done.usage}, ensure_ascii=False))
        return 0
    for c in chunks:
        sys.stdout.write(c.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_chat(client: Client, args) -> int:
    history = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input(">>> " if interactive else "")
        except EOFError:
            break
        if not line.strip():
            continue
        if line.strip() in ("/bye", "/exit", "/quit"):
            break
        history.append({"role": "user", "content": line})
        reply = []
        for c in client.chat(history, **_sampling(args)):
            sys.stdout.write(c.text)
            sys.stdout.flush()
            reply.append(c.text)
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(reply)})
    return 0


def cmd_status(client: Client, args) -> int:
    s = client.status()
    if args.json:
        from google.protobuf.json_format import MessageToDict
        print(json.dumps(MessageToDict(s, preserving_proto_field_name=True), indent=2))
        return 0
    state = STATES.get(s.state, str(s.state))
    if s.state == 2:
        state += f" ({s.load_progress}, {s.load_fraction:.0%})"
    tiers = ", ".join(f"{t.name} {t.layers} layers {_human(t.bytes)}" for t in s.tiers) or "-"
    rows = [("MODEL", "BACKEND", "STATE", "TIERS", "MEMORY", "LIVE", "QUEUED", "BATCH", "SLOTS FREE", "TOK/S"),
            (s.model or "-", s.backend or "-", state, tiers, _human(s.memory_bytes), str(s.live_requests),
             str(s.queued_requests), f"{s.batch_size}/{s.max_batch}", str(s.free_slots), f"{s.tokens_per_second:.1f}")]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    for t in s.tiers:
        print(_tier_line(t))
    if s.error:
        print(f"error: {s.error}")
    return 0


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
        from google.protobuf.json_format import MessageToDict
        print(json.dumps(MessageToDict(m, preserving_proto_field_name=True), indent=2))
        return 0
    print(f"{'NAME':30}  {'ARCH':8}  {'SIZE':>10}  {'LAYERS':>6}  {'CONTEXT':>7}  BACKEND  PATH")
    print(f"{m.name:30}  {m.architecture:8}  {_human(m.file_bytes):>10}  {m.n_layers:>6}  {m.context_length:>7}  "
          f"{m.backend:7}  {m.path}")
    if m.plan.explanation:
        print(f"plan: {m.plan.explanation}")
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
    _add_sampling(g)
    c = sub.add_parser("chat", help="interactive chat, history kept (/bye to leave)")
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
