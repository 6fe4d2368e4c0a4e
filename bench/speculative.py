"""Speculative decoding on the CPU with the real model: per draft source, generated tokens per
target pass and the end-to-end speed-up, on the six reference prompts and a code edit.

    .venv/bin/python bench/speculative.py --json bench/out/speculative_cpu.json [--max-tokens 64]
    .venv/bin/python bench/speculative.py --smoke --dir /tmp/ntx-smoke   # a tiny synthetic model, 8 tokens

Target: the all-F32 copy of the default model (made with `ntx-model quantize`; our CPU engine
computes it exactly as it computes the Q4_1 file). Sources: n-gram lookup; the Q4_0 copy as a
separate draft model; the model with layers skipped (the calibrated auto choice at +3%
perplexity if bench/quality.py saved a calibration, else the 7 most similar layers); its own
first 15 of 30 layers. Greedy, each output checked token for token against plain decoding.
Each source runs twice:
- with the cost table measured here (a CPU verify step of T tokens costs much more than one:
  compute-bound), so the controller picks what pays on this machine: the CPU speed-up, decode
  tok/s after the first token (prefill excluded, the same for both);
- with the cost table of a PCIe-bound streamed target (STREAMED: a 16-token step costs 1.15×
  one, as the 70B shape at 24 GiB measured on the H200, and a resident draft ~1% of a streamed
  step), which lets drafts run long: the tokens per pass such a target would get from each
  draft's agreement. Its CPU tok/s means nothing and is not reported as a speed-up.
The H200 part is bench/speculative_gpu.py. `--smoke` runs the same on a tiny synthetic model of 4
layers (the first and last are never skipped: the skip draft leaves out the two others, the
prefix draft is the first layer) with 8 tokens per prompt, still checked token for token.
"""

from __future__ import annotations

import json
import os
import sys
import time

from threadpoolctl import threadpool_limits

import common
from ntransformerd.engine.calibration import layer_skip
from ntransformerd.engine.generation import speculative as sp
from ntransformerd.engine.runtime.engine import Engine, EngineConfig, default_model_path, generate
from ntransformerd.engine.generation.sampler import SamplingParams
from ntransformerd.tools.quantize import quantize_file

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, os.pardir, "tests", "golden")
STREAMED = sp.StepCosts({1: 1.0, 2: 1.01, 4: 1.03, 8: 1.07, 16: 1.15}, draft=0.01)


def prompts(engine) -> list[tuple[str, list[int], bool]]:
    """(name, prompt ids, ignore_eos): the six reference prompts and the code edit."""
    with open(os.path.join(GOLDEN, "forward_smollm2.json")) as f:
        ref = [(p["name"], p["prompt_ids"], True) for p in json.load(f)["prompts"]]
    with open(os.path.join(GOLDEN, "code_edit_prompt.json")) as f:
        code = json.load(f)
    return ref + [("code_edit", engine.encode_chat(code["messages"]), False)]


def timed(events) -> tuple[list[int], float]:
    """Token ids and the seconds from the first token to the last."""
    ids, t_first = [], None
    for ev in events:
        ids.append(ev.token)
        if t_first is None:
            t_first = time.perf_counter()
    return ids, time.perf_counter() - t_first


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__file__, __doc__)
    ap.add_argument("--dir", default="/tmp/ntx-quality", help="where the F32 and Q4_0 copies go")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--sources", default="ngram,draft,skip,prefix:15")
    args = ap.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    if args.smoke:  # the whole vocabulary: the reference prompts are the default model's token ids
        args.max_tokens, args.sources = 8, args.sources.replace("prefix:15", "prefix:1")
        src, name, n_skip = common.synthetic(args.dir, "tiny", "q4_1", n_layers=4), "tiny", 2
    else:
        src, name, n_skip = default_model_path(), "smollm2", 7
    f32, q4 = os.path.join(args.dir, f"{name}-f32.gguf"), os.path.join(args.dir, f"{name}-q4_0.gguf")
    for path, t in ((f32, "f32"), (q4, "q4_0")):
        if not os.path.exists(path):
            quantize_file(src, path, t)
    out = {"max_tokens": args.max_tokens, "model": os.path.basename(src), "smoke": args.smoke,
           "load_average": os.getloadavg(), "sources": {}}
    with threadpool_limits(1):
        target = Engine.load(f32, config=EngineConfig(backend="cpu", max_batch=2, max_ctx=2048))
        draft_engine = sp.load_draft_engine(q4, target)
        cal = layer_skip.load_cached(src)
        skip = cal.auto(layer_skip.AUTO_THRESHOLD) if cal else None
        skip_mode = f"skip:{','.join(map(str, skip))}" if skip else f"skip:{n_skip}"
        if skip is None:  # no saved calibration of the model: calibrate here (cosine only is enough)
            sim = layer_skip.layer_similarity(target, prompts(target)[-2][1] * 4, ctx=256, max_chunks=1)
            cal = layer_skip.Calibration("", "", 256, 1, [float(s) for s in sim], [])
            skip_mode = f"skip:{','.join(map(str, cal.most_similar(n_skip)))}"
        work = prompts(target)
        plain = {}
        for name, ids, ignore in work:
            params = SamplingParams.greedy(max_tokens=args.max_tokens, ignore_eos=ignore)
            plain[name] = timed(generate(target, ids, params))
        out["plain_tok_s"] = {n: (len(i) - 1) / s for n, (i, s) in plain.items()}
        print(f"{'source [cost table]':32} {'prompt':10} {'tok/pass':>8} {'accept':>7} {'tok/s':>7} {'plain':>7} {'speed-up':>8}")
        for mode in args.sources.split(","):
            mode = skip_mode if mode == "skip" else mode
            draft = sp.make_draft(mode, target, draft_engine=draft_engine, model_path=src)
            measured = sp.measure_costs(target, draft)
            for table, costs in (("cpu", measured), ("streamed", STREAMED)):
                key = f"{mode} [{table}]"
                rows = []
                for name, ids, ignore in work:
                    s = sp.Speculator(target, draft, costs=costs)
                    params = SamplingParams.greedy(max_tokens=args.max_tokens, ignore_eos=ignore)
                    got, secs = timed(sp.generate(target, ids, params, s))
                    assert got == plain[name][0], f"{key} on {name}: not the plain greedy output"
                    st = s.stats()
                    tps, ptps = (len(got) - 1) / secs, out["plain_tok_s"][name]
                    rows.append({"prompt": name, "tokens": len(got), "tokens_per_pass": st["tokens_per_pass"],
                                 "acceptance": st["acceptance"], "tok_s": tps, "plain_tok_s": ptps,
                                 "speedup": tps / ptps})
                    shown = f"{tps:7.1f} {ptps:7.1f} {tps / ptps:7.2f}x" if table == "cpu" else ""
                    print(f"{key:32} {name:10} {st['tokens_per_pass']:8.2f} {st['acceptance']:7.0%} {shown}", flush=True)
                ref = [r for r in rows if r["prompt"] != "code_edit"]
                res = {"costs": s.costs.to_dict(), "rows": rows,
                       "reference_tokens_per_pass": sum(r["tokens_per_pass"] for r in ref) / len(ref)}
                if table == "cpu":
                    res["reference_speedup"] = sum(r["speedup"] for r in ref) / len(ref)
                out["sources"][key] = res
                print(f"{key:32} {'6 refs':10} {res['reference_tokens_per_pass']:8.2f}  "
                      f"{'speed-up %.2fx' % res['reference_speedup'] if table == 'cpu' else ''}  costs {res['costs']}")
    common.write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
