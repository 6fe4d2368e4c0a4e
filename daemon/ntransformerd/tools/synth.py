"""Synthetic Llama GGUFs at real shapes with random weights, written at disk speed.

Speed work runs on these: a Llama-3-70B-shaped Q4_K_M file is 40 GB, and quantizing 70
billion random floats would take an hour. Instead each tensor's blocks are random bytes
(from a pool, so generation outruns the disk) with their scale fields set to constants
calibrated once per type through gguf.quants, so every weight is finite, roughly zero-mean
with a standard deviation near 0.02, and the file dequantizes like any other. The vocabulary
and chat template are the default model's, so synthetic models tokenize and chat.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import os
from collections.abc import Callable
from importlib import resources

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType, GGUFWriter
from gguf import quants as gguf_quants

from ntransformerd.engine.quants import BLOCK_DTYPES, QUANT_BLOCKS
from ntransformerd.tools.atomic import check_output
from ntransformerd.tools.quantize import FTYPES, plan_types


@dataclasses.dataclass(frozen=True)
class Shape:
    n_layers: int
    d_model: int
    d_ff: int
    n_heads: int
    n_kv_heads: int
    vocab: int = 49152  # the default model's tokenizer
    context: int = 8192  # the GGUF's context_length: the positions a sequence may reach
    rope_base: float = 500000.0
    llama31_rope: bool = True  # write rope_freqs as Llama 3.1 does


SHAPES = {
    "tiny": Shape(n_layers=2, d_model=256, d_ff=512, n_heads=4, n_kv_heads=2, rope_base=10000.0,
                  llama31_rope=False),
    "small": Shape(n_layers=4, d_model=512, d_ff=1536, n_heads=8, n_kv_heads=2),
    # Llama 3.1's context: long-context work (bench/long_context.py) runs on these shapes
    "llama3-8b": Shape(n_layers=32, d_model=4096, d_ff=14336, n_heads=32, n_kv_heads=8, context=131072),
    "llama3-70b": Shape(n_layers=80, d_model=8192, d_ff=28672, n_heads=64, n_kv_heads=8, context=131072),
}

WEIGHT_STD = 0.02


def llama31_rope_factors(head_dim: int, base: float, factor: float = 8.0, low: float = 1.0,
                         high: float = 4.0, original_context: int = 8192) -> np.ndarray:
    """Llama 3.1's per-frequency divisors (the rope_freqs tensor)."""
    freqs = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    low_wavelen, high_wavelen = original_context / low, original_context / high
    smooth = (original_context / wavelen - low) / (high - low)
    out = np.where(wavelen < high_wavelen, 1.0,
                   np.where(wavelen > low_wavelen, factor, 1.0 / ((1 - smooth) / factor + smooth)))
    return out.astype(np.float32)


def tensor_shapes(s: Shape) -> dict[str, tuple[int, ...]]:
    """Every tensor of a model of shape `s`, numpy order, in file order."""
    hd = s.d_model // s.n_heads
    kv = s.n_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (s.vocab, s.d_model), "output_norm.weight": (s.d_model,),
        "output.weight": (s.vocab, s.d_model)}
    if s.llama31_rope:
        shapes["rope_freqs.weight"] = (hd // 2,)
    for i in range(s.n_layers):
        for name, shp in (("attn_norm", (s.d_model,)), ("attn_q", (s.d_model, s.d_model)),
                          ("attn_k", (kv, s.d_model)), ("attn_v", (kv, s.d_model)),
                          ("attn_output", (s.d_model, s.d_model)), ("ffn_norm", (s.d_model,)),
                          ("ffn_gate", (s.d_ff, s.d_model)), ("ffn_up", (s.d_ff, s.d_model)),
                          ("ffn_down", (s.d_model, s.d_ff))):
            shapes[f"blk.{i}.{name}.weight"] = shp
    return shapes


def tensor_types(s: Shape, ftype: str) -> dict[str, Q]:
    """The per-tensor types a real file of this ftype has (llama.cpp's rules, in quantize)."""
    return plan_types([(n, tuple(reversed(shp))) for n, shp in tensor_shapes(s).items()], ftype,
                      n_layer=s.n_layers, n_gqa=s.n_heads // s.n_kv_heads)


def _calibrate(qtype: Q) -> dict[str, float]:
    """Constant scale fields that give ~zero-mean weights of std WEIGHT_STD for random quants."""
    dt = BLOCK_DTYPES[qtype]
    rng = np.random.default_rng(1234)
    raw = rng.integers(0, 256, (4096, dt.itemsize), dtype=np.uint8)
    blocks = raw.view(dt).reshape(-1)
    scale_f = "d"
    offset_f = "m" if "m" in dt.names else "dmin" if "dmin" in dt.names else None

    def stats(d: float, off: float) -> tuple[float, float]:
        b = blocks.copy()
        b[scale_f] = d
        if offset_f:
            b[offset_f] = off
        x = gguf_quants.dequantize(b.view(np.uint8), qtype)
        return float(x.mean()), float(x.std())

    mean_d, _ = stats(1.0, 0.0)
    fields = {scale_f: 1.0}
    if offset_f:
        mean_o, _ = stats(0.0, 1.0)
        fields[offset_f] = -mean_d / mean_o if mean_o else 0.0
    _, std = stats(fields[scale_f], fields.get(offset_f, 0.0) if offset_f else 0.0)
    k = WEIGHT_STD / std
    return {f: v * k for f, v in fields.items()}


class _RandomQuant:
    """Random quantized tensors drawn as slices of one random pool, scales set to constants."""

    POOL = 64 << 20

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.pool = self.rng.integers(0, 256, self.POOL, dtype=np.uint8)
        self.fields: dict[Q, dict[str, float]] = {}

    def _bytes(self, n: int) -> np.ndarray:
        out = np.empty(n, np.uint8)
        done = 0
        while done < n:
            start = int(self.rng.integers(0, self.POOL))
            take = min(n - done, self.POOL - start)
            out[done:done + take] = self.pool[start:start + take]
            done += take
        return out

    def tensor(self, qtype: Q, shape: tuple[int, ...]) -> np.ndarray:
        n = math.prod(shape)
        if qtype == Q.F32:
            return (self.rng.standard_normal(shape, dtype=np.float32) * WEIGHT_STD)
        if qtype == Q.F16:
            return (self.rng.standard_normal(shape, dtype=np.float32) * WEIGHT_STD).astype(np.float16)
        if qtype == Q.BF16:
            x = self.rng.standard_normal(n, dtype=np.float32) * WEIGHT_STD
            return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(*shape[:-1], -1)
        block_elems, block_bytes = QUANT_BLOCKS[qtype]
        if qtype not in self.fields:
            self.fields[qtype] = _calibrate(qtype)
        raw = self._bytes(n // block_elems * block_bytes)
        blocks = raw.view(BLOCK_DTYPES[qtype])
        for field, value in self.fields[qtype].items():
            blocks[field] = value
        return raw.reshape(*shape[:-1], shape[-1] // block_elems * block_bytes)


def _tokenizer_metadata(vocab: int | None = None) -> dict:
    """The default model's tokenizer; with `vocab` below its size, its first `vocab` tokens and
    the merges among them: still a working BPE, and a GGUF whose metadata parses in a fraction
    of the time (tests under CPU emulation read it at every start)."""
    data = resources.files("ntransformerd.tools").joinpath("data/smollm2-tokenizer.json.gz").read_bytes()
    meta = json.loads(gzip.decompress(data))
    tokens = meta["tokenizer.ggml.tokens"]["value"]
    if vocab is None or vocab >= len(tokens):
        return meta
    kept = set(tokens[:vocab])
    meta["tokenizer.ggml.tokens"]["value"] = tokens[:vocab]
    meta["tokenizer.ggml.token_type"]["value"] = meta["tokenizer.ggml.token_type"]["value"][:vocab]
    meta["tokenizer.ggml.merges"]["value"] = [
        m for m in meta["tokenizer.ggml.merges"]["value"]
        if all(p in kept for p in m.split(" ")) and m.replace(" ", "") in kept]
    for key in ("bos", "eos", "unknown", "padding"):
        item = meta.get(f"tokenizer.ggml.{key}_token_id")
        if item is not None and item["value"] >= vocab:
            raise ValueError(f"vocab {vocab} drops the {key} token ({item['value']})")
    return meta


def synthesize(out: str, *, shape: str | Shape = "tiny", ftype: str = "q8_0", seed: int = 0,
               context: int | None = None, progress: Callable[[int, int], None] | None = None) -> int:
    """Write a synthetic model; return its size in bytes. context: its context_length (None:
    the shape's)."""
    s = SHAPES[shape] if isinstance(shape, str) else shape
    if context is not None:
        if context < 1:
            raise ValueError(f"context {context}: give a positive number of positions")
        s = dataclasses.replace(s, context=context)
    if ftype not in FTYPES:
        raise ValueError(f"unknown type {ftype!r}; one of {', '.join(FTYPES)}")
    check_output(out)
    hd = s.d_model // s.n_heads
    shapes, types = tensor_shapes(s), tensor_types(s, ftype)
    plan = [(name, shp, types[name]) for name, shp in shapes.items()]

    w = GGUFWriter(out, arch="llama")
    w.add_name(f"synthetic {shape if isinstance(shape, str) else 'custom'} {ftype} seed {seed}")
    w.add_block_count(s.n_layers)
    w.add_context_length(s.context)
    w.add_embedding_length(s.d_model)
    w.add_feed_forward_length(s.d_ff)
    w.add_head_count(s.n_heads)
    w.add_head_count_kv(s.n_kv_heads)
    w.add_rope_freq_base(s.rope_base)
    w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(s.vocab)
    w.add_file_type(FTYPES[ftype][1])
    for key, item in _tokenizer_metadata(s.vocab).items():
        sub = GGUFValueType(item["sub_type"]) if item["sub_type"] is not None else None
        w.add_key_value(key, item["value"], GGUFValueType(item["type"]), sub_type=sub)

    gen = _RandomQuant(seed)
    rope = llama31_rope_factors(hd, s.rope_base) if s.llama31_rope else None
    sizes = []
    for name, shp, q in plan:
        block_elems, block_bytes = QUANT_BLOCKS[q]
        nbytes = math.prod(shp) // block_elems * block_bytes
        sizes.append(nbytes)
        w.add_tensor_info(name, shp, np.dtype(np.float32), nbytes, raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    total, done = sum(sizes), 0
    for (name, shp, q), nbytes in zip(plan, sizes):
        if name == "rope_freqs.weight":
            data = rope
        elif len(shp) == 1:
            data = np.ones(shp, np.float32)
        else:
            data = gen.tensor(q, shp)
        w.write_tensor_data(np.ascontiguousarray(data).view(np.uint8).reshape(-1))
        done += nbytes
        if progress:
            progress(done, total)
    w.close()
    return os.path.getsize(out)
