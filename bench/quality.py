"""What lossy choices cost: perplexity of the default model in every type `ntx-model quantize`
makes, and the layer-skip calibration table (cosine per layer, perplexity with k layers skipped).

    .venv/bin/python bench/quality.py --json bench/out/quality.json [--ctx 256] [--chunks 8]
    .venv/bin/python bench/quality.py --smoke --dir /tmp/ntx-smoke     # a tiny synthetic model, 2 short chunks

Perplexity is llama-perplexity's (engine/calibration/perplexity.py) on /usr/share/common-licenses/GPL-3.
Every type is requantized from the Q4_1 file (the only copy of the model there is), so a type
finer than Q4_1 measures Q4_1's own loss plus its rounding. The calibration is saved beside
the model, where `--skip-layers auto` and `N` read it. `--smoke` measures a tiny synthetic model
instead (a type of each family, two chunks of 32 tokens; its calibration lands beside it, in --dir).
"""

from __future__ import annotations

import hashlib
import os
import sys
import time

from threadpoolctl import threadpool_limits

import common
from ntransformerd.engine.calibration import layer_skip
from ntransformerd.engine.runtime.engine import Engine, EngineConfig, default_model_path
from ntransformerd.engine.calibration.perplexity import perplexity, text_tokens
from ntransformerd.tools.quantize import FTYPES, quantize_file

TEXT = "/usr/share/common-licenses/GPL-3"
SMOKE_TYPES = "f32,q8_0,q4_0,q4_k_m,q6_k"


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__file__, __doc__)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--dir", default="/tmp/ntx-quality", help="where the requantized copies go")
    ap.add_argument("--types", help=f"comma-separated (default: all of {','.join(FTYPES)}; --smoke: {SMOKE_TYPES})")
    ap.add_argument("--no-calibrate", action="store_true")
    args = ap.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    if args.smoke:
        args.ctx, args.chunks, args.types = 32, 2, args.types or SMOKE_TYPES
        src, name = common.synthetic(args.dir, "tiny", "q4_1", vocab=2048), "tiny"
    else:
        src, name = default_model_path(), "smollm2"
    types = (args.types or ",".join(FTYPES)).split(",")
    with open(TEXT, "rb") as f:
        data = f.read()
    text, text_sha = data.decode(), hashlib.sha256(data).hexdigest()
    config = EngineConfig(backend="cpu", max_batch=1, max_ctx=args.ctx, prefill_chunk=args.ctx)
    out = {"text": TEXT, "ctx": args.ctx, "chunks": args.chunks, "model": os.path.basename(src), "smoke": args.smoke,
           "types": []}
    with threadpool_limits(1):  # the CPU is shared; one BLAS thread gave the steadiest figures
        base = Engine.load(src, config=config)
        tokens = text_tokens(base, text)
        ref = perplexity(base, tokens, ctx=args.ctx, max_chunks=args.chunks).perplexity
        print(f"{'type':8} {'MiB':>7} {'perplexity':>11} {'vs q4_1':>8}")
        for t in types:
            path = os.path.join(args.dir, f"{name}-{t}.gguf")
            if not os.path.exists(path):
                quantize_file(src, path, t)
            t0 = time.perf_counter()
            p = perplexity(Engine.load(path, config=config), tokens, ctx=args.ctx, max_chunks=args.chunks)
            row = {"type": t, "mib": os.path.getsize(path) / 2**20, "perplexity": p.perplexity,
                   "vs_q4_1": p.perplexity / ref - 1, "tokens_scored": p.tokens_scored,
                   "seconds": time.perf_counter() - t0}
            out["types"].append(row)
            print(f"{t:8} {row['mib']:7.1f} {p.perplexity:11.4f} {100 * row['vs_q4_1']:+7.2f}%", flush=True)
        if not args.no_calibrate:
            t0 = time.perf_counter()
            cal = layer_skip.calibrate(base, tokens, ctx=args.ctx, model_sha256=layer_skip.file_sha256(src),
                                       text_sha256=text_sha, max_chunks=args.chunks)
            saved = layer_skip.save(cal, src)
            out["calibration"] = {**cal.to_dict(), "saved": saved, "seconds": time.perf_counter() - t0,
                                  "auto": list(cal.auto(layer_skip.AUTO_THRESHOLD))}
            b = cal.table[0]["perplexity"]
            print("\n  k  perplexity  vs k=0  layers")
            for row in cal.table:
                print(f"{row['k']:3d}  {row['perplexity']:10.4f}  {100 * (row['perplexity'] / b - 1):+6.2f}%  "
                      f"{','.join(map(str, row['layers'])) or '-'}")
            print("cosine per layer: " + " ".join(f"{i}:{s:.3f}" for i, s in enumerate(cal.similarity)))
            print(f"auto (+3%): {out['calibration']['auto']}; saved {saved}")
    common.write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
