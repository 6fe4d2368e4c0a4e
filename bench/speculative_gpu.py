"""What a verify step costs on the GPU, and what speculation buys on a streamed model.

    python3 bench/speculative_gpu.py --dir /tmp/ntx --json bench/out/speculative_gpu.json
    python3 bench/speculative_gpu.py --smoke --dir /tmp/ntx-smoke   # the tiny shape, one layer streamed

1. Verify-step cost: one step of T tokens per sequence (T = 1, 2, 4, 8, 16) against T = 1,
   at batch 1 and 16, for the 70B-shaped Q4_K_M in a 24 GiB VRAM budget (the rest streamed from
   pinned RAM) and the 8B-shaped Q4_K_M all resident; each step as speculation runs it
   (Engine.step with every row's top id picked on the device), median of `reps`.
2. End to end on the streamed 70B shape: greedy speculation with a replay draft, which proposes
   the target's own recorded greedy continuation with each drafted token replaced by a random
   id at rate 1 - p (random weights make a real draft meaningless: the accepted tokens per pass
   come from p, and the figures are projections for drafts of that acceptance). Each pass
   verifies k drafted tokens per sequence in one step of k + 1 tokens. The record is made with
   steps of that same shape (k junk drafts, none accepted), so the speculative output must equal
   it token for token (checked); how often it also equals one-token greedy decoding is reported:
   a step of more rows multiplies on other kernels (f16 tensor cores from 4 rows, int8 below),
   and the near-flat logits of random weights flip under that rounding. Reports tokens per
   target pass and tok/s, against plain decoding measured in the same run.
3. Layer skip on the streamed 70B shape: decode tok/s with every m-th layer left out of the
   step (Engine.step(layers=...)); the plan still holds the skipped layers, so this is the
   stream's saving alone (a plan built with skip_layers also frees their VRAM for others).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "daemon"))

import common  # noqa: E402
from ntransformerd.engine.backends.cuda import cp  # noqa: E402 (None without CuPy)
from ntransformerd.engine.runtime.engine import Engine, EngineConfig  # noqa: E402
from ntransformerd.engine.gguf_file import GGUFModel  # noqa: E402

TOKENS = (1, 2, 4, 8, 16)
CONTEXT = 40  # prompt tokens of every sequence before the measured steps


def prompts(b: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [[int(x) for x in rng.integers(100, vocab - 1, CONTEXT)] for _ in range(b)]


def open_prefilled(e: Engine, b: int):
    slots = [e.open() for _ in range(b)]
    logits = e.step([(s, p) for s, p in zip(slots, prompts(b, e.cfg.vocab_size))])  # one pass for all
    return slots, [int(np.argmax(r)) for r in logits]


def verify_costs(e: Engine, b: int, reps: int) -> dict:
    slots, last = open_prefilled(e, b)
    out = {}
    try:
        for t in TOKENS:
            times = []
            for r in range(reps + 1):
                items = [(s, [tok] * t) for s, tok in zip(slots, last)]
                t0 = time.perf_counter()
                e.step(items, all_logits=True, top=1)
                dt = time.perf_counter() - t0
                for s in slots:
                    e.truncate(s, CONTEXT)
                if r:  # the first compiles and captures
                    times.append(dt)
            out[t] = statistics.median(times)
    finally:
        for s in slots:
            e.close(s)
    return {str(t): {"step_s": out[t], "vs_1": out[t] / out[1]} for t in TOKENS}


def plain_greedy(e: Engine, b: int, n: int, layers=None) -> tuple[list[list[int]], float]:
    slots, last = open_prefilled(e, b)
    outs = [[tok] for tok in last]
    try:
        top = e.step([(s, [o[-1]]) for s, o in zip(slots, outs)], top=1, layers=layers)  # captures: untimed
        for o, row in zip(outs, top):
            o.append(int(row.ids[0]))
        t0 = time.perf_counter()
        for _ in range(n - 2):
            top = e.step([(s, [o[-1]]) for s, o in zip(slots, outs)], top=1, layers=layers)
            for o, row in zip(outs, top):
                o.append(int(row.ids[0]))
        dt = time.perf_counter() - t0
    finally:
        for s in slots:
            e.close(s)
    return outs, b * (n - 1) / dt


def speculative(e: Engine, b: int, n: int, want: list[list[int]] | None, k: int, p: float, seed: int) -> dict:
    """Greedy speculation with the replay draft of `want` (None: junk drafts, for the record);
    returns tokens per pass, tok/s, the output and whether it equals `want`."""
    rng = np.random.default_rng(seed)
    slots, last = open_prefilled(e, b)
    outs = [[tok] for tok in last]
    passes = 0
    try:
        t0 = time.perf_counter()
        while min(len(o) for o in outs) < n:
            drafts = []
            for o, w in zip(outs, want or [[]] * b):
                d = list(w[len(o):len(o) + k])
                d += [int(rng.integers(0, e.cfg.vocab_size))] * (k - len(d))  # past the record: noise
                drafts.append([x if rng.random() < p else int(rng.integers(0, e.cfg.vocab_size)) for x in d])
            starts = [e.length(s) for s in slots]
            top = e.step([(s, [o[-1]] + d) for s, o, d in zip(slots, outs, drafts)], all_logits=True, top=1)
            passes += 1
            for j, (s, o, d) in enumerate(zip(slots, outs, drafts)):
                target = [int(top.ids[j * (k + 1) + r, 0]) for r in range(k + 1)]
                a = 0
                while a < k and d[a] == target[a]:
                    a += 1
                o.extend(d[:a] + [target[a]])
                e.truncate(s, starts[j] + 1 + a)  # the last token and the accepted drafts stay
        dt = time.perf_counter() - t0
    finally:
        for s in slots:
            e.close(s)
    gen = sum(len(o) - 1 for o in outs)
    same = want is not None and all(o[:n] == w[:n] for o, w in zip(outs, want))
    return {"k": k, "p": p, "batch": b, "passes": passes, "tokens_per_pass": gen / (passes * b),
            "tok_s": gen / dt, "identical_to_record": same, "outs": [o[:n] for o in outs]}


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of sequences' positions where a and b agree, up to each pair's first difference."""
    same = 0
    for x, y in zip(a, b):
        j = 0
        while j < min(len(x), len(y)) and x[j] == y[j]:
            j += 1
        same += j
    return same / sum(len(x) for x in a)


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__file__, __doc__)
    ap.add_argument("--dir", default="/tmp/ntx", help="the synthetic files (made here if missing)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=25, help="generated tokens per sequence in part 2")
    ap.add_argument("--no-8b", action="store_true")
    ap.add_argument("--no-verify", action="store_true", help="skip part 1")
    ap.add_argument("--host-compute", choices=("off", "auto"), default="off",
                    help="the streamed shape's host_compute: auto has the host compute streamed layers beside the GPU")
    ap.add_argument("--threads", type=int, default=None, help="the host's threads (cpu_threads; default: all)")
    a = ap.parse_args(argv)
    common.require_gpu(__file__)
    out = {"smoke": a.smoke, "verify": {}, "speculative": [], "skip": []}

    # (name, shape, engine settings, streamed: parts 2 and 3 run on it)
    streamed = ("llama3-70b", "llama3-70b", {"vram_budget": "24GiB"}, True)
    resident = ("llama3-8b", "llama3-8b", {}, False)
    if a.smoke:  # the tiny shape's second layer streamed from pinned RAM; few reps, few tokens
        streamed = ("tiny streamed", "tiny", {"max_vram_layers": 1}, True)
        resident = ("tiny", "tiny", {}, False)
        a.reps, a.tokens = 1, 10
    if a.host_compute != "off":
        name, synth_shape, settings, is_streamed = streamed
        streamed = (f"{name} host {a.host_compute}", synth_shape,
                    {**settings, "host_compute": a.host_compute, "cpu_threads": a.threads}, is_streamed)
    runs = [streamed] + ([] if a.no_8b else [resident])
    for shape, synth_shape, settings, is_streamed in runs:
        path = common.synthetic(a.dir, synth_shape, "q4_k_m")
        t = time.perf_counter()
        e = Engine(GGUFModel(path), config=EngineConfig(backend="cuda", max_batch=17, max_ctx=256, **settings))
        print(f"{shape}: loaded in {time.perf_counter() - t:.0f} s; plan {e.plan.explain().splitlines()[1:4]}",
              flush=True)
        for b in () if a.no_verify else (1, 16):
            v = verify_costs(e, b, a.reps)
            out["verify"][f"{shape} B={b}"] = v
            print(f"{shape} B={b:2d} verify step / one-token step: "
                  + "  ".join(f"T={t}: {v[str(t)]['vs_1']:.2f}x ({v[str(t)]['step_s'] * 1e3:.1f} ms)" for t in TOKENS),
                  flush=True)
        if is_streamed:
            for b in (1, 16):
                greedy, plain = plain_greedy(e, b, a.tokens)
                out["speculative"].append({"batch": b, "plain_tok_s": plain})
                print(f"{shape} B={b:2d} plain greedy {plain:.2f} tok/s", flush=True)
                records = {}
                for k, p in ((4, 0.7), (4, 0.8), (8, 0.8)):
                    if k not in records:
                        records[k] = speculative(e, b, a.tokens, None, k, 0.0, seed=0)["outs"]
                        print(f"{shape} B={b:2d} k={k} record: agrees with one-token greedy on "
                              f"{100 * agreement(records[k], greedy):.0f}% of the positions", flush=True)
                    r = speculative(e, b, a.tokens, records[k], k, p, seed=b * 100 + k)
                    r["vs_plain"] = r["tok_s"] / plain
                    r["agreement_with_one_token_greedy"] = agreement(r.pop("outs"), greedy)
                    out["speculative"].append(r)
                    print(f"{shape} B={b:2d} k={k} p={p}: {r['tokens_per_pass']:.2f} tokens/pass, {r['tok_s']:.2f} tok/s "
                          f"({r['vs_plain']:.2f}x plain), output {'identical' if r['identical_to_record'] else 'DIFFERENT'}"
                          " to the record", flush=True)
            n = e.cfg.n_layers
            for every in (0, 10, 4):  # none, 10%, 25% of the layers left out
                layers = None if not every else [i for i in range(n) if i % every != every - 1]
                _, rate = plain_greedy(e, 1, 10, layers=layers)
                frac = 0 if not every else 1 - len(layers) / n
                out["skip"].append({"skipped_fraction": frac, "tok_s": rate})
                print(f"{shape} B= 1 {100 * frac:.0f}% of layers skipped: {rate:.2f} tok/s", flush=True)
        del e
        cp.get_default_memory_pool().free_all_blocks()
        cp.get_default_pinned_memory_pool().free_all_blocks()
    common.write_json(a.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
