"""What a quantized KV cache costs: perplexity of the default model at a long context with the
cache stored as f16, q8_0 and q4_0 (engine/runtime/kv_cache.py), on the fast CPU backend.

    .venv/bin/python bench/kv_quality.py                     # ctx 8192, the first 2 chunks (16384 tokens)
    .venv/bin/python bench/kv_quality.py --ctx 2048 --chunks 4 --types f32,f16,q8_0
    .venv/bin/python bench/kv_quality.py --smoke             # a tiny synthetic model, ctx 64

The text is every license in /usr/share/common-licenses (the regular files, sorted by name,
joined by newlines; the symlinks are other names of them): ~52k tokens of English no one on the
team wrote. Perplexity is llama-perplexity's (engine/calibration/perplexity.py): chunks of ctx tokens from
an empty cache, the second half of each scored, so every scored token sees at least ctx/2
tokens through the cache. Each type runs in its own engine (backend cpu, one sequence,
prefill_chunk 512); the table gives its bytes per token of context, the cache of one full
sequence, the perplexity, the change against f16 and the seconds the run took.

The fast backend's 8-bit activations make perplexity chaotic at the per-chunk level (a change of
rounding anywhere moves a 255-token chunk by up to a percent), so compare types over thousands
of scored tokens: ctx 8192 × 2 chunks scores 8190.
"""

from __future__ import annotations

import os
import sys
import time

import common
from ntransformerd.engine.runtime.engine import Engine, EngineConfig, default_model_path
from ntransformerd.engine.runtime.kv_cache import bytes_per_token
from ntransformerd.engine.calibration.perplexity import LICENSES, licenses_text, perplexity, text_tokens

TYPES = "f16,q8_0,q4_0"


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__file__, __doc__)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--types", default=TYPES, help=f"comma-separated kv_dtype values (default {TYPES}); the first "
                                                   "is the baseline")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="cpu_threads (default: every CPU)")
    ap.add_argument("--dir", default="/tmp/ntx-smoke", help="where --smoke writes its synthetic model")
    args = ap.parse_args(argv)
    if not os.path.isdir(LICENSES):
        print(f"{LICENSES} is missing (Debian's common-licenses)", file=sys.stderr)
        return common.SKIP
    if args.smoke:
        args.ctx, args.chunks = 64, 2
        path = common.synthetic(args.dir, "tiny", "q8_0")
    else:
        path = default_model_path()
    text = licenses_text()
    types = args.types.split(",")
    out = {"model": os.path.basename(path), "text": f"{LICENSES}/* (regular files, sorted)", "ctx": args.ctx,
           "chunks": args.chunks, "backend": args.backend, "smoke": args.smoke, "types": []}
    print(f"{'kv_dtype':8} {'B/token':>8} {'MiB/seq':>8} {'perplexity':>11} {'vs ' + types[0]:>9} {'seconds':>8}",
          flush=True)
    base = None
    for t in types:
        config = EngineConfig(backend=args.backend, kv_dtype=t, max_batch=1, max_ctx=args.ctx, prefill_chunk=512,
                              cpu_threads=args.threads)
        e = Engine.load(path, config=config)
        tokens = text_tokens(e, text)
        if "tokens" not in out:
            out["tokens"] = len(tokens)
            if len(tokens) < args.ctx * args.chunks:
                print(f"the text is {len(tokens)} tokens, fewer than {args.chunks} chunks of {args.ctx}", file=sys.stderr)
                return 2
        t0 = time.perf_counter()
        p = perplexity(e, tokens, ctx=args.ctx, max_chunks=args.chunks)
        seconds = time.perf_counter() - t0
        base = p.perplexity if base is None else base
        bpt = bytes_per_token(e.cfg, t)
        row = {"kv_dtype": t, "bytes_per_token": bpt, "mib_per_sequence": bpt * args.ctx / 2**20,
               "perplexity": p.perplexity, "vs_first": p.perplexity / base - 1, "tokens_scored": p.tokens_scored,
               "chunk_perplexities": list(p.chunk_perplexities), "seconds": seconds}
        out["types"].append(row)
        print(f"{t:8} {bpt:8d} {row['mib_per_sequence']:8.1f} {p.perplexity:11.4f} {100 * row['vs_first']:+8.3f}% "
              f"{seconds:8.0f}", flush=True)
        e.unload()
    common.write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
