"""The daemon's serving throughput on the GPU against the engine's own step rate, and against
llama.cpp's batched bench on the default model (issue 24).

    python3 bench/serving_gpu.py --dir /tmp/ntx --clients 1 16 64 \
        --batched-bench /tmp/llama/llama.cpp/build/bin/llama-batched-bench
    python3 bench/serving_gpu.py --smoke --dir /tmp/ntx-smoke      # tiny model, a few tokens: does it run?
                                                                   # (on the cpu backend where there is no GPU)

1. The engine alone (in this process, no daemon): decode steps of B sequences (B = each client
   count), every row's next id drawn as the daemon draws it (Engine.step's sample: on the GPU),
   greedy and sampled, tok/s = B × steps / time: the rate the daemon could reach if the host cost
   nothing beside the step.
2. The daemon (`ntransformerd --backend cuda`, max_batch = the largest client count) on the same
   file: N clients at once, each one request of --max-tokens tokens (ignore_eos), greedy and then
   seeded sampling (temperature 0.8, top-k 40); aggregate tok/s = generated tokens / wall time of
   the level (prefill included, a short prompt), each level warmed first (its batch's captured
   steps, the client processes). The ratio to (1) is the share of the engine's rate the serving
   loop keeps; the rest is the host's share of a daemon step (host_share).
3. The default model at --default-clients (1, 16, 64) through the daemon against
   `llama-batched-bench` (the same file, -npp 16 -ntg --max-tokens -npl 1,16,64, all layers on the
   GPU), its TG rate. --default-only: this part alone.
Clients run in several processes (threads of one Python process would share one interpreter).
"""

from __future__ import annotations

import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time


sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "daemon"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "client"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "proto"))

import common  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper and the sea."


def engine_rates(path: str, batches: list[int], steps: int, backend: str) -> dict[tuple[int, bool], float]:
    """The engine's own decode rate (tok/s) per (batch, sampled), in this process: one engine,
    B sequences, each step drawing every row's next id as the daemon's steps do (Engine.step's
    sample: on the device where the backend draws there), its SampleRows made once."""
    from ntransformerd.engine.runtime.engine import Engine, EngineConfig
    from ntransformerd.engine.generation.sampler import SampleRows, Sampler, SamplingParams
    e = Engine.load(path, config=EngineConfig(backend=backend, max_batch=max(batches), max_ctx=512))
    rates = {}
    try:
        for sampled in (False, True):
            params = SamplingParams(temperature=0.8, top_k=40, seed=1, ignore_eos=True) if sampled else \
                SamplingParams.greedy(ignore_eos=True)
            for b in batches:
                slots = [e.open() for _ in range(b)]
                sample = SampleRows.of([Sampler(params, e.cfg.vocab_size, eog_ids=e.tokenizer.eog_ids)] * b, [[1]] * b)
                e.step([(s, [1 + j, 2, 3, 4]) for j, s in enumerate(slots)])
                for _ in range(3):
                    e.step([(s, [7]) for s in slots], sample=sample)
                t = time.perf_counter()
                for _ in range(steps):
                    e.step([(s, [11]) for s in slots], sample=sample)
                rates[(b, sampled)] = b * steps / (time.perf_counter() - t)
                for s in slots:
                    e.close(s)
    finally:
        e.unload()
        del e
    return rates


def _client_proc(args) -> int:
    socket, n, max_tokens, sampled, seed0 = args
    import concurrent.futures

    from ntx_client import Client

    def one(k: int) -> int:
        with Client(socket) as c:
            kw = dict(temperature=0.8, top_k=40, seed=seed0 + k) if sampled else dict(temperature=0)
            r = c.complete(PROMPT, max_tokens=max_tokens, ignore_eos=True, **kw)
            return len(r.ids)

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return sum(pool.map(one, range(n)))


def serve_level(socket: str, clients: int, max_tokens: int, sampled: bool) -> float:
    procs = min(clients, 8)
    shares = [clients // procs + (1 if i < clients % procs else 0) for i in range(procs)]
    with multiprocessing.get_context("spawn").Pool(procs) as pool:
        # every worker started, its client library imported and connected, before the clock starts
        pool.map(_client_proc, [(socket, 1, 1, False, 0)] * procs, chunksize=1)
        t = time.perf_counter()
        tokens = sum(pool.map(_client_proc, [(socket, n, max_tokens, sampled, 1000 * i)
                                              for i, n in enumerate(shares)]))
        return tokens / (time.perf_counter() - t)


def start_daemon(path: str, max_batch: int, d: str, backend: str):
    proc, socket = common.start_daemon(d, ["--backend", backend, "--model", path, "--max-batch", str(max_batch),
                                           "--max-ctx", "512"])
    serve_level(socket, 1, 4, False)  # warm: kernels, graphs
    return proc, socket


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed_level(proc, socket: str, clients: int, max_tokens: int, sampled: bool) -> tuple[float, float]:
    """(aggregate tok/s, the daemon's CPU µs per generated token) of one level."""
    c0 = cpu_seconds(proc.pid)
    r = serve_level(socket, clients, max_tokens, sampled)
    # every request makes max_tokens (ignore_eos); the daemon is idle while the client workers start
    return r, 1e6 * (cpu_seconds(proc.pid) - c0) / (clients * max_tokens)


def batched_bench(binary: str, path: str, ntg: int, npl: list[int]) -> dict[int, float]:
    """llama-batched-bench's text-generation rate (S_TG t/s) per parallel sequence count."""
    r = subprocess.run([binary, "-m", path, "-c", str(max(npl) * (16 + ntg) + 64), "-b", "2048", "-ub", "512",
                        "-npp", "16", "-ntg", str(ntg), "-npl", ",".join(map(str, npl)), "-ngl", "99"],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"llama-batched-bench failed: {r.stderr[-2000:]}")
    out = {}
    for line in r.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 10 and re.fullmatch(r"\d+", cells[0] or "x"):
            out[int(cells[2])] = float(cells[7])  # PP, TG, B, N_KV, T_PP, S_PP, T_TG, S_TG, T, S
    return out


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__file__, __doc__)
    ap.add_argument("--dir", default="/tmp/ntx", help="the synthetic files (made here if missing)")
    ap.add_argument("--model", help="the served file (default: the 8B-shaped Q4_K_M made in --dir)")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batched-bench", metavar="BIN", help="llama-batched-bench (CUDA build): part 3")
    ap.add_argument("--default-model", metavar="PATH", help="part 3's file (default: the embedded default model)")
    ap.add_argument("--default-clients", type=int, nargs="+", default=[1, 16, 64], help="part 3's client counts")
    ap.add_argument("--default-only", action="store_true",
                    help="part 3 alone (an A/B of the default model's rows, e.g. under NTX_F16_LEGACY=0 and 1)")
    ap.add_argument("--backend", choices=("cuda", "cpu"), help="default: cuda (cpu in --smoke without a GPU)")
    a = ap.parse_args(argv)
    if a.default_only and not (a.batched_bench or a.smoke):
        ap.error("--default-only runs part 3, which needs --batched-bench")
    if a.backend is None:
        a.backend = "cpu" if a.smoke and common.gpu_missing() else "cuda"
    if a.backend == "cuda":
        common.require_gpu(__file__)
    if a.smoke:
        a.clients, a.max_tokens = [1, 2], 8
    path = a.model or ("" if a.default_only else common.synthetic(a.dir, "tiny" if a.smoke else "llama3-8b", "q4_k_m"))
    out = {"smoke": a.smoke, "backend": a.backend, "model": os.path.basename(path), "max_tokens": a.max_tokens,
           "levels": [], "f16_legacy": os.environ.get("NTX_F16_LEGACY", "")}
    top = max(a.clients)
    rates = {} if a.default_only else engine_rates(path, a.clients, 8 if a.smoke else 40, a.backend)
    for (b, sampled), r in rates.items():
        print(f"engine alone, batch {b:3d}, {'sampled' if sampled else 'greedy '}: {r:9.1f} tok/s", flush=True)
    d = tempfile.mkdtemp(prefix="ntx-serve-")
    try:
        proc, socket = start_daemon(path, top, d, a.backend) if not a.default_only else (None, None)
        try:
            for sampled in (False, True) if proc else ():
                for n in a.clients:
                    serve_level(socket, n, 4, sampled)  # warm: this batch's captured steps, the clients' paths
                    r, cpu_us = timed_level(proc, socket, n, a.max_tokens, sampled)
                    e = rates[(n, sampled)]
                    # a daemon step of n rows takes n / r s, the engine's n / e s: the rest is the host's
                    row = {"clients": n, "sampled": sampled, "daemon_tok_s": r, "engine_tok_s": e,
                           "vs_engine": r / e, "host_share": max(0.0, 1.0 - r / e), "daemon_cpu_us_per_token": cpu_us}
                    out["levels"].append(row)
                    print(f"daemon, {n:3d} clients, {'sampled' if sampled else 'greedy ':7s}: {r:9.1f} tok/s = "
                          f"{100 * r / e:.0f}% of the engine's step rate (host share of a step "
                          f"{100 * row['host_share']:.0f}%; daemon CPU {cpu_us:.0f} µs a token)", flush=True)
        finally:
            if proc:
                common.stop_daemon(proc)
        if a.batched_bench or a.smoke:
            from ntransformerd.engine.runtime.engine import default_model_path
            small = common.synthetic(a.dir, "tiny", "q4_k_m") if a.smoke else (a.default_model or default_model_path())
            npl = [1, 2] if a.smoke else a.default_clients
            alone = engine_rates(small, npl, 8 if a.smoke else 40, a.backend)  # the engine's own bound on it
            proc, socket = start_daemon(small, max(npl), d, a.backend)
            try:
                ours, cpu = {}, {}
                for n in npl:
                    serve_level(socket, n, 4, False)  # warm
                    ours[n], cpu[n] = timed_level(proc, socket, n, a.max_tokens, False)
            finally:
                common.stop_daemon(proc)
            peer = batched_bench(a.batched_bench, small, a.max_tokens, npl) if a.batched_bench else {}
            out["default_model"] = {"ours": ours, "llama_batched_bench": peer,
                                    "engine_alone": {n: alone[(n, False)] for n in npl}, "daemon_cpu_us_per_token": cpu}
            for n in npl:
                vs = f", llama-batched-bench {peer[n]:.1f} tok/s: {ours[n] / peer[n]:.2f}x" if n in peer else ""
                print(f"default model, {n:2d} clients: daemon {ours[n]:.1f} tok/s (the engine alone "
                      f"{alone[(n, False)]:.1f}, daemon CPU {cpu[n]:.0f} µs a token){vs}", flush=True)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    common.write_json(a.json, out)
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
