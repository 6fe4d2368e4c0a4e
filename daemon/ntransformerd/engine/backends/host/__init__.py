"""The CPU backend: quantized kernels on GGUF blocks at the host's memory bandwidth.

Weights stay as the model file stores them, in its memory map (no float32 copy, no second
copy): each matmul quantizes its input rows to int8 blocks once and multiplies them with the
weight blocks directly (kernels/cpu/quant*.c, per instruction set). model.forward is recorded
once per step shape into a tape that one C call replays on a team of threads (record.py); the
exact float32 reference (backends/cpu.py, `cpu-ref`) stays beside it and the tests compare the
two.

    ops, weights = host.load(model)
    kv = host.kv_cache(cfg, n_slots=8, max_ctx=4096, dtype="q8_0")
    steps = host.graphs(ops, weights, kv)
    logits = steps.run(batch)                 # (segments, V) float32
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import types

import numpy as np
from gguf import GGMLQuantizationType as Q

from ntransformerd.engine.backends.cpu import rope_frequencies
from ntransformerd.engine.backends.host import native
from ntransformerd.engine.backends.host.attention import AttentionProbe
from ntransformerd.engine.backends.host.record import (BLOCK32_TYPES, FLOAT_TYPES, HostOps, Matrix, Tape,
                                                       header, model_consts, top_rows)
from ntransformerd.engine.gguf_file import GGUFModel, LlamaConfig
from ntransformerd.engine.runtime.kv_cache import KVCache
from ntransformerd.engine.runtime.model import Batch, forward, run_layers
from ntransformerd.engine.runtime.model import head as llama_head
from ntransformerd.engine.generation.sampler import TopLogits
from ntransformerd.settings import SettingError



def available() -> bool:
    return native.available()


def default_threads() -> int:
    """OMP_NUM_THREADS where it is set (OpenMP's own convention), else one thread per CPU this
    process may run on."""
    env = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(env) if env.isdigit() and int(env) > 0 else len(os.sched_getaffinity(0))


def matrix(model: GGUFModel, name: str) -> Matrix:
    t = model.tensor(name)
    if len(t.shape) != 2:
        raise ValueError(f"{name}: a matrix has two dimensions, this one {t.shape}")
    return Matrix(t.qtype, t.shape[1], t.shape[0], t.row_bytes, t.data)


def vector(model: GGUFModel, name: str) -> np.ndarray:
    return np.ascontiguousarray(model.dequantize(name), dtype=np.float32)


class HostWeights:
    """Every layer's matrices as the file stores them (its memory map; the page cache brings them
    in on first use) and its norm vectors as float32. acquire/release/prefetch answer the
    interface every placement answers; nothing moves here."""

    streamed = False

    def __init__(self, model: GGUFModel, lib: native.Library | None = None):
        self.model, self.lib = model, lib or native.load()
        cfg = model.config
        self.token_embd = matrix(model, "token_embd.weight")
        output = self.token_embd if cfg.tied_output else matrix(model, "output.weight")
        # The output matrix's rounding lands on the logits directly, and it multiplies one row
        # per sequence and step: 16-bit activations there cost little and remove its share of
        # the int8 activations' distance from the exact run (bench/RESULTS.md, KL divergence).
        self.output = dataclasses.replace(output, act16=output.qtype in BLOCK32_TYPES)
        self.output_norm = vector(model, "output_norm.weight")
        self._layers = []
        for i in range(cfg.n_layers):
            p = f"blk.{i}."
            m = {n: matrix(model, p + n + ".weight") for n in
                 ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
            self._layers.append(types.SimpleNamespace(
                attn_norm=vector(model, p + "attn_norm.weight"), ffn_norm=vector(model, p + "ffn_norm.weight"),
                attn_qkv=(m["attn_q"], m["attn_k"], m["attn_v"]), attn_output=m["attn_output"],
                ffn_gate_up=(m["ffn_gate"], m["ffn_up"]), ffn_down=m["ffn_down"]))
            model.layer_loaded(i)

    def embed_rows(self, tokens: np.ndarray) -> np.ndarray:
        """Rows of token_embd as float32 (the kernels' dequantization)."""
        lib = self.lib
        ids = np.ascontiguousarray(tokens, dtype=np.int64)
        m = self.token_embd
        out = np.empty((len(ids), m.n_in), np.float32)
        lib.dequantize_rows(int(m.qtype), m.ptr, m.row_bytes, m.n_in, ids.ctypes.data, len(ids), out.ctypes.data)
        return out

    def acquire(self, i: int):
        return self._layers[i]

    def release(self, i: int) -> None:
        pass

    def prefetch(self, layers) -> None:
        pass

    def link_busy(self) -> tuple[float, int]:
        return 0.0, 0


def load(model: GGUFModel, *, resident: set[int] | None = None,
         cpu_kernels: str = "auto") -> tuple[HostOps, HostWeights]:
    """The ops and weights of `model` on this CPU, on the kernels of `cpu_kernels` (a
    native.VARIANTS name, or auto: the best this CPU runs). `resident` is accepted for the common
    backend interface: every layer is computed from the memory map, so the page cache decides
    what stays."""
    for name, t in model.tensors.items():
        if t.qtype not in FLOAT_TYPES and t.qtype not in native_types():
            raise ValueError(f"{name}: type {t.qtype.name} has no CPU kernel")
    lib = library(cpu_kernels)
    return HostOps(model.config, lib), HostWeights(model, lib)


def library(cpu_kernels: str = "auto") -> native.Library:
    """The compiled kernels of `cpu_kernels` (a native.VARIANTS name, or auto: the best this CPU
    runs); a variant this CPU cannot run is a SettingError naming the setting, before any build."""
    try:
        return native.load(cpu_kernels)
    except native.UnsupportedVariant as e:
        raise SettingError(str(e), setting="cpu_kernels", value=cpu_kernels) from None


def native_types() -> tuple[Q, ...]:
    return (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)


def kv_cache(cfg: LlamaConfig, *, n_slots: int, max_ctx: int, dtype: str, n_blocks: int | None = None) -> KVCache:
    """The paged cache (kv_cache.py) the kernels read through its block tables: f32, f16, q8_0, q4_0."""
    return KVCache(cfg, n_slots=n_slots, max_ctx=max_ctx, dtype=dtype, n_blocks=n_blocks)


def _cap(n: int) -> int:
    """Arena capacity for n rows: powers of two from 16, so few layouts exist."""
    return max(16, 1 << (max(n, 1) - 1).bit_length())


class HostSteps:
    """Recorded passes of model.forward and their replay (record.py). One compute thread: a
    step returns its logits before the next starts."""

    def __init__(self, ops: HostOps, weights: HostWeights, kv: KVCache, *, threads: int | None = None):
        self.ops, self.w, self.kv = ops, weights, kv
        self.cfg = ops.cfg
        self.lib = ops.lib
        self.threads = threads or default_threads()
        c = self.cfg
        cache = getattr(kv, "cache", kv)  # a device's share of a multi-device cache (tiers.runs.HomeKV)
        self.cache, self.max_ctx = cache, cache.max_ctx
        freqs = rope_frequencies(c, self._freq_factors(weights.model))
        theta = np.arange(self.max_ctx, dtype=np.float64)[:, None] * freqs[None, :]  # (max_ctx, rope_dim/2)
        self.rope_cos = np.ascontiguousarray(np.cos(theta), dtype=np.float32)
        self.rope_sin = np.ascontiguousarray(np.sin(theta), dtype=np.float32)
        self.consts = model_consts(c, self.rope_cos, self.rope_sin, cache)
        per = self.lib.attn_scratch(ctypes.addressof(self.consts))  # floats one thread's attention uses
        self.scratch_per_thread = per
        self.scratch = np.zeros(self.threads * per, np.float32)
        # the threads' shared room for attention's split partials (kernels/cpu/attention.h), sized by max_ctx
        self.attn_parts = np.zeros(self.lib.attn_parts(ctypes.addressof(self.consts)), np.float32)
        self.arena = np.zeros(0, np.uint8)
        self.tapes: dict[tuple, Tape] = {}

    @staticmethod
    def _freq_factors(model: GGUFModel):
        return model.dequantize("rope_freqs.weight") if "rope_freqs.weight" in model.tensors else None

    def covers(self, segments, layers=None) -> bool:
        return bool(segments)

    def tape(self, batch: Batch, *, embed: bool, layers, head: bool, all_logits: bool) -> Tape:
        """The recording of this piece of model.forward, made on first use: the whole pass
        (forward itself), or the host's share of a multi-device step — embed or take x in, run
        `layers`, then the head or hand the hidden state out (model.run_layers, model.head)."""
        key = (embed, None if layers is None else tuple(layers), head, all_logits)
        tape = self.tapes.get(key)
        if tape is None:
            ops, cfg = self.ops, self.cfg
            tape = ops.begin()
            if embed and head:
                out = forward(ops, cfg, self.w, self.kv, batch, layers=layers, all_logits=all_logits)
            else:
                x = ops.embed(self.w, batch.tokens) if embed else ops.input(cfg.d_model)
                out = run_layers(ops, cfg, self.w, self.kv, batch, x, range(cfg.n_layers) if layers is None else layers)
                if head:
                    out = llama_head(ops, cfg, self.w, out, batch, all_logits=all_logits)
            ops.end(out)
            self.tapes[key] = tape
        return tape

    def run_step(self, segments, *, layers=None, all_logits: bool = False, top: int | None = None):
        """The engine's step: host logits, or with top a TopLogits."""
        logits = self.run(Batch.of(list(segments)), layers=layers, all_logits=all_logits)
        return logits if top is None else self.top(logits, top)

    def run(self, batch: Batch, *, x: np.ndarray | None = None, layers=None, head: bool = True,
            all_logits: bool = False, out: np.ndarray | None = None) -> np.ndarray:
        """One step, or the host's piece of one: from the tokens (or from hidden states x (N, D)),
        through `layers` (default all), to logits (segments, V) of each segment's last row, or
        (rows, V) of all — or without the head to the hidden states (N, D). `out`, if given,
        receives the result (e.g. pinned memory bound for another device) and is returned."""
        n = len(batch.tokens)
        if int(batch.positions.max()) >= self.max_ctx:
            raise ValueError(f"position {int(batch.positions.max())} is past the KV cache's {self.max_ctx}")
        for seg in batch.segments:  # the blocks this step writes, before the kernels look them up
            self.cache.reserve(seg.slot, seg.start + len(seg.tokens))
        tape = self.tape(batch, embed=x is None, layers=layers, head=head, all_logits=all_logits)
        tokens = np.ascontiguousarray(batch.tokens, dtype=np.int64)
        positions = np.ascontiguousarray(batch.positions, dtype=np.int64)
        lengths = np.diff(batch.offsets)
        slots = np.repeat(np.array([s.slot for s in batch.segments], np.int64), lengths)
        out_rows = (np.arange(n, dtype=np.int64) if all_logits or not head
                    else np.ascontiguousarray(batch.last_rows, np.int64))
        instrs, nbytes, offsets = tape.layout(_cap(n), _cap(len(out_rows)))
        if self.arena.nbytes < nbytes:
            self.arena = np.zeros(nbytes + 4096, np.uint8)
        if x is not None:
            d = self.cfg.d_model
            if x.shape != (n, d):
                raise ValueError(f"hidden states of shape {x.shape}, the step has ({n}, {d})")
            np.frombuffer(self.arena, np.float32, n * d, offsets[tape.input.id]).reshape(n, d)[:] = x
        h = header(tokens, positions, slots, out_rows)
        rc = self.lib.step(ctypes.addressof(instrs), len(instrs), ctypes.addressof(h), self.arena.ctypes.data,
                           ctypes.addressof(self.consts), self.scratch.ctypes.data, self.scratch_per_thread,
                           self.threads, self.attn_parts.ctypes.data, self.attn_parts.size)
        if rc != 0:
            why = ("the KV cache's layout does not match the kernels'" if rc == -3
                   else f"head_dim {self.cfg.head_dim} or GQA group too large")
            raise RuntimeError(f"the CPU step failed ({rc}): {why}")
        w, rows = tape.output.width, (len(out_rows) if head else n)
        result = np.frombuffer(self.arena, np.float32, rows * w, offsets[tape.output.id]).reshape(rows, w)
        if out is None:
            return result.copy()
        out[...] = result
        return out

    def top(self, logits: np.ndarray, n: int) -> TopLogits:
        return top_rows(self.lib, logits, n, threads=self.threads)


def graphs(ops: HostOps, weights: HostWeights, kv: KVCache, *, threads: int | None = None) -> HostSteps:
    """The recorded steps the engine runs every batch with."""
    return HostSteps(ops, weights, kv, threads=threads)
