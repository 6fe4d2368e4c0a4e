"""Long contexts on a small GPU (issue 36): a 70B-shaped Q4_K_M whose file says 131072 positions
(Llama 3.1), served by the daemon at a 24 GiB VRAM budget with q8_0 KV and a pool that holds 4
sequences of 32768 positions at once; the decode rate of 4 sequences at 32k against 4 at 512 on
that one plan (goal ≥ 0.9×), and the plan's resident layers with the KV type's trade.

    python3 bench/long_context.py --dir /tmp/ntx                 # the acceptance run (one device call)
    python3 bench/long_context.py --dir /tmp/ntx --quick         # llama3-8b shape, 4 x 8k
    python3 bench/long_context.py --dir /tmp/ntx --history distinct  # 4 histories of their own (longer)
    python3 bench/long_context.py --smoke                        # tiny model, the cpu backend without a GPU

One daemon (`ntransformerd`, the client library over its socket): --max-batch 4, --max-ctx
CONTEXT, --kv-dtype q8_0, --kv-blocks 4 × CONTEXT / 16 (every sequence can reach CONTEXT at
once), --vram-budget 24GiB, --prefill-chunk 512. The plan it loaded is printed as `ntx-model run
--plan` prints it (its "KV trade" line: the layers q8_0 keeps resident, and whether f16 would fit at
all), beside the planner's rows for the default pool (kv_blocks 0) in q8_0 and f16.

Levels, each --tokens greedy tokens (ignore_eos) for 4 requests sent at once, the decode rate
measured from the streamed tokens while all four decode (tokens in the window from the last
first token to the first last token, over its length):
  short: 4 distinct prompts of 512 tokens, before and after the long levels (the median of two);
  long: 4 sequences at CONTEXT positions. A 32k prompt through a streamed 70B prefills at a
  few hundred tokens per second at best (each 512-token chunk streams every non-resident
  layer), so 4 × 32k would take most of a 10-minute device call: by default (--history shared)
  one history of CONTEXT − tail − tokens positions is prefilled once (a request of its own,
  kept by the prefix cache) and the 4 requests continue it with distinct 32-token tails, their
  KV the history's blocks shared by reference (server/prefix_cache.py) plus their own; each
  step's attention reads 4 × CONTEXT positions, but the pool holds the history once.
  --history distinct prefills 4 histories of their own (4× the prefill; the pool full).
The step streams every non-resident layer either way (attention is a small part of it), so
the ratio measures what the context costs beside the streaming.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

SHORT = 512
TAIL = 32  # each long request's own tokens after the shared history


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclasses.dataclass
class Setup:
    shape: str
    context: int  # positions per sequence (max_ctx)
    budget: str | None
    tokens: int  # greedy tokens per request
    chunk: int
    short: int = SHORT


def planner_rows(path: str, s: Setup, backend: str) -> list[dict]:
    """The planner's plans (no GPU needed) for the default pool in q8_0 and f16: what kv_blocks
    costs in resident layers against the pool the planner would choose."""
    from ntransformerd.engine import tiers
    from ntransformerd.engine.runtime.engine import EngineConfig
    from ntransformerd.engine.gguf_file import GGUFModel
    model = GGUFModel(path)
    sizes = [model.layer_bytes(i) for i in range(model.config.n_layers)]
    rows = [{"plan": "the file", "context_length": model.config.context_length}]
    for dtype in ("q8_0", "f16"):
        cfg = EngineConfig(backend="cpu", max_batch=4, max_ctx=s.context, kv_dtype=dtype, vram_budget=s.budget,
                           prefill_chunk=s.chunk)
        try:
            p = tiers.model_plan(model, cfg, backend="cuda" if backend == "cuda" else "cpu", layer_bytes=sizes)
            rows.append({"plan": f"default pool, {dtype} KV", "resident_layers": len(p.layers("vram")),
                         "kv_tokens": p.kv_tokens, "kv_why": p.kv.why, "trade": p.kv.trade()})
        except tiers.PlanError as e:
            rows.append({"plan": f"default pool, {dtype} KV", "error": str(e)})
        log(f"planner: {rows[-1]}")
    return rows


def level(sock: str, prompts: list[list[int]], tokens: int) -> dict:
    """The 4 prompts sent at once, `tokens` greedy tokens each: the decode rate while all of them
    decode, from the streamed tokens' arrival times."""
    from ntx_client import Client
    start = threading.Barrier(len(prompts))

    def one(prompt: list[int]) -> dict:
        with Client(sock) as c:
            start.wait()
            t0, times, usage = time.perf_counter(), [], None
            for chunk in c.generate(prompt_ids=prompt, max_tokens=tokens, temperature=0, ignore_eos=True, timeout=900):
                now = time.perf_counter()
                times += [now] * len(chunk.ids)
                usage = chunk.usage or usage
            return {"t0": t0, "times": times, "usage": usage}

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        runs = list(pool.map(one, prompts))
    lo, hi = max(r["times"][0] for r in runs), min(r["times"][-1] for r in runs)
    inside = sum(lo < t <= hi for r in runs for t in r["times"])
    together = hi > lo and inside > 0
    if not together:  # no stretch where all four decode (a tiny model's steps come in bursts)
        lo, hi = min(r["times"][0] for r in runs), max(r["times"][-1] for r in runs)
        inside = sum(len(r["times"]) - 1 for r in runs)
        log(f"the {len(runs)} requests did not decode together: the rate over all of them (raise --tokens)")
    hi = max(hi, lo + 1e-9)
    return {"tok_s": inside / (hi - lo), "steps_s": inside / len(runs) / (hi - lo), "window_tokens": inside,
            "together": together,
            "first_token_s": [r["times"][0] - r["t0"] for r in runs],
            "cached_prompt_tokens": [r["usage"]["cached_prompt_tokens"] if r["usage"] else None for r in runs]}


class Progress:
    """The daemon's prefilled and generated token counts on stderr every `every` seconds while a
    long level runs (a 32k prefill through a streamed 70B says nothing for a minute)."""

    def __init__(self, sock: str, every: float = 20.0):
        self.sock, self.every, self.done = sock, every, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()

    def run(self) -> None:
        from ntx_client import Client
        t0 = time.perf_counter()
        with Client(self.sock) as c:
            while not self.done.wait(self.every):
                st = c.status()
                log(f"  … {time.perf_counter() - t0:.0f} s: {st.prefill_tokens_total} prompt tokens prefilled, "
                    f"{st.tokens_generated_total} generated, {st.live_requests} live")


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__file__, __doc__)
    p.add_argument("--dir", default="/tmp/ntx", help="where synthetic models are made (default /tmp/ntx)")
    p.add_argument("--quick", action="store_true", help="the llama3-8b shape, 4 x 8192 (a shorter run)")
    p.add_argument("--history", choices=("shared", "distinct"), default="shared",
                   help="the long level's histories: one prefilled once and continued 4 ways (default), or 4")
    p.add_argument("--budget", default="24GiB", help="vram_budget (default 24GiB)")
    p.add_argument("--context", type=int, help="positions per sequence (default 32768; --quick 8192)")
    p.add_argument("--tokens", type=int, help="greedy tokens per request (default 16; --quick 64)")
    p.add_argument("--rounds", type=int, help="long levels (default 2; 1 with --history distinct)")
    p.add_argument("--chunk", type=int, default=512, help="prefill_chunk (default 512)")
    p.add_argument("--host-compute", default="off", help="the daemon's host_compute (default off: one plan)")
    a = p.parse_args(argv)
    a.rounds = a.rounds or (1 if a.history == "distinct" else 2)
    backend = "cuda"
    if a.smoke and common.gpu_missing():
        backend = "cpu"  # the path without a GPU: the daemon on the cpu backend
    else:
        common.require_gpu(__file__)
    if a.smoke:
        s = Setup("tiny", 256, None if backend == "cpu" else "1GiB", 8, 32, short=24)
        a.rounds = 1
    elif a.quick:
        s = Setup("llama3-8b", a.context or 8192, a.budget, a.tokens or 64, a.chunk)
    else:
        s = Setup("llama3-70b", a.context or 32768, a.budget, a.tokens or 16, a.chunk)
    t = time.perf_counter()
    path = common.synthetic(a.dir, s.shape, "q4_k_m")
    log(f"{path} ready in {time.perf_counter() - t:.1f} s")
    out = {"model": os.path.basename(path), "backend": backend, "budget": s.budget, "context": s.context,
           "history": a.history, "tokens": s.tokens, "smoke": a.smoke, "plans": planner_rows(path, s, backend)}
    if out["plans"][0]["context_length"] < s.context:
        raise SystemExit(f"{path} holds {out['plans'][0]['context_length']} positions, not {s.context}: a file made "
                         "before the llama3 shapes' context became 131072; remove it and run again")

    blocks = 4 * -(-s.context // 16)
    flags = ["--backend", backend, "--model", path, "--max-batch", "4", "--max-ctx", str(s.context),
             "--kv-dtype", "q8_0", "--kv-blocks", str(blocks), "--prefill-chunk", str(s.chunk),
             "--host-compute", a.host_compute, "--max-queue", "16"]
    if s.budget:
        flags += ["--vram-budget", s.budget]
    from ntx_client import Client
    with tempfile.TemporaryDirectory(prefix="ntx-long-") as d:
        t = time.perf_counter()
        log(f"starting the daemon: {' '.join(flags)}")
        proc, sock = common.start_daemon(d, flags)
        try:
            out["load_s"] = time.perf_counter() - t
            with Client(sock) as c:
                info, kv = c.model(), c.status().kv
            out["plan"] = info.plan.explanation
            out["daemon_plan"] = {"resident_layers": kv.resident_layers, "resident_by_dtype": dict(kv.resident_by_dtype),
                                  "kv_dtype": kv.dtype, "kv_blocks": kv.blocks, "pool_tokens": kv.pool_tokens,
                                  "context_length": info.context_length}
            log(f"loaded in {out['load_s']:.1f} s\n{info.plan.explanation}")
            run(sock, s, a, out)
        finally:
            common.stop_daemon(proc)
            with open(os.path.join(d, "daemon.log")) as f:
                tail = f.read()[-1500:]
            if "Traceback" in tail:
                log(f"daemon log:\n{tail}")
    short, long_ = statistics.median(out["short"]), statistics.median(out["long"])
    out["short_tok_s"], out["long_tok_s"], out["long_vs_short"] = short, long_, long_ / short
    rows = out["daemon_plan"]
    print(f"\n{out['model']} (its context {out['plans'][0]['context_length']}), budget {s.budget}, q8_0 KV, "
          f"{rows['kv_blocks']} blocks = 4 x {s.context}: {rows['resident_layers']} layers resident "
          f"(at this pool: {', '.join(f'{k} {v}' for k, v in rows['resident_by_dtype'].items())})")
    print("\n".join(line for line in out["plan"].splitlines() if "KV" in line or "resident" in line))
    for r in out["plans"][1:]:
        print(f"  planner, {r['plan']}: " + (f"{r['resident_layers']} resident, {r['kv_tokens']} positions "
                                             f"({r['kv_why']}); {r['trade']}" if "error" not in r else r["error"]))
    print(f"| context | 4 sequences, decode tok/s (runs) |\n|---|---|\n"
          f"| {s.short} | {short:.3f} ({', '.join(f'{x:.3f}' for x in out['short'])}) |\n"
          f"| {s.context} ({a.history} history) | {long_:.3f} ({', '.join(f'{x:.3f}' for x in out['long'])}) |")
    print(f"{s.context} vs {s.short}: {out['long_vs_short']:.3f}x (goal >= 0.9)", flush=True)
    common.write_json(a.json, out)
    return 0


def run(sock: str, s: Setup, a, out: dict) -> None:
    """The levels: short, long × rounds, short again."""
    from ntx_client import Client
    with Client(sock) as c:
        vocab = c.model().vocab_size
    rng = np.random.default_rng(0)

    def ids(n: int) -> list[int]:
        return rng.integers(1, vocab, n).tolist()

    level(sock, [ids(8) for _ in range(4)], 3)  # warm: the batch's kernels and captured steps
    out["short"], out["long"], out["long_levels"] = [], [], []

    def short() -> None:
        r = level(sock, [ids(s.short) for _ in range(4)], s.tokens)
        out["short"].append(r["tok_s"])
        log(f"4 x {s.short}: {r['tok_s']:.3f} tok/s ({r['window_tokens']} tokens in the window)")

    short()
    history = s.context - TAIL - s.tokens - 16
    if a.history == "shared":
        base = ids(history)
        t = time.perf_counter()
        with Client(sock) as c, Progress(sock):  # prefilled once, kept by the prefix cache
            c.complete(prompt_ids=base, max_tokens=1, temperature=0, ignore_eos=True, timeout=1800)
        out["history_prefill_s"] = time.perf_counter() - t
        log(f"history of {history} positions prefilled in {out['history_prefill_s']:.1f} s "
            f"({history / out['history_prefill_s']:.0f} tok/s)")
    for i in range(a.rounds):
        if a.history == "shared":
            prompts = [base + ids(TAIL) for _ in range(4)]
        else:
            prompts = [ids(history + TAIL) for _ in range(4)]
        t = time.perf_counter()
        with Progress(sock):
            r = level(sock, prompts, s.tokens)
        r["seconds"] = time.perf_counter() - t
        out["long"].append(r["tok_s"])
        out["long_levels"].append(r)
        log(f"4 x {s.context} (round {i + 1}): {r['tok_s']:.3f} tok/s, first tokens after "
            f"{', '.join(f'{x:.1f}' for x in r['first_token_s'])} s, cached prompt tokens {r['cached_prompt_tokens']}")
    short()


if __name__ == "__main__":
    raise SystemExit(main())
