"""What the user socket's relay (server/relay.py) adds to a call: its cost per token.

    python bench/relay.py                # a gRPC server process, then a CPU daemon on the default model
    python bench/relay.py --smoke        # a few calls, the tiny synthetic model

The daemon accepts on the user socket itself to learn each client's uid, and passes the bytes on
to its gRPC server; every message crosses one more recv and send. Measured two ways, each
through the relay and straight to the server's own listener (which only the daemon's user may
open):
  - a gRPC server process of its own behind a relay (the relay's own process, as the daemon
    starts it): the round trip of a small unary call, and a stream of small messages, the size
    of a one-token GenerateResponse, read as fast as they come; again with a thread of the
    server's process busy in Python (as the scheduler's is between steps), which the gRPC
    server's threads share the interpreter with (the relay no longer does);
  - the daemon: time to first token and the interval between tokens of greedy generations,
    one at a time and --streams at once.
Prints a table and writes JSON (bench/out/relay.json by default).
"""

from __future__ import annotations

import concurrent.futures
import glob
import multiprocessing
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import grpc

import common
from ntransformerd.server import sockets
from ntransformerd.server.relay import Relay
from ntx_client import Client

TOKEN_MESSAGE = b"x" * 40  # about a GenerateResponse of one token and its text


def _ident(b):
    return b


def serve(directory: str, busy: bool, ready) -> None:
    """A gRPC server with /bench/Echo (unary) and /bench/Tokens (n messages), behind a relay."""
    def echo(request, context):
        return request

    def tokens(request, context):
        for _ in range(int(request)):
            yield TOKEN_MESSAGE
    handler = grpc.method_handlers_generic_handler("bench", {
        "Echo": grpc.unary_unary_rpc_method_handler(echo, _ident, _ident),
        "Tokens": grpc.unary_stream_rpc_method_handler(tokens, _ident, _ident)})
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(8), handlers=[handler])
    public = os.path.join(directory, "user.sock")
    inner = sockets.bind_private(server, public)
    server.start()
    relay = Relay()
    relay.start(sockets.listen(public, mode=sockets.USER_MODE), inner)
    if busy:
        def spin():
            x = 0
            while True:
                x += 1
        threading.Thread(target=spin, daemon=True).start()
    ready.put(inner)
    threading.Event().wait()


def _median_us(xs) -> float:
    return statistics.median(xs) * 1e6


def micro(calls: int, stream: int, busy: bool) -> dict:
    d = tempfile.mkdtemp(prefix="ntx-bench-relay-")
    os.chmod(d, 0o755)
    q = multiprocessing.get_context("fork").Queue()
    proc = multiprocessing.get_context("fork").Process(target=serve, args=(d, busy, q), daemon=True)
    proc.start()
    try:
        inner = q.get(timeout=60)
        out = {}
        for name, path in (("relayed", os.path.join(d, "user.sock")), ("direct", inner)):
            with grpc.insecure_channel(f"unix:{path}") as ch:
                echo = ch.unary_unary("/bench/Echo", _ident, _ident)
                tokens = ch.unary_stream("/bench/Tokens", _ident, _ident)
                for _ in range(max(10, calls // 10)):  # connect and warm up
                    echo(b"ping")
                rtt = []
                for _ in range(calls):
                    t = time.perf_counter()
                    echo(b"ping")
                    rtt.append(time.perf_counter() - t)
                t = time.perf_counter()
                n = sum(1 for _ in tokens(str(stream).encode()))
                per_message = (time.perf_counter() - t) / n
            out[name] = dict(rtt_median_us=_median_us(rtt), rtt_p90_us=statistics.quantiles(rtt, n=10)[-1] * 1e6,
                             stream_us_per_message=per_message * 1e6)
        return out
    finally:
        proc.kill()
        proc.join()
        shutil.rmtree(d, ignore_errors=True)


def generation(c: Client, prompt: str, max_tokens: int) -> tuple[float, float]:
    """(seconds to the first token, the stream's mean interval between later tokens). The daemon joins
    the tokens a slow reader left queued into one message, so per-message gaps would mix zeros with
    whole steps; the span from the first token to the last over the tokens after the first does not."""
    t0 = time.perf_counter()
    first = last = None
    count = 0
    for chunk in c.generate(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True, prefix_cache=False):
        now, n = time.perf_counter(), len(chunk.ids)
        if not n:
            continue
        if first is None:
            first = now
        last, count = now, count + n
    if first is None:
        raise SystemExit("the daemon streamed no token")
    return first - t0, (last - first) / max(1, count - 1)


def daemon_run(model: str | None, backend: str, runs: int, max_tokens: int, streams: int) -> dict:
    d = tempfile.mkdtemp(prefix="ntx-bench-relay-")
    socket = os.path.join(d, "d.sock")
    cmd = [sys.executable, "-m", "ntransformerd.main", "--socket", socket, "--backend", backend, "--config",
           os.devnull, "--max-batch", str(max(2, streams)), "--socket-group", "", "--max-ctx", "512"] + \
        (["--model", model] if model else [])
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    try:
        while not os.path.exists(socket):
            if proc.poll() is not None:
                raise SystemExit(f"ntransformerd exited {proc.returncode}")
            time.sleep(0.05)
        inner = glob.glob(os.path.join(d, ".ntx-grpc-*", "s"))[0]  # the server's own listener, past the relay
        out = {}
        paths = {"relayed": socket, "direct": inner}
        clients = {k: [Client(p) for _ in range(streams)] for k, p in paths.items()}
        try:
            clients["relayed"][0].wait_ready(600)
            for cs in clients.values():
                for c in cs:
                    generation(c, "Hello", 2)  # connect, warm up
            for n in (1, streams):
                ttft = {k: [] for k in paths}
                gaps = {k: [] for k in paths}
                with concurrent.futures.ThreadPoolExecutor(n) as pool:
                    for i in range(runs):  # alternate, so that drifts of the host's load fall on both
                        for k, cs in clients.items():
                            for first, g in pool.map(lambda j: generation(cs[j], f"Story {i}.{j}: once upon a time",
                                                                          max_tokens), range(n)):
                                ttft[k].append(first)
                                gaps[k].append(g)
                for k in paths:
                    out.setdefault(k, {})[f"streams_{n}"] = dict(
                        ttft_median_ms=statistics.median(ttft[k]) * 1e3,
                        token_interval_median_ms=statistics.median(gaps[k]) * 1e3,  # of the streams' means
                        token_interval_mean_ms=statistics.fmean(gaps[k]) * 1e3)
        finally:
            for cs in clients.values():
                for c in cs:
                    c.close()
        return out
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        shutil.rmtree(d, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__file__, __doc__)
    p.add_argument("--calls", type=int, default=2000, help="unary round trips per path (default 2000)")
    p.add_argument("--stream", type=int, default=20000, help="messages in the stream (default 20000)")
    p.add_argument("--runs", type=int, default=10, help="generations per path on the daemon (default 10)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--streams", type=int, default=4, help="generations at once in the second daemon run (default 4)")
    p.add_argument("--model", help="for the daemon (default: the embedded model)")
    p.add_argument("--backend", default="cpu")
    args = p.parse_args(argv)
    d = tempfile.mkdtemp(prefix="ntx-bench-")
    try:
        if args.smoke:
            args.calls, args.stream, args.runs, args.max_tokens, args.streams = 50, 200, 1, 16, 2
            args.model = args.model or common.synthetic(d, "tiny", vocab=2048)
        result = dict(micro={"idle": micro(args.calls, args.stream, False),
                             "busy": micro(args.calls, args.stream, True)},
                      daemon=daemon_run(args.model, args.backend, args.runs, args.max_tokens, args.streams),
                      smoke=args.smoke, host=dict(cpus=os.cpu_count(), load=os.getloadavg()))
    finally:
        shutil.rmtree(d, ignore_errors=True)
    print(f"{'':28}  {'relayed':>9}  {'direct':>9}  {'added':>9}")
    for load, m in result["micro"].items():
        for key, label in (("rtt_median_us", "unary round trip µs"), ("stream_us_per_message", "stream µs/message")):
            r, dd = m["relayed"][key], m["direct"][key]
            print(f"{label + ' (' + load + ')':28}  {r:>9.1f}  {dd:>9.1f}  {r - dd:>9.1f}")
    for n in result["daemon"]["relayed"]:
        for key, label in (("ttft_median_ms", "TTFT ms"), ("token_interval_median_ms", "token interval ms")):
            r, dd = result["daemon"]["relayed"][n][key], result["daemon"]["direct"][n][key]
            print(f"{'daemon ' + label + ', ' + n.replace('_', ' '):28}  {r:>9.2f}  {dd:>9.2f}  {r - dd:>9.2f}")
    common.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
