"""Time to first token of a chat's second turn against its first, with the prefix cache on and off.

    python bench/prefix_cache.py                  # starts a CPU daemon on the default model
    python bench/prefix_cache.py --socket /run/ntransformer/ntransformerd.sock --history 4000
    python bench/prefix_cache.py --model 70B.gguf --backend cuda --vram-budget 24GiB
    python bench/prefix_cache.py --smoke     # a daemon on a tiny synthetic model, a short history

Turn 1 sends a history of about --history tokens and a question; turn 2 repeats it with turn 1's
reply and a new question, the way every chat client does. Each turn is timed from the request to
its first streamed token, once with the prefix cache (the default) and once with the request's
opt-out; the daemon's Status counters say how many prompt tokens each turn prefilled. Prints a
table and writes JSON (bench/out/prefix_cache.json by default).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import common
from ntx_client import Client

PARAGRAPH = ("The lighthouse keeper climbed the spiral stairs every evening, counting the steps aloud. "
             "At the top he trimmed the wick, polished the great lens and watched the ships pass. ")


def history(c: Client, tokens: int) -> list[dict]:
    msgs = [{"role": "system", "content": "You are a careful assistant who answers briefly."}]
    i = 0
    while len(c.tokenize(messages=msgs)) < tokens:
        msgs += [{"role": "user", "content": f"Question {i}: " + PARAGRAPH},
                 {"role": "assistant", "content": f"Answer {i}: the keeper trims the wick and counts the steps."}]
        i += 1
    return msgs + [{"role": "user", "content": "Summarise the story in one line."}]


def turn(c: Client, messages, max_tokens: int, cache: bool) -> dict:
    s0 = c.status()
    t0 = time.monotonic()
    first, text, prompt = None, [], 0
    for chunk in c.chat(messages, max_tokens=max_tokens, temperature=0, prefix_cache=cache):
        if first is None:
            first = time.monotonic() - t0
        text.append(chunk.text)
        if chunk.usage:
            prompt = chunk.usage["prompt_tokens"]
    s1 = c.status()
    return dict(ttft_seconds=first, seconds=time.monotonic() - t0, prompt_tokens=prompt,
                prefilled_tokens=s1.prefill_tokens_total - s0.prefill_tokens_total,
                hit_tokens=s1.prefix_hit_tokens_total - s0.prefix_hit_tokens_total, text="".join(text))


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__file__, __doc__)
    p.add_argument("--socket", help="use a running daemon (default: start one on the default model)")
    p.add_argument("--model", help="model for the daemon this starts")
    p.add_argument("--backend", default="cpu")
    p.add_argument("--vram-budget", help="for the daemon this starts, e.g. 24GiB")
    p.add_argument("--history", type=int, default=1000, help="tokens of chat history (default 1000)")
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args(argv)

    proc, socket = None, args.socket
    d = tempfile.mkdtemp(prefix="ntx-bench-")
    if args.smoke:
        args.history, args.max_tokens = 64, 2
        if socket is None and args.model is None:
            args.model = common.synthetic(d, "tiny", vocab=2048)
    if socket is None:
        socket = os.path.join(d, "d.sock")
        cmd = [sys.executable, "-m", "ntransformerd.main", "--socket", socket, "--backend", args.backend,
               "--config", os.devnull, "--max-batch", "4", "--socket-group", "",
               "--max-ctx", str(args.history + 512)]
        if args.model:
            cmd += ["--model", args.model]
        if args.vram_budget:
            cmd += ["--vram-budget", args.vram_budget]
        proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
        while not os.path.exists(socket):
            if proc.poll() is not None:
                raise SystemExit(f"ntransformerd exited {proc.returncode}")
            time.sleep(0.05)
    rows = []
    try:
        with Client(socket) as c:
            c.wait_ready(1800)
            model = c.model()
            if not c.status().prefix_cache:
                raise SystemExit("the daemon runs with prefix_cache = false: turn it on to measure it")
            msgs = history(c, args.history)
            turn(c, [{"role": "user", "content": "Hi"}], 2, cache=False)  # warm up
            for cache in (False, True):
                t1 = turn(c, msgs, args.max_tokens, cache)
                msgs2 = msgs + [{"role": "assistant", "content": t1["text"]},
                                {"role": "user", "content": "Thank you. And in three words?"}]
                t2 = turn(c, msgs2, args.max_tokens, cache)
                rows.append(dict(prefix_cache=cache, turn1=t1, turn2=t2))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        shutil.rmtree(d, ignore_errors=True)
    print(f"model {model.name} ({model.backend}), history {rows[0]['turn1']['prompt_tokens']} tokens, greedy")
    print(f"{'cache':>5}  {'turn':>4}  {'prompt':>6}  {'prefilled':>9}  {'hit':>5}  {'TTFT s':>7}  {'x of turn 1':>11}")
    for r in rows:
        for k in ("turn1", "turn2"):
            t = r[k]
            print(f"{'on' if r['prefix_cache'] else 'off':>5}  {k[-1]:>4}  {t['prompt_tokens']:>6}  "
                  f"{t['prefilled_tokens']:>9}  {t['hit_tokens']:>5}  {t['ttft_seconds']:>7.3f}  "
                  f"{t['ttft_seconds'] / r['turn1']['ttft_seconds']:>11.3f}")
    common.write_json(args.json, dict(model=model.name, backend=model.backend, history_tokens=args.history,
                                      runs=rows, smoke=args.smoke, host=dict(cpus=os.cpu_count(), load=os.getloadavg())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
