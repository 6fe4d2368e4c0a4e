"""Streaming-tier speed of the CUDA backend on synthetic Llama-3-shaped Q4_K_M files.

    python3 bench/streaming.py --dir /tmp/ntx [--json bench/out/streaming.json] [--no-70b]
    python3 bench/streaming.py --smoke --dir /tmp/ntx-smoke    # the tiny shape in place of both: does it run?

1. the pinned → device ceiling (cudaMemcpyAsync of 1 GiB from page-locked memory), same run;
2. 8B Q4_K_M with 32, 24, 16, 8, 0 resident layers (rest pinned) at batch 1, 4, 16: decode
   tok/s, streamed bytes per step, and the ratio to the PCIe bound (ceiling / streamed bytes);
   every split decodes through the captured step, the streamed ones with their layer copies
   inside its graph (backends/cuda/weights.py); each row says which path ran;
3. the O_DIRECT tier (every layer from storage) against a plain O_DIRECT reader of the file;
4. a 70B-shaped Q4_K_M with a 24 GiB VRAM budget, the rest pinned, at batch 1 and 16;
5. the hybrid rows (issue 23): the 8B at 24, 16, 8, 0 resident layers, batch 1 and 16, with the
   host computing some streamed layers beside the GPU (host_compute auto, placed from the rates
   measured at load) against pure streaming (off): tok/s and the plan's predicted step time;
6. the capped-link rows: the same splits at batch 1 with the stream paced to --link-cap
   (6.5 GB/s, a PCIe Gen3 x8 link) and --cap-threads host threads (8), hybrid against pure
   streaming;
with --llama-bench BIN (a CUDA build: bench/llamacpp/build.sh), `llama-bench -ngl N -t T` at each
split in the same run, and every ratio against it.

    python3 bench/streaming.py --dir /tmp/ntx --no-70b --no-odirect --splits \
        --llama-bench /tmp/llama/build/bin/llama-bench        # the hybrid and capped rows only
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "daemon"))

import common  # noqa: E402
from ntransformerd.engine.backends.cuda import cp  # noqa: E402 (None without CuPy)
from ntransformerd.engine.gguf_file import GGUFModel  # noqa: E402
from ntransformerd.engine.runtime.engine import Engine, EngineConfig  # noqa: E402


def log(*a):
    print(*a, flush=True)


def h2d_ceiling(nbytes: int = 1 << 30, reps: int = 5) -> float:
    mem = cp.cuda.alloc_pinned_memory(nbytes)
    host = np.frombuffer(mem, np.uint8, nbytes)
    host[:] = 1
    dev = cp.empty(nbytes, cp.uint8)
    s = cp.cuda.Stream(non_blocking=True)
    a, b = cp.cuda.Event(), cp.cuda.Event()
    best = 0.0
    for _ in range(reps):
        a.record(s)
        cp.cuda.runtime.memcpyAsync(dev.data.ptr, host.ctypes.data, nbytes, cp.cuda.runtime.memcpyHostToDevice, s.ptr)
        b.record(s)
        b.synchronize()
        best = max(best, nbytes / (cp.cuda.get_elapsed_time(a, b) / 1e3))
    del dev
    return best


def free_engine(e) -> None:
    if e is not None and hasattr(e.weights, "close"):
        e.weights.close()
    del e
    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()
    cp.get_default_pinned_memory_pool().free_all_blocks()


def decode_path(e: Engine, batch: int) -> str:
    """Which path the decode steps of `batch` sequences took: 'graph' (one replay of the captured
    model.forward per step, streamed copies inside) or 'model.forward' (eagerly: storage layers)."""
    g = e.steps
    if g is None or not g.use_graphs:
        return "model.forward"
    r, t = g.bucket(batch, 1)
    return "graph" if any(k[:3] == (r, t, None) for k in g._buckets) else "model.forward"


def decode_rate(e: Engine, batch: int, steps: int) -> float:
    slots = [e.open() for _ in range(batch)]
    try:
        e.step([(s, [1 + j]) for j, s in enumerate(slots)])  # first position of every sequence
        for _ in range(2):  # warm: kernels, graphs, the stream's first laps
            e.step([(s, [7]) for s in slots])
        t = time.perf_counter()
        for _ in range(steps):
            e.step([(s, [11]) for s in slots])
        dt = time.perf_counter() - t
    finally:
        for s in slots:
            e.close(s)
    return batch * steps / dt


def prefill_rate(e: Engine, n: int = 240) -> float:
    s = e.open()
    try:
        e.prefill(s, [5] * 8)
        t = time.perf_counter()
        e.prefill(s, list(np.arange(n) % 1000 + 10))
        return n / (time.perf_counter() - t)
    finally:
        e.close(s)


def plain_odirect(path: str, nbytes: int, threads: int = 8, chunk: int = 16 << 20) -> float:
    """A plain reader: `threads` threads pread 16 MiB O_DIRECT chunks of the first nbytes."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    nbytes = nbytes // chunk * chunk
    nxt = [0]
    lock = threading.Lock()

    def work():
        raw = np.empty(chunk + 4096, np.uint8)
        buf = raw[(-raw.ctypes.data) % 4096:][:chunk]
        while True:
            with lock:
                off = nxt[0]
                nxt[0] += chunk
            if off >= nbytes:
                return
            os.preadv(fd, [memoryview(buf)], off)

    t = time.perf_counter()
    ts = [threading.Thread(target=work) for _ in range(threads)]
    for x in ts:
        x.start()
    for x in ts:
        x.join()
    dt = time.perf_counter() - t
    os.close(fd)
    return nbytes / dt


def llama_bench(binary: str, path: str, ngl: int, threads: int, n: int) -> float:
    """`llama-bench -ngl N -t T`: its batch-1 decode (tg) in tok/s."""
    r = subprocess.run([binary, "-m", path, "-ngl", str(ngl), "-t", str(threads), "-p", "0", "-n", str(n),
                        "-r", "2", "-o", "json"], capture_output=True, text=True, timeout=1200)
    if r.returncode != 0:
        raise RuntimeError(f"llama-bench -ngl {ngl} -t {threads} failed: {r.stderr[-2000:]}")
    return float(json.loads(r.stdout)[0]["avg_ts"])


def predicted_step_s(plan, rows: int) -> tuple[float | None, list[int]]:
    """The plan's simulated pass at a step of `rows` rows and the layers the host computes there
    (None, []: the plan has no host-compute schedule)."""
    sched = plan.schedule
    if sched is None:
        return None, []
    p = next((p for p in sched.placements if p.rows >= rows), sched.placements[-1])
    return p.time.seconds, p.host_layers


def hybrid_rows(args, path: str, label: str, out: dict, save, *, splits, batches, link_cap=None,
                threads=None, kind: str) -> None:
    """host_compute auto against off at each split (and llama-bench -ngl N -t T), same run."""
    for k in splits:
        rates = {}
        for hc in ("off", "auto"):
            t = time.perf_counter()
            e = Engine.load(path, config=EngineConfig(backend="cuda", max_batch=max(batches), max_ctx=256,
                                                      max_vram_layers=k, host_compute=hc, link_cap=link_cap,
                                                      cpu_threads=threads))
            load_s = time.perf_counter() - t
            for b in batches:
                steps = 3 if args.smoke else (6 if k <= 8 else 10)
                r = decode_rate(e, b, steps)
                pred, host = predicted_step_s(e.plan, b)
                rates[hc, b] = r
                row = {"rows": kind, "model": label, "resident_layers": k, "batch": b, "host_compute": hc,
                       "link_cap": link_cap, "cpu_threads": threads, "tok_s": r, "predicted_step_s": pred,
                       "measured_step_s": b / r, "host_layers": host, "path": decode_path(e, b), "load_s": load_s}
                if hc == "auto":
                    row["figures"] = e.plan.schedule.figures.to_dict()
                    row["vs_off"] = r / rates["off", b]
                out["runs"].append(row)
                log(f"  [{kind}] resident {k}, host_compute {hc:4s}, batch {b:2d}: {r:8.1f} tok/s"
                    + (f"  predicted {pred * 1e3:.2f} ms/step, measured {b / r * 1e3:.2f}, host {len(host)} layers"
                       if pred is not None else "")
                    + (f"  ({row['vs_off']:.2f}x off)" if hc == "auto" else ""))
                save()
            if hc == "auto":
                log("\n".join(e.plan.schedule.explain()))
            free_engine(e)
            e = None
        if args.llama_bench:
            t_lb = threads or args.threads
            lb = llama_bench(args.llama_bench, path, k, t_lb, 8 if args.smoke else 64)
            row = {"rows": kind, "model": label, "resident_layers": k, "batch": 1, "engine": "llama-bench",
                   "cpu_threads": t_lb, "tok_s": lb, "hybrid_vs_llama": rates["auto", 1] / lb,
                   "streaming_vs_llama": rates["off", 1] / lb}
            out["runs"].append(row)
            log(f"  [{kind}] llama-bench -ngl {k} -t {t_lb}: {lb:.1f} tok/s; hybrid {row['hybrid_vs_llama']:.2f}x, "
                f"pure streaming {row['streaming_vs_llama']:.2f}x")
            save()


def ab_rows(args, path: str, label: str, out: dict, save, *, splits, batch: int, reps: int) -> None:
    """host_compute off and auto loaded side by side at each split, their decode at `batch`
    measured in turns (`reps` each, 20 steps a turn): medians and spread, so that a small
    difference can be told from noise."""
    for k in splits:
        engines = {hc: Engine.load(path, config=EngineConfig(backend="cuda", max_batch=batch, max_ctx=256,
                                                               max_vram_layers=k, host_compute=hc,
                                                               cpu_threads=args.threads))
                   for hc in ("off", "auto")}
        rates = {hc: [] for hc in engines}
        for _ in range(reps):
            for hc, e in engines.items():
                rates[hc].append(decode_rate(e, batch, 3 if args.smoke else 20))
        med = {hc: float(np.median(v)) for hc, v in rates.items()}
        pred, host = predicted_step_s(engines["auto"].plan, batch)
        row = {"rows": "ab", "model": label, "resident_layers": k, "batch": batch, "tok_s": rates,
               "median": med, "auto_vs_off": med["auto"] / med["off"], "host_layers": host}
        out["runs"].append(row)
        log(f"  [ab] resident {k}, batch {batch}: off {med['off']:.1f} tok/s ({min(rates['off']):.1f}-"
            f"{max(rates['off']):.1f}), auto {med['auto']:.1f} ({min(rates['auto']):.1f}-{max(rates['auto']):.1f}), "
            f"host {len(host)} layers: {row['auto_vs_off']:.3f}x")
        save()
        for e in engines.values():
            free_engine(e)
        engines = None


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__file__, __doc__)
    ap.add_argument("--dir", default="/tmp/ntx", help="the synthetic files (made here if missing)")
    ap.add_argument("--splits", type=int, nargs="*", default=[32, 24, 16, 8, 0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--no-70b", action="store_true")
    ap.add_argument("--hybrid-70b", action="store_true", help="also the 70B with host_compute auto")
    ap.add_argument("--deep", type=int, nargs="*", default=[], help="splits also run at --deep-depth, batch 1")
    ap.add_argument("--deep-depth", type=int, default=4)
    ap.add_argument("--no-odirect", action="store_true")
    ap.add_argument("--hybrid-splits", type=int, nargs="*", default=[24, 16, 8, 0],
                    help="resident layers of the hybrid and capped-link rows (none: no such rows)")
    ap.add_argument("--hybrid-batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--link-cap", default="6.5GB/s", help="the capped-link rows' stream rate (off: no such rows)")
    ap.add_argument("--cap-threads", type=int, default=8, help="host threads of the capped-link rows")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="host threads of the hybrid rows and their llama-bench (default: every CPU)")
    ap.add_argument("--ab-splits", type=int, nargs="*", default=[],
                    help="splits where host_compute off and auto are loaded side by side and measured in turns")
    ap.add_argument("--ab-batch", type=int, default=16)
    ap.add_argument("--ab-reps", type=int, default=5)
    ap.add_argument("--llama-bench", metavar="BIN", help="a CUDA build of llama-bench: adds -ngl N -t T rows")
    args = ap.parse_args(argv)
    common.require_gpu(__file__)
    # --smoke: the tiny shape (2 layers) stands in for the 8B and the 70B one
    big, huge, n_layers = ("tiny", "tiny", 2) if args.smoke else ("llama3-8b", "llama3-70b", 32)
    label = "tiny-q4_k_m" if args.smoke else "8b-q4_k_m"
    if args.smoke:
        args.splits, args.batches, args.deep = [2, 1, 0], [1, 4], [1]
        args.hybrid_splits, args.hybrid_batches = ([1, 0] if args.hybrid_splits else []), [1, 4]
        args.ab_splits, args.ab_batch = [1], 4
    out = {"gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "smoke": args.smoke, "runs": []}

    def save():
        common.write_json(args.json, out)

    bw = h2d_ceiling(64 << 20 if args.smoke else 1 << 30)
    out["h2d_ceiling_Bps"] = bw
    log(f"pinned -> device ceiling: {bw / 1e9:.1f} GB/s")

    p8 = common.synthetic(args.dir, big, "q4_k_m")
    for k in args.splits:
        t = time.perf_counter()
        e = Engine.load(p8, config=EngineConfig(backend="cuda", max_batch=16, max_ctx=256, max_vram_layers=k))
        load_s = time.perf_counter() - t
        streamed = e.plan.streamed_bytes_per_step
        layer_bytes = max(e.plan.layer_bytes)
        bound = bw / streamed if streamed else None
        log(f"8B resident {k}: load {load_s:.1f} s, streamed/step {streamed / 2**30:.2f} GiB, "
            f"PCIe bound {bound and round(bound, 1)} tok/s (batch 1)")
        for b in args.batches:
            steps = 3 if args.smoke else 32 if streamed == 0 else (6 if k <= 8 else 10)
            r = decode_rate(e, b, steps)
            path = decode_path(e, b)
            row = {"model": label, "resident_layers": k, "batch": b, "tok_s": r, "streamed_bytes": streamed,
                   "pcie_bound_step_s": bound, "ratio_to_bound": (r / b / bound) if bound else None,
                   "load_s": load_s, "path": path}
            out["runs"].append(row)
            log(f"  batch {b:2d}: {r:8.1f} tok/s [{path}]" + (f"  ({r / b:.2f} steps/s = {100 * r / b / bound:.0f}% "
                                                             f"of the PCIe bound)" if bound else ""))
            save()
        if k == n_layers // 2:
            pr = prefill_rate(e)
            out["runs"].append({"model": label, "resident_layers": k, "prefill_240_tok_s": pr})
            log(f"  prefill 240 tokens (one chunk): {pr:.0f} tok/s")
        free_engine(e)
        e = None

    for k in args.deep:
        e = Engine.load(p8, config=EngineConfig(backend="cuda", max_batch=16, max_ctx=256, max_vram_layers=k,
                                                stream_depth=args.deep_depth))
        streamed = e.plan.streamed_bytes_per_step
        bound = bw / streamed
        r = decode_rate(e, 1, 10)
        path = decode_path(e, 1)
        out["runs"].append({"model": label, "resident_layers": k, "batch": 1, "tok_s": r, "depth": args.deep_depth,
                            "streamed_bytes": streamed, "pcie_bound_step_s": bound, "ratio_to_bound": r / bound,
                            "path": path})
        log(f"8B resident {k}, depth {args.deep_depth}, batch 1: {r:.1f} tok/s [{path}] "
            f"({100 * r / bound:.0f}% of the PCIe bound)")
        free_engine(e)
        e = None
        save()

    if not args.no_odirect:
        pod, nod = (common.synthetic(args.dir, "small", "q4_k_m"), 4) if args.smoke else (p8, n_layers)
        size = os.path.getsize(pod)
        chunk = (1 if args.smoke else 16) << 20
        plain = plain_odirect(pod, size, chunk=chunk)
        log(f"plain O_DIRECT reader (8 threads, {chunk >> 20} MiB): {plain / 1e9:.2f} GB/s")
        # RAM for the staging buffers and less than one layer more: every layer from storage
        # (--smoke: a ring of one slot of the small shape, whose layers are over the setting's
        # 1 MiB floor; the tiny shape's are under it)
        if args.smoke:
            m = GGUFModel(pod)
            ram = dict(pinned_budget=max(m.layer_bytes(i) for i in range(nod)), stream_depth=1)
        else:
            ram = dict(pinned_budget="300MiB")
        e = Engine.load(pod, config=EngineConfig(backend="cuda", max_batch=1, max_ctx=64, max_vram_layers=0, **ram))
        assert len(e.plan.layers("storage")) == nod, e.plan.explain()
        streamed = e.plan.streamed_bytes_per_step
        slot = e.open()
        e.step([(slot, [1])])  # one lap warm
        t = time.perf_counter()
        n = 2
        for _ in range(n):
            e.step([(slot, [2])])
        tier = n * streamed / (time.perf_counter() - t)
        e.close(slot)
        path = decode_path(e, 1)
        out["odirect"] = {"plain_Bps": plain, "tier_Bps": tier, "ratio": tier / plain, "file_bytes": size,
                          "stats": e.weights.stream.stats, "path": path}
        log(f"O_DIRECT tier ({nod} storage layers, decode [{path}]): {tier / 1e9:.2f} GB/s = "
            f"{100 * tier / plain:.0f}% of plain")
        free_engine(e)
        e = None
        save()

    if not args.no_70b:
        p70 = common.synthetic(args.dir, huge, "q4_k_m")
        t = time.perf_counter()
        # --smoke: one of the tiny shape's two layers streamed, as most of the 70B's are in 24 GiB
        budget = {"max_vram_layers": 1} if args.smoke else {"vram_budget": "24GiB"}
        e = Engine.load(p70, config=EngineConfig(backend="cuda", max_batch=16, max_ctx=256, **budget))
        load_s = time.perf_counter() - t
        log(e.plan.explain(h2d_bps=bw))
        streamed = e.plan.streamed_bytes_per_step
        bound = bw / streamed
        log(f"{huge} {budget}: load {load_s:.1f} s, streamed/step {streamed / 2**30:.2f} GiB, bound {bound:.2f} tok/s")
        for b in (1, 16):
            r = decode_rate(e, b, 4)
            path = decode_path(e, b)
            out["runs"].append({"model": f"{huge}-q4_k_m", **budget, "batch": b, "tok_s": r,
                                "resident_layers": len(e.plan.layers("vram")), "streamed_bytes": streamed,
                                "pcie_bound_step_s": bound, "ratio_to_bound": r / b / bound, "load_s": load_s,
                                "plan": e.plan.to_dict(), "path": path})
            log(f"  batch {b:2d}: {r:6.2f} tok/s [{path}] ({100 * r / b / bound:.0f}% of the PCIe bound)")
            save()
        free_engine(e)
        e = None
        save()
        if args.hybrid_70b:  # the same budget with the host computing streamed layers beside the GPU
            e = Engine.load(p70, config=EngineConfig(backend="cuda", max_batch=16, max_ctx=256, host_compute="auto",
                                                     cpu_threads=args.threads, **budget))
            if getattr(e.plan, "schedule", None) is not None:
                log("\n".join(e.plan.schedule.explain()))
            for b in (1, 16):
                r = decode_rate(e, b, 4)
                out["runs"].append({"model": f"{huge}-q4_k_m", **budget, "batch": b, "tok_s": r, "host_compute": "auto",
                                    "host_layers": len(e.plan.layers("host")) if hasattr(e.plan, "layers") else None,
                                    "pcie_bound_step_s": bound})
                log(f"  batch {b:2d}, host_compute auto: {r:6.2f} tok/s ({r / b * streamed / bw:.2f}x the PCIe bound)")
                save()
            free_engine(e)
            e = None

    if args.ab_splits:
        log(f"side-by-side rows: host_compute off and auto in turns, batch {args.ab_batch}, {args.ab_reps} turns")
        ab_rows(args, p8, label, out, save, splits=args.ab_splits, batch=args.ab_batch,
                reps=2 if args.smoke else args.ab_reps)
    if args.hybrid_splits:
        log(f"hybrid rows: host_compute auto vs off, {args.threads} host threads")
        hybrid_rows(args, p8, label, out, save, splits=args.hybrid_splits, batches=args.hybrid_batches,
                    threads=args.threads, kind="hybrid")
        if args.link_cap not in ("", "off"):
            log(f"capped-link rows: link {args.link_cap}, {args.cap_threads} host threads")
            hybrid_rows(args, p8, label, out, save, splits=args.hybrid_splits, batches=[1],
                        link_cap=args.link_cap, threads=args.cap_threads, kind="capped")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
