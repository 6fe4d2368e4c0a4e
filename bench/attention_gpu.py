"""Decode attention on the GPU: µs per layer by context and batch, and what depth costs a decode step.

    python bench/attention_gpu.py [--json bench/out/attention_gpu.json]              # kernels only
    python bench/attention_gpu.py --e2e --dir /tmp/ntx [--ftype q4_k_m]             # + 8B decode at depth 0 / 4k
    python bench/attention_gpu.py --smoke --e2e --dir /tmp/ntx-smoke                 # does it run?

Part 1 times attn_decode (kernels/attention.cu: fixed splits of split_len(max_ctx) positions, the
captured step's fused launch: RoPE, cache append, attention, merge) and the unfused pair
(rope_kv, then attention) for the 8B's shapes (32 q heads, 8 kv heads, head_dim 128) over an f16
and a q8_0 cache, every row at the same context, at contexts 512, 1k, 4k, 16k and batches 1 and
16: 20 launches captured in a graph and replayed, so the figure is device time per launch (one
layer). Beside it, the floor: the K and V bytes the rows read over the device-to-device copy
bandwidth. Part 2 (--e2e) decodes with the synthetic Llama-3-8B file resident (StepGraphs, the
captured step) at depth 0 and at --depth positions of context, B=1, and reports the device step
time of each and their ratio (the goal: depth 4k within 5% of depth 0).
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "daemon"))

import common  # noqa: E402
from ntransformerd.engine.backends import cuda  # noqa: E402
from ntransformerd.engine.backends.cuda import StepGraphs, cp  # noqa: E402 (cp is None without CuPy)
from ntransformerd.engine.gguf_file import GGUFModel, LlamaConfig  # noqa: E402
from resident import copy_bandwidth, device_step_s, gpu_time  # noqa: E402


def config(heads: int, kv: int, hd: int, max_ctx: int) -> LlamaConfig:
    return LlamaConfig(n_layers=1, d_model=heads * hd, d_ff=64, n_heads=heads, n_kv_heads=kv, head_dim=hd,
                       vocab_size=100, context_length=max_ctx, rms_eps=1e-5, rope_base=500000.0, rope_dim=hd,
                       rope_neox=False, rope_scale=1.0, tied_output=True)


def attention_us(cfg: LlamaConfig, dtype: str, ctx: int, rows: int, max_ctx: int, *, fused: bool) -> float:
    """µs of one layer's decode attention for `rows` rows, each at position ctx - 1 of its own slot."""
    blocks = rows * -(-ctx // 16)
    kv = cuda.CudaKVCache(cfg, n_slots=rows, max_ctx=max_ctx, dtype=dtype, n_blocks=blocks)
    for s in range(rows):
        kv.reserve(s, ctx)
    kv.tables.refresh()
    layer = kv.layer(0)
    if dtype == "f16":  # values of the scale a model's keys have; the q8_0 cache's zeros cost the same reads
        layer.k[:] = cp.random.standard_normal(layer.k.shape, dtype=cp.float32).astype(cp.float16)
        layer.v[:] = cp.random.standard_normal(layer.v.shape, dtype=cp.float32).astype(cp.float16)
    width = cfg.q_dim + 2 * cfg.kv_dim
    qkv = cp.random.standard_normal((rows, width), dtype=cp.float32)
    v = qkv[:, cfg.q_dim + cfg.kv_dim:]
    slots = cp.arange(rows, dtype=cp.int32)
    pos = cp.full((rows,), ctx - 1, cp.int32)
    out = cp.empty((rows, cfg.q_dim), cp.float32)
    scratch = cuda.attention_scratch(rows, cfg, max_ctx)
    freqs = cuda.CudaOps(cfg).freqs

    def once():
        if fused:
            cuda.attention_decode_(qkv, v, layer, slots, pos, freqs, cfg, n=rows, ld=width, ldv=width, out=out,
                                   scratch=scratch)
        else:  # rotates qkv in place again each time: the same work
            cuda.rope_kv_(qkv, v, pos, slots, freqs, layer, cfg, n=rows, ld=width, ldv=width)
            cuda.attention_(qkv, qkv[:, cfg.q_dim:], v, layer, slots, pos, cfg, n=rows, ldq=width, ldk=width,
                            ldv=width, out=out, scratch=scratch, append=False)

    once()  # compile and load before capture
    # the fills, the block tables' copy and once() ran on the default stream, which a non-blocking
    # stream does not wait for: unsynchronized, the graph's first replay read tables not yet
    # written (an illegal address on the H100 at 4096 positions x 16 rows; none under
    # CUDA_LAUNCH_BLOCKING=1)
    cp.cuda.Device().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        for _ in range(20):
            once()
        graph = stream.end_capture()
        t = gpu_time(lambda: graph.launch(stream), reps=10) / 20
    del kv, scratch
    return t * 1e6


def kv_bytes(cfg: LlamaConfig, dtype: str, ctx: int, rows: int) -> int:
    row = cfg.head_dim * 2 if dtype == "f16" else cfg.head_dim // 32 * 34
    return 2 * rows * ctx * cfg.n_kv_heads * row  # K and V


def depth_steps(path: str, depths: list[int], max_ctx: int, steps: int) -> list[dict]:
    """Device time of the captured B=1 decode step with the model resident, at each depth."""
    model = GGUFModel(path)
    ops, weights = cuda.load(model)
    kv = cuda.kv_cache(model.config, n_slots=2, max_ctx=max_ctx)
    dec = StepGraphs(ops, weights, kv)
    out = []
    for depth in depths:
        slot = kv.alloc()
        try:
            if depth:  # the context's values do not change the work: the cache's zeros will do
                kv.reserve(slot, depth)
                kv.lengths[slot] = depth
            toks = np.array([100], np.int32)
            for _ in range(4):  # capture + warm-up
                toks = dec.step([slot], toks, advance=True)
            ms = min(device_step_s(dec, [slot], toks, reps=steps) for _ in range(3)) * 1e3
        finally:
            kv.free(slot)
        out.append({"depth": depth, "device_step_ms": ms, "tok_s": 1e3 / ms})
        print(f"  depth {depth:6d}: device step {ms:.3f} ms ({1e3 / ms:.1f} tok/s)", flush=True)
    del dec, ops, weights, kv
    cp.get_default_memory_pool().free_all_blocks()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__file__, __doc__)
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 4096, 16384])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--max-ctx", type=int, default=16384,
                    help="the cache's configured context (sets the split length; default 16384: 128)")
    ap.add_argument("--e2e", action="store_true", help="also decode the synthetic 8B at depth 0 and --depth")
    ap.add_argument("--dir", default="/tmp/ntx", help="synthetic files (made here if missing)")
    ap.add_argument("--ftype", default="q4_k_m")
    ap.add_argument("--depth", type=int, default=4096)
    ap.add_argument("--e2e-max-ctx", type=int, default=8192, help="the e2e cache's context (Llama 3's 8192)")
    ap.add_argument("--steps", type=int, default=32)
    a = ap.parse_args(argv)
    common.require_gpu(__file__)
    if a.smoke:
        shape, contexts, batches, max_ctx, steps, depth = (8, 2, 64), [16, 200], [1, 3], 256, 4, 100
    else:
        shape, contexts, batches, max_ctx = (32, 8, 128), a.contexts, a.batches, a.max_ctx
        steps, depth = a.steps, a.depth
    if max(contexts) > max_ctx:
        ap.error(f"--contexts up to {max(contexts)} need --max-ctx at least that")
    dev = cp.cuda.runtime.getDeviceProperties(0)
    bw = copy_bandwidth(64 << 20 if a.smoke else 4 << 30) / 2  # bytes read per second
    cfg = config(*shape, max_ctx)
    res = {"device": dev["name"].decode(), "read_bw_Bps": bw, "smoke": a.smoke, "shape": list(shape),
           "max_ctx": max_ctx, "split_len": cuda.split_len(max_ctx), "attention": []}
    print(f"device {res['device']}: read {bw / 1e9:.0f} GB/s; heads {shape}, max_ctx {max_ctx}: "
          f"splits of {res['split_len']} positions", flush=True)
    print("\n| kv | context | B | fused µs | unfused µs | floor µs | fused / floor |\n|---|---|---|---|---|---|---|")
    for dtype in ("f16", "q8_0"):
        for ctx in contexts:
            for b in batches:
                f = attention_us(cfg, dtype, ctx, b, max_ctx, fused=True)
                u = attention_us(cfg, dtype, ctx, b, max_ctx, fused=False)
                floor = kv_bytes(cfg, dtype, ctx, b) / bw * 1e6
                res["attention"].append({"kv": dtype, "context": ctx, "batch": b, "fused_us": f, "unfused_us": u,
                                         "floor_us": floor})
                print(f"| {dtype} | {ctx} | {b} | {f:.1f} | {u:.1f} | {floor:.1f} | {f / floor:.1f}x |", flush=True)
                cp.get_default_memory_pool().free_all_blocks()
    if a.e2e or a.smoke:  # a smoke run takes the whole path
        path = common.synthetic(a.dir, "tiny" if a.smoke else "llama3-8b", a.ftype)
        e2e_ctx = 512 if a.smoke else a.e2e_max_ctx
        print(f"\n{os.path.basename(path)} resident, B=1, max_ctx {e2e_ctx}:", flush=True)
        res["e2e"] = {"path": path, "max_ctx": e2e_ctx, "steps": depth_steps(path, [0, depth], e2e_ctx, steps)}
        d0, d1 = res["e2e"]["steps"]
        res["e2e"]["depth_cost"] = d1["device_step_ms"] / d0["device_step_ms"] - 1
        print(f"  depth {depth} costs {100 * res['e2e']['depth_cost']:.1f}% of the depth-0 step (goal ≤ 5%)")
    common.write_json(a.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
