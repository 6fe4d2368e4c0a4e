"""llama.cpp's logits of the scored rows, chunk by chunk, as engine/calibration/perplexity.py scores them.

    /tmp/llama-venv/bin/python bench/llamacpp/logits.py MODEL.gguf TOKENS.npy CTX OUTDIR [--threads N] [--gpu-layers N]

Runs in a Python that has llama-cpp-python and numpy (nothing of ntransformer): for each whole
chunk of CTX tokens of TOKENS (int64 ids, from our tokenizer, which equals llama.cpp's), from an
empty cache, it evaluates the chunk and writes the logits of rows CTX//2 … CTX-2 to
OUTDIR/chunk-NNNN.npy (float32, (CTX - 1 - CTX//2, V)). The KV cache is F32 (llama.cpp's
default is F16, which would add its own rounding to the comparison), as is ours on the CPU;
the last line printed is llama-cpp-python's version. One model per process:
llama-cpp-python crashed when a second Llama() was opened in the same process.
"""

from __future__ import annotations

import argparse
import os
import sys

import llama_cpp
import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("tokens")
    ap.add_argument("ctx", type=int)
    ap.add_argument("out")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--gpu-layers", type=int, default=0, help="layers on the GPU (a CUDA build; 0: the CPU)")
    ap.add_argument("--extra-bufts", action="store_true",
                    help="let llama.cpp use its extra CPU buffer types (AMX, repacked weights); off by default")
    args = ap.parse_args()
    if not args.extra_bufts:
        # A native build on a CPU with AMX multiplies batches with its AMX kernels, which crashed
        # (SIGSEGV in ggml_backend_amx_mul_mat) in the VMs here; without the extra buffer types
        # llama.cpp runs its plain CPU kernels, the ones most CPUs get. Llama() takes no such
        # argument, so the default model parameters it starts from are changed.
        default = llama_cpp.llama_cpp.llama_model_default_params

        def params():
            p = default()
            p.use_extra_bufts = False
            return p
        llama_cpp.llama_cpp.llama_model_default_params = params
    tokens = np.load(args.tokens)
    ctx, first = args.ctx, args.ctx // 2
    llm = llama_cpp.Llama(args.model, n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, logits_all=True, verbose=False,
                          n_threads=args.threads, n_threads_batch=args.threads, n_gpu_layers=args.gpu_layers,
                          type_k=0, type_v=0, flash_attn=False)  # ggml type 0: an F32 KV cache
    add_bos = llm.metadata.get("tokenizer.ggml.add_bos_token", "false") == "true"
    os.makedirs(args.out, exist_ok=True)
    for c in range(len(tokens) // ctx):
        chunk = [int(t) for t in tokens[c * ctx:(c + 1) * ctx]]
        if add_bos:
            chunk[0] = llm.token_bos()
        llm.reset()
        llm.eval(chunk)
        np.save(os.path.join(args.out, f"chunk-{c:04d}.npy"), np.asarray(llm.scores[first:ctx - 1], np.float32))
        print(f"llama.cpp {os.path.basename(args.model)}: chunk {c + 1}/{len(tokens) // ctx}", file=sys.stderr,
              flush=True)
    print(llama_cpp.__version__)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
