"""Constrained decoding libraries on the default model's vocabulary (49,152 tokens): llguidance,
outlines-core and xgrammar, each where it imports. Per library: building its view of the
vocabulary, compiling a large JSON schema (and a small one), and the mask per generated token
while a valid document of that schema is fed through it, token by token; then what a mask adds
to a decode step of the cpu backend at batch 1 and 16 (ours: llguidance, the mask applied to
the row before sampling, engine/generation/constraints.py).

    python bench/constraint_libraries.py [--json bench/out/constraint_libraries.json]
    python bench/constraint_libraries.py --smoke       # a small schema, few tokens: does it run?

xgrammar imports torch and transformers at import time; where torch is missing, run it with
--torch-standin DIR: a directory holding a stand-in `torch` package (any attribute is a dummy),
enough for its compiler and for a mask filled into a numpy array through DLPack.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np

import common


def large_schema(n_props: int) -> dict:
    """A schema of `n_props` properties, each an object of typed fields (strings with bounds and
    patterns, bounded numbers, enums, arrays of objects), two levels of nesting below it."""
    def item(i: int) -> dict:
        return {"type": "object", "additionalProperties": False, "required": ["id", "kind", "score", "tags", "parts"],
                "properties": {
                    "id": {"type": "string", "pattern": f"^P{i}-[0-9]{{3}}$"},
                    "kind": {"enum": ["alpha", "beta", "gamma", f"kind{i}"]},
                    "score": {"type": "number", "minimum": -10, "maximum": 10 + i},
                    "count": {"type": "integer", "minimum": 0, "maximum": 1000},
                    "note": {"type": "string", "maxLength": 40},
                    "tags": {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 4},
                    "parts": {"type": "array", "maxItems": 3, "items": {
                        "type": "object", "required": ["name", "ok"], "additionalProperties": False,
                        "properties": {"name": {"type": "string"}, "ok": {"type": "boolean"},
                                       "weight": {"type": ["number", "null"]}}}}}}
    return {"type": "object", "additionalProperties": False, "required": [f"p{i}" for i in range(n_props)],
            "properties": {f"p{i}": item(i) for i in range(n_props)}}


def instance(n_props: int) -> str:
    """A document valid against large_schema(n_props), as a model writes it under the constraint."""
    doc = {f"p{i}": {"id": f"P{i}-{i % 1000:03d}", "kind": ["alpha", "beta", "gamma"][i % 3], "score": (i % 7) - 3.5,
                     "tags": ["x", f"tag {i}"], "parts": [{"name": f"part {i}", "ok": i % 2 == 0, "weight": None}]}
           for i in range(n_props)}
    return json.dumps(doc)  # one line, ", " and ": ": the layout of engine/generation/constraints.py's JSON_LAYOUT


SMALL = {"type": "object", "required": ["name", "age"], "additionalProperties": False,
         "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150}}}


def timed(f):
    t = time.perf_counter()
    out = f()
    return out, time.perf_counter() - t


def summary(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median_us": round(statistics.median(xs) * 1e6, 1), "p99_us": round(xs[int(0.99 * (len(xs) - 1))] * 1e6, 1),
            "max_us": round(xs[-1] * 1e6, 1), "tokens": len(xs)}


def run_llguidance(tok, vocab: int, schema: dict, ids: list[int]) -> dict:
    import llguidance
    from ntransformerd.engine.generation import constraints

    comp, t_vocab = timed(lambda: constraints.Compiler(tok, vocab))
    small, t_small = timed(lambda: comp.compile("json_schema", json.dumps(SMALL)))
    c, t_big = timed(lambda: comp.compile("json_schema", json.dumps(schema)))
    bits = np.zeros((1, (vocab + 31) // 32), np.int32)
    row = np.zeros(vocab, np.float32)
    ts, ts_apply = [], []
    for t in ids:
        _, dt = timed(lambda: c.matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes))
        assert bits[0, t >> 5] >> (t & 31) & 1, f"llguidance refused token {t} of the valid document"
        ts.append(dt)

        def apply():  # what Constraint.mask and the sampler add: the bits as a bool row, applied
            allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab].astype(bool)
            row[~allowed] = -np.inf
        ts_apply.append(timed(apply)[1])
        c.consume(t)
    return {"library": "llguidance", "version": llguidance.__version__, "vocabulary_s": round(t_vocab, 3),
            "compile_small_ms": round(t_small * 1e3, 2), "compile_large_ms": round(t_big * 1e3, 2),
            "mask": summary(ts), "apply_to_row": summary(ts_apply), "pulls_in": "nothing (a Rust extension, abi3)"}


def run_outlines(tok, vocab: int, schema: dict, ids: list[int], eos: int, limit_s: float) -> dict:
    """In a child process, given up after limit_s: its index of a large schema can take minutes."""
    import multiprocessing
    import queue

    import outlines_core  # noqa: F401 - ImportError here, not in the child

    def child():
        try:
            q.put(_outlines(tok, vocab, schema, ids, eos))
        except Exception as e:  # noqa: BLE001 - reported in the results
            q.put({"library": "outlines-core", "failed": f"{type(e).__name__}: {e}"})

    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=child)
    p.start()
    try:
        return q.get(timeout=limit_s)
    except queue.Empty:
        return {"library": "outlines-core", "gave_up_after_s": limit_s,
                "pulls_in": "nothing (a Rust extension); JSON schema only through one regular expression"}
    finally:
        p.terminate()
        p.join()


def _outlines(tok, vocab: int, schema: dict, ids: list[int], eos: int) -> dict:
    import outlines_core as oc
    from importlib.metadata import version

    def build():
        m: dict[bytes, list[int]] = {}
        for i in range(min(tok.vocab_size, vocab)):
            if i != eos and not tok.is_control(i):
                b = tok.token_bytes(i)
                if b:
                    m.setdefault(b, []).append(i)
        return oc.Vocabulary(eos, m)
    v, t_vocab = timed(build)
    small, t_small = timed(lambda: oc.Index(oc.json_schema.build_regex_from_schema(json.dumps(SMALL)), v))
    regex = oc.json_schema.build_regex_from_schema(json.dumps(schema))
    out = {"library": "outlines-core", "version": version("outlines-core"), "vocabulary_s": round(t_vocab, 3),
           "compile_small_ms": round(t_small * 1e3, 2), "large_schema_regex_chars": len(regex),
           "pulls_in": "nothing (a Rust extension); JSON schema only through one regular expression"}
    index, t_big = timed(lambda: oc.Index(regex, v))
    out["compile_large_ms"] = round(t_big * 1e3, 2)
    g = oc.Guide(index)
    mask = np.zeros((vocab + 31) // 32, np.int32)
    ts = []
    for t in ids:
        _, dt = timed(lambda: g.write_mask_into(mask.ctypes.data, mask.size, 4))
        ts.append(dt)
        g.advance(t)
    out["mask"] = summary(ts)
    return out


def run_xgrammar(tok, vocab: int, schema: dict, ids: list[int], eog: list[int]) -> dict:
    import xgrammar as xgr
    from importlib.metadata import version

    def build():
        enc = [(b"" if tok.is_control(i) else tok.token_bytes(i)) if i < tok.vocab_size else b"" for i in range(vocab)]
        return xgr.TokenizerInfo(enc, vocab_type=xgr.VocabType.RAW, vocab_size=vocab, stop_token_ids=eog)
    info, t_vocab = timed(build)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    _, t_small = timed(lambda: compiler.compile_json_schema(json.dumps(SMALL)))
    cg, t_big = timed(lambda: compiler.compile_json_schema(json.dumps(schema), any_whitespace=True))
    m = xgr.GrammarMatcher(cg)
    bits = np.zeros((1, (vocab + 31) // 32), np.int32)
    ts = []
    for t in ids:
        _, dt = timed(lambda: m.fill_next_token_bitmask(bits, 0))
        ts.append(dt)
        assert m.accept_token(t), f"xgrammar refused token {t} of the valid document"
    return {"library": "xgrammar", "version": version("xgrammar"), "vocabulary_s": round(t_vocab, 3),
            "compile_small_ms": round(t_small * 1e3, 2), "compile_large_ms": round(t_big * 1e3, 2),
            "mask": summary(ts), "pulls_in": "torch, transformers, triton, apache-tvm-ffi (imported at import time)"}


def step_overhead(engine, tok, schema: dict, ids: list[int], batches, steps: int) -> list[dict]:
    """A decode step of the cpu backend at batch B against B masks computed and applied to their
    rows (the constrained rows' share of a step)."""
    from ntransformerd.engine.generation import constraints
    from ntransformerd.engine.generation.sampler import Sampler, SamplingParams

    comp = constraints.compiler_for(tok, engine.cfg.vocab_size)
    out = []
    for b in batches:
        slots = [engine.open() for _ in range(b)]
        try:
            for s in slots:
                engine.prefill(s, ids[:8])
            cons = [comp.compile("json_schema", json.dumps(schema)) for _ in range(b)]
            sampler = Sampler(SamplingParams.greedy(), engine.cfg.vocab_size)
            t_step, t_mask = [], []
            for j in range(steps):
                tokens = [ids[8 + j]] * b
                rows, dt = timed(lambda: engine.step([(s, [t]) for s, t in zip(slots, tokens)]))
                t_step.append(dt)
                t0 = time.perf_counter()
                for c, row, t in zip(cons, rows, tokens):
                    sampler.sample(row, (), c.mask())
                    c.consume(ids[j])
                t_mask.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for row in rows:
                    sampler.sample(row, ())
                t_mask[-1] -= time.perf_counter() - t0  # the mask's share only, not the draw itself
            step, mask = statistics.median(t_step), statistics.median(t_mask)
            out.append({"batch": b, "step_ms": round(step * 1e3, 3), "masks_ms": round(mask * 1e3, 3),
                        "overhead_pct": round(100 * mask / step, 2)})
        finally:
            for s in slots:
                engine.close(s)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__file__, __doc__)
    ap.add_argument("--properties", type=int, default=20, help="properties of the large schema")
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per batch size")
    ap.add_argument("--torch-standin", metavar="DIR", help="a directory with a stand-in torch package, for xgrammar")
    ap.add_argument("--outlines-limit", type=float, default=300.0,
                    help="seconds outlines-core may take in all before it is given up")
    a = ap.parse_args(argv)
    if a.torch_standin:
        sys.path.append(a.torch_standin)
    from ntransformerd.engine.runtime.engine import Engine, EngineConfig
    n = 3 if a.smoke else a.properties
    engine = Engine.load(None, config=EngineConfig(backend="cpu", max_batch=16, max_ctx=512))
    tok, vocab = engine.tokenizer, engine.cfg.vocab_size
    schema = large_schema(n)
    ids = tok.encode(instance(n), parse_special=False, add_special=False)
    eog = sorted(tok.eog_ids)
    res = {"smoke": a.smoke, "vocab": vocab, "schema_bytes": len(json.dumps(schema)), "document_tokens": len(ids),
           "libraries": [], "step_overhead": []}
    for name, run in (("llguidance", lambda: run_llguidance(tok, vocab, schema, ids)),
                      ("outlines-core", lambda: run_outlines(tok, vocab, schema, ids, eog[0], a.outlines_limit)),
                      ("xgrammar", lambda: run_xgrammar(tok, vocab, schema, ids, eog))):
        try:
            r = run()
        except ImportError as e:
            r = {"library": name, "skipped": f"does not import here: {e}"}
        res["libraries"].append(r)
        print(json.dumps(r), flush=True)
    res["step_overhead"] = step_overhead(engine, tok, schema, ids, (1, 2) if a.smoke else (1, 16),
                                         4 if a.smoke else a.steps)
    for r in res["step_overhead"]:
        print(json.dumps(r), flush=True)
    common.write_json(a.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
