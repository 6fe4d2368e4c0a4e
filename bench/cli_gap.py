"""`ntx-model run` against the daemon at one client: the same Scheduler, the same engine flags,
in turns, so what the daemon's serving path costs a token stands out from a shared host's noise.

    python3 bench/cli_gap.py                                   # cpu backend, default model, 10 turns of 256 tokens
    python3 bench/cli_gap.py --sides daemon daemon:interval=0  # the daemon against itself with one thing changed
    python3 bench/cli_gap.py --stream-thread                   # streaming on its own thread, as beside a GPU
    python3 bench/cli_gap.py --cold 5                          # processes started per round: `ntx-model run` itself
    python3 bench/cli_gap.py --model 8b.gguf --flags "--backend cuda --host-compute auto --vram-budget 20GiB"
    python3 bench/cli_gap.py --smoke                           # tiny synthetic model: does it run?

Sides (--sides, default `daemon cli`), each given the same engine --flags:
  - `daemon`: ntransformerd (this script's --serve, which runs ntransformerd.main), one client
    over its socket through the client library; greedy, ignore_eos, no prefix cache, --prompt
    then --tokens tokens. The rate is the client's: tokens after the first over the time from
    the first to the last, as they arrive. `daemon:KNOB=V,...` changes one thing in that daemon:
    switch=S (sys.setswitchinterval), interval=S (the daemon's --stream-interval: 0, a message
    each step, as before it), nice=N (its threads but the scheduler's and the compute
    team's at nice N, gRPC's and the relay process too), idle=all or idle=relay (those threads,
    or the relay process alone, under SCHED_IDLE: on a core only when nothing else wants it),
    client=threads (the client library's stream read by gRPC's channel thread, as before
    ntx_client.channels.BLOCKING_OPTIONS), or an environment variable (`daemon:OMP_NUM_THREADS=1`).
  - `cli`: ntx-model run's engine and its Served (the daemon's Scheduler in-process), loaded once
    in a process of its own; each turn is one request through a new Served, as `ntx-model run`
    makes it, its rate taken where the loop yields each token (what run's decode_tok_s is).
  - either with `:--flag=V` adds an engine flag to that side alone (`cli:--cpu-threads=15`).
Every side is loaded and warmed once (one request), then --turns turns each, the order rotated
every turn, so the sides run seconds apart. --cold N instead starts every side afresh each
round (the daemon with one warm-up request; `cli` as `ntx-model run --json` itself, cold).

Reported: each side's median and min-max, each side over the first per turn (median, min-max),
and µs a token by thread (their Python names; the compute team's threads show as `(python)`,
the relay process apart): CPU, time runnable but waiting for a core, and how often it ran
(/proc/PID/task/TID/schedstat), plus the client process's CPU (this script, reading the stream).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from host_ceiling import THREAD_NAMES, _write_thread_names  # noqa: E402

SERVE = "--serve"  # argv[1] of a daemon this script starts (serve())
CLI = "--cli"  # argv[1] of a cold `ntx-model run` this script starts (cli())
CLI_LOOP = "--cli-loop"  # argv[1] of the process of the `cli` side's turns (cli_loop())
STREAM_THREAD = "NTX_CLIGAP_STREAM_THREAD"  # set: every side streams on its own thread (--stream-thread)
NICE_SPARED = ("scheduler", "MainThread")  # nice=N leaves these (and the compute team, not Python's) alone


# ---- inside the processes this script starts ----------------------------------------------

def serve(argv: list[str]) -> int:
    """A daemon: ntransformerd.main with argv[1:], after what the knobs (JSON, argv[0]) ask."""
    knobs, argv = json.loads(argv[0]), argv[1:]
    if "switch" in knobs:
        sys.setswitchinterval(float(knobs["switch"]))
    if "interval" in knobs:
        argv = argv + ["--stream-interval", str(float(knobs["interval"]))]
    names = os.environ.get(THREAD_NAMES)
    if names:
        threading.Thread(target=_write_thread_names, args=(names, 0.2), name="thread-names", daemon=True).start()
    if "nice" in knobs or "idle" in knobs:
        how = f"nice={knobs['nice']}" if "nice" in knobs else "idle"
        threading.Thread(target=_demote, args=(how, knobs.get("idle") or "all"), name="demote", daemon=True).start()
    _stream_thread()
    from ntransformerd import main as daemon_main
    return daemon_main.main(argv)


def _stream_thread() -> None:
    """With --stream-thread, text and writes on the streaming thread as beside a device (a host
    backend's scheduler does them inline, after each step)."""
    if not os.environ.get(STREAM_THREAD):
        return
    from ntransformerd.server.scheduler import Scheduler
    attach = Scheduler.attach

    def threaded(self, engine, **kw):
        attach(self, engine, **kw)
        self.streamer.inline = False
    Scheduler.attach = threaded


def _demote(how: str, which: str) -> None:
    """Lower the serving threads' claim on the cores, looked at each 0.2 s (gRPC starts its
    threads late). how: `nice=N` or `idle` (SCHED_IDLE: they run only on a core nothing else
    wants). which: `all` (this process's Python threads but NICE_SPARED, gRPC's own threads, and
    its children: the relay process) or `relay` (the children only)."""
    done: set[int] = set()
    me = os.getpid()
    while True:
        tids = []
        if which == "all":
            tids += [t.native_id for t in threading.enumerate() if t.name not in NICE_SPARED and t.native_id]
            for tid in os.listdir(f"/proc/{me}/task"):
                with contextlib.suppress(OSError), open(f"/proc/{me}/task/{tid}/comm") as f:
                    if f.read().startswith(("event_engine", "grpc")):
                        tids.append(int(tid))
        with contextlib.suppress(OSError), open(f"/proc/{me}/task/{me}/children") as f:
            tids += [int(c) for c in f.read().split()]
        for tid in set(tids) - done:
            with contextlib.suppress(OSError):
                if how == "idle":
                    os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
                else:
                    os.setpriority(os.PRIO_PROCESS, tid, int(how.partition("=")[2]))
            done.add(tid)
        time.sleep(0.2)


def _own_names() -> dict[str, str]:
    return thread_names(os.getpid(), {t.native_id: t.name for t in threading.enumerate()})


def cli(argv: list[str]) -> int:
    """A cold `ntx-model run` with argv[1:]; its threads' stats at its first and last token go to argv[0]."""
    from ntransformerd.tools import ntx_model
    tokens, seen = ntx_model.Served.tokens, []

    def counted(self, prompt_ids, params):
        for item in tokens(self, prompt_ids, params):
            if not seen or item[2] is not None:
                seen.append((thread_stats(os.getpid()), _own_names()))
            yield item
    ntx_model.Served.tokens = counted
    code = ntx_model.main(argv[1:])
    with open(argv[0], "w") as f:
        json.dump(seen, f)
    return code


def cli_loop(argv: list[str]) -> int:
    """ntx-model run's engine loaded once from argv (run's flags, --prompt and --max-tokens), then
    for each line on stdin one request through a Served of its own, as `ntx-model run` makes it:
    one JSON line a request."""
    from ntransformerd.engine.generation.sampler import SamplingParams
    from ntransformerd.engine.runtime.engine import Engine, default_model_path, resolved
    from ntransformerd.settings import SETTINGS
    from ntransformerd.tools import ntx_model
    _stream_thread()
    args = ntx_model.build_parser().parse_args(["run", *argv])
    values = ntx_model.run_settings(args)
    args.model = SETTINGS["model"].parse(values.get("model")) or default_model_path()
    mode = SETTINGS["speculative"].parse(values.get("speculative"))
    config, _ = resolved(ntx_model.engine_config(args, values))
    engine = Engine.load(args.model, config=config)
    prompt_ids = engine.tokenizer.encode(args.prompt, parse_special=True, add_special=True)
    params = SamplingParams.greedy(max_tokens=args.max_tokens, ignore_eos=True).validate()
    print("ready", flush=True)
    for _ in sys.stdin:
        served = ntx_model.Served(engine, mode=mode, draft=None)
        times, t0, t1 = [], None, None
        for _token, _, finish in served.tokens(prompt_ids, params):
            times.append(time.perf_counter())
            if t0 is None:
                t0 = thread_stats(os.getpid())
            elif finish is not None:
                t1, names = thread_stats(os.getpid()), _own_names()
        by_thread = per_token(t0, t1, len(times) - 1, names)
        print(json.dumps({"tok_s": (len(times) - 1) / (times[-1] - times[0]), "tokens": len(times),
                          "by_thread": by_thread}), flush=True)
    return 0


# ---- measuring ------------------------------------------------------------------------------

def thread_stats(pid: int) -> dict[str, list[float]]:
    """{tid: [CPU ns, ns runnable but waiting for a core, times run]} so far of pid's threads, and
    of its children (the relay process) as `child PID` (/proc/.../schedstat)."""
    out, paths = {}, {}
    with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{pid}/children") as f:
        paths = {f"child {c}": f"/proc/{c}/schedstat" for c in f.read().split()}
    for tid in os.listdir(f"/proc/{pid}/task"):
        paths[tid] = f"/proc/{pid}/task/{tid}/schedstat"
    for key, path in paths.items():
        with contextlib.suppress(OSError), open(path) as f:
            out[key] = [float(x) for x in f.read().split()[:3]]
    return out


def thread_names(pid: int, names: dict[int, str] | str) -> dict[str, str]:
    """{tid: its group}: the Python thread's name where known (names: tid → name, or the file
    _write_thread_names keeps), else the kernel's in parentheses; numbers dropped (`rpc_3` and
    `rpc_7` are `rpc`); children are `relay process`."""
    if isinstance(names, str):
        path, names = names, {}
        with contextlib.suppress(OSError), open(path) as f:
            names = {int(tid): name for tid, _, name in (line.strip().partition(" ") for line in f)}
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        name = names.get(int(tid))
        if name is None:
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f"({f.read().strip()})"
        out[tid] = re.sub(r"[_-]?\d+", "", name or "(gone)")
    return out


def per_token(t0: dict, t1: dict, n: int, names: dict[str, str]) -> dict[str, dict]:
    """thread_stats' growth from t0 to t1 over n tokens by group (names: thread_names), as
    {group: {cpu_us, wait_us, runs}} a token; groups under 0.5 µs of CPU a token left out."""
    groups: dict[str, list[float]] = {}
    for key, now in t1.items():
        before = t0.get(key, (0.0, 0.0, 0.0))
        acc = groups.setdefault("relay process" if key.startswith("child") else names.get(key, "(gone)"), [0.0] * 3)
        for i in range(3):
            acc[i] += now[i] - before[i]
    rows = {k: {"cpu_us": round(cpu / 1e3 / n, 1), "wait_us": round(wait / 1e3 / n, 1), "runs": round(runs / n, 2)}
            for k, (cpu, wait, runs) in groups.items() if cpu >= 0.5e3 * n}
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]["cpu_us"]))


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# ---- the sides --------------------------------------------------------------------------------

def knobs_of(spec: str) -> tuple[dict, dict, list[str]]:
    """`daemon:switch=0.001,OMP_NUM_THREADS=1,--cpu-threads=15` → ({switch: "0.001"},
    {OMP_NUM_THREADS: "1"}, ["--cpu-threads", "15"]); a cli side takes flags only."""
    knobs, env, flags = {}, {}, []
    for kv in filter(None, spec.partition(":")[2].split(",")):
        k, _, v = kv.partition("=")
        if k.startswith("--"):
            flags += [k, v] if v else [k]
        elif k.isupper() and not spec.startswith("cli"):
            env[k] = v
        elif k in ("switch", "interval", "nice", "idle", "client") and not spec.startswith("cli"):
            knobs[k] = v
        else:
            raise SystemExit(f"--sides {spec}: {k} is not a knob (switch, nice, an environment variable or a "
                             "--flag=value; a cli side takes flags only)")
    return knobs, env, flags


class DaemonSide:
    """A daemon (serve()) with the engine flags and the spec's knobs, and one client of it."""

    def __init__(self, spec: str, a, flags: list[str]):
        from ntx_client import Client, channels
        knobs, env, extra = knobs_of(spec)
        flags = [*flags, *extra]
        self.a, self.dir = a, tempfile.mkdtemp(prefix="ntx-cligap-")
        self.names = os.path.join(self.dir, "threads")
        saved = os.environ.copy()
        os.environ.update({THREAD_NAMES: self.names, **env})
        try:  # start_daemon's child inherits the environment
            self.proc, sock = common.start_daemon(self.dir, flags, program=[sys.executable, os.path.abspath(__file__),
                                                                            SERVE, json.dumps(knobs)])
        finally:
            os.environ.clear()
            os.environ.update(saved)
        blocking = channels.BLOCKING_OPTIONS
        if knobs.get("client") == "threads":  # the client library's stream read by the channel's thread
            channels.BLOCKING_OPTIONS = []
        try:
            self.client = Client(sock)
        finally:
            channels.BLOCKING_OPTIONS = blocking

    def request(self) -> dict:
        times = []
        t0, c0 = thread_stats(self.proc.pid), _cpu_s()
        for chunk in self.client.generate(prompt=self.a.prompt, max_tokens=self.a.tokens, temperature=0,
                                          ignore_eos=True, prefix_cache=False):
            times += [time.perf_counter()] * len(chunk.ids)
        t1, c1 = thread_stats(self.proc.pid), _cpu_s()
        n = len(times)
        by_thread = per_token(t0, t1, n, thread_names(self.proc.pid, self.names))
        return {"tok_s": (n - 1) / (times[-1] - times[0]), "tokens": n, "by_thread": by_thread,
                "client_cpu_us": round(1e6 * (c1 - c0) / n, 1)}

    def close(self) -> None:
        self.client.close()
        common.stop_daemon(self.proc)
        with contextlib.suppress(OSError):
            for name in os.listdir(self.dir):
                os.unlink(os.path.join(self.dir, name))
            os.rmdir(self.dir)


class CliSide:
    """cli_loop in a process of its own: one request a call."""

    def __init__(self, spec: str, a, flags: list[str], model: str | None):
        flags = [*flags, *knobs_of(spec)[2]]
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), CLI_LOOP, *([model] if model else []),
                                      *flags, "--prompt", a.prompt, "--max-tokens", str(a.tokens)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise SystemExit(f"the cli side exited {self.proc.wait()}")

    def request(self) -> dict:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the cli side exited {self.proc.wait()}")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


def cold_cli(a, flags: list[str], model: str | None) -> dict:
    """`ntx-model run` itself, started for this one request."""
    fd, stats = tempfile.mkstemp(prefix="ntx-cligap-", suffix=".json")
    os.close(fd)
    cmd = [sys.executable, os.path.abspath(__file__), CLI, stats, "run", *([model] if model else []), *flags,
           "--prompt", a.prompt, "--temperature", "0", "--ignore-eos", "--max-tokens", str(a.tokens), "--json"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"ntx-model run exited {r.returncode}: {r.stderr[-2000:]}")
        last = json.loads(r.stdout.strip().splitlines()[-1])
        with open(stats) as f:
            (t0, _), (t1, names) = json.load(f)[-2:]
    finally:
        os.unlink(stats)
    return {"tok_s": last["decode_tok_s"], "tokens": last["generated_tokens"],
            "by_thread": per_token(t0, t1, last["generated_tokens"] - 1, names)}


def turns(a, flags: list[str]) -> list[dict]:
    """Every side loaded and warmed once, then --turns turns each in rotated order."""
    model = ["--model", a.model] if a.model else []
    sides, rows = {}, []
    try:
        for spec in a.sides:
            sides[spec] = (CliSide(spec, a, flags, a.model) if spec.startswith("cli") else
                           DaemonSide(spec, a, [*flags, *model]))
        for side in sides.values():
            side.request()  # the first request's one-time work
        for t in range(a.turns):
            order = a.sides[t % len(a.sides):] + a.sides[:t % len(a.sides)]
            rows.append({spec: sides[spec].request() for spec in order})
            report_turn(a, t, rows[-1])
    finally:
        for side in sides.values():
            side.close()
    return rows


def cold(a, flags: list[str]) -> list[dict]:
    """--cold rounds: every side started afresh each round (a daemon warmed by one request)."""
    rows = []
    for r in range(a.cold):
        order = a.sides[r % len(a.sides):] + a.sides[:r % len(a.sides)]
        row = {}
        for spec in order:
            if spec.startswith("cli"):
                row[spec] = cold_cli(a, [*flags, *knobs_of(spec)[2]], a.model)
                continue
            side = DaemonSide(spec, a, [*flags, *(["--model", a.model] if a.model else [])])
            try:
                side.request()
                row[spec] = side.request()
            finally:
                side.close()
        rows.append(row)
        report_turn(a, r, row)
    return rows


# ---- the report -------------------------------------------------------------------------------

def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def report_turn(a, t: int, row: dict) -> None:
    first = row[a.sides[0]]["tok_s"]
    print(f"turn {t}: " + ", ".join(f"{s} {row[s]['tok_s']:.1f}" + ("" if s == a.sides[0] else
                                                                  f" ({row[s]['tok_s'] / first:.3f})")
                                    for s in a.sides) + f" tok/s; load {os.getloadavg()[0]:.2f}", flush=True)


def summary(a, rows: list[dict]) -> dict:
    out = {}
    for spec in a.sides:
        side = {"tok_s": spread([r[spec]["tok_s"] for r in rows])}
        if spec != a.sides[0]:
            side["over_first"] = spread([r[spec]["tok_s"] / r[a.sides[0]]["tok_s"] for r in rows])
        groups = sorted({k for r in rows for k in r[spec]["by_thread"]})
        side["threads"] = {k: {m: statistics.median(r[spec]["by_thread"].get(k, {}).get(m, 0.0) for r in rows)
                               for m in ("cpu_us", "wait_us", "runs")} for k in groups}
        if "client_cpu_us" in rows[0][spec]:
            side["client_cpu_us"] = statistics.median(r[spec]["client_cpu_us"] for r in rows)
        out[spec] = side
        tok = side["tok_s"]
        over = side.get("over_first")
        print(f"{spec}: {tok['median']:.1f} [{tok['min']:.1f}-{tok['max']:.1f}] tok/s" +
              (f", over {a.sides[0]} {over['median']:.3f} [{over['min']:.3f}-{over['max']:.3f}]" if over else ""))
        threads = sorted(side["threads"].items(), key=lambda kv: -kv[1]["cpu_us"])
        print("  µs a token (cpu/waiting/runs): " + ", ".join(
            f"{k} {v['cpu_us']:.0f}/{v['wait_us']:.0f}/{v['runs']:.1f}" for k, v in threads) +
              (f"; client process cpu {side['client_cpu_us']:.0f}" if "client_cpu_us" in side else ""))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    inner = {SERVE: serve, CLI: cli, CLI_LOOP: cli_loop}
    if argv[:1] and argv[0] in inner:
        return inner[argv[0]](argv[1:])
    p = common.parser(__file__, __doc__)
    p.add_argument("--model", help="the model file (default: the embedded default model)")
    p.add_argument("--flags", default="--backend cpu", help="engine flags of every side (default: --backend cpu)")
    p.add_argument("--sides", nargs="+", default=["daemon", "cli"], metavar="SIDE",
                   help="cli[:--flag=V,...] or daemon[:KNOB=V,...] (default: daemon cli); ratios are over the first")
    p.add_argument("--turns", type=int, default=10, help="requests of each side, in turns (default 10)")
    p.add_argument("--cold", type=int, default=0, metavar="N", help="instead: N rounds of processes started afresh")
    p.add_argument("--stream-thread", action="store_true",
                   help="every side streams on its own thread, as beside a device (a host backend does it inline)")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--prompt", default="The")
    a = p.parse_args(argv)
    if a.smoke:
        a.turns, a.cold, a.tokens = 2, min(a.cold, 1), 8
        a.model = common.synthetic(os.path.join(common.OUT, "smoke"), "tiny")
    for spec in a.sides:
        if spec.partition(":")[0] not in ("cli", "daemon"):
            raise SystemExit(f"--sides {spec}: a side is cli or daemon, with :KNOB=V,... after it")
        knobs_of(spec)  # a bad knob is refused before anything starts
    flags = shlex.split(a.flags)
    if a.stream_thread:
        os.environ[STREAM_THREAD] = "1"  # the sides' processes inherit it
    out = {"smoke": a.smoke, "flags": a.flags, "model": a.model or "default", "tokens": a.tokens, "sides": a.sides,
           "stream_thread": a.stream_thread, "mode": "cold" if a.cold else "turns",
           "host": {"cpus": os.cpu_count(), "load_before": os.getloadavg()}}
    rows = cold(a, flags) if a.cold else turns(a, flags)
    out["host"]["load_after"] = os.getloadavg()
    out["summary"] = summary(a, rows)
    out["rows"] = rows
    common.write_json(a.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
