"""CPU backend speed on the default model, beside llama.cpp on the same file in the same run.

    .venv/bin/pip install -e '.[bench]'        # llama-cpp-python (builds llama.cpp, ~5 min)
    .venv/bin/python bench/cpu.py [--model M.gguf] [--prompt-tokens 512] [--decode-tokens 64] [--repeat 3]

Prefill: one prompt of --prompt-tokens tokens (our chunk = the whole prompt). Decode: greedy,
--decode-tokens steps at batch 1 after a short prompt. Both engines get the same token ids and
the same thread count (all cores). Reports the median of --repeat runs and the spread (min-max).
Prints a table and writes JSON (bench/out/cpu.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np


def ours(path: str, prompt: list[int], n_decode: int) -> tuple[float, float]:
    from ntransformerd.engine.engine import Engine, EngineConfig

    e = Engine.load(path, config=EngineConfig(max_seqs=2, max_ctx=len(prompt) + n_decode + 8,
                                              prefill_chunk=len(prompt)))
    s = e.open()
    t = time.perf_counter()
    e.prefill(s, prompt)
    prefill = len(prompt) / (time.perf_counter() - t)
    e.close(s)
    s = e.open()
    logits = e.prefill(s, prompt[:8])
    t = time.perf_counter()
    for _ in range(n_decode):
        logits = e.step([(s, [int(np.argmax(logits[-1] if logits.ndim > 1 else logits))])])
    decode = n_decode / (time.perf_counter() - t)
    return prefill, decode


def llama_cpp(path: str, prompt: list[int], n_decode: int, threads: int) -> tuple[float, float]:
    import llama_cpp as lc

    llm = lc.Llama(path, n_ctx=len(prompt) + n_decode + 8, n_batch=len(prompt), n_threads=threads,
                   n_threads_batch=threads, verbose=False)
    t = time.perf_counter()
    llm.eval(prompt)
    prefill = len(prompt) / (time.perf_counter() - t)
    llm.reset()
    llm.eval(prompt[:8])
    t = time.perf_counter()
    for _ in range(n_decode):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        llm.eval([tok])
    decode = n_decode / (time.perf_counter() - t)
    return prefill, decode


def summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "out", "cpu.json"))
    args = p.parse_args()

    from ntransformerd.engine.engine import default_model_path

    path = args.model or default_model_path()
    threads = os.cpu_count() or 1
    rng = np.random.default_rng(0)
    prompt = [int(x) for x in rng.integers(100, 40000, args.prompt_tokens)]
    rows = {"ntransformer (cpu, f32)": ([], []), "llama.cpp": ([], [])}
    for _ in range(args.repeat):
        for name, fn in (("ntransformer (cpu, f32)", lambda: ours(path, prompt, args.decode_tokens)),
                         ("llama.cpp", lambda: llama_cpp(path, prompt, args.decode_tokens, threads))):
            pf, dc = fn()
            rows[name][0].append(pf)
            rows[name][1].append(dc)
    result = {"model": os.path.basename(path), "threads": threads, "prompt_tokens": args.prompt_tokens,
              "decode_tokens": args.decode_tokens,
              "engines": {k: {"prefill_tok_s": summary(v[0]), "decode_tok_s": summary(v[1])} for k, v in rows.items()}}
    ref = result["engines"]["llama.cpp"]
    print(f"{result['model']}, {threads} threads, prompt {args.prompt_tokens}, decode {args.decode_tokens}, "
          f"median of {args.repeat} (min-max)")
    print(f"{'engine':26} {'prefill tok/s':>24} {'decode tok/s':>22} {'decode vs llama.cpp':>20}")
    for name, r in result["engines"].items():
        pf, dc = r["prefill_tok_s"], r["decode_tok_s"]
        ratio = dc["median"] / ref["decode_tok_s"]["median"]
        print(f"{name:26} {pf['median']:8.1f} ({pf['min']:.0f}-{pf['max']:.0f}) {dc['median']:10.1f} "
              f"({dc['min']:.1f}-{dc['max']:.1f}) {ratio:12.2f}x")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
