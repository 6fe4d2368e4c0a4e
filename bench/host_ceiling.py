"""The daemon's ceiling: what it streams when the device's step costs nothing (issue 24).

    python3 bench/host_ceiling.py                          # default model, 1 16 64 clients, 64 tokens each
    python3 bench/host_ceiling.py --clients 16 --py-spy 5  # and where the daemon's time goes (py-spy top)
    python3 bench/host_ceiling.py --device-ms 2.24,0.16    # beside a stand-in device: the 8B on the H200
    python3 bench/host_ceiling.py --device-ms 2.24,0.16 --speculative ngram   # every request speculating
    python3 bench/host_ceiling.py --smoke                  # tiny synthetic model: does it run?

The whole daemon runs (the relay, the gRPC server, the scheduler loop, the streaming thread, as
beside a GPU) on the served file, except that its pipeline's step is host_share.InstantStep:
each row's top ids handed back at once, and where the step draws, ids handed back as a device's
draws come (the top candidate of each row, greedy or sampled: the draw itself is the device's
work, not the host's). N clients (in
several processes) each send one request of --max-tokens tokens (ignore_eos) at once; aggregate
tok/s = generated tokens / wall time, and the daemon's CPU µs per token (all its threads, from
/proc). No device step can make the daemon stream faster than this: a GPU whose step of B rows
takes S ms reaches B / S tok/s only where this ceiling stands above it (bench/serving_gpu.py
compares the daemon with the engine alone on the device; this one needs no device).

With --speculative MODE the daemon speculates by default (every request drafts and verifies);
the stand-in's draws then follow a cycle of CYCLE ids, so that an n-gram draft finds what the
"model" repeats and verify steps accept some of it (each row's peak follows its own token, in
every row of an all-logits step too), and a launched step of any kind (a verify step, a prompt
chunk) overlaps the host as a decode step does.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "daemon"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "client"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "proto"))

import common  # noqa: E402


class SimDevice:
    """A stand-in device whose step of n rows takes base + per_row × n ms, in order, one at a
    time: a synchronous step sleeps until its end; a launched one returns at once, and its
    result() sleeps until its end (time.sleep lets the GIL go, as waiting on a CUDA event does)."""

    def __init__(self, base_ms: float, per_row_ms: float):
        self.base, self.per_row = base_ms / 1e3, per_row_ms / 1e3
        self.free_at = 0.0  # when the last queued step ends

    def queue(self, rows: int) -> float:
        """The end of a step of `rows` queued now behind the ones before it."""
        self.free_at = max(time.perf_counter(), self.free_at) + self.base + self.per_row * rows
        return self.free_at

    @staticmethod
    def wait(until: float) -> None:
        left = until - time.perf_counter()
        if left > 0:
            time.sleep(left)


class SimLaunch:
    """A launched step's handle (as sampling.Drawing): result() waits for its end."""

    def __init__(self, drawn, end: float):
        self.drawn, self.end = drawn, end

    def result(self):
        SimDevice.wait(self.end)
        return self.drawn


CYCLE = 16  # --speculative: the stand-in's draws cycle through this many ids


def serve(argv: list[str], device_ms: tuple[float, float] | None, cycle: int = 0) -> int:
    """The daemon (ntransformerd.main with argv) whose engines' steps cost nothing, or take
    device_ms = (base, per row) ms on a stand-in device with launched steps (the overlapped
    loop as on a GPU), streaming on its own thread as beside a device."""
    from host_share import InstantStep
    from ntransformerd import main as daemon_main
    from ntransformerd.engine.generation.sampler import Drawn, TopLogits
    from ntransformerd.engine.runtime.engine import Engine
    from ntransformerd.engine.tiers.step_pipeline import Pipeline
    from ntransformerd.server.scheduler import Scheduler

    attach = Scheduler.attach
    device = None if device_ms is None else SimDevice(*device_ms)

    class DeviceDraws(InstantStep):
        """Draws as a device hands them over: ids at once (each row's top candidate), none of
        the host's sampling work (on a GPU the kernels draw; sampled rows cost the host nothing)."""

        def _next(self, last: np.ndarray, n: int) -> np.ndarray:
            """(rows, n) most likely ids after each row's token: a chain through the vocabulary, or
            with `cycle` a short cycle of ids that repeats (a draft can guess it)."""
            if cycle:
                return 1000 + (last[:, None] - 1000 + 1 + np.arange(n)) % cycle
            return (last[:, None] * 7 + 1 + np.arange(n)) % self.vocab

        def _top(self, batch, n: int):
            last = np.asarray([int(s.tokens[-1]) for s in batch.segments], np.int64)
            return TopLogits(self._next(last, n), np.broadcast_to(self.vals[:n], (len(last), n)).copy(),
                             np.zeros(len(last), np.int64), sort=False)

        def __call__(self, batch, *, sample=None, all_logits=False, **kw):
            if sample is not None:
                ids = self._top(batch, 1).ids[:, 0].astype(np.int64)
                return Drawn(np.where(sample.draws, ids, -1), np.zeros(len(ids), np.int8))
            if all_logits:  # every token's row, its peak after that token
                toks = np.concatenate([np.asarray(s.tokens, np.int64) for s in batch.segments])
                out = np.zeros((len(toks), self.vocab), np.float32)
                out[np.arange(len(toks)), self._next(toks, 1)[:, 0]] = 1.0
                return out
            if kw.get("top") is None:  # each sequence's last row, its peak after its last token
                last = np.asarray([int(s.tokens[-1]) for s in batch.segments], np.int64)
                out = np.zeros((len(last), self.vocab), np.float32)
                out[np.arange(len(last)), self._next(last, 1)[:, 0]] = 1.0
                return out
            return super().__call__(batch, **kw)

    def instant(pipeline):
        step = pipeline.__dict__.get("_instant")
        if step is None:
            step = pipeline.__dict__["_instant"] = DeviceDraws(pipeline.cfg.vocab_size)
        return step

    def step(self, batch, **kw):
        out = instant(self)(batch, **kw)
        if device is not None:
            device.wait(device.queue(len(batch.segments)))
        return out

    def launch(self, batch, *, sample=None, all_logits=False, top=None, layers=None, after=None, rows=None):
        """Any step, launched: its result at once, its end on the stand-in device's clock; with
        `after`, its rows' tokens are that step's draws (which the device holds)."""
        if after is not None:
            ids = after.drawn.ids
            for seg, j in zip(batch.segments, rows):
                if j >= 0:
                    seg.tokens[-1] = ids[j]
        out = instant(self)(batch, sample=sample, all_logits=all_logits, top=top, layers=layers)
        return None if out is None else SimLaunch(out, device.queue(len(batch.segments)))

    def threaded_attach(self, engine, **kw):
        attach(self, engine, **kw)
        self.streamer.inline = False  # as beside a device: text and writes on the streaming thread
        self.overlap = device is not None

    Pipeline.step = step
    Scheduler.attach = threaded_attach
    profile = os.environ.get(PROFILE)
    if profile:  # the scheduler thread under cProfile, its stats written when the loop ends
        import cProfile
        from ntransformerd.server.loop import Loop
        loop = Loop._loop

        def profiled(self):
            prof = cProfile.Profile()
            try:
                prof.runcall(loop, self)
            finally:
                prof.dump_stats(profile)
        Loop._loop = profiled
    names = os.environ.get(THREAD_NAMES)
    if names:
        threading.Thread(target=_write_thread_names, args=(names,), name="thread-names", daemon=True).start()
    if device is not None:
        Pipeline.launch = launch
        Engine.overlaps = lambda self, n_rows: True
    return daemon_main.main(argv)


PROFILE = "NTX_CEILING_PROFILE"  # the file where the daemon writes its scheduler thread's cProfile stats
THREAD_NAMES = "NTX_CEILING_THREAD_NAMES"  # the file where the daemon process writes its threads' names


def _write_thread_names(path: str, period: float = 1.0) -> None:
    """Every `period` seconds, this process's threads as `native id name` lines (Python's thread
    names are not the kernel's, so /proc alone cannot tell the scheduler from a gRPC worker)."""
    while True:
        text = "".join(f"{t.native_id} {t.name}\n" for t in threading.enumerate() if t.native_id is not None)
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)
        time.sleep(period)


def _ticks(path: str) -> float:
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int, names_path: str) -> dict[str, float]:
    """CPU seconds so far of the daemon's threads, summed by name with its number dropped (`rpc_3`
    and `rpc_7` are `rpc`), and of the relay process (its child) as `relay process`."""
    names = {}
    with contextlib.suppress(OSError):
        with open(names_path) as f:
            for line in f:
                tid, _, name = line.strip().partition(" ")
                names[int(tid)] = re.sub(r"[_-]?\d+$", "", name.split(" ")[0])
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            group = names.get(int(tid), "other (gRPC core, unnamed)")
            out[group] = out.get(group, 0.0) + _ticks(f"/proc/{pid}/task/{tid}/stat")
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            for child in f.read().split():
                out["relay process"] = out.get("relay process", 0.0) + _ticks(f"/proc/{child}/stat")
    return out


def py_spy(pid: int, seconds: int, raw: str | None = None) -> str:
    """py-spy's view of the daemon for `seconds` (its top functions by own time), or why not;
    raw: where to keep its samples (py-spy's raw format: one stack a line, with its count)."""
    exe = shutil.which("py-spy")
    if exe is None:
        return "py-spy is not installed (pip install py-spy)"
    r = subprocess.run([exe, "record", "--pid", str(pid), "--duration", str(seconds), "--format", "raw",
                        "--output", "/dev/stdout", "--nonblocking"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"py-spy failed: {r.stderr[-500:]}"
    if raw:
        with open(raw, "w") as f:
            f.write(r.stdout)
    own: dict[str, int] = {}
    total = 0
    for line in r.stdout.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit() or line.startswith("py-spy>"):  # its own closing message
            continue
        leaf = stack.split(";")[-1]
        own[leaf] = own.get(leaf, 0) + int(n)
        total += int(n)
    top = sorted(own.items(), key=lambda kv: -kv[1])[:25]
    return "\n".join(f"{100 * n / max(total, 1):5.1f}%  {name}" for name, n in top)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:  # --serve [--device-ms B,R] [--cycle N] DAEMON-FLAGS: the daemon process
        rest, device_ms, cycle = argv[1:], None, 0
        if rest[:1] == ["--device-ms"]:
            device_ms, rest = tuple(float(x) for x in rest[1].split(",")), rest[2:]
        if rest[:1] == ["--cycle"]:
            cycle, rest = int(rest[1]), rest[2:]
        return serve(rest, device_ms, cycle)
    ap = common.parser(__file__, __doc__)
    ap.add_argument("--model", help="the served file (default: the embedded default model)")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per level (default 2; the best is kept)")
    ap.add_argument("--device-ms", metavar="BASE,PER_ROW",
                    help="a stand-in device: a step of n rows takes BASE + PER_ROW × n ms, launched steps "
                         "overlap the host as on a GPU (e.g. 2.24,0.16: the 8B Q4_K_M on the H200); the "
                         "figure is then the share of the device's rate n / step the daemon keeps")
    ap.add_argument("--speculative", metavar="MODE", default="off",
                    help="the daemon's default speculative mode, so every request speculates (e.g. ngram); the "
                         f"stand-in's draws then cycle through {CYCLE} ids, which a draft can guess")
    ap.add_argument("--cycle", type=int, default=CYCLE,
                    help=f"with --speculative: the stand-in's draws cycle through this many ids (default {CYCLE}; "
                         "0: a chain through the vocabulary that never repeats, so drafts find nothing)")
    ap.add_argument("--greedy-only", action="store_true", help="greedy levels only (no sampled pass)")
    ap.add_argument("--py-spy", type=int, metavar="S", default=0,
                    help="sample the daemon with py-spy for S seconds during the largest level's run")
    ap.add_argument("--py-spy-raw", metavar="PATH", help="with --py-spy: keep py-spy's raw samples here")
    a = ap.parse_args(argv)
    from serving_gpu import serve_level, timed_level

    from ntransformerd.engine.runtime.engine import default_model_path
    path = a.model or default_model_path()
    if a.smoke:
        a.clients, a.max_tokens, a.repeats = [1, 2], 8, 1
        a.device_ms = a.device_ms or "0.5,0.05"  # the stand-in device's launched steps: the overlapped loop
        path = common.synthetic(os.path.join(common.OUT, "smoke"), "tiny")
    top = max(a.clients)
    out = {"smoke": a.smoke, "model": os.path.basename(path), "max_tokens": a.max_tokens,
           "host": {"cpus": os.cpu_count(), "load": os.getloadavg()}, "levels": []}
    d = tempfile.mkdtemp(prefix="ntx-ceiling-")
    names_path = os.path.join(d, "threads")
    os.environ[THREAD_NAMES] = names_path  # the daemon process inherits it
    device = [] if a.device_ms is None else ["--device-ms", a.device_ms]
    speculating = a.speculative != "off"
    out["speculative"] = a.speculative
    out["cycle"] = a.cycle if speculating else None
    if device:
        base, per_row = (float(x) for x in a.device_ms.split(","))
        out["device_ms"] = {"base": base, "per_row": per_row}
    try:
        proc, sock = common.start_daemon(d, ["--backend", "cpu", "--model", path, "--max-batch", str(top),
                                             "--max-queue", str(max(64, top)), "--max-ctx", "512",
                                             *(["--speculative", a.speculative] if speculating else [])],
                                         program=[sys.executable, os.path.abspath(__file__), "--serve", *device,
                                                  *(["--cycle", str(a.cycle)] if speculating else [])])
    except BaseException:
        shutil.rmtree(d, ignore_errors=True)
        raise
    try:
        for sampled in (False,) if a.greedy_only else (False, True):
            for n in a.clients:
                serve_level(sock, n, 4, sampled)  # warm the clients' paths
                spy = None
                if a.py_spy and n == top and not sampled:  # py-spy samples the daemon while the level runs
                    spy = concurrent.futures.ThreadPoolExecutor(1).submit(py_spy, proc.pid, a.py_spy, a.py_spy_raw)
                    time.sleep(0.5)
                t0 = thread_cpu(proc.pid, names_path)
                runs = [timed_level(proc, sock, n, a.max_tokens, sampled) for _ in range(a.repeats)]
                t1 = thread_cpu(proc.pid, names_path)
                tokens = a.repeats * n * a.max_tokens
                threads = {k: 1e6 * (t1[k] - t0.get(k, 0.0)) / tokens for k in t1}
                threads = dict(sorted(((k, v) for k, v in threads.items() if v >= 0.5), key=lambda kv: -kv[1]))
                rate, cpu_us = max(runs)
                row = {"clients": n, "sampled": sampled, "tok_s": rate, "tok_s_runs": [r for r, _ in runs],
                       "daemon_cpu_us_per_token": cpu_us,
                       "daemon_cpu_us_per_token_runs": [c for _, c in runs],
                       "cpu_us_per_token_by_thread": threads}
                vs = ""
                if device:
                    row["device_tok_s"] = 1e3 * n / (base + per_row * n)
                    row["vs_device"] = rate / row["device_tok_s"]
                    vs = f" = {100 * row['vs_device']:.0f}% of the device's {row['device_tok_s']:.0f}"
                out["levels"].append(row)
                print(f"{n:3d} clients, {'sampled' if sampled else 'greedy ':7s}: {rate:8.1f} tok/s{vs} "
                      f"(runs {', '.join(f'{r:.0f}' for r, _ in runs)}); daemon CPU {cpu_us:.0f} µs a token",
                      flush=True)
                print("     CPU µs a token by thread (all runs): "
                      + ", ".join(f"{k} {v:.0f}" for k, v in threads.items()), flush=True)
                if spy is not None:
                    text = spy.result()
                    out["py_spy"] = text
                    print(text, flush=True)
    finally:
        common.stop_daemon(proc)
        shutil.rmtree(d, ignore_errors=True)
    common.write_json(a.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
