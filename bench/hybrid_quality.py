"""Is a hybrid step the same computation? Real weights, the host computing beside the GPU against
the GPU alone (issue 23).

    python3 bench/hybrid_quality.py --model .gpu-data/smollm2-4l.gguf --json bench/out/hybrid_quality.json
    python3 bench/hybrid_quality.py --smoke --dir /tmp/ntx-smoke     # a tiny synthetic model: does it run?

Two engines on the same file: every layer resident on the GPU (its captured steps), and a
hybrid plan where half the layers are streamed and the host computes some of them at every step
shape (made-up figures that make the host and the link alike, measured at 1 and 512 rows, so the
placement gives the host layers in decode steps and prefill chunks alike). Reports:
1. perplexity (engine/calibration/perplexity.py, ctx --ctx, --chunks chunks of the text) of both and the
   hybrid's relative difference (the goal: within 0.1%);
2. greedy ids of the six reference prompts (tests/golden/forward_smollm2.json: the default
   model's ids, which its slices share), --tokens each, through Engine.generate on both: the
   length of the common prefix of each pair, and which layers the host computed.
3. the same greedy ids through two daemons (`ntransformerd --backend cuda`): every layer resident,
   and `--host-compute auto` with a `--vram-budget` that leaves half the layers streamed (the host
   takes the ones the measured figures give it; Status shows where): common prefixes again.
The host computes in float32 with int8 activations and the GPU on its own kernels, so the two
differ by rounding: where the top two logits are nearly tied a greedy pair may part.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "daemon"))

import common  # noqa: E402
from ntransformerd.engine import tiers  # noqa: E402
from ntransformerd.engine.runtime.engine import Engine, EngineConfig, default_model_path, generate  # noqa: E402
from ntransformerd.engine.gguf_file import GGUFModel  # noqa: E402
from ntransformerd.engine.calibration.perplexity import perplexity, text_tokens  # noqa: E402
from ntransformerd.engine.generation.sampler import SamplingParams  # noqa: E402
from ntransformerd.engine.tiers.placement import Figures  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, os.pardir, "tests", "golden", "forward_smollm2.json")
TEXT = "/usr/share/common-licenses/GPL-3"


def hybrid_engine(model: GGUFModel, config: EngineConfig, resident: int) -> Engine:
    from ntransformerd.engine.backends import cuda
    n = model.config.n_layers
    cfg = dataclasses.replace(config, max_vram_layers=resident, host_compute="auto")
    sizes = [cuda.layer_nbytes(model, i) for i in range(n)]
    figures = Figures(55e9, {1: 55e9, 512: 55e9})
    plan = tiers.model_plan(model, cfg, backend="cuda", vram_free=cuda.vram_free(), layer_bytes=sizes,
                            figures=figures)
    return Engine(model, config=cfg, plan=plan)


def greedy(e: Engine, prompt: list[int], n: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [ev.token for ev in generate(e, prompt, params)]


def daemon_greedy(path: str, prompts, n: int, extra: list[str]) -> tuple[list[list[int]], list]:
    """Greedy ids of each prompt through a daemon started with `extra` flags, and its Status's
    placements."""
    import shutil
    import tempfile

    from ntx_client import Client
    d = tempfile.mkdtemp(prefix="ntx-hq-")
    proc, sock = common.start_daemon(d, ["--backend", "cuda", "--model", path, "--max-batch", "2", "--max-ctx", "1024",
                                         "--kv-dtype", "f16", *extra])
    try:
        with Client(sock) as c:
            ids = [c.complete(prompt_ids=p, max_tokens=n, temperature=0, ignore_eos=True).ids for _, p in prompts]
            placements = [{"rows": p.rows, "host_layers": list(p.host_layers), "steps": p.steps,
                           "measured_step_seconds": p.measured_step_seconds} for p in c.status().placements]
        return ids, placements
    finally:
        common.stop_daemon(proc)
        shutil.rmtree(d, ignore_errors=True)


def half_budget(plan, n_resident: int) -> int:
    """A VRAM budget whose plan keeps the first n_resident layers and streams the rest."""
    lb = plan.layer_bytes
    slots = 2 * max(lb[n_resident:], default=0)
    slack = min(1 << 20, min(lb) // 2)  # rounding room, less than a layer (a smoke's layers are < 1 MiB)
    return plan.fixed_bytes + plan.kv_bytes + plan.workspace_bytes + sum(lb[:n_resident]) + slots + slack


def common_prefix(a: list[int], b: list[int]) -> int:
    j = 0
    while j < min(len(a), len(b)) and a[j] == b[j]:
        j += 1
    return j


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__file__, __doc__)
    ap.add_argument("--model", help="a GGUF file (default: the embedded default model)")
    ap.add_argument("--dir", default="/tmp/ntx", help="where --smoke makes its synthetic model")
    ap.add_argument("--text", default=TEXT, help="the perplexity text")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=14)
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per reference prompt")
    ap.add_argument("--daemon-budget", type=int, help="the hybrid daemon's --vram-budget in bytes (default: "
                    "what keeps half the layers in the engine's plan)")
    ap.add_argument("--daemon-only", action="store_true", help="part 3 alone")
    a = ap.parse_args(argv)
    common.require_gpu(__file__)
    if a.smoke:
        # four layers: with two, the streaming slots' room holds both, so a budget cannot make them stream
        path, a.ctx, a.chunks, a.tokens = common.synthetic(a.dir, "tiny", "q4_k_m", n_layers=4), 64, 1, 4
    else:
        path = a.model or default_model_path()
    model = GGUFModel(path)
    config = EngineConfig(backend="cuda", max_batch=2, max_ctx=max(a.ctx, 1024), kv_dtype="f16")
    # half the layers streamed (the smoke's model: all of them, so that the host takes some)
    resident = 0 if a.smoke else model.config.n_layers // 2
    engines = {"gpu": Engine(model, config=config), "hybrid": hybrid_engine(model, config, resident)}
    sched = engines["hybrid"].plan.schedule
    print("\n".join(engines["hybrid"].plan.explain().splitlines()), flush=True)
    out = {"model": os.path.basename(path), "smoke": a.smoke, "ctx": a.ctx,
           "host_layers_by_rows": {str(p.rows): p.host_layers for p in sched.placements}}

    if a.smoke:
        rng = np.random.default_rng(0)
        toks = [int(x) for x in rng.integers(0, model.config.vocab_size, a.ctx * a.chunks)]
        prompts = [("random", [int(x) for x in rng.integers(0, model.config.vocab_size, 12)])]
    else:
        with open(a.text, encoding="utf-8") as f:
            toks = text_tokens(engines["gpu"], f.read())
        with open(GOLDEN) as f:
            prompts = [(p["name"], p["prompt_ids"]) for p in json.load(f)["prompts"]]
    if not a.daemon_only:
        ppl = {}
        for name, e in engines.items():
            t = time.perf_counter()
            ppl[name] = perplexity(e, toks, ctx=a.ctx, max_chunks=a.chunks).perplexity
            print(f"{name:7s} perplexity {ppl[name]:.4f} ({time.perf_counter() - t:.1f} s)", flush=True)
        out["perplexity"] = ppl
        out["perplexity_rel_diff"] = ppl["hybrid"] / ppl["gpu"] - 1
        print(f"hybrid vs gpu: {100 * out['perplexity_rel_diff']:+.4f}%", flush=True)

        out["greedy"] = []
        for name, ids in prompts:
            g, h = greedy(engines["gpu"], ids, a.tokens), greedy(engines["hybrid"], ids, a.tokens)
            n = common_prefix(g, h)
            out["greedy"].append({"prompt": name, "tokens": len(g), "common_prefix": n})
            print(f"  {name:16s} common prefix {n:3d} of {len(g)}", flush=True)
    stats = engines["hybrid"].kv.stats
    out["kv_syncs"], out["handoffs"] = stats["syncs"], engines["hybrid"].pipeline.handoff.stats["copies"]
    budget = a.daemon_budget or half_budget(engines["gpu"].plan, resident)
    # the budget counts the GPU plan's KV pool: the daemon keeps that pool, or its planner would
    # give the layers the room a smaller pool leaves (tiers.kv_pool) and stream none
    blocks = tiers.kv_blocks_of(engines["gpu"].plan)
    for e in engines.values():
        e.unload()
    engines = None
    gpu_ids, _ = daemon_greedy(path, prompts, a.tokens, [])
    hyb_ids, placed = daemon_greedy(path, prompts, a.tokens, ["--host-compute", "auto", "--vram-budget", str(budget)]
                                     + (["--kv-blocks", str(blocks)] if blocks else []))
    out["daemon"] = {"vram_budget": budget, "placements": placed,
                     "common_prefix": [{"prompt": name, "tokens": len(g), "common_prefix": common_prefix(g, h)}
                                       for (name, _), g, h in zip(prompts, gpu_ids, hyb_ids)]}
    print(f"daemons (hybrid: --vram-budget {budget}, host layers by rows "
          f"{ {p['rows']: len(p['host_layers']) for p in placed} }):", flush=True)
    for r in out["daemon"]["common_prefix"]:
        print(f"  {r['prompt']:16s} common prefix {r['common_prefix']:3d} of {r['tokens']}", flush=True)
    common.write_json(a.json, out)
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
