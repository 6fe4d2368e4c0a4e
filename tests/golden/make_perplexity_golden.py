"""Make the perplexity golden (run once; CI reads tests/golden/perplexity_smollm2.json).

    python3 -m venv /tmp/refvenv && /tmp/refvenv/bin/pip install llama-cpp-python numpy
    .venv/bin/python tests/golden/make_perplexity_golden.py --ref-python /tmp/refvenv/bin/python

The reference is llama.cpp (through llama-cpp-python) on the all-F32 copy of the default model
(our `quantize_file(..., "f32")` only dequantizes, bit-exact with ggml) with an F32 KV cache,
driven as llama-perplexity drives it: the whole text tokenized once (special tokens added as
the model says, special-token text not parsed), chunks of CTX tokens each from an empty cache,
the logits of rows CTX/2 … CTX-2 scoring the next tokens, log-softmax in float64.

llama-cpp-python crashed when a second model was opened in one process, so the reference runs
in its own process (this script calls itself with --reference).

The text is the GPL version 3 that every Debian machine has at /usr/share/common-licenses/GPL-3:
English no one on the team wrote.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = "/usr/share/common-licenses/GPL-3"
CTX = 512


def reference(model: str, text: str, ctx: int, out: str) -> None:
    """In the llama-cpp-python process: token ids and per-chunk NLL sums."""
    import llama_cpp

    llm = llama_cpp.Llama(model, n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, logits_all=True, verbose=False,
                          n_threads=2, type_k=0, type_v=0, flash_attn=False)  # ggml type 0 = F32 KV cache
    with open(text, encoding="utf-8") as f:
        body = f.read()
    add_bos = llm.metadata.get("tokenizer.ggml.add_bos_token", "false") == "true"
    ids = llm.tokenize(body.encode(), add_bos=add_bos, special=False)
    first = ctx // 2
    chunks = []
    for c in range(len(ids) // ctx):
        chunk = list(ids[c * ctx:(c + 1) * ctx])
        if add_bos:
            chunk[0] = llm.token_bos()
        llm.reset()
        llm.eval(chunk)
        z = np.array(llm.scores[first:ctx - 1], dtype=np.float64)  # (ctx - 1 - first, V)
        m = z.max(-1, keepdims=True)
        lse = m[:, 0] + np.log(np.exp(z - m).sum(-1))
        nll = lse - z[np.arange(len(z)), chunk[first + 1:ctx]]
        chunks.append({"nll_sum": float(nll.sum()), "tokens": int(nll.size)})
        print(f"chunk {c}: ppl {np.exp(nll.mean()):.4f}", file=sys.stderr)
    with open(out, "w") as f:
        json.dump({"ids": list(map(int, ids)), "chunks": chunks, "llama_cpp_version": llama_cpp.__version__}, f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref-python", help="a python with llama-cpp-python installed")
    ap.add_argument("--reference", nargs=3, metavar=("MODEL", "TEXT", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--ctx", type=int, default=CTX)
    args = ap.parse_args()
    if args.reference:
        reference(args.reference[0], args.reference[1], args.ctx, args.reference[2])
        return 0
    if not args.ref_python:
        ap.error("--ref-python is required")

    from ntransformerd.engine.runtime.engine import default_model_path
    from ntransformerd.tools.quantize import quantize_file

    src = default_model_path()
    with open(TEXT, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    with tempfile.TemporaryDirectory() as tmp:
        f32, out = os.path.join(tmp, "f32.gguf"), os.path.join(tmp, "ref.json")
        quantize_file(src, f32, "f32")
        subprocess.run([args.ref_python, os.path.abspath(__file__), "--ctx", str(args.ctx),
                        "--reference", f32, TEXT, out], check=True)
        with open(out) as f:
            ref = json.load(f)
    nll = sum(c["nll_sum"] for c in ref["chunks"])
    n = sum(c["tokens"] for c in ref["chunks"])
    golden = {"model": os.path.basename(src), "reference": "llama.cpp on the all-F32 copy, F32 KV cache",
              "llama_cpp_version": ref["llama_cpp_version"], "text": TEXT, "text_sha256": sha,
              "ctx": args.ctx, "n_tokens": len(ref["ids"]), "perplexity": float(np.exp(nll / n)),
              "tokens_scored": n, "chunks": ref["chunks"], "ids": ref["ids"]}
    with open(os.path.join(HERE, "perplexity_smollm2.json"), "w") as f:
        json.dump(golden, f, indent=None)
    print(f"perplexity {golden['perplexity']:.4f} over {len(ref['chunks'])} chunks of {args.ctx}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
