"""Aggregate generation throughput of ntransformerd at 1 vs N concurrent clients.

    python bench/serving.py                       # starts a CPU daemon on the default model
    python bench/serving.py --socket /run/ntransformer/ntransformerd.sock --clients 1 8 16
    python bench/serving.py --smoke        # a daemon on a tiny synthetic model, 1 and 2 clients: does it run?

Each client sends greedy requests (--max-tokens each, --ignore-eos) back to back for
--requests requests; tok/s = all generated tokens / wall time of the level. Prints a table and
writes JSON (bench/out/serving.json by default).
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import common
from ntx_client import Client

PROMPTS = ["The quick brown fox", "Once upon a time", "def main():", "The capital of France is",
           "In 1905, Albert Einstein", "My favourite recipe is", "import numpy as np", "Dear diary, today"]


def run_level(socket: str, clients: int, requests: int, max_tokens: int) -> dict:
    def client(k: int) -> tuple[int, list[float]]:
        tokens, latencies = 0, []
        with Client(socket) as c:
            for j in range(requests):
                t = time.monotonic()
                r = c.complete(PROMPTS[(k + j) % len(PROMPTS)], max_tokens=max_tokens, temperature=0, ignore_eos=True)
                latencies.append(time.monotonic() - t)
                tokens += len(r.ids)
        return tokens, latencies

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(client, range(clients)))
    wall = time.monotonic() - t0
    tokens = sum(t for t, _ in results)
    lat = sorted(x for _, ls in results for x in ls)
    return dict(clients=clients, requests=clients * requests, tokens=tokens, seconds=wall,
                tokens_per_second=tokens / wall, p50_request_seconds=lat[len(lat) // 2],
                per_client_tokens_per_second=tokens / wall / clients)


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__file__, __doc__)
    p.add_argument("--socket", help="use a running daemon (default: start a CPU one on the default model)")
    p.add_argument("--model", help="model for the daemon this starts")
    p.add_argument("--backend", default="cpu")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    p.add_argument("--requests", type=int, default=2, help="requests per client")
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args(argv)

    proc, socket = None, args.socket
    d = tempfile.mkdtemp(prefix="ntx-bench-")
    if args.smoke:
        args.clients, args.requests, args.max_tokens = [1, 2], 1, 4
        if socket is None and args.model is None:
            args.model = common.synthetic(d, "tiny", vocab=2048)
    if socket is None:
        socket = os.path.join(d, "d.sock")
        cmd = [sys.executable, "-m", "ntransformerd.main", "--socket", socket, "--backend", args.backend,
               "--config", os.devnull, "--max-batch", str(max(args.clients)), "--socket-group", ""]
        if args.model:
            cmd += ["--model", args.model]
        proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
        while not os.path.exists(socket):
            if proc.poll() is not None:
                raise SystemExit(f"ntransformerd exited {proc.returncode}")
            time.sleep(0.05)
    try:
        with Client(socket) as c:
            c.wait_ready(600)
            model = c.model()
        run_level(socket, 1, 1, 4)  # warm up
        rows = [run_level(socket, n, args.requests, args.max_tokens) for n in args.clients]
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        shutil.rmtree(d, ignore_errors=True)
    base = rows[0]["tokens_per_second"]
    print(f"model {model.name} ({model.backend}), {args.max_tokens} tokens per request, greedy")
    print(f"{'clients':>7}  {'requests':>8}  {'tokens':>6}  {'seconds':>7}  {'tok/s':>7}  {'x of 1':>6}  {'p50 req s':>9}")
    for r in rows:
        print(f"{r['clients']:>7}  {r['requests']:>8}  {r['tokens']:>6}  {r['seconds']:>7.1f}  "
              f"{r['tokens_per_second']:>7.1f}  {r['tokens_per_second'] / base:>6.2f}  {r['p50_request_seconds']:>9.2f}")
    common.write_json(args.json, dict(model=model.name, backend=model.backend, max_tokens=args.max_tokens,
                                      levels=rows, speedup={r["clients"]: r["tokens_per_second"] / base for r in rows},
                                      smoke=args.smoke, host=dict(cpus=os.cpu_count(), load=os.getloadavg())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
