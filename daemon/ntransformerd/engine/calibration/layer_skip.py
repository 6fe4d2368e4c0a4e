"""Layer skip: leave out the layers that barely change their input, with the perplexity cost measured.

Calibration runs a text through the model once, layer by layer, and takes for each layer the
cosine similarity of its input and output hidden states, averaged over every position. A layer
whose output points where its input did adds little; the k most similar layers are the skip
candidates, and the perplexity with each k = 0 … n/4 of them left out says what skipping costs.

    --skip-layers 3,7,11        exactly these layers
    --skip-layers 4             the 4 most similar layers (by calibration)
    --skip-layers auto          the most layers whose perplexity stays within +3% of the full model
    --skip-layers auto:0.05     … within +5%

The calibration is kept per model, keyed by the file's sha256, beside the model (MODEL.skip.json)
or in the state directory, so a start does not recalibrate.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Callable, Sequence

import numpy as np

from ntransformerd import dirs
from ntransformerd.engine.runtime import model as llama
from ntransformerd.engine.runtime.model import Batch, Segment
from ntransformerd.engine.calibration.perplexity import perplexity

AUTO_THRESHOLD = 0.03  # relative perplexity increase `auto` allows
CACHE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class SkipSpec:
    """A parsed --skip-layers: explicit layers, the N most similar, or auto within a threshold."""

    layers: tuple[int, ...] | None = None
    count: int | None = None
    threshold: float | None = None  # auto

    @property
    def needs_calibration(self) -> bool:
        return self.layers is None

    def __str__(self) -> str:
        if self.layers is not None:
            return ",".join(map(str, self.layers)) or "none"
        if self.count is not None:
            return str(self.count)
        return f"auto:{self.threshold:g}"


def parse_skip(spec: str | Sequence[int] | None) -> SkipSpec | None:
    """'auto' | 'auto:0.05' | '4' | '3,7,11' | '' / 'none' / None (no skip)."""
    if spec is None:
        return None
    if not isinstance(spec, str):
        return SkipSpec(layers=tuple(sorted({int(i) for i in spec})))
    s = spec.strip().lower()
    if s in ("", "none", "off", "0"):
        return None
    m = re.fullmatch(r"auto(?::([0-9]*\.?[0-9]+))?", s)
    if m:
        t = AUTO_THRESHOLD if m.group(1) is None else float(m.group(1))
        if not 0 <= t <= 10:
            raise ValueError(f"skip threshold {t:g} is out of range: a relative perplexity increase in 0..10")
        return SkipSpec(threshold=t)
    if re.fullmatch(r"[0-9]+", s):
        return SkipSpec(count=int(s))
    if re.fullmatch(r"[0-9]+(,[0-9]+)+,?", s):
        return SkipSpec(layers=tuple(sorted({int(i) for i in s.strip(",").split(",")})))
    raise ValueError(f"--skip-layers {spec!r}: use auto, auto:THRESHOLD (e.g. auto:0.03), a count N, "
                     "or layer indices like 3,7,11")


@dataclasses.dataclass
class Calibration:
    """Per-layer similarity and the perplexity table of one model on one text."""

    model_sha256: str
    text_sha256: str
    ctx: int
    chunks: int
    similarity: list[float]  # (n_layers,) mean cosine(input, output)
    table: list[dict]  # [{"k", "layers", "perplexity"}] for k = 0 … n/4

    @property
    def order(self) -> list[int]:
        """Layers, most similar first (ties: lower index first); never the first or last layer,
        which carry the embedding in and the prediction out."""
        n = len(self.similarity)
        inner = [i for i in range(n) if 0 < i < n - 1]
        return sorted(inner, key=lambda i: (-self.similarity[i], i))

    def most_similar(self, k: int) -> tuple[int, ...]:
        if not 0 <= k <= len(self.order):
            raise ValueError(f"cannot skip {k} layers: the model has {len(self.order)} skippable layers")
        return tuple(sorted(self.order[:k]))

    def auto(self, threshold: float) -> tuple[int, ...]:
        """The largest k of the table whose perplexity is within (1 + threshold) of k = 0."""
        base = self.table[0]["perplexity"]
        ok = [row for row in self.table if row["perplexity"] <= base * (1.0 + threshold)]
        return tuple(max(ok, key=lambda row: row["k"])["layers"])

    def to_dict(self) -> dict:
        return {"version": CACHE_VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "Calibration":
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})


def resolve(spec: SkipSpec | None, n_layers: int, calibration: Calibration | None = None) -> tuple[int, ...]:
    """The layer indices a spec names; calibration is needed for a count or auto."""
    if spec is None:
        return ()
    if spec.layers is not None:
        bad = [i for i in spec.layers if not 0 <= i < n_layers]
        if bad:
            raise ValueError(f"--skip-layers: layer {bad[0]} does not exist (the model has layers 0..{n_layers - 1})")
        if len(spec.layers) >= n_layers:
            raise ValueError("--skip-layers would skip every layer")
        return spec.layers
    if calibration is None:
        raise ValueError(f"--skip-layers {spec} needs a calibration: run ntx-model calibrate-skip MODEL --file TEXT")
    if len(calibration.similarity) != n_layers:
        raise ValueError(f"the calibration is for {len(calibration.similarity)} layers, the model has {n_layers}")
    return calibration.most_similar(spec.count) if spec.count is not None else calibration.auto(spec.threshold)


def run_layers(n_layers: int, skip: Sequence[int]) -> list[int]:
    """The layers a step runs when `skip` are left out."""
    s = set(skip)
    return [i for i in range(n_layers) if i not in s]


# ---- calibration -------------------------------------------------------------------------


def layer_similarity(engine, tokens: Sequence[int], *, ctx: int, max_chunks: int | None = None,
                     progress: Callable[[int, int], None] | None = None) -> np.ndarray:
    """Mean cosine similarity of each layer's input and output over all positions of the chunks.

    Runs the model's layers one at a time (model.run_layers, as the forward pass does) so the
    hidden state between layers can be read; the chunking is perplexity's.
    """
    cfg = engine.cfg
    n_chunks = len(tokens) // ctx if max_chunks is None else min(len(tokens) // ctx, max_chunks)
    if n_chunks == 0:
        raise ValueError(f"the text is {len(tokens)} tokens: calibration needs at least ctx = {ctx}")
    total, rows = np.zeros(cfg.n_layers, np.float64), 0
    slot = engine.open()
    try:
        for c in range(n_chunks):
            chunk = np.asarray(tokens[c * ctx:(c + 1) * ctx], np.int64)
            if engine.tokenizer.add_bos:
                chunk[0] = engine.tokenizer.bos_id
            engine.truncate(slot, 0)
            batch = Batch.of([Segment(slot, 0, chunk)])
            for i, x, y in _layer_io(engine, batch):
                a, b = np.asarray(x, np.float64), np.asarray(y, np.float64)
                cos = (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1) + 1e-30)
                total[i] += cos.sum()
            rows += len(chunk)
            if progress is not None:
                progress(c + 1, n_chunks)
    finally:
        engine.close(slot)
    return total / rows


def _layer_io(engine, batch: Batch):
    """(layer, its input, its output) as host arrays (N, D), layer by layer: through the
    backend's ops eagerly, or through the recorded pieces where the backend records steps
    (the cpu backend: embed, then one layer at a time from the hidden state)."""
    cfg, ops, weights = engine.cfg, engine.ops, engine.weights
    pieces = getattr(engine.steps, "run", None)
    if pieces is not None:
        x = pieces(batch, layers=[], head=False)
        for i in range(cfg.n_layers):
            y = pieces(batch, x=x, layers=[i], head=False)
            yield i, x, y
            x = y
        return
    with ops.step_context(batch):
        x = ops.embed(weights, batch.tokens)  # (N, D)
        for i in range(cfg.n_layers):
            y = llama.run_layers(ops, cfg, weights, engine.kv, batch, x, [i])  # (N, D)
            yield i, ops.to_host(x), ops.to_host(y)
            x = y


def calibrate(engine, tokens: Sequence[int], *, ctx: int, model_sha256: str, text_sha256: str,
              max_k: int | None = None, max_chunks: int | None = None,
              progress: Callable[[str, int, int], None] | None = None) -> Calibration:
    """Similarity per layer, then the perplexity with the k most similar layers skipped."""
    n = engine.cfg.n_layers
    max_k = n // 4 if max_k is None else max_k
    sim = layer_similarity(engine, tokens, ctx=ctx, max_chunks=max_chunks,
                           progress=None if progress is None else lambda d, t: progress("similarity", d, t))
    cal = Calibration(model_sha256, text_sha256, ctx, 0, [float(s) for s in sim], [])
    for k in range(max_k + 1):
        skip = cal.most_similar(k)
        p = perplexity(engine, tokens, ctx=ctx, layers=None if not skip else run_layers(n, skip),
                       max_chunks=max_chunks,
                       progress=None if progress is None else lambda d, t, k=k: progress(f"k={k}", d, t))
        cal.chunks = p.chunks
        cal.table.append({"k": k, "layers": list(skip), "perplexity": p.perplexity})
    return cal


# ---- the cache -----------------------------------------------------------------------------


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def state_dir() -> str:
    """Where the daemon and tools keep what they compute once per model (dirs.state_dir)."""
    return dirs.state_dir()


def cache_paths(model_path: str, sha256: str) -> list[str]:
    return [model_path + ".skip.json", os.path.join(state_dir(), f"skip-{sha256}.json")]


def save(cal: Calibration, model_path: str) -> str:
    """Write beside the model if that directory is writable, else in the state directory."""
    data = json.dumps(cal.to_dict(), indent=1)
    for path in cache_paths(model_path, cal.model_sha256):
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            tmp = f"{path}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                f.write(data)
            os.replace(tmp, path)
            return path
        except OSError:
            continue
    raise OSError(f"cannot write the calibration beside {model_path} nor in {state_dir()}")


def load_cached(model_path: str, sha256: str | None = None) -> Calibration | None:
    """The calibration kept for this model file (checked by sha256), or None."""
    sha256 = sha256 or file_sha256(model_path)
    for path in cache_paths(model_path, sha256):
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, ValueError):
            continue
        if d.get("version") == CACHE_VERSION and d.get("model_sha256") == sha256:
            return Calibration.from_dict(d)
    return None


def skip_layers_for(model_path: str, spec: str | SkipSpec | None, n_layers: int) -> tuple[int, ...]:
    """--skip-layers resolved for a model file, reading its cached calibration where needed."""
    spec = spec if isinstance(spec, SkipSpec) or spec is None else parse_skip(spec)
    if spec is None:
        return ()
    cal = load_cached(model_path) if spec.needs_calibration else None
    return resolve(spec, n_layers, cal)
