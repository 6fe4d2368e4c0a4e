"""What one streamed Generate message costs the serving process, per gRPC server kind (issue 36).

    python3 bench/grpc_stream.py                        # every variant, 1 16 64 streams, 5 repeats
    python3 bench/grpc_stream.py --variants sync aio_step --streams 64 --repeats 9
    python3 bench/grpc_stream.py --rate 20000           # offered tokens/s (all streams together)
    python3 bench/grpc_stream.py --rate 20000 --busy-us 30 --messages 12000   # beside a busy scheduler
    python3 bench/grpc_stream.py --smoke                # a few messages each: does it run?

A server process serves the daemon's Inference/Generate (the proto's own stubs and messages)
on a Unix socket; a feeder thread in it plays the daemon's streaming thread: every step (period
streams / --rate) it hands one token to each open stream, and each stream's handler turns what
it finds into GenerateResponse messages (what waits behind the first is joined into one, as
Request.stream does), the first with the prompt's ids, the last with finish_reason and usage.
Clients in separate processes (grpc.aio, up to 16 streams each) read every stream to its end,
each stream on a connection of its own (--connections process: one a process).

With --busy-us the feeder also holds the interpreter for that long a token before each hand-over,
as the daemon's scheduler thread does between device steps. That changes the answer: a sync
handler thread then wakes late, finds several tokens waiting and sends them as one message, so
fewer, larger messages offset its dearer wakeups; compare grpc µs/token, not µs/msg, there, and
check a verdict on the whole daemon (bench/host_ceiling.py) before acting on it.

    sync      grpc.server + ThreadPoolExecutor, one handler thread a stream blocking on a
              queue.SimpleQueue (the daemon today)
    aio       grpc.aio.server; the feeder hands each token over by loop.call_soon_threadsafe
              into the stream's asyncio.Queue
    aio_step  grpc.aio.server; the feeder hands a whole step over in one call_soon_threadsafe,
              the loop spreads it (one wakeup of the loop a step, not one a token)

Measured over the clients' streaming (after they connected): the server process's CPU (its
threads' /proc/PID/task/TID/schedstat, in ns; stat's utime + stime, in 10 ms ticks, beside it as
a check) per message and per token, by thread (comm names, digits dropped: "rpc" the sync
server's handler threads, "loop" the aio server's event loop, "feeder" the stand-in streaming
thread, "python" what else runs Python: the sync server's poller thread; "event_engine" grpc's
C++ threads), messages/s and tokens/s. A Python thread's CPU is close to the time it held the
GIL (grpc's C++ threads run outside it), so the table shows where the interpreter goes.
Variants alternate within each repeat; medians over repeats, with min and max. Prints a
table, writes JSON (bench/out/grpc_stream.json by default).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import ctypes
import json
import os
import queue
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import grpc

import common
from ntx_proto.ntransformer.v1 import inference_pb2 as pb, inference_pb2_grpc

VARIANTS = ("sync", "aio", "aio_step")
PROMPT_IDS = list(range(1, 17))
CLK_TCK = os.sysconf("SC_CLK_TCK")
PER_CLIENT = 16  # streams per client process


# ---- the server ---------------------------------------------------------------------------------

def name_thread(name: str) -> None:
    """Name the calling thread in /proc (Python 3.11 leaves every thread "python"), so that its
    CPU shows under its own name: prctl(PR_SET_NAME)."""
    ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)


class Feeder:
    """The streaming thread's stand-in: one token to each open stream every `period` s; a
    stream ends after the max_tokens its request asked for. `hand(stream, step)` delivers.
    busy: seconds of Python a token that the step holds the interpreter for first (the
    scheduler's host work between device steps, which the gRPC side competes with)."""

    def __init__(self, period: float, hand, busy: float = 0.0):
        self.period, self.hand, self.busy = period, hand, busy
        self._lock = threading.Lock()
        self._new: list = []
        threading.Thread(target=self._run, name="feeder", daemon=True).start()

    def add(self, stream, tokens: int) -> None:
        with self._lock:
            self._new.append([stream, tokens, 0])

    def _run(self) -> None:
        name_thread("feeder")
        live: list = []
        due = time.perf_counter()
        while True:
            with self._lock:
                live += self._new
                self._new.clear()
            step = []
            for s in live:
                s[2] += 1
                step.append((s[0], s[2], s[2] == s[1]))  # (stream, token number, last)
            live = [s for s in live if s[2] < s[1]]
            if step:
                spin_until = time.perf_counter() + self.busy * len(step)
                while time.perf_counter() < spin_until:
                    pass
                self.hand(step)
            due = max(due + self.period, time.perf_counter() - 10 * self.period)  # behind: no long burst
            left = due - time.perf_counter()
            if left > 0:
                time.sleep(left)


def response(items: list) -> pb.GenerateResponse:
    """The message for the tokens (token number, last) taken together, as the servicer builds it."""
    ids = [n for n, _ in items]
    m = pb.GenerateResponse(text="".join(f" w{n}" for n in ids), token_ids=ids,
                            prompt_ids=PROMPT_IDS if ids[0] == 1 else ())
    if items[-1][1]:
        m.finish_reason = pb.FINISH_REASON_LENGTH
        m.usage.CopyFrom(pb.Usage(prompt_tokens=len(PROMPT_IDS), completion_tokens=ids[-1], queue_seconds=0.001,
                                  prefill_seconds=0.002, decode_seconds=0.5))
    return m


class SyncServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, period: float, busy: float):
        self.feeder = Feeder(period, self._hand, busy)

    @staticmethod
    def _hand(step) -> None:
        for q, n, last in step:
            q.put((n, last))

    def Generate(self, request, context):
        q = queue.SimpleQueue()
        self.feeder.add(q, request.max_tokens)
        while True:
            items = [q.get()]
            while True:  # join what waits behind it (Request.stream)
                try:
                    items.append(q.get_nowait())
                except queue.Empty:
                    break
            yield response(items)
            if items[-1][1]:
                return


class AioServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, period: float, busy: float, loop: asyncio.AbstractEventLoop, per_step: bool):
        self.loop = loop
        self.feeder = Feeder(period, self._hand_step if per_step else self._hand_each, busy)

    def _hand_each(self, step) -> None:
        for q, n, last in step:
            self.loop.call_soon_threadsafe(q.put_nowait, (n, last))

    def _hand_step(self, step) -> None:
        self.loop.call_soon_threadsafe(self._spread, step)

    @staticmethod
    def _spread(step) -> None:
        for q, n, last in step:
            q.put_nowait((n, last))

    async def Generate(self, request, context):
        q: asyncio.Queue = asyncio.Queue()
        self.feeder.add(q, request.max_tokens)
        while True:
            items = [await q.get()]
            while not q.empty():
                items.append(q.get_nowait())
            yield response(items)
            if items[-1][1]:
                return


def serve(variant: str, socket: str, period: float, busy: float) -> None:
    """Serve until stdin closes; say "ready" on stdout once listening."""
    if variant == "sync":
        server = grpc.server(concurrent.futures.ThreadPoolExecutor(64 + 16, initializer=name_thread, initargs=("rpc",)))
        inference_pb2_grpc.add_InferenceServicer_to_server(SyncServicer(period, busy), server)
        server.add_insecure_port(f"unix:{socket}")
        server.start()
        print("ready", flush=True)
        sys.stdin.read()
        server.stop(0)
        return

    async def run():
        name_thread("loop")
        server = grpc.aio.server()
        inference_pb2_grpc.add_InferenceServicer_to_server(
            AioServicer(period, busy, asyncio.get_running_loop(), per_step=variant == "aio_step"), server)
        server.add_insecure_port(f"unix:{socket}")
        await server.start()
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await server.stop(0)
    asyncio.run(run())


# ---- the clients ----------------------------------------------------------------------------------

def client(socket: str, streams: int, tokens: int, own_channels: bool) -> None:
    """`streams` Generate calls at once once stdin says go (each on a connection of its own with
    own_channels, as the daemon's clients come through the relay; else all on one); prints
    {"messages", "tokens"}."""
    async def run():
        channels = [grpc.aio.insecure_channel(f"unix:{socket}") for _ in range(streams if own_channels else 1)]
        for ch in channels:
            await ch.channel_ready()
        stubs = [inference_pb2_grpc.InferenceStub(ch) for ch in channels]
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        counts = collections.Counter()

        async def one(stub):
            async for m in stub.Generate(pb.GenerateRequest(prompt="x", max_tokens=tokens)):
                counts["messages"] += 1
                counts["tokens"] += len(m.token_ids)
        await asyncio.gather(*(one(stubs[k % len(stubs)]) for k in range(streams)))
        for ch in channels:
            await ch.close()
        print(json.dumps(counts), flush=True)
    asyncio.run(run())


# ---- the measurement ------------------------------------------------------------------------------

def cpu_by_thread(pid: int) -> dict[str, float]:
    """CPU seconds of each of the process's threads (/proc/PID/task/TID/schedstat: the time on a
    CPU in ns, not stat's clock ticks of 10 ms), summed by name less digits."""
    out: dict[str, float] = collections.defaultdict(float)
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
        except OSError:  # ended meanwhile
            continue
        out[re.sub(r"[0-9]+", "", name) or name] += ns / 1e9
    return out


def process_cpu(pid: int) -> float:
    """The process's CPU seconds (/proc/PID/stat utime + stime: every thread, ended ones too)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def level(socket: str, server: subprocess.Popen, streams: int, tokens: int, connections: str) -> dict:
    """One run of `streams` streams of `tokens` tokens against a started server."""
    sizes = [PER_CLIENT] * (streams // PER_CLIENT) + ([streams % PER_CLIENT] if streams % PER_CLIENT else [])
    clients = [_spawn("--client", socket, "--streams", str(k), "--tokens", str(tokens), "--connections", connections)
               for k in sizes]
    for c in clients:
        if c.stdout.readline().strip() != "ready":
            raise SystemExit("a client did not connect")
    ticks0, threads0, t0 = process_cpu(server.pid), cpu_by_thread(server.pid), time.perf_counter()
    for c in clients:
        c.stdin.write("go\n")
        c.stdin.flush()
    counts = collections.Counter()
    for c in clients:
        counts.update(json.loads(c.stdout.readline()))
    wall, ticks, threads = time.perf_counter() - t0, process_cpu(server.pid) - ticks0, cpu_by_thread(server.pid)
    for c in clients:
        c.stdin.close()
        c.wait(30)
    if counts["tokens"] != streams * tokens:
        raise SystemExit(f"{counts['tokens']} tokens streamed, not {streams * tokens}")
    msgs = counts["messages"]
    spent = {k: v - threads0.get(k, 0.0) for k, v in threads.items()}
    cpu = sum(spent.values())
    by_thread = {k: v * 1e6 / msgs for k, v in spent.items() if v > 0}
    return dict(streams=streams, messages=msgs, tokens=counts["tokens"], seconds=wall,
                messages_per_second=msgs / wall, tokens_per_second=counts["tokens"] / wall,
                cpu_us_per_message=cpu * 1e6 / msgs, cpu_us_per_token=cpu * 1e6 / counts["tokens"],
                grpc_cpu_us_per_token=(cpu - spent.get("feeder", 0.0)) * 1e6 / counts["tokens"],
                cpu_share=cpu / wall, stat_cpu_us_per_message=ticks * 1e6 / msgs, us_per_message_by_thread=by_thread)


def summary(runs: list[dict]) -> dict:
    keys = ("messages_per_second", "tokens_per_second", "cpu_us_per_message", "cpu_us_per_token",
            "grpc_cpu_us_per_token", "cpu_share")
    out = {k: dict(median=statistics.median(r[k] for r in runs), min=min(r[k] for r in runs),
                   max=max(r[k] for r in runs)) for k in keys}
    names = sorted({t for r in runs for t in r["us_per_message_by_thread"]})
    out["us_per_message_by_thread"] = {t: statistics.median(r["us_per_message_by_thread"].get(t, 0.0) for r in runs)
                                       for t in names}
    return out


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] in ("--serve", "--client"):
        role, socket, *rest = sys.argv[1:]
        if role == "--serve":
            serve(rest[0], socket, float(rest[1]), float(rest[2]))
        else:
            client(socket, int(rest[1]), int(rest[3]), rest[5] == "stream")
        return 0
    p = common.parser(__file__, __doc__)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64], help="concurrent streams (default 1 16 64)")
    p.add_argument("--repeats", type=int, default=5, help="runs of every variant and level, alternated (default 5)")
    p.add_argument("--rate", type=float, default=5000.0,
                   help="tokens/s the feeder offers, all streams together (default 5000: about the daemon's "
                        "ceiling on a tiny model at 64 clients); a step every streams/rate s")
    p.add_argument("--messages", type=int, default=6000, help="tokens per run, all streams together (default 6000)")
    p.add_argument("--busy-us", type=float, default=0.0,
                   help="µs of Python a token that each step holds the interpreter for before it hands the "
                        "tokens over (the scheduler's share: ~30-40 in the daemon at 64 clients; default 0)")
    p.add_argument("--connections", choices=("stream", "process"), default="stream",
                   help="a connection per stream (default: as the daemon's clients, each through the relay), "
                        "or one per client process for all its streams")
    args = p.parse_args(argv)
    if args.smoke:
        args.streams, args.repeats, args.messages = [1, 2], 1, 40
    d = tempfile.mkdtemp(prefix="ntx-bench-grpc-")
    runs: dict = collections.defaultdict(list)
    try:
        for rep in range(args.repeats):
            order = args.variants[rep % len(args.variants):] + args.variants[:rep % len(args.variants)]
            for n in args.streams:
                for v in order:  # alternated: the host's other load falls on every variant
                    socket = os.path.join(d, f"{v}.sock")
                    server = _spawn("--serve", socket, v, str(n / args.rate), str(args.busy_us / 1e6))
                    try:
                        if server.stdout.readline().strip() != "ready":
                            raise SystemExit(f"the {v} server did not start")
                        r = level(socket, server, n, max(2, args.messages // n), args.connections)
                    finally:
                        server.stdin.close()
                        server.wait(30)
                    runs[(v, n)].append(r)
                    print(f"repeat {rep} {v:8} {n:3} streams: {r['cpu_us_per_message']:7.1f} µs/msg "
                          f"{r['cpu_us_per_token']:7.1f} µs/token {r['messages_per_second']:8.0f} msg/s "
                          f"{r['tokens_per_second']:8.0f} tok/s", flush=True)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    result = dict(smoke=args.smoke, rate=args.rate, messages=args.messages, repeats=args.repeats,
                  connections=args.connections, busy_us=args.busy_us,
                  host=dict(cpus=os.cpu_count(), load=os.getloadavg(), grpc=grpc.__version__),
                  levels=[dict(variant=v, streams=n, **summary(rs), runs=rs) for (v, n), rs in sorted(runs.items())])
    print(f"\n{'variant':8} {'streams':>7}  {'µs/msg':>18}  {'µs/token':>8}  {'grpc µs/token':>13}  {'msg/s':>7}  "
          f"{'tok/s':>7}  by thread µs/msg")
    for x in result["levels"]:
        m = x["cpu_us_per_message"]
        threads = " ".join(f"{k}={v:.1f}" for k, v in sorted(x["us_per_message_by_thread"].items(),
                                                                key=lambda kv: -kv[1]) if v >= 0.5)
        print(f"{x['variant']:8} {x['streams']:>7}  {m['median']:6.1f} [{m['min']:4.0f}-{m['max']:4.0f}]  "
              f"{x['cpu_us_per_token']['median']:8.1f}  {x['grpc_cpu_us_per_token']['median']:13.1f}  "
              f"{x['messages_per_second']['median']:7.0f}  "
              f"{x['tokens_per_second']['median']:7.0f}  {threads}")
    common.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
