"""CPU backends beside llama.cpp on the same file, same token ids, same thread count, same run.

    .venv/bin/pip install 'llama-cpp-python>=0.3'     # the peer (builds llama.cpp, ~5 min)
    .venv/bin/python bench/cpu.py [--model M.gguf] [--threads N] [--batch 1 8] [--repeat 3]
    .venv/bin/python bench/cpu.py --smoke             # tiny synthetic model, seconds (CI)
    .venv/bin/python bench/cpu.py --model 8B-Q4_K_M.gguf --threads 16 --engines cpu \\
        --llama-bench /tmp/llama/build/bin/llama-bench   # the H200 host: -ngl 0 -t 16 in the same call

Engines: `cpu` (quantized kernels, recorded steps), `cpu-ref` (the float32 reference) and
llama.cpp through llama-cpp-python (prefill and decode at every batch size) and/or
`llama-bench -ngl 0` (batch-1 decode, when --llama-bench names the binary). Prefill: one
prompt of --prompt-tokens in one chunk. Decode at batch B: B sequences after a short prompt,
--decode-tokens greedy steps of B rows. Each figure is the median of --repeat runs with the
spread (min-max); engines alternate within each repeat. Decode is also given as weight bytes
read per second (bytes of every layer and the output matrix per step) and as a fraction of
the host's read bandwidth measured in the same run (all threads summing a 1 GiB buffer).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from ntransformerd.engine.backends.host import native
from ntransformerd.engine.runtime.engine import Engine, EngineConfig, default_model_path
from ntransformerd.engine.gguf_file import GGUFModel

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


def step_bytes(model: GGUFModel) -> int:
    """Weight bytes one decode step reads: every layer and the output matrix."""
    c = model.config
    out = model.tensors["token_embd.weight" if c.tied_output else "output.weight"].nbytes
    return sum(model.layer_bytes(i) for i in range(c.n_layers)) + out


def read_bandwidth(threads: int, nbytes: int = 1 << 30) -> float:
    """Bytes per second all `threads` read from RAM (best of 3 passes over nbytes)."""
    lib = native.load()
    buf = np.ones(nbytes // 8, np.int64)
    lib.read_probe(buf.ctypes.data, buf.nbytes, 1, threads)  # warm: pages present, threads up
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        lib.read_probe(buf.ctypes.data, buf.nbytes, 2, threads)
        best = max(best, 2 * buf.nbytes / (time.perf_counter() - t))
    return best


def ours(backend: str, path: str, prompt: list[int], n_decode: int, batches: list[int], threads: int) -> dict:
    e = Engine.load(path, config=EngineConfig(backend=backend, max_batch=max(batches) + 1,
                                              max_ctx=len(prompt) + n_decode + 16,
                                              prefill_chunk=len(prompt), cpu_threads=threads))
    s = e.open()
    e.prefill(s, prompt[:16])  # warm: recordings made, pages in
    e.close(s)
    res = {}
    s = e.open()
    t = time.perf_counter()
    e.prefill(s, prompt)
    res["prefill"] = len(prompt) / (time.perf_counter() - t)
    e.close(s)
    for b in batches:
        slots = [e.open() for _ in range(b)]
        logits = np.stack([e.prefill(sl, prompt[i:i + 8]) for i, sl in enumerate(slots)])
        t = time.perf_counter()
        for _ in range(n_decode):
            logits = e.decode(slots, [int(np.argmax(r)) for r in logits])
        res[f"decode_b{b}"] = b * n_decode / (time.perf_counter() - t)
        for sl in slots:
            e.close(sl)
    return res


def run_llama_cpp(path: str, prompt: list[int], n_decode: int, batches: list[int], threads: int) -> dict:
    import llama_cpp as lc  # the peer, installed for benchmarks only

    n_ctx = (len(prompt) + n_decode + 16) * (max(batches) + 1)
    llm = lc.Llama(path, n_ctx=n_ctx, n_batch=len(prompt), n_ubatch=len(prompt), n_threads=threads,
                   n_threads_batch=threads, n_seq_max=max(batches) + 1, logits_all=False, verbose=False)
    llm.eval(prompt[:16])
    llm.reset()
    res = {}
    t = time.perf_counter()
    llm.eval(prompt)
    res["prefill"] = len(prompt) / (time.perf_counter() - t)
    vocab = llm.n_vocab()
    for b in batches:  # a context of its own with b sequences (the Llama object's has one)
        params = lc.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = (16 + n_decode + 8) * b + 64, 512, 512
        params.n_seq_max, params.n_threads, params.n_threads_batch = b, threads, threads
        ctx = lc.llama_init_from_model(llm.model, params)
        batch = lc.llama_batch_init(max(8 * b, b), 0, 1)
        try:
            def decode(items):  # items: (seq, pos, token, want_logits)
                batch.n_tokens = len(items)
                for i, (sq, pos, tok, want) in enumerate(items):
                    batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
                    batch.seq_id[i][0], batch.logits[i] = sq, want
                if lc.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed")

            for sq in range(b):
                decode([(sq, p, prompt[sq + p], p == 7) for p in range(8)])
            nxt = [int(np.argmax(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, -1), (vocab,))))] * b
            t = time.perf_counter()
            for step in range(n_decode):
                decode([(sq, 8 + step, nxt[sq], True) for sq in range(b)])
                nxt = [int(np.argmax(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), (vocab,))))
                       for i in range(b)]
            res[f"decode_b{b}"] = b * n_decode / (time.perf_counter() - t)
        finally:
            lc.llama_batch_free(batch)
            lc.llama_free(ctx)
    return res


def llama_bench(binary: str, path: str, n_decode: int, threads: int) -> dict:
    """`llama-bench -ngl 0`: its batch-1 decode (tg) on the host."""
    r = subprocess.run([binary, "-m", path, "-ngl", "0", "-t", str(threads), "-p", "0", "-n", str(n_decode),
                        "-r", "1", "-o", "json"], capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"llama-bench failed: {r.stderr[-2000:]}")
    rows = json.loads(r.stdout)
    return {"decode_b1": float(rows[0]["avg_ts"])}


def summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="GGUF file (default: the embedded default model)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--engines", default="cpu,cpu-ref,llama.cpp",
                   help="comma list of cpu, cpu-ref, llama.cpp (llama-cpp-python), llama-bench")
    p.add_argument("--llama-bench", metavar="BIN", help="llama-bench binary: adds its -ngl 0 decode")
    p.add_argument("--smoke", action="store_true", help="a tiny synthetic model, a few tokens, one run")
    p.add_argument("--json", default=os.path.join(OUT, "cpu.json"))
    args = p.parse_args(argv)

    engines = [x for x in args.engines.split(",") if x]
    if args.llama_bench and "llama-bench" not in engines:
        engines.append("llama-bench")
    tmp = None
    if args.smoke:
        from ntransformerd.tools.synth import Shape, synthesize
        tmp = tempfile.TemporaryDirectory()
        path = os.path.join(tmp.name, "smoke.gguf")
        synthesize(path, shape=Shape(n_layers=2, d_model=256, d_ff=512, n_heads=4, n_kv_heads=2, vocab=2048),
                   ftype="q4_1", seed=0)
        args.prompt_tokens, args.decode_tokens, args.repeat, args.batch = 32, 4, 1, [1, 2]
        engines = [x for x in engines if x not in ("llama.cpp", "llama-bench")]
    else:
        path = args.model or default_model_path()
    if "llama.cpp" in engines:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            print("llama-cpp-python is not installed: llama.cpp left out", file=sys.stderr)
            engines.remove("llama.cpp")
    model = GGUFModel(path)
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    prompt = [int(x) for x in rng.integers(min(100, vocab // 2), vocab, args.prompt_tokens)]
    bandwidth = read_bandwidth(args.threads, (64 << 20) if args.smoke else (1 << 30))
    runs: dict[str, dict[str, list[float]]] = {e: {} for e in engines}
    for _ in range(args.repeat):
        for eng in engines:
            if eng == "llama.cpp":
                r = run_llama_cpp(path, prompt, args.decode_tokens, args.batch, args.threads)
            elif eng == "llama-bench":
                r = llama_bench(args.llama_bench, path, args.decode_tokens, args.threads)
            else:
                r = ours(eng, path, prompt, args.decode_tokens, args.batch, args.threads)
            for k, v in r.items():
                runs[eng].setdefault(k, []).append(v)
    per_step = step_bytes(model)
    result = {"smoke": args.smoke, "model": os.path.basename(path), "threads": args.threads, "prompt_tokens": args.prompt_tokens,
              "decode_tokens": args.decode_tokens, "batches": args.batch, "step_bytes": per_step,
              "read_bandwidth_GBs": bandwidth / 1e9, "kernels": native.load().variant.name,
              "engines": {e: {k: summary(v) for k, v in r.items()} for e, r in runs.items()}}
    peer = next((e for e in ("llama.cpp", "llama-bench") if e in engines), None)
    cols = ["prefill"] + [f"decode_b{b}" for b in args.batch]
    print(f"{result['model']}: {args.threads} threads, prompt {args.prompt_tokens}, decode {args.decode_tokens} "
          f"steps, median of {args.repeat} (min-max); host reads {bandwidth / 1e9:.1f} GB/s; "
          f"{per_step / 1e6:.1f} MB of weights per step; kernels {result['kernels']}")
    print(f"{'engine':12}" + "".join(f"{c + ' tok/s':>26}" for c in cols) + f"{'b1 GB/s (of host)':>20}")
    for e, r in result["engines"].items():
        line = f"{e:12}"
        for c in cols:
            if c not in r:
                line += f"{'-':>26}"
                continue
            s = r[c]
            ratio = ""
            if peer and e != peer and c in result["engines"][peer]:
                ratio = f" {s['median'] / result['engines'][peer][c]['median']:.2f}x"
            line += f"{s['median']:9.1f} ({s['min']:.0f}-{s['max']:.0f}){ratio:>7}"
        if "decode_b1" in r:
            gbs = r["decode_b1"]["median"] * per_step / 1e9
            line += f"{gbs:8.1f} ({gbs / (bandwidth / 1e9):.0%})"
        print(line)
    if peer:
        print(f"ratios against {peer} (same run)")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
