"""Recording model.forward once per step shape, and replaying it in one call.

`HostOps` answers the ops model.forward calls, but instead of computing it appends
instructions to a `Tape` and hands back symbolic `Buf`s (an activation of some width over the
step's rows). After the pass, the tape knows every buffer's first and last use and packs them
into one arena (first fit over live ranges), so a step of any row count up to the arena's
capacity needs one allocation, reused by every step. Replaying writes the step's tokens,
positions and slots into the header and calls `ntx_step` once: Python pays per step, not per op.

The tape is parametric in the batch: row counts, positions and slots are read at run time, so
one recording serves every batch of the same (layers, all_logits) shape — decode at any batch
size, verify steps and prefill chunks alike.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses

import numpy as np
from gguf import GGMLQuantizationType as Q

from ntransformerd.engine.backends.host.native import Header, Instr, Library, ModelConsts
from ntransformerd.engine.runtime.kv_cache import KV_TYPES, row_bytes
from ntransformerd.engine.generation.sampler import TopLogits

OP_EMBED, OP_RMS_NORM, OP_QUANT, OP_MATMUL, OP_SWIGLU, OP_ROWS, OP_ATTN_WRITE, OP_ATTN = range(1, 9)
ROWS_ALL, ROWS_OUT = 0, 1
SAME_PHASE = 1
ALIGN = 64

FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
K_TYPES = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
BLOCK32_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)  # the types with a 16-bit activation kernel
ACT16 = 0x100  # ntx_cpu.h's NTX_ACT16: a type id | ACT16 multiplies against 16-bit activation blocks


@dataclasses.dataclass(frozen=True)
class Matrix:
    """A GGUF weight matrix as stored (out rows of `n_in` elements, row_bytes each)."""

    qtype: Q
    n_in: int
    n_out: int
    row_bytes: int
    data: np.ndarray  # raw bytes, a view of the model file's map (kept alive here)
    act16: bool = False  # products take 16-bit activation blocks (a BLOCK32_TYPES type)

    @property
    def ptr(self) -> int:
        return self.data.ctypes.data

    @property
    def kernel_type(self) -> int:
        """The kernels' id for this matrix's products: its GGML type, | ACT16 where act16."""
        return int(self.qtype) | (ACT16 if self.act16 else 0)

    @property
    def act_format(self) -> int:
        """The kernel type that stands for this matrix's activation format (f32, 8-bit blocks of
        32 or 256, 16-bit blocks of 32): matrices of one format share one quantized copy of
        their input."""
        if self.qtype in FLOAT_TYPES:
            return int(Q.F32)
        if self.act16:
            return int(Q.Q8_0) | ACT16
        return int(Q.Q4_K if self.qtype in K_TYPES else Q.Q8_0)


@dataclasses.dataclass(eq=False)
class Buf:
    """An activation of the tape: `width` float32 per row (or `row_bytes` for a quantized copy),
    over the step's rows or its output rows."""

    id: int
    width: int
    rows: int  # ROWS_ALL | ROWS_OUT
    row_bytes: int


class Tape:
    """The instructions of one recorded pass and the arena layout of its buffers."""

    def __init__(self, lib: Library):
        self.lib = lib
        self.instrs: list[dict] = []
        self.bufs: list[Buf] = []
        self.keep: list = []  # objects whose memory the instructions point into
        self.input: Buf | None = None  # hidden states written before the step (a piece's input)
        self.output: Buf | None = None
        self._layouts: dict[tuple[int, int], tuple[ctypes.Array, int, dict[int, int]]] = {}

    def buf(self, width: int, rows: int, row_bytes: int | None = None) -> Buf:
        b = Buf(len(self.bufs), width, rows, width * 4 if row_bytes is None else row_bytes)
        self.bufs.append(b)
        return b

    def emit(self, op: int, *, out: Buf | None = None, x: Buf | None = None, y: Buf | None = None,
             res: Buf | None = None, rows: int = ROWS_ALL, **fields) -> None:
        self.instrs.append(dict(op=op, out=out, x=x, y=y, res=res, rows=rows, **fields))

    def layout(self, cap_rows: int, cap_out: int) -> tuple[ctypes.Array, int, dict[int, int]]:
        """(instructions with arena offsets, arena bytes, offset of each buffer) for steps of at
        most cap_rows rows and cap_out output rows."""
        key = (cap_rows, cap_out)
        if key not in self._layouts:
            self._layouts[key] = self._pack(cap_rows, cap_out)
        return self._layouts[key]

    def _pack(self, cap_rows: int, cap_out: int) -> tuple[ctypes.Array, int, dict[int, int]]:
        # Instructions of one phase run at once (no barrier between them): a buffer is live
        # from the start of the phase that first touches it to the end of the last one.
        start, end, s = [], [0] * len(self.instrs), 0
        for i, ins in enumerate(self.instrs):
            start.append(s)
            if not ins.get("flags", 0) & SAME_PHASE:
                end[s:i + 1] = [i] * (i + 1 - s)
                s = i + 1
        end[s:] = [len(self.instrs) - 1] * (len(self.instrs) - s)
        first, last = {}, {}
        for i, ins in enumerate(self.instrs):
            for role in ("x", "y", "res", "out"):
                b = ins[role]
                if b is not None:
                    first.setdefault(b.id, start[i])
                    last[b.id] = end[i]
        if self.input is not None:  # written before the first instruction
            first[self.input.id] = 0
            last.setdefault(self.input.id, 0)
        if self.output is not None:
            last[self.output.id] = len(self.instrs)
        size = {b.id: -(-b.row_bytes * (cap_out if b.rows == ROWS_OUT else cap_rows) // ALIGN) * ALIGN
                for b in self.bufs}
        offset: dict[int, int] = {}
        live: list[tuple[int, int, int]] = []  # (offset, end, buffer) placed so far
        total = 0
        for bid in sorted(first, key=lambda b: (first[b], -size[b])):
            live = [p for p in live if last[p[2]] >= first[bid]]  # free the ranges that ended
            at = 0
            for o, e, _ in sorted(live):
                if at + size[bid] <= o:
                    break
                at = max(at, e)
            offset[bid] = at
            live.append((at, at + size[bid], bid))
            total = max(total, at + size[bid])
        arr = (Instr * len(self.instrs))()
        for i, ins in enumerate(self.instrs):
            c = arr[i]
            c.op, c.flags, c.rows = ins["op"], ins.get("flags", 0), ins["rows"]
            c.wtype, c.n, c.m = int(ins.get("wtype", 0)), ins.get("n", 0), ins.get("m", 0)
            for role in ("x", "y", "res", "out"):
                b = ins[role]
                setattr(c, role, -1 if b is None else offset[b.id])
            c.w, c.w_row_bytes = ins.get("w", None), ins.get("w_row_bytes", 0)
            c.kv_k, c.kv_v = ins.get("kv_k", None), ins.get("kv_v", None)
            c.eps = ins.get("eps", 0.0)
        return arr, total, offset


class HostOps:
    """The ops model.forward calls, recorded into the current tape (see module docstring)."""

    name = "cpu"

    def __init__(self, cfg, lib: Library):
        self.cfg, self.lib = cfg, lib
        self.tape: Tape | None = None
        self._acts: dict[tuple[int, Q], Buf] = {}

    def begin(self) -> Tape:
        self.tape, self._acts = Tape(self.lib), {}
        return self.tape

    def end(self, output: Buf) -> Tape:
        tape, self.tape = self.tape, None
        tape.output = output
        fuse_quantization(tape)
        return tape

    def step_context(self, batch):
        """Nothing to set up: the recorded steps carry their own thread team."""
        return contextlib.nullcontext()

    @staticmethod
    def to_host(x: np.ndarray) -> np.ndarray:
        return x

    def top(self, logits: np.ndarray, n: int) -> TopLogits:
        return top_rows(self.lib, logits, n)

    def input(self, width: int) -> Buf:
        """Hidden states handed in from another device, one row per step row."""
        self.tape.input = self.tape.buf(width, ROWS_ALL)
        return self.tape.input

    def embed(self, weights, tokens) -> Buf:
        m: Matrix = weights.token_embd
        out = self.tape.buf(m.n_in, ROWS_ALL)
        self.tape.keep.append(m.data)
        self.tape.emit(OP_EMBED, out=out, wtype=m.qtype, n=m.n_in, w=m.ptr, w_row_bytes=m.row_bytes)
        return out

    def rope_table(self, positions):
        return None  # the kernels rotate by each row's position from the table built at load

    def rms_norm(self, x: Buf, w: np.ndarray, eps: float) -> Buf:
        out = self.tape.buf(x.width, x.rows)
        self.tape.keep.append(w)
        self.tape.emit(OP_RMS_NORM, out=out, x=x, rows=x.rows, n=x.width, w=w.ctypes.data, eps=float(eps))
        return out

    def _act(self, x: Buf, fmt: int) -> Buf:
        """x quantized for weights of activation format `fmt` (Matrix.act_format), once per
        (buffer, format)."""
        if fmt == Q.F32:
            return x
        key = (x.id, fmt)
        if key not in self._acts:
            out = self.tape.buf(x.width, x.rows, self.lib.act_row_bytes(fmt, x.width))
            self.tape.emit(OP_QUANT, out=out, x=x, rows=x.rows, wtype=fmt, n=x.width)
            self._acts[key] = out
        return self._acts[key]

    def matmul(self, x: Buf, w, residual: Buf | None = None):
        """x @ w (+ residual) on GGUF blocks; a stack (tuple) gives one product per member, all in
        one phase of the step (their inputs are quantized first, once per format)."""
        members = w if isinstance(w, tuple) else (w,)
        acts = [self._act(x, m.act_format) for m in members]
        outs = []
        for j, (m, a) in enumerate(zip(members, acts)):
            if m.n_in != x.width:
                raise ValueError(f"matmul: input width {x.width} does not match the matrix's {m.n_in}")
            out = self.tape.buf(m.n_out, x.rows)
            self.tape.keep.append(m.data)
            self.tape.emit(OP_MATMUL, out=out, x=a, res=residual, rows=x.rows, wtype=m.kernel_type, n=m.n_in,
                           m=m.n_out, w=m.ptr, w_row_bytes=m.row_bytes,
                           flags=SAME_PHASE if j + 1 < len(members) else 0)
            outs.append(out)
        return tuple(outs) if isinstance(w, tuple) else outs[0]

    def swiglu(self, g: Buf, u: Buf) -> Buf:
        out = self.tape.buf(g.width, g.rows)
        self.tape.emit(OP_SWIGLU, out=out, x=g, y=u, rows=g.rows, n=g.width)
        return out

    def rows(self, x: Buf, rows) -> Buf:
        out = self.tape.buf(x.width, ROWS_OUT)
        self.tape.emit(OP_ROWS, out=out, x=x, rows=ROWS_OUT, n=x.width)
        return out

    def attention(self, q: Buf, k: Buf, v: Buf, kv, batch, rope=None) -> Buf:
        """RoPE on q and k, k and v into the layer's cache, causal GQA attention (two phases)."""
        self.tape.keep.append(kv)
        ptrs = dict(kv_k=kv.k.ctypes.data, kv_v=kv.v.ctypes.data)
        self.tape.emit(OP_ATTN_WRITE, x=q, y=k, res=v, **ptrs)
        out = self.tape.buf(q.width, ROWS_ALL)
        self.tape.emit(OP_ATTN, out=out, x=q, **ptrs)
        return out


def fuse_quantization(tape: Tape) -> None:
    """A norm's or SwiGLU's output quantized by the op itself, row by row as it is made: one
    phase (and one barrier) less per fused op. Each producer takes the first quantization of
    its output; a second format (mixed weight types) keeps its own instruction."""
    producer = {ins["out"].id: ins for ins in tape.instrs if ins["out"] is not None}
    kept = []
    for ins in tape.instrs:
        p = producer.get(ins["x"].id) if ins["op"] == OP_QUANT else None
        if p is not None and p["op"] in (OP_RMS_NORM, OP_SWIGLU) and "act" not in p and p["rows"] == ins["rows"]:
            p["act"] = ins["out"]
            p["wtype"] = ins["wtype"]
            p["y" if p["op"] == OP_RMS_NORM else "res"] = ins["out"]
            continue
        kept.append(ins)
    tape.instrs = kept


TOPK_MAX = 256  # larger top requests pick on the host with numpy


def top_rows(lib: Library, logits: np.ndarray, n: int, *, threads: int = 1) -> TopLogits:
    """Each row's n most likely ids and their logits, picked in C (NaN counted, as -inf; ties
    to the lower id): sampler.TopLogits.of without a sort of the row."""
    if n > TOPK_MAX:
        return TopLogits.of(logits, n)
    logits = np.ascontiguousarray(logits, np.float32)
    rows, v = logits.shape
    ids = np.empty((rows, n), np.int64)
    vals = np.empty((rows, n), np.float32)
    nan = np.empty(rows, np.int64)
    lib.topk(logits.ctypes.data, rows, v, n, ids.ctypes.data, vals.ctypes.data, nan.ctypes.data,
             max(1, min(threads, rows)))
    return TopLogits(ids, vals, nan, sort=False)


def model_consts(cfg, rope_cos: np.ndarray, rope_sin: np.ndarray, cache) -> ModelConsts:
    """The step's constants: the model's shape, the rope table, and the KV cache's layout (a
    kv_cache.KVCache: its storage type, block size and block tables, read by each step)."""
    qtype = KV_TYPES[cache.dtype][0]
    t = cache.blocks
    return ModelConsts(n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                       rope_dim=cfg.rope_dim, rope_neox=int(cfg.rope_neox), kv_type=int(qtype), max_ctx=cache.max_ctx,
                       attn_scale=float(np.float32(1.0 / np.sqrt(cfg.head_dim))), kv_block=t.block_size,
                       rope_cos=rope_cos.ctypes.data, rope_sin=rope_sin.ctypes.data,
                       kv_tables=t.tables.ctypes.data, kv_max_blocks=t.max_blocks,
                       kv_row_bytes=row_bytes(cache.dtype, cfg.head_dim))


def header(tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, out_rows: np.ndarray) -> Header:
    """The step's header; the arrays must stay alive (and int64, contiguous) for the call."""
    return Header(n_rows=len(tokens), n_out=len(out_rows), tokens=tokens.ctypes.data,
                  positions=positions.ctypes.data, slots=slots.ctypes.data, out_rows=out_rows.ctypes.data)
