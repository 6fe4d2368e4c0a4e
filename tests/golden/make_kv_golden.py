"""Make the KV-layout golden (run once; CI reads tests/golden/kv_layout_smollm2.json).

    PYTHONPATH=daemon:client:system .venv/bin/python tests/golden/make_kv_golden.py

Greedy ids of the default model on the cpu and cpu-ref backends, with an f32 and an f16 KV
cache, in three runs that exercise the cache's layout: each forward golden prompt alone; all of
them live at once, prefilled in interleaved 7-token chunks and then decoded as one batch (their
positions interleave wherever the cache allocates them); and one long prompt from the licenses
text (900 tokens). With each id, the top-2 margin of the logits it was picked from, so a test
can tell a real difference from a near-tie that another instruction set may break the other
way.

The committed file was made with the contiguous layout (slots × max_ctx, before the paged
cache): tests/engine/test_kv_cache.py checks that the paged cache gives the same ids.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from ntransformerd.engine.runtime.engine import Engine, EngineConfig, default_model_path
from ntransformerd.engine.calibration.perplexity import licenses_text

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "kv_layout_smollm2.json")
N_GENERATE = 32
LONG = 900
CHUNK = 7
CONFIGS = (("cpu", "f32"), ("cpu", "f16"), ("cpu-ref", "f32"), ("cpu-ref", "f16"))


def pick(logits: np.ndarray) -> tuple[int, float]:
    """The argmax and its margin over the runner-up."""
    top2 = np.sort(logits)[-2:]
    return int(np.argmax(logits)), float(top2[1] - top2[0])


def solo(e: Engine, prompt: list[int], n: int) -> dict:
    slot = e.open()
    try:
        logits = e.prefill(slot, prompt)
        ids, margins = [], []
        for _ in range(n):
            t, m = pick(logits)
            ids.append(t)
            margins.append(m)
            logits = e.step([(slot, [t])])[0]
        return {"ids": ids, "margins": margins}
    finally:
        e.close(slot)


def batched(e: Engine, prompts: list[list[int]], n: int) -> list[dict]:
    """Every prompt live at once: prefilled CHUNK tokens at a time in turn, then decoded together."""
    slots = [e.open() for _ in prompts]
    try:
        last = [None] * len(prompts)
        done = [0] * len(prompts)
        while any(d < len(p) for d, p in zip(done, prompts)):
            items, who = [], []
            for i, p in enumerate(prompts):
                if done[i] < len(p):
                    items.append((slots[i], p[done[i]:done[i] + CHUNK]))
                    who.append(i)
                    done[i] += len(items[-1][1])
            out = e.step(items)
            for i, row in zip(who, out):
                last[i] = row
        runs = [{"ids": [], "margins": []} for _ in prompts]
        for _ in range(n):
            toks = []
            for r, row in zip(runs, last):
                t, m = pick(row)
                r["ids"].append(t)
                r["margins"].append(m)
                toks.append(t)
            last = list(e.decode(slots, toks))
        return runs
    finally:
        for s in slots:
            e.close(s)


def main() -> int:
    with open(os.path.join(HERE, "forward_smollm2.json")) as f:
        fwd = json.load(f)
    prompts = [p["prompt_ids"] for p in fwd["prompts"]]
    out = {"n_generate": N_GENERATE, "chunk": CHUNK, "long_tokens": LONG, "prompts": [p["name"] for p in fwd["prompts"]],
           "runs": {}}
    for backend, kv in CONFIGS:
        e = Engine.load(default_model_path(), config=EngineConfig(backend=backend, kv_dtype=kv, max_batch=8,
                                                                   max_ctx=1024))
        long_prompt = e.tokenizer.encode(licenses_text(), parse_special=False)[:LONG]
        out["long_ids"] = long_prompt
        run = {"solo": [solo(e, p, N_GENERATE) for p in prompts], "batched": batched(e, prompts, N_GENERATE),
               "long": solo(e, long_prompt, N_GENERATE)}
        out["runs"][f"{backend}/{kv}"] = run
        print(backend, kv, [r["ids"][:6] for r in run["solo"]], file=sys.stderr)
    with open(OUT, "w") as f:
        json.dump(out, f)
    print(f"wrote {OUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
