"""Same-run A/B of the captured decode step between checkouts (or settings) of the engine.

    python bench/ab_decode.py --code /tmp/old . --dir /tmp/ntx --rounds 2 --json bench/out/ab.json
    python bench/ab_decode.py --code . . --env '' 'NTX_PDL=0' ...      # one checkout, two settings
    python bench/ab_decode.py --smoke --dir /tmp/ntx-smoke              # this checkout twice, tiny files
    python bench/ab_decode.py --deterministic --dir /tmp/ntx            # deterministic off / on, B = 1, 16, 64

For each file and plan (8B-shaped Q8_0 and Q4_K_M all resident; Q4_K_M with 24 resident layers
and the rest streamed from pinned RAM) and each variant, a fresh process loads the engine
through its own Engine API and measures the device time of one decode step at batch 1 and 16
(captured steps replayed back to back on the step's stream, median of 3 × 16 steps), plus 16
greedy ids at batch 1 from a fixed prompt. Variants take turns, `rounds` times each; the
table gives each variant's median and the range of its runs, and the ratio to the first
variant. Compare variants of one run only. Raw output: the JSON file (keep it under bench/out/).

--deterministic measures the cost of the `deterministic` setting: this checkout with
NTX_DETERMINISTIC=0 and =1 taking turns, at batch 1, 16 and 64, on the resident 8B-shaped
Q4_K_M file (--types to choose others), two rounds: about two minutes on an H200 once the file
exists. "x the first" is the default's step time over the variant's: 0.90x means the
deterministic step takes 1/0.90 = 1.11 times as long (an 11% cost). Their greedy ids may differ
on random weights (near-ties everywhere; the two modes round differently).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import common

HERE = os.path.dirname(os.path.abspath(__file__))
PLANS = (("q8_0", None), ("q4_k_m", None), ("q4_k_m", 24))  # (type, max resident layers)
SMOKE_PLANS = (("q8_0", None), ("q4_k_m", None), ("q4_k_m", 1))  # the tiny shape has 2 layers


def worker(code: str, path: str, max_vram_layers: int | None, batches: list[int]) -> dict:
    # Imported here: each worker process measures the engine of its own checkout, whose packages
    # (the daemon and those it imports) all come from that checkout.
    for d in ("system", "client", "proto", "daemon"):
        sys.path.insert(0, os.path.join(os.path.abspath(code), d))
    import cupy as cp
    import numpy as np
    from ntransformerd.engine.gguf_file import GGUFModel
    try:
        from ntransformerd.engine.runtime.engine import Engine, EngineConfig
    except ImportError:  # a checkout from before engine/ was grouped (runtime/, generation/, calibration/)
        from ntransformerd.engine.engine import Engine, EngineConfig

    extra = {}
    if "deterministic" in EngineConfig.__dataclass_fields__:  # its variable, read as ntx-model reads it
        from ntransformerd.settings import MODEL, given
        extra = {k: v for k, v in given(MODEL, flags={}, file={}, environ=os.environ).items() if k == "deterministic"}
    e = Engine(GGUFModel(path), config=EngineConfig(backend="cuda", max_batch=max(batches) + 2, max_ctx=1024,
                                                    max_vram_layers=max_vram_layers, **extra))
    runner = getattr(e, "steps", None) or getattr(e, "_graphs", None) or getattr(e, "_decoder")
    new_api = hasattr(runner, "bucket")  # StepGraphs: the caller moves the cache lengths on

    def launch(slots, toks):
        if new_api:
            runner.launch(slots, toks, advance=True)
        else:
            runner.launch(slots, toks)

    out = {"plan": list(e.plan.tiers) if e.plan is not None else None, "steps_ms": {},
           "deterministic": bool(getattr(e.report(), "deterministic", False)) if hasattr(e, "report") else False}
    s = e.open()
    logits, ids = e.prefill(s, [(17 * j) % 40000 + 100 for j in range(23)]), []
    for _ in range(16):
        ids.append(int(np.argmax(logits)))
        logits = e.step([(s, [ids[-1]])])[0]
    e.close(s)
    out["greedy"] = ids
    for b in batches:
        slots = [e.open() for _ in range(b)]
        toks = np.arange(b, dtype=np.int32) + 100
        for _ in range(4):  # capture and warm-up
            launch(slots, toks)
        runner.stream.synchronize()
        runs = []
        for _ in range(3):
            a, z = cp.cuda.Event(), cp.cuda.Event()
            a.record(runner.stream)
            for _ in range(16):
                launch(slots, toks)
            z.record(runner.stream)
            z.synchronize()
            runs.append(cp.cuda.get_elapsed_time(a, z) / 16)
        out["steps_ms"][str(b)] = statistics.median(runs)
        for sl in slots:
            e.close(sl)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__file__, __doc__)
    ap.add_argument("--code", nargs="+", help="checkouts to compare (the first is the base; --smoke: . .)")
    ap.add_argument("--env", nargs="*", default=None, help="per variant, KEY=VALUE[,KEY=VALUE] for its process")
    ap.add_argument("--dir", default="/tmp/ntx", help="synthetic 8B files (made here if missing)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="default 1 16 (--deterministic: 1 16 64)")
    ap.add_argument("--deterministic", action="store_true", help="A/B the deterministic setting off and on")
    ap.add_argument("--types", nargs="+", choices=("q8_0", "q4_k_m"), default=None,
                    help="the resident 8B-shaped files to measure (--deterministic: default q4_k_m)")
    ap.add_argument("--worker", nargs=3, metavar=("CODE", "PATH", "MAX_VRAM_LAYERS"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.deterministic:
        if a.code or a.env:
            ap.error("--deterministic compares this checkout with itself: leave --code and --env out")
        a.code = [os.path.join(HERE, os.pardir)] * 2
        a.env = ["NTX_DETERMINISTIC=0", "NTX_DETERMINISTIC=1"]
    a.batches = a.batches or ([1, 16, 64] if a.deterministic else [1, 16])
    if a.worker:
        code, path, mvl = a.worker
        print(json.dumps(worker(code, path, None if mvl == "-" else int(mvl), a.batches)))
        return 0

    if a.smoke and not a.code:
        a.code = [os.path.join(HERE, os.pardir)] * 2
    if not a.code:
        ap.error("--code: give the checkouts to compare")
    common.require_gpu(__file__)
    shape, plans, rounds = ("tiny", SMOKE_PLANS, 1) if a.smoke else ("llama3-8b", PLANS, a.rounds)
    if a.types or a.deterministic:
        plans = tuple((t, None) for t in (a.types or ["q4_k_m"]))
    envs = a.env or [""] * len(a.code)
    if len(envs) != len(a.code):
        ap.error("--env takes one entry per --code")
    variants = [(c, e) for c, e in zip(a.code, envs)]
    results = {}  # (plan index, variant index) → list of worker outputs
    for _ in range(rounds):
        for p, (ftype, mvl) in enumerate(plans):
            # here, not in the workers: the files are the same for every variant
            path = common.synthetic(a.dir, shape, ftype)
            for v, (code, env) in enumerate(variants):
                penv = dict(os.environ, PYTHONUNBUFFERED="1")
                penv.update(kv.split("=", 1) for kv in env.split(",") if kv)
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", code, path, "-" if mvl is None else str(mvl),
                       "--batches", *map(str, a.batches)]
                r = subprocess.run(cmd, env=penv, capture_output=True, text=True)
                if r.returncode != 0:
                    print(r.stdout[-2000:], r.stderr[-4000:], file=sys.stderr)
                    raise SystemExit(f"worker failed: {code} {ftype} {mvl}")
                results.setdefault((p, v), []).append(json.loads(r.stdout.strip().splitlines()[-1]))
    table = []
    for p, (ftype, mvl) in enumerate(plans):
        base = None
        for v, (code, env) in enumerate(variants):
            runs = results[(p, v)]
            for b in a.batches:
                ms = [x["steps_ms"][str(b)] for x in runs]
                med = statistics.median(ms)
                if v == 0:
                    base = base or {}
                    base[b] = med
                row = {"type": ftype, "resident_layers": mvl if mvl is not None else "all", "variant": v, "code": code,
                       "env": env, "deterministic": runs[0].get("deterministic"), "batch": b, "median_ms": med,
                       "runs_ms": ms, "tok_s": b * 1e3 / med,
                       "speed_vs_first": base[b] / med, "greedy_same_as_first": runs[0]["greedy"] == results[(p, 0)][0]["greedy"]}
                table.append(row)
                print(f"{ftype:7s} resident {str(row['resident_layers']):>3s} B={b:<2d} v{v} {code} {env}: "
                      f"{med:.3f} ms/step (runs {min(ms):.3f}-{max(ms):.3f}) {row['tok_s']:.1f} tok/s, "
                      f"{row['speed_vs_first']:.3f}x the first, greedy ids {'same' if row['greedy_same_as_first'] else 'DIFFER'}",
                      flush=True)
    common.write_json(a.json, {"variants": variants, "shape": shape, "smoke": a.smoke, "rows": table,
                               "raw": {f"{p},{v}": r for (p, v), r in results.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
