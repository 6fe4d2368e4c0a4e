"""Resident-model speed of the CUDA backend on synthetic Llama-3-8B-shaped files.

    python bench/resident.py --dir /tmp/ntx [--json bench/out/resident.json] [--types q8_0 q4_k_m]
    python bench/resident.py --smoke --dir /tmp/ntx-smoke      # tiny files, a few steps: does it run?

Measures in one run: device-to-device copy bandwidth (bytes read + written) and from it the
HBM roofline (model bytes / bandwidth) per file; decode tok/s at batch 1, 4, 16 from the
captured decode step (each step waits for its token ids, as a server does), the same step's
device time alone (graph replays back to back) and so the Python overhead per step; batch-1
decode launched kernel by kernel (no graph); prefill tok/s for a 512-token prompt through
model.forward; and per-matrix matvec times against their byte floors. Prints a table, writes JSON.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "daemon"))

import common  # noqa: E402
from ntransformerd.engine.runtime import model as llama  # noqa: E402
from ntransformerd.engine.backends import cuda  # noqa: E402
from ntransformerd.engine.backends.cuda import StepGraphs, cp  # noqa: E402 (cp is None without CuPy)
from ntransformerd.engine.gguf_file import GGUFModel  # noqa: E402
from ntransformerd.engine.runtime.model import Batch, Segment  # noqa: E402
from ntransformerd.engine.generation.sampler import Sampler, SamplingParams  # noqa: E402


def gpu_time(fn, reps: int = 20, warm: int = 3) -> float:
    """Median seconds of fn() on the current stream, timed with events."""
    stream = cp.cuda.get_current_stream()
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(stream)
        fn()
        b.record(stream)
        b.synchronize()
        ts.append(cp.cuda.get_elapsed_time(a, b) / 1e3)
    return float(np.median(ts))


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    src = cp.empty(nbytes // 4, cp.float32)
    src[:] = 1.0
    dst = cp.empty_like(src)
    t = gpu_time(lambda: dst.__setitem__(Ellipsis, src), reps=10)
    del src, dst
    return 2 * nbytes / t  # bytes read + written per second


def device_step_s(dec: StepGraphs, slots, toks, reps: int = 16) -> float:
    """Seconds of one decode step on the device alone: replays queued back to back (positions
    keep advancing)."""
    a, b = cp.cuda.Event(), cp.cuda.Event()
    a.record(dec.stream)
    for _ in range(reps):
        dec.launch(slots, toks, advance=True)
    b.record(dec.stream)
    b.synchronize()
    return cp.cuda.get_elapsed_time(a, b) / 1e3 / reps


def decode_rates(dec: StepGraphs, kv, batch: int, steps: int) -> dict:
    slots = [kv.alloc() for _ in range(batch)]
    try:
        toks = np.arange(batch, dtype=np.int32) + 100
        for _ in range(4):  # capture + warm-up
            toks = dec.step(slots, toks, advance=True)
        t0 = time.perf_counter()
        for _ in range(steps):
            toks = dec.step(slots, toks, advance=True)
        wall = (time.perf_counter() - t0) / steps
        dev = device_step_s(dec, slots, toks)
    finally:
        for s in slots:
            kv.free(s)
    return {"batch": batch, "step_ms": wall * 1e3, "device_step_ms": dev * 1e3,
            "tok_s": batch / wall, "python_overhead_frac": max(0.0, 1 - dev / wall)}


def sampled_rates(dec: StepGraphs, kv, cfg, steps: int, modes=("device_top", "host_rows")) -> dict:
    """Batch-1 decode tok/s with llama.cpp's default sampling (top-k 40, top-p 0.95, min-p 0.05,
    temperature 0.8) as the daemon runs it: "device_top", the step's 40 most likely ids picked on
    the device (StepGraphs.top); "host_rows", the whole row of logits copied to the host and
    sampled there; "greedy", the step's argmax alone (StepGraphs.step), for scale."""
    out = {}
    for name in modes:
        sampler = Sampler(SamplingParams(seed=0), cfg.vocab_size)
        slot = kv.alloc()
        try:
            tok = 100
            t0 = 0.0
            for i in range(4 + steps):  # capture + warm-up, then timed
                if i == 4:
                    t0 = time.perf_counter()
                if name == "greedy":
                    tok = int(dec.step([slot], [tok], advance=True)[0])
                elif name == "device_top":
                    tok = sampler.sample(dec.top([slot], [tok], sampler.need(), advance=True)[0])
                else:
                    tok = sampler.sample(dec.logits([slot], [tok], advance=True)[0].get())
            out[name] = steps / (time.perf_counter() - t0)
        finally:
            kv.free(slot)
    return out


def prefill_rate(ops, cfg, weights, kv, n: int = 512, reps: int = 3) -> dict:
    rng = np.random.default_rng(0)
    ts = []
    for r in range(reps + 1):
        slot = kv.alloc()
        batch = Batch.of([Segment(slot, 0, rng.integers(0, cfg.vocab_size, n))])
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        logits = llama.forward(ops, cfg, weights, kv, batch)
        cp.cuda.Device().synchronize()
        if r:
            ts.append(time.perf_counter() - t0)
        assert np.isfinite(ops.to_host(logits)).all()
        kv.free(slot)
    t = float(np.median(ts))
    return {"tokens": n, "seconds": t, "tok_s": n / t}


def matvec_breakdown(weights, cfg, bw: float) -> list[dict]:
    ly = weights.acquire(cfg.n_layers // 2)
    rows = []
    # the stacks model.block multiplies (one piece per quant type among their members)
    mats = [(f"attn_qkv{j}", t) for j, t in enumerate(ly.attn_qkv.pieces)] + [("attn_output", ly.attn_output)] + \
           [(f"ffn_gate_up{j}", t) for j, t in enumerate(ly.ffn_gate_up.pieces)] + [("ffn_down", ly.ffn_down),
                                                                                  ("output", weights.output)]
    for name, t in mats:
        row = {"matrix": name, "type": t.qtype.name, "shape": list(t.shape), "bytes": t.nbytes}
        for b in (1, 16):
            x = cp.random.standard_normal((b, t.shape[1]), dtype=cp.float32)
            out = cp.empty((b, t.shape[0]), cp.float32)
            # the activations quantized once, as the decode step does (norm/swiglu write them)
            xq = cuda.quantize(x, cuda.QAct(b, t.shape[1])) if t.qtype in cuda.FAST_MATVEC else None
            cuda.matvec(x, t, out=out, xq=xq)  # compile/load before capture
            stream = cp.cuda.Stream(non_blocking=True)
            with stream:  # 20 launches replayed from a graph: kernel time without Python's
                stream.begin_capture()
                for _ in range(20):
                    cuda.matvec(x, t, out=out, xq=xq)
                graph = stream.end_capture()
                s = gpu_time(lambda: graph.launch(stream), reps=10) / 20
            key = "" if b == 1 else f"_b{b}"
            row["us" + key] = s * 1e6
            row["frac_of_bw" + key] = t.nbytes / bw / s
        row["floor_us"] = t.nbytes / bw * 1e6
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__file__, __doc__)
    ap.add_argument("--dir", default="/tmp/ntx", help="the synthetic files (made here if missing)")
    ap.add_argument("--types", nargs="+", default=["q8_0", "q4_k_m"])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--max-ctx", type=int, default=1024)
    a = ap.parse_args(argv)
    common.require_gpu(__file__)
    shape, steps, prefill_tokens = ("tiny", 4, 32) if a.smoke else ("llama3-8b", a.steps, 512)
    dev = cp.cuda.runtime.getDeviceProperties(0)
    res = {"device": dev["name"].decode(), "copy_bw_Bps": copy_bandwidth(64 << 20 if a.smoke else 4 << 30),
           "shape": shape, "smoke": a.smoke, "files": []}
    bw = res["copy_bw_Bps"]
    print(f"device {res['device']}: device-to-device copy {bw / 1e9:.0f} GB/s (read + write)", flush=True)
    for ftype in a.types:
        t0 = time.perf_counter()
        path = common.synthetic(a.dir, shape, ftype)
        t_syn = time.perf_counter() - t0
        model = GGUFModel(path)
        cfg = model.config
        t0 = time.perf_counter()
        ops, weights = cuda.load(model)
        cp.cuda.Device().synchronize()
        t_load = time.perf_counter() - t0
        kv = cuda.kv_cache(cfg, n_slots=32, max_ctx=a.max_ctx)
        size = os.path.getsize(path)
        r = {"type": ftype, "path": path, "file_bytes": size, "device_weight_bytes": weights.nbytes,
             "synth_s": t_syn, "load_s": t_load, "roofline_tok_s": bw / size}
        print(f"{ftype}: {size / 2**30:.2f} GiB, roofline {r['roofline_tok_s']:.1f} tok/s "
              f"(synth {t_syn:.1f} s, load {t_load:.1f} s)", flush=True)
        r["matvec"] = matvec_breakdown(weights, cfg, bw)
        for m in r["matvec"]:
            print(f"  matvec {m['matrix']:12s} {m['type']:5s} {m['shape']} {m['us']:8.1f} us "
                  f"(floor {m['floor_us']:.1f}, {100 * m['frac_of_bw']:.0f}% of bw); B=16 {m['us_b16']:.1f} us "
                  f"({m['us_b16'] / m['us']:.1f}x B=1)", flush=True)
        dec = StepGraphs(ops, weights, kv)
        r["decode"] = [decode_rates(dec, kv, b, steps) for b in (1, 4, 16)]
        for d in r["decode"]:
            d["frac_of_roofline"] = d["tok_s"] / d["batch"] / r["roofline_tok_s"] if d["batch"] == 1 else None
            print(f"  decode B={d['batch']:2d}: {d['tok_s']:8.1f} tok/s, step {d['step_ms']:.3f} ms, "
                  f"device {d['device_step_ms']:.3f} ms, python {100 * d['python_overhead_frac']:.1f}%", flush=True)
        r["decode_b1_sampled"] = sampled_rates(dec, kv, cfg, steps)
        print(f"  decode B=1 sampled (top-k 40 defaults): {r['decode_b1_sampled']['device_top']:.1f} tok/s with the "
              f"40 best ids picked on the device, {r['decode_b1_sampled']['host_rows']:.1f} tok/s with whole rows "
              f"sampled on the host", flush=True)
        plain = StepGraphs(ops, weights, kv, pdl=False)
        r["decode_b1_no_pdl"] = decode_rates(plain, kv, 1, steps)
        print(f"  decode B=1 captured without programmatic dependent launch: "
              f"{r['decode_b1_no_pdl']['tok_s']:.1f} tok/s (pdl {'on' if dec.pdl else 'refused'} above)", flush=True)
        eager = StepGraphs(ops, weights, kv, use_graphs=False)
        r["decode_eager_b1"] = decode_rates(eager, kv, 1, min(16, steps))
        print(f"  decode B=1 without graphs: {r['decode_eager_b1']['tok_s']:.1f} tok/s", flush=True)
        r["prefill"] = prefill_rate(ops, cfg, weights, kv, n=prefill_tokens)
        print(f"  prefill {prefill_tokens}: {r['prefill']['tok_s']:.0f} tok/s", flush=True)
        res["files"].append(r)
        del dec, plain, eager, ops, weights, kv, model
        cp.get_default_memory_pool().free_all_blocks()
    common.write_json(a.json, res)
    print(f"\n| file | roofline tok/s | decode B=1 | % roofline | B=4 | B=16 | B16/B1 | python % (B=1) | prefill {prefill_tokens} |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in res["files"]:
        d = {x["batch"]: x for x in r["decode"]}
        print(f"| {r['type']} | {r['roofline_tok_s']:.0f} | {d[1]['tok_s']:.1f} | {100 * d[1]['frac_of_roofline']:.0f}% "
              f"| {d[4]['tok_s']:.0f} | {d[16]['tok_s']:.0f} | {d[16]['tok_s'] / d[1]['tok_s']:.1f}x "
              f"| {100 * d[1]['python_overhead_frac']:.1f}% | {r['prefill']['tok_s']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
