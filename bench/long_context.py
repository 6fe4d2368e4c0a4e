"""Long contexts on a small GPU (issue 25): a 70B-shaped Q4_K_M at a 24 GiB budget with
max_ctx 32768 and 4 sequences — does the plan fit, how many layers stay resident, and what does
8k tokens of context cost a batch-1 decode step against 512 on the same plan.

    python bench/long_context.py [--dir /tmp/ntx] [--contexts 512 8192] [--json PATH]

Rows: the plan (resident / streamed layers, KV pool) for kv_dtype f16 and q8_0 at max_ctx and
f16 at half of it (planner only); then one engine (f16 KV), one slot prefilled to each context
with the same random tokens, `--steps` greedy decode steps timed per context (median of
`--turns` turns, spread printed). The goal: the long context's rate ≥ 0.9× the short one's.
The smoke run (--smoke) takes the same path on the tiny synthetic model."""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def plan_row(model, config, label: str) -> dict:
    from ntransformerd.engine.runtime.engine import plan_for, resolved
    config, _ = resolved(config)
    plan = plan_for(model, config)
    row = {"plan": label, "kv_dtype": config.kv_dtype, "max_ctx": config.max_ctx, "max_batch": config.max_batch,
           "kv_blocks": plan.kv.blocks if plan.kv is not None else None, "kv_tokens": plan.kv_tokens,
           "kv_why": plan.kv.why if plan.kv is not None else "",
           "resident_layers": len(plan.layers("vram")),
           "streamed_layers": len(plan.streamed), "n_layers": model.config.n_layers}
    log(f"{label}: {row['resident_layers']} of {row['n_layers']} layers resident, KV pool "
        f"{row['kv_blocks']} blocks = {row['kv_tokens']} positions")
    return row


def timed_decode(engine, slot: int, first: int, steps: int) -> float:
    """Seconds per greedy decode step of `slot` (batch 1), `steps` steps."""
    from ntransformerd.engine.backends.cuda.nvrtc import cp
    tok = first
    cp.cuda.Device().synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        logits = engine.decode([slot], [tok])
        tok = int(np.argmax(logits[0]))
    cp.cuda.Device().synchronize()
    return (time.perf_counter() - t) / steps


def main() -> None:
    p = common.parser(__file__, __doc__)
    p.add_argument("--dir", default="/tmp/ntx", help="where synthetic models are made (default /tmp/ntx)")
    p.add_argument("--contexts", type=int, nargs=2, default=(512, 8000), metavar=("SHORT", "LONG"),
                   help="the two contexts (default 512 8000: the 70B shape holds 8192 positions, the steps need room)")
    p.add_argument("--budget", default="24GiB", help="vram_budget of the plan (default 24GiB)")
    p.add_argument("--max-ctx", type=int, default=32768)
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    args = p.parse_args()
    common.require_gpu(__file__)
    from ntransformerd.engine.runtime.engine import Engine, EngineConfig
    from ntransformerd.engine.gguf_file import GGUFModel

    if args.smoke:
        path = common.synthetic(args.dir, "tiny", "q4_k_m")
        contexts, max_ctx, budget, steps, turns = (32, 160), 256, None, 2, 2
    else:
        path = common.synthetic(args.dir, "llama3-70b", "q4_k_m")
        contexts, max_ctx, budget, steps, turns = tuple(args.contexts), args.max_ctx, args.budget, args.steps, args.turns
    base = EngineConfig(backend="cuda", max_batch=args.max_batch, max_ctx=max_ctx, kv_dtype="f16",
                        vram_budget=budget, prefill_chunk=512)
    model = GGUFModel(path)
    out = {"model": os.path.basename(path), "budget": budget, "plans": [], "contexts": []}
    out["plans"].append(plan_row(model, base, f"f16 KV, max_ctx {max_ctx}"))
    out["plans"].append(plan_row(model, dataclasses.replace(base, kv_dtype="q8_0"), f"q8_0 KV, max_ctx {max_ctx}"))
    out["plans"].append(plan_row(model, dataclasses.replace(base, max_ctx=max_ctx // 2), f"f16 KV, max_ctx {max_ctx // 2}"))
    del model

    t = time.perf_counter()
    engine = Engine.load(path, config=base)
    log(f"loaded in {time.perf_counter() - t:.1f} s\n{engine.plan.explain()}")
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, engine.cfg.vocab_size, max(contexts)).tolist()
    slots = {}
    for n in contexts:
        slot = engine.open()
        t = time.perf_counter()
        logits = engine.prefill(slot, prompt[:n])
        log(f"prefilled {n} tokens in {time.perf_counter() - t:.1f} s")
        slots[n] = (slot, int(np.argmax(logits)))
    rates: dict[int, list[float]] = {n: [] for n in contexts}
    for _ in range(turns):  # the contexts alternate, so drift in the machine touches both alike
        for n in contexts:
            slot, first = slots[n]
            engine.truncate(slot, n)
            rates[n].append(1.0 / timed_decode(engine, slot, first, steps))
    for n in contexts:
        med = statistics.median(rates[n])
        out["contexts"].append({"context": n, "tok_s": med, "runs": rates[n]})
        log(f"context {n:>6}: {med:8.3f} tok/s  (runs {', '.join(f'{r:.3f}' for r in rates[n])})")
    short, long_ = (statistics.median(rates[n]) for n in contexts)
    out["long_vs_short"] = long_ / short
    log(f"context {contexts[1]} vs {contexts[0]}: {out['long_vs_short']:.3f}× (goal ≥ 0.9)")
    out["smoke"] = args.smoke
    common.write_json(args.json, out)


if __name__ == "__main__":
    main()
