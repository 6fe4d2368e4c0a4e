"""How far the fast paths' predictions are from the exact run: KL divergence, ours and llama.cpp's.

    # here (CPU): our cpu path against our exact run and against llama.cpp's F32 run, and
    # llama.cpp's Q4_1 CPU run against its F32 run (llama-cpp-python in a venv of its own)
    .venv/bin/python bench/kl_divergence.py --llama-python /tmp/llama-venv/bin/python \
        [--texts GPL-3 MPL-1.1] [--save-base DIR --top 1024]
    # the GPU machine: the cuda and hybrid paths against bases saved here (--save-base)
    python3 bench/kl_divergence.py --model smollm2.gguf --base DIR/base-GPL-3.npz --base DIR/base-MPL-1.1.npz \
        --engines cuda,hybrid,cpu
    .venv/bin/python bench/kl_divergence.py --smoke          # a tiny synthetic model, seconds

Every run scores the same token ids (our tokenizer; it equals llama.cpp's) in the same chunks
(engine/calibration/perplexity.py: ctx --ctx, the second half of each chunk scored), and every comparison
is engine/calibration/perplexity.py's: KL(base ‖ run) per scored token, its mean and 99th percentile, and
how often both runs rank the same token first.

Runs (a name per row of the table):
  exact       our float32 reference (cpu-ref) on --model: the base of our rows
  cpu         our host backend's quantized kernels on --model
  cuda        our GPU backend, every layer resident;  hybrid: half the layers streamed and the
              host computing some of them (bench/hybrid_quality.py's plan)
  llama-f32   llama.cpp on the all-F32 copy of --model (`ntx-model quantize --type f32`: the same
              numbers the exact run computes with): the base of llama.cpp's rows
  llama-cpu   llama.cpp's CPU run of --model itself
  llama-gpu   llama.cpp's run of --model with every layer on the GPU (a CUDA build of
              llama-cpp-python behind --llama-python)
Rows compare each run with `exact` and with `llama-f32` where both were made. The two exact
runs agree to ~1e-6 (shared/notes/perplexity.md), so either base ranks the fast runs alike.

The bases here keep the whole vocabulary (exact KL). A base for another machine (--save-base)
keeps the --top most likely tokens of each row and folds the rest into one outcome: a KL a
little lower than the whole vocabulary's (the table's `tail` says how much mass was folded;
compare such rows with this machine's rows against the same files, --base). llama.cpp runs in
its own process per model (llama-cpp-python crashed on a second model in one process).
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import os
import subprocess
import sys
import tempfile
import time

import gguf
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "daemon"))

import common  # noqa: E402
from ntransformerd.engine.runtime.engine import Engine, EngineConfig, default_model_path  # noqa: E402
from ntransformerd.engine.gguf_file import GGUFModel  # noqa: E402
from ntransformerd.engine.calibration.perplexity import Base, KLMeter, Recorder, perplexity, text_tokens  # noqa: E402
from ntransformerd.tools.quantize import quantize_file  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
LICENSES = "/usr/share/common-licenses"
LLAMA_LOGITS = os.path.join(HERE, "llamacpp", "logits.py")
OURS = ("exact", "cpu", "cuda", "hybrid")
LLAMA = ("llama-f32", "llama-cpu", "llama-gpu")


@dataclasses.dataclass
class Text:
    name: str
    tokens: list[int]
    ctx: int
    chunks: int
    base: Base | None = None  # given (--base): replaces the exact run as the base of our rows


PIECES = {  # --f32 PIECE: these tensors stored as float32 (the same values) in a copy of --model
    "output": ("token_embd", "output"),  # the output matrix (tied to token_embd in the default model)
    "attn": ("attn_q", "attn_k", "attn_v", "attn_output"),
    "ffn": ("ffn_gate", "ffn_up", "ffn_down"),
    "attn_qkv": ("attn_q", "attn_k", "attn_v"),
    "attn_output": ("attn_output",),
    "ffn_gate_up": ("ffn_gate", "ffn_up"),
    "ffn_down": ("ffn_down",),
    "all": ("token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"),
}


def f32_copy(src: str, dst: str, piece: str) -> str:
    """src with the tensors of PIECES[piece] dequantized to F32, in dst (made once). The exact
    run computes with exactly these values, so the copy's `cpu` run differs from the file's only
    where those products now take float32 activations instead of int8 blocks."""
    if os.path.exists(dst):
        return dst
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst + ".partial", arch)
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = f.types[0]
        writer.add_key_value(key, f.contents(), vtype, sub_type=f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))  # numpy order
        kind = t.name.removesuffix(".weight").split(".")[-1]  # blk.3.attn_q.weight -> attn_q
        if t.tensor_type != gguf.GGMLQuantizationType.F32 and kind in PIECES[piece]:
            writer.add_tensor(t.name, gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape))
        else:
            writer.add_tensor(t.name, t.data, raw_shape=shape if t.tensor_type == gguf.GGMLQuantizationType.F32 else None,
                              raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(dst + ".partial", dst)
    return dst


def engine_for(name: str, path: str, ctx: int, threads: int | None) -> Engine:
    """Our run `name` (OURS; "cpu f32:PIECE" is the cpu path on a f32_copy at `path`)."""
    config = EngineConfig(backend="cpu-ref" if name == "exact" else "cpu" if name.startswith("cpu") else "cuda",
                          max_batch=1, max_ctx=ctx, prefill_chunk=ctx, cpu_threads=threads)
    if name == "hybrid":
        from hybrid_quality import hybrid_engine  # needs CuPy: imported only for the GPU rows
        return hybrid_engine(GGUFModel(path), config, GGUFModel(path).config.n_layers // 2)
    return Engine.load(path, config=config)


def llama_chunks(python: str, model: str, tokens: list[int], ctx: int, out: str, threads: int, gpu: bool) -> str:
    """llama.cpp's scored-row logits of every chunk (bench/llamacpp/logits.py), in out/."""
    os.makedirs(out, exist_ok=True)
    ids = os.path.join(out, "tokens.npy")
    np.save(ids, np.asarray(tokens, np.int64))
    r = subprocess.run([python, LLAMA_LOGITS, model, ids, str(ctx), out, "--threads", str(threads),
                        "--gpu-layers", "999" if gpu else "0"], stdout=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise SystemExit(f"llama.cpp ({python}) failed on {model}: exit {r.returncode}")
    return r.stdout.strip()


def feed(chunk_dir: str, tokens: list[int], ctx: int, observers) -> None:
    """Hand each saved chunk's logits to the observers, as perplexity() would."""
    first = ctx // 2
    for c, f in enumerate(sorted(glob.glob(os.path.join(chunk_dir, "chunk-*.npy")))):
        logits = np.load(f)
        targets = np.asarray(tokens[c * ctx + first + 1:(c + 1) * ctx], np.int64)
        for o in observers:
            o(logits, targets)


def row(text: str, run: str, base: str, meter: KLMeter, seconds: float | None = None) -> dict:
    kl = meter.result()
    return {"text": text, "run": run, "base": base, **kl.to_dict(), "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__file__, __doc__)
    ap.add_argument("--model", help="GGUF file (default: the embedded default model, Q4_1)")
    ap.add_argument("--texts", nargs="+", default=["GPL-3", "MPL-1.1"], help=f"names under {LICENSES} or paths")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, help="only the first N chunks of each text")
    ap.add_argument("--engines", default="exact,cpu,llama-f32,llama-cpu",
                    help=f"comma list of {', '.join(OURS + LLAMA)} (llama-* need --llama-python)")
    ap.add_argument("--base", action="append", default=[], metavar="BASE.npz",
                    help="a base saved by --save-base (or ntx-model perplexity --save-logits), in place of the "
                         "exact run: its text and chunks are the ones run; repeat for more texts")
    ap.add_argument("--save-base", metavar="DIR", help="save the exact run of each text as DIR/base-TEXT.npz")
    ap.add_argument("--top", type=int, default=1024, help="tokens per row a --save-base base keeps (default 1024)")
    ap.add_argument("--f32", default="", metavar="PIECES", help="where the cpu path loses: comma list of "
                    f"{', '.join(PIECES)}; each adds a cpu run on a copy of --model with those tensors as F32 "
                    "(their products then take float32 activations)")
    ap.add_argument("--llama-python", metavar="PY", help="a python with llama-cpp-python (a venv of its own)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "ntx-kl"),
                    help="scratch: the F32 copy and llama.cpp's chunk logits (about 50 MB a chunk)")
    args = ap.parse_args(argv)
    engines = args.engines.split(",")
    if bad := [e for e in engines if e not in OURS + LLAMA]:
        ap.error(f"--engines: {', '.join(bad)} not among {', '.join(OURS + LLAMA)}")
    if any(e in LLAMA for e in engines) and not args.llama_python:
        if args.smoke:
            engines = [e for e in engines if e not in LLAMA]
        else:
            ap.error("--engines llama-* need --llama-python (a python with llama-cpp-python)")
    if any(e in ("cuda", "hybrid", "llama-gpu") for e in engines):
        common.require_gpu(__file__)
    os.makedirs(args.dir, exist_ok=True)
    if args.smoke:
        path = common.synthetic(args.dir, "tiny", "q4_1")
        args.ctx, args.chunks = 32, 2
    else:
        path = args.model or default_model_path()
    vocab_engine = Engine.load(path, config=EngineConfig(backend="cpu-ref", max_batch=1, max_ctx=args.ctx))

    texts = []
    for b in args.base:
        base = Base.load(b)
        name = os.path.basename(str(base.about.get("file") or b))
        texts.append(Text(name, list(base.tokens), base.ctx, base.chunks, base))
    if not args.base:
        for t in args.texts:
            f = t if os.sep in t else os.path.join(LICENSES, t)
            with open(f, encoding="utf-8") as fh:
                tokens = text_tokens(vocab_engine, fh.read())
            texts.append(Text(os.path.basename(f), tokens, args.ctx, len(tokens) // args.ctx))
    for t in texts:
        t.chunks = min(t.chunks, args.chunks or t.chunks)
        t.tokens = t.tokens[:t.chunks * t.ctx]
    del vocab_engine
    f32 = None
    if "llama-f32" in engines:
        with open(path, "rb") as fh:
            sha = hashlib.sha256(fh.read()).hexdigest()[:12]
        f32 = os.path.join(args.dir, f"{os.path.basename(path)}.{sha}.f32.gguf")
        if not os.path.exists(f32):
            quantize_file(path, f32, "f32")

    rows, about = [], {"model": os.path.basename(path), "ctx": args.ctx, "threads": args.threads,
                       "smoke": args.smoke, "texts": {}}
    for t in texts:
        n_vocab = GGUFModel(path).config.vocab_size
        about["texts"][t.name] = {"chunks": t.chunks, "tokens_scored": t.chunks * (t.ctx - 1 - t.ctx // 2)}
        bases: dict[str, Base] = {}
        llama_dirs = {}
        for e in (x for x in LLAMA if x in engines):  # first: their bases feed our rows' meters
            d = os.path.join(args.dir, f"{t.name}-{e}")
            for old in glob.glob(os.path.join(d, "chunk-*.npy")):
                os.unlink(old)
            t0 = time.perf_counter()
            version = llama_chunks(args.llama_python, f32 if e == "llama-f32" else path, t.tokens, t.ctx, d,
                                   args.threads, e == "llama-gpu")
            about["llama_cpp_version"] = version
            llama_dirs[e] = (d, time.perf_counter() - t0)
        if "llama-f32" in llama_dirs:
            rec = Recorder(n_vocab)
            feed(llama_dirs["llama-f32"][0], t.tokens, t.ctx, [rec])
            bases["llama-f32"] = rec.base(t.tokens, t.ctx, {"run": "llama-f32"})
        if t.base is not None:
            bases["exact"] = t.base
        pieces = [p for p in args.f32.split(",") if p]
        if bad := [p for p in pieces if p not in PIECES]:
            ap.error(f"--f32: {', '.join(bad)} not among {', '.join(PIECES)}")
        runs = [(e, path) for e in OURS if e in engines and not (e == "exact" and t.base is not None)]
        runs += [(f"cpu f32:{p}", f32_copy(path, os.path.join(args.dir, f"{os.path.basename(path)}.f32-{p}.gguf"), p))
                 for p in pieces]
        for e, model in runs:
            meters = {b: KLMeter(base) for b, base in bases.items()}
            rec = Recorder(n_vocab) if e == "exact" else None
            keep = Recorder(args.top) if e == "exact" and args.save_base else None
            observers = [o for o in (rec, keep, *meters.values()) if o is not None]

            def observe(logits, targets):
                for o in observers:
                    o(logits, targets)
            engine = engine_for(e, model, t.ctx, args.threads)
            t0 = time.perf_counter()
            perplexity(engine, t.tokens, ctx=t.ctx, max_chunks=t.chunks, observe=observe)
            seconds = time.perf_counter() - t0
            del engine
            for b, m in meters.items():
                rows.append(row(t.name, e, b, m, seconds))
            if rec is not None:
                bases["exact"] = rec.base(t.tokens, t.ctx, {"run": "exact"})
            if keep is not None:
                os.makedirs(args.save_base, exist_ok=True)
                out = os.path.join(args.save_base, f"base-{t.name}.npz")
                keep.base(t.tokens, t.ctx, {"model": os.path.basename(path), "backend": "cpu-ref",
                                            "file": t.name}).save(out)
                print(f"saved {out} ({os.path.getsize(out) / 2**20:.1f} MiB)", flush=True)
        for e, (d, seconds) in llama_dirs.items():
            meters = {b: KLMeter(base) for b, base in bases.items() if b != e}
            feed(d, t.tokens, t.ctx, list(meters.values()))
            for b, m in meters.items():
                rows.append(row(t.name, e, b, m, seconds))
        bases.clear()

    print(f"\n{'text':10} {'run':14} {'base':10} {'mean KL':>10} {'± err':>8} {'99% KL':>9} {'max KL':>8} "
          f"{'same top %':>13} {'ln PPL ratio':>12} {'tail':>7}")
    for r in rows:
        print(f"{r['text']:10} {r['run']:14} {r['base']:10} {r['mean']:10.3e} {r['mean_err']:8.1e} {r['p99']:9.3e} "
              f"{r['max']:8.2e} {100 * r['same_top']:7.2f} ±{100 * r['same_top_err']:4.2f} {r['ln_ppl_ratio']:+12.2e} "
              f"{r['base_tail_mass']:7.1e}")
    common.write_json(args.json, {**about, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
