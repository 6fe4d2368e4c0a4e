"""`ntx-model perplexity` and `ntx-model calibrate-skip`: what a model (or a lossy trick on it)
costs in quality, measured on a text; and the speculator behind `ntx-model run --speculative`.

    ntx-model perplexity [MODEL] --file TEXT [--ctx 512] [--chunks N] [--skip-layers …] [--json]
                         [--save-logits BASE.npz | --kl-divergence BASE.npz]
    ntx-model calibrate-skip [MODEL] --file TEXT [--ctx 512] [--chunks N] [--max-k K] [--json]
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import numpy as np

from ntransformerd.engine.calibration import layer_skip
from ntransformerd.engine.generation import speculative
from ntransformerd.engine.backends import BACKENDS
from ntransformerd.settings import SETTINGS
from ntransformerd.engine.runtime.engine import Engine, EngineConfig, default_model_path
from ntransformerd.engine.gguf_file import GGUFModel
from ntransformerd.engine.calibration.perplexity import BASE_TOP, Base, Recorder, kl_divergence, perplexity, text_tokens
from ntransformerd.tools.atomic import atomic_output, check_input, check_output


def progress_bar(label: str, *, stream=None):
    """progress(done, total) drawing a bar on stderr when it is a terminal, else nothing."""
    stream = stream or sys.stderr
    if not stream.isatty():
        return None
    t0 = time.monotonic()

    def show(done: int, total: int) -> None:
        width = 30
        fill = width * done // max(total, 1)
        eta = (time.monotonic() - t0) / max(done, 1) * (total - done)
        stream.write(f"\r{label} [{'#' * fill}{'.' * (width - fill)}] {done}/{total}  eta {eta:4.0f} s")
        if done >= total:
            stream.write("\n")
        stream.flush()
    return show


def _read_text(path: str) -> tuple[str, str]:
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8"), hashlib.sha256(data).hexdigest()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text: {e}") from None


def _engine(args, skip=()):
    backend = args.backend or SETTINGS["backend"].default
    return Engine.load(args.model, config=EngineConfig(backend=backend, max_batch=1, max_ctx=args.ctx,
                                                        prefill_chunk=min(args.ctx, 512), skip_layers=tuple(skip) or None))


def cmd_perplexity(args) -> int:
    path = args.model or default_model_path()
    if args.save_logits:  # before the run: a path that cannot be written fails now, not minutes later
        check_output(args.save_logits, path, args.file, args.kl_divergence)
    if args.kl_divergence:
        check_input(args.kl_divergence, "a base written by --save-logits")
    if args.logits_top < 1:
        raise ValueError(f"--logits-top {args.logits_top}: keep at least 1 token per scored token")
    base = Base.load(args.kl_divergence) if args.kl_divergence else None
    if base is not None:  # the base's tokens and chunking: the same rows, scored the same way
        if args.ctx is not None and args.ctx != base.ctx:
            raise ValueError(f"--ctx {args.ctx}: the base {args.kl_divergence} was run with --ctx {base.ctx} "
                             "(leave --ctx out to use it)")
        args.ctx = base.ctx
    elif not args.file:
        raise ValueError("perplexity needs --file TEXT (or --kl-divergence BASE, which holds its text's tokens)")
    args.ctx = args.ctx or 512
    n_layers = GGUFModel(path).config.n_layers
    skip = layer_skip.skip_layers_for(path, args.skip_layers, n_layers)
    engine = _engine(args, skip)
    text_sha = None
    if args.file:
        text, text_sha = _read_text(args.file)
        tokens = text_tokens(engine, text)
        if base is not None and not np.array_equal(tokens[:len(base.tokens)], base.tokens):
            raise ValueError(f"--file {args.file} does not tokenize to the text of the base {args.kl_divergence} "
                             "(leave --file out to read the base's tokens)")
    else:
        tokens = list(base.tokens)
    t0 = time.perf_counter()
    recorder = Recorder(args.logits_top) if args.save_logits else None
    kl = None
    if base is not None:
        p, kl = kl_divergence(engine, base, max_chunks=args.chunks, progress=progress_bar("perplexity"))
    else:
        p = perplexity(engine, tokens, ctx=args.ctx, max_chunks=args.chunks, progress=progress_bar("perplexity"),
                       observe=recorder)
    seconds = time.perf_counter() - t0
    if recorder is not None:
        saved = recorder.base(tokens, p.ctx, {"model": path, "backend": engine.backend.name, "file": args.file,
                                              "text_sha256": text_sha, "skip_layers": list(skip)})
        with atomic_output(args.save_logits) as tmp:
            saved.save(tmp)
    out = {"model": path, "file": args.file, "n_tokens": len(tokens), "skip_layers": list(skip),
           **p.to_dict(), "seconds": round(seconds, 2)}
    if kl is not None:
        out["kl_divergence"] = {"base": args.kl_divergence, "base_about": base.about, **kl.to_dict()}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"perplexity {p.perplexity:.4f}  ({p.chunks} chunks of {p.ctx} tokens, {p.tokens_scored} scored, "
          f"{len(tokens)} in the text{', skipping layers ' + ','.join(map(str, skip)) if skip else ''}; "
          f"{seconds:.1f} s)")
    if kl is not None:
        print(f"KL divergence from {args.kl_divergence} ({base.about.get('backend', '?')} run of "
              f"{os.path.basename(str(base.about.get('model', '?')))}), over {kl.tokens} tokens:\n"
              f"  mean {kl.mean:.5g} ± {kl.mean_err:.2g}  median {kl.median:.5g}  99% {kl.p99:.5g}  max {kl.max:.5g}\n"
              f"  same top token {100 * kl.same_top:.2f} ± {100 * kl.same_top_err:.2f} %  "
              f"ln(PPL / PPL base) {kl.ln_ppl_ratio:+.6f}"
              + (f"  (base tail mass {kl.base_tail_mass:.2e})" if kl.base_tail_mass else ""))
    if recorder is not None:
        print(f"saved the logits (top {args.logits_top} per scored token) to {args.save_logits}")
    return 0


def cmd_calibrate_skip(args) -> int:
    path = args.model or default_model_path()
    sha = layer_skip.file_sha256(path)
    engine = _engine(args)
    text, text_sha = _read_text(args.file)
    tokens = text_tokens(engine, text)
    bars = {}

    def progress(stage: str, done: int, total: int) -> None:
        if stage not in bars:
            bars[stage] = progress_bar(f"{stage:>10}")
        if bars[stage] is not None:
            bars[stage](done, total)

    cal = layer_skip.calibrate(engine, tokens, ctx=args.ctx, model_sha256=sha, text_sha256=text_sha,
                               max_k=args.max_k, max_chunks=args.chunks, progress=progress)
    saved = layer_skip.save(cal, path)
    if args.json:
        print(json.dumps({"model": path, "saved": saved, **cal.to_dict()}))
        return 0
    print(f"{path}: {len(cal.similarity)} layers, {cal.chunks} chunks of {cal.ctx} tokens of {args.file}")
    print("layer  cos(in, out)")
    for i in cal.order + [i for i in range(len(cal.similarity)) if i not in cal.order]:
        print(f"{i:5d}  {cal.similarity[i]:.4f}{'' if i in cal.order else '  (never skipped)'}")
    base = cal.table[0]["perplexity"]
    print("\n  k  perplexity   vs k=0  layers")
    for row in cal.table:
        print(f"{row['k']:3d}  {row['perplexity']:10.4f}  {100 * (row['perplexity'] / base - 1):+6.2f}%  "
              f"{','.join(map(str, row['layers'])) or '-'}")
    auto = cal.auto(layer_skip.AUTO_THRESHOLD)
    print(f"\nauto (+{100 * layer_skip.AUTO_THRESHOLD:g}%) skips {len(auto)}: {','.join(map(str, auto)) or 'none'}")
    print(f"saved {saved}")
    return 0


def speculator(engine, mode: str, draft_path: str | None):
    """`ntx-model run --speculative MODE [--draft MODEL]`: the Speculator, its costs measured now."""
    draft_engine = speculative.load_draft_engine(draft_path, engine) if draft_path else None
    spec = speculative.Speculator(engine, speculative.make_draft(mode, engine, draft_engine=draft_engine))
    spec.costs  # measured now, while a KV slot is free for it
    return spec


def add_commands(sub) -> None:
    """Register the commands on ntx-model's subparsers."""
    s = sub.add_parser("perplexity", help="perplexity on a text, as llama.cpp's llama-perplexity computes it")
    s.add_argument("model", nargs="?", metavar="MODEL", help="GGUF file (default: the embedded model)")
    s.add_argument("--file", metavar="TEXT", help="UTF-8 text file (not needed with --kl-divergence)")
    s.add_argument("--ctx", type=int, help="tokens per chunk (default 512, or the base's); the second half is scored")
    s.add_argument("--chunks", type=int, metavar="N", help="score only the first N chunks")
    s.add_argument("--skip-layers", metavar="SPEC", help="auto[:THRESHOLD] | N | 3,7,11 (see calibrate-skip)")
    s.add_argument("--backend", choices=BACKENDS, default=None,
                   help="cpu (quantized kernels), cpu-ref (float32 reference), cuda, auto (default: the backend "
                        "setting's, auto)")
    s.add_argument("--save-logits", metavar="BASE.npz", help="save this run's predictions as the base of a later "
                   "--kl-divergence (run the exact reference: --backend cpu-ref)")
    s.add_argument("--logits-top", type=int, default=BASE_TOP, metavar="K", help="tokens kept per scored token in "
                   f"--save-logits; the rest are one outcome (default {BASE_TOP}; the vocabulary size: all)")
    s.add_argument("--kl-divergence", metavar="BASE.npz", help="KL divergence of this run from a saved base, "
                   "over the base's text and chunks: mean, 99th percentile, same top token")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=cmd_perplexity)

    s = sub.add_parser("calibrate-skip", help="per-layer similarity and the perplexity of skipping the k most similar")
    s.add_argument("model", nargs="?", metavar="MODEL", help="GGUF file (default: the embedded model)")
    s.add_argument("--file", required=True, metavar="TEXT", help="UTF-8 calibration text")
    s.add_argument("--ctx", type=int, default=512, help="tokens per chunk (default 512)")
    s.add_argument("--chunks", type=int, metavar="N", help="use only the first N chunks")
    s.add_argument("--max-k", type=int, metavar="K", help="largest number of skipped layers tried (default n/4)")
    s.add_argument("--backend", choices=BACKENDS, default=None,
                   help="cpu (quantized kernels), cpu-ref (float32 reference), cuda, auto (default: the backend "
                        "setting's, auto)")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=cmd_calibrate_skip)
