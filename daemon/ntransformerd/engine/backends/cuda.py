"""The CUDA backend: CuPy arrays and our kernels from `kernels/` (one .cu per op family).

Each op is a thin launcher that checks dtype and shape, then launches; `backends/cpu.py` is the
reference every launcher is tested against (tests/gpu). Weights stay quantized on the device
(Q8_0 and Q6_K repacked at load into planes that 16-byte loads can read; the other types as
their GGUF blocks) and `matmul` dequantizes inside the multiply for up to 32 rows (decode);
longer chunks (prefill) dequantize the weight to f16 and multiply with cuBLAS. The KV cache is
F16. The captured decode step (CUDA graphs) lives in cuda_decode.py.

For Q8_0, Q4_K and Q6_K the fused multiply of 1-2 rows reads the activations quantized (QAct:
two int8 levels per element and a scale per 32, about 2^-15 of each group's largest value, see
kernels/quant_act.cuh) and multiplies with int8 dot products (dp4a); from 4 rows (batch bucket
4), rows of whole 256-blocks are dequantized to f16 in registers and multiplied on f16 tensor
cores (mmh_*, K split over blocks for few-row matrices), at prefill's precision; other widths use
int8 tensor-core mma.sync on QAct. The CPU reference stays float32 and the tests compare within
each path's tolerance. Prefill attention runs on tensor cores too (attn_chunk).

Kernels are compiled on first use (NVRTC, with kernels/common.cuh and the family's headers
prepended; CuPy caches the binaries on disk; `precompile` builds them all in parallel). Inside
the captured decode step they may be launched with programmatic dependent launch (`pdl()`,
through cuLaunchKernelEx), which every kernel of kernels/ is written to allow.
"""

from __future__ import annotations

import contextlib
import functools

import math
import os
import types

import numpy as np
from gguf import GGMLQuantizationType as Q

from ntransformerd.engine.backends.cpu import rope_frequencies
from ntransformerd.engine.gguf_file import GGUFModel, LlamaConfig, TensorInfo
from ntransformerd.engine.kv_cache import SlotTable
from ntransformerd.engine.model import Batch
from ntransformerd.engine.quants import BLOCK_DTYPES

try:
    import cupy as cp
except ImportError:  # CI and CPU-only hosts
    cp = None

KERNEL_DIR = os.environ.get("NTX_KERNEL_DIR") or os.path.join(
    os.path.dirname(__file__), *([os.pardir] * 4), "kernels")
MATVEC_MAX_ROWS = 32  # up to this many rows a matmul is the fused dequant-multiply
MATVEC_BUCKETS = (1, 2, 4, 8, 16, 32)  # compiled batch widths of the fused kernels
FAST_MATVEC = {Q.Q8_0: "mvq_q8_0", Q.Q4_K: "mvq_q4_k", Q.Q6_K: "mvq_q6_k"}  # on QAct activations
MMA_MATVEC = {Q.Q8_0: "mma_q8_0", Q.Q4_K: "mma_q4_k", Q.Q6_K: "mma_q6_k"}  # the same, tensor cores
# From bucket 4, rows of whole 256-element blocks dequantize to f16 in registers for f16
# tensor-core products (kernels/quant.cu, mmh_*): prefill's precision (about 2^-11 of each
# weight and activation) instead of the int8 kernels' 2^-15; the batch-16 step 1.17x (Q8_0) and
# 1.24x (Q4_K_M) faster, Q6_K matrices 1.9x (bench/RESULTS.md). NTX_F16_MMA=0 keeps the int8
# mma_* kernels (rows of other widths always do).
F16_MATVEC = ({Q.Q8_0: "mmh_q8_0", Q.Q4_K: "mmh_q4_k", Q.Q6_K: "mmh_q6_k"}
              if os.environ.get("NTX_F16_MMA", "1") != "0" else {})
MMH_ROWS = 128  # rows per mmh block
MMH_PART_FLOATS = 32 * 131072  # split-K partial sums: batch rows × (splits × N), 16 MB per stream
MMA_MIN_BUCKET = 4  # from this batch bucket on, the FAST_MATVEC types multiply on tensor cores
# Up to this many rows the int8 mma kernels take 16 rows per block (else 32), so every SM gets work.
MMA_ONE_TILE_ROWS = int(os.environ.get("NTX_MMA_ONE_TILE_ROWS", "8192"))
ROWS_PER_WARP = {1: 2, 2: 2, 4: 4, 8: 4, 16: 4, 32: 2}  # per batch bucket: x reuse vs registers
# One-row matvecs of at most MVQ_WIDE_MAX_N output rows (per type) take WIDE_ROWS_PER_WARP rows
# per warp instead of ROWS_PER_WARP[1]:
# half the blocks (one wave instead of two for the 8B shape's attn_output and ffn_down), each
# warp's loads for all its rows issued at once. H200, 8B, B=1 graph step, same run (bench/RESULTS.md,
# round 6): Q8_0 2.870 -> 2.669 ms up to 8192 rows, 2.640 for every matrix; Q4_K_M 2.426 -> 2.343
# up to 8192 rows; every matrix 2.338 (the Q6_K output 58.8 -> 50.6 us, the Q4_K gate_up 27.1 ->
# 28.2). NTX_MVQ_WIDE_MAX_N sets one bound for every type (0: never).
WIDE_ROWS_PER_WARP = 4
MVQ_WIDE_MAX_N = {Q.Q8_0: 1 << 30, Q.Q4_K: 8192, Q.Q6_K: 1 << 30}
if os.environ.get("NTX_MVQ_WIDE_MAX_N"):
    MVQ_WIDE_MAX_N = dict.fromkeys(MVQ_WIDE_MAX_N, int(os.environ["NTX_MVQ_WIDE_MAX_N"]))
# A dp4a matvec of fewer warps than this (rows / rows per warp; the H200 holds 8448 at once)
# splits K over its block's four warps instead, so few-row matrices still keep every SM's loads
# in flight (kernels/quant.cu, mvq_finish).
SPLIT_K_WARPS = int(os.environ.get("NTX_SPLIT_K_WARPS", "4096"))  # 0: never split (for benchmarks)
# Blocks per SM the one-row (bucket 1) dp4a matvecs are compiled to allow (their registers then
# fit: Q8_0 in 64 without spills, the K-quants in 80); 1 leaves the compiler free
# (NTX_MVQ_MIN_BLOCKS=1 for benchmarks). Occupancy, not instruction issue, held them back.
MVQ_MIN_BLOCKS = {Q.Q8_0: 8, Q.Q4_K: 6, Q.Q6_K: 6}
if os.environ.get("NTX_MVQ_MIN_BLOCKS"):
    MVQ_MIN_BLOCKS = dict.fromkeys(MVQ_MIN_BLOCKS, int(os.environ["NTX_MVQ_MIN_BLOCKS"]))
# The Q8_0 dp4a matvec launches only as many blocks as the SMs hold at once, each looping over
# row groups (no tail wave, no block start per group); 0: a block per group (kernels/quant.cu).
MVQ_PERSISTENT = os.environ.get("NTX_MVQ_PERSISTENT", "1") != "0"
# Up to this batch bucket the decode step's attention is one launch (attn_decode) instead of
# rope_kv + attn_partial + attn_combine. Round 7 (H200, same run, with PDL in every bucket and 16
# splits from bucket 4, cuda_decode.py): the one launch is faster at every batch size: B=4 Q4_K_M
# step 3.379 -> 3.137 ms, B=8 3.644 -> 3.437, B=16 4.556 -> 4.397 (the three kernels with 16
# splits). Before attn_decode loaded the cache ahead of pdl_wait and before fewer splits, the
# three kernels were faster at 16 rows. NTX_ATTN_ONE_LAUNCH=0: never (benchmarks).
ATTN_ONE_LAUNCH_MAX_BUCKET = 32 if os.environ.get("NTX_ATTN_ONE_LAUNCH", "1") != "0" else 0
PRELUDE = {"quant": ("quant_act.cuh",), "norm": ("quant_act.cuh",), "activation": ("quant_act.cuh",),
           "attention": ("quant_act.cuh",)}  # headers prepended to a family's .cu, after common.cuh


def available() -> bool:
    if cp is None:
        return False
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver, no device
        return False


# ---- kernels --------------------------------------------------------------------------------

_modules: dict[tuple[str, str], "Kernel"] = {}


@functools.cache
def _libcuda():
    """The CUDA driver library, for what CuPy does not wrap (launch attributes, occupancy)."""
    import ctypes
    return ctypes.CDLL("libcuda.so.1")


class Kernel:
    """A compiled kernel; calling it launches on the current stream (CuPy's launch), or, while
    programmatic dependent launch is on (`pdl()`), through cuLaunchKernelEx with the PDL
    attribute, so that it may start while the previous kernel finishes (every kernel of
    kernels/ waits for its predecessor's writes: PDL_ENTRY in common.cuh)."""

    def __init__(self, fn):
        self.fn = fn
        self._occupancy: dict[int, int] = {}

    def blocks_per_sm(self, threads: int) -> int:
        """How many blocks of `threads` one SM holds at once (registers, shared memory, limits)."""
        got = self._occupancy
        if threads not in got:
            import ctypes
            lib = _libcuda()
            n = ctypes.c_int()
            func = getattr(self.fn, "kernel", self.fn)
            err = lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), ctypes.c_void_p(func.ptr),
                                                                  ctypes.c_int(threads), ctypes.c_size_t(0))
            if err:
                raise RuntimeError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor failed: CUDA error {err}")
            got[threads] = max(1, n.value)
        return got[threads]

    def __call__(self, grid, block, args):
        if _pdl.on:
            _pdl.launch(self.fn, grid, block, args)
        else:
            self.fn(grid, block, args)


def kernel_source(family: str) -> str:
    """kernels/<family>.cu as compiled: common.cuh and the family's headers first (all of it is
    CuPy's cache key)."""
    src = ""
    for fn in ("common.cuh", *PRELUDE.get(family, ()), f"{family}.cu"):
        with open(os.path.join(KERNEL_DIR, fn)) as f:
            src += f.read() + "\n"
    return src


def kernel(family: str, name: str) -> Kernel:
    """Function `name` (a template instance like 'mvq_q8_0<2,1>') of kernels/<family>.cu."""
    key = (family, name)
    fn = _modules.get(key)
    if fn is None:
        mod = cp.RawModule(code=kernel_source(family), options=("--std=c++17",), name_expressions=[name])
        fn = _modules[key] = Kernel(mod.get_function(name))
    return fn


class _PDL:
    """cuLaunchKernelEx through ctypes (CuPy wraps only cuLaunchKernel), with
    CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION set. Used while capturing the decode
    step (one launch per kernel per capture), so the ctypes cost never recurs per token."""

    ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6

    def __init__(self):
        self.on = False
        self._lib = None

    def _setup(self):
        import ctypes
        c = ctypes

        class Attr(c.Structure):  # CUlaunchAttribute: id, pad to 8, a 64-byte value union
            _fields_ = [("id", c.c_int), ("pad", c.c_char * 4), ("value", c.c_ubyte * 64)]

        class Config(c.Structure):  # CUlaunchConfig
            _fields_ = [("gx", c.c_uint), ("gy", c.c_uint), ("gz", c.c_uint), ("bx", c.c_uint), ("by", c.c_uint),
                        ("bz", c.c_uint), ("smem", c.c_uint), ("stream", c.c_void_p), ("attrs", c.POINTER(Attr)),
                        ("n_attrs", c.c_uint)]

        lib = _libcuda()
        lib.cuLaunchKernelEx.argtypes = [c.POINTER(Config), c.c_void_p, c.POINTER(c.c_void_p), c.c_void_p]
        lib.cuLaunchKernelEx.restype = c.c_int
        self._c, self._Attr, self._Config, self._lib = c, Attr, Config, lib

    def _arg(self, a):
        c = self._c
        if isinstance(a, cp.ndarray):
            return c.c_void_p(a.data.ptr)
        if isinstance(a, np.int32):
            return c.c_int32(int(a))
        if isinstance(a, np.float32):
            return c.c_float(float(a))
        if isinstance(a, (np.int64, np.intp)):
            return c.c_int64(int(a))
        raise TypeError(f"PDL launch: unsupported kernel argument {type(a).__name__}")

    def launch(self, fn, grid, block, args) -> None:
        if self._lib is None:
            self._setup()
        c = self._c
        grid, block = tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block))
        attr = self._Attr()
        attr.id = self.ATTR_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value[0] = 1  # programmaticStreamSerializationAllowed
        cfg = self._Config(*grid, *block, 0, cp.cuda.get_current_stream().ptr, c.pointer(attr), 1)
        vals = [self._arg(a) for a in args]
        params = (c.c_void_p * len(vals))(*[c.cast(c.pointer(v), c.c_void_p) for v in vals])
        func = getattr(fn, "kernel", fn)  # CuPy's RawKernel holds the driver Function (.ptr: CUfunction)
        err = self._lib.cuLaunchKernelEx(c.byref(cfg), func.ptr, params, None)
        if err:
            raise RuntimeError(f"cuLaunchKernelEx failed: CUDA error {err}")


_pdl = _PDL()


@contextlib.contextmanager
def pdl(on: bool = True):
    """Launch kernels with programmatic dependent launch inside this block (sm_90 and later)."""
    prev, _pdl.on = _pdl.on, on and int(cp.cuda.Device().compute_capability) >= 90
    try:
        yield
    finally:
        _pdl.on = prev


def _blocks(n: int, per: int) -> int:
    return (n + per - 1) // per


def _check(x, dtype, ndim: int, what: str):
    if not isinstance(x, cp.ndarray) or x.dtype != dtype or x.ndim != ndim:
        raise TypeError(f"{what}: expected a {ndim}-D cupy {np.dtype(dtype).name} array, got "
                        f"{type(x).__name__} {getattr(x, 'dtype', '')} {getattr(x, 'shape', '')}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{what}: must be C-contiguous")


# ---- weights on the device ------------------------------------------------------------------

class CudaTensor:
    """A 2-D weight (N, K) on the device as its planes (see kernels/quant.cu for the layouts)."""

    def __init__(self, qtype: Q, shape: tuple[int, int], planes: tuple):
        self.qtype, self.shape, self.planes = qtype, shape, planes

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.planes)

    def rows(self, a: int, b: int) -> "CudaTensor":
        """Rows a..b as a view (planes are row-major, so a row slice stays contiguous)."""
        return CudaTensor(self.qtype, (b - a, self.shape[1]), tuple(p[a:b] for p in self.planes))

    def ptrs(self) -> tuple:
        p = list(self.planes) + [self.planes[0]] * (4 - len(self.planes))
        return tuple(p)


def host_planes(qtype: Q, raw: np.ndarray, shape: tuple[int, int]) -> list[np.ndarray]:
    """The device layout of a tensor's GGUF bytes (N, row_bytes), as host arrays (N, ·) uint8."""
    n, k = shape
    raw = np.ascontiguousarray(raw).reshape(n, -1).view(np.uint8)
    if qtype == Q.Q8_0:
        b = raw.view(BLOCK_DTYPES[Q.Q8_0]).reshape(n, k // 32)
        return [np.ascontiguousarray(b["qs"]).view(np.uint8).reshape(n, k),
                np.ascontiguousarray(b["d"]).view(np.uint8).reshape(n, k // 16)]
    if qtype == Q.Q6_K:
        b = raw.view(BLOCK_DTYPES[Q.Q6_K]).reshape(n, k // 256)
        return [np.ascontiguousarray(b["ql"]).reshape(n, k // 2),
                np.ascontiguousarray(b["qh"]).reshape(n, k // 4),
                np.ascontiguousarray(b["scales"]).view(np.uint8).reshape(n, k // 16),
                np.ascontiguousarray(b["d"]).view(np.uint8).reshape(n, k // 128)]
    return [raw]


def _device_alloc(shape, dtype, what: str):
    try:
        return cp.empty(shape, dtype)
    except cp.cuda.memory.OutOfMemoryError:
        free, total = cp.cuda.runtime.memGetInfo()
        need = math.prod(shape) * np.dtype(dtype).itemsize
        raise MemoryError(f"{what}: {need / 2**30:.2f} GiB does not fit on the GPU "
                          f"({free / 2**30:.2f} of {total / 2**30:.2f} GiB free); use a smaller "
                          "model, fewer KV slots or a shorter context") from None


def upload(infos: list[TensorInfo], what: str) -> CudaTensor:
    """Tensors of one type stacked by rows (e.g. attn_q, attn_k, attn_v) as one CudaTensor."""
    qtype, k = infos[0].qtype, infos[0].shape[-1]
    assert all(t.qtype == qtype and t.shape[-1] == k for t in infos)
    n = sum(t.shape[0] for t in infos)
    parts = [host_planes(qtype, t.data, (t.shape[0], k)) for t in infos]
    planes = []
    for j in range(len(parts[0])):
        dev = _device_alloc((n, parts[0][j].shape[1]), np.uint8, what)
        r = 0
        for p in parts:
            dev[r:r + len(p[j])].set(p[j])
            r += len(p[j])
        planes.append(dev)
    return CudaTensor(qtype, (n, k), tuple(planes))


class CudaWeights:
    """Every tensor resident on the device. Layers hand out GGUF-named fields; attn_q/k/v and
    ffn_gate/up are row views of one stacked tensor where their types agree (`qkv`, `gate_up`),
    so the captured decode step multiplies each stack once."""

    def __init__(self, model: GGUFModel):
        self.model, cfg = model, model.config
        self.token_embd = upload([model.tensor("token_embd.weight")], "token_embd")
        self.output = self.token_embd if cfg.tied_output else upload([model.tensor("output.weight")], "output")
        self.output_norm = cp.asarray(model.dequantize("output_norm.weight"))
        self._layers = []
        for i in range(cfg.n_layers):
            self._layers.append(self._load(i))
            model.layer_loaded(i)

    def _load(self, i: int) -> types.SimpleNamespace:
        t = self.model.layer_tensors(i)
        ns = types.SimpleNamespace(attn_norm=cp.asarray(self.model.dequantize(t["attn_norm"].name)),
                                   ffn_norm=cp.asarray(self.model.dequantize(t["ffn_norm"].name)))
        for stack, names in (("qkv", ("attn_q", "attn_k", "attn_v")), ("gate_up", ("ffn_gate", "ffn_up"))):
            infos = [t[n] for n in names]
            groups = [[infos[0]]]
            for info in infos[1:]:  # consecutive tensors of one type share an upload
                if info.qtype == groups[-1][0].qtype:
                    groups[-1].append(info)
                else:
                    groups.append([info])
            tensors = [upload(g, f"blk.{i}.{stack}") for g in groups]
            views = []
            for g, ct in zip(groups, tensors):
                r = 0
                for info in g:
                    views.append(ct.rows(r, r + info.shape[0]))
                    r += info.shape[0]
            for n, v in zip(names, views):
                setattr(ns, n, v)
            setattr(ns, stack, tensors)  # the uploads: 1 (fused) to 3 tensors
        for n in ("attn_output", "ffn_down"):
            setattr(ns, n, upload([t[n]], f"blk.{i}.{n}"))
        return ns

    def embed_rows(self, tokens) -> "cp.ndarray":
        return dequantize_rows(self.token_embd, cp.asarray(tokens, dtype=cp.int32))

    def acquire(self, i: int) -> types.SimpleNamespace:
        return self._layers[i]

    def release(self, i: int) -> None:
        pass

    describe = acquire  # layer i's fields, for their shapes and types

    def decode_feed(self) -> "ResidentFeed":
        return ResidentFeed(self)

    @property
    def nbytes(self) -> int:
        n = self.token_embd.nbytes + (0 if self.output is self.token_embd else self.output.nbytes)
        for ly in self._layers:
            n += sum(t.nbytes for t in ly.qkv + ly.gate_up) + ly.attn_output.nbytes + ly.ffn_down.nbytes
        return n


class DecodeFeed:
    """How the captured decode step (cuda_decode.py) gets each layer's weights during a step.

    begin is called on the step's stream at the start of every step body (inside a capture when
    the step is captured), acquire/release around each layer's kernels; before_launch and
    after_launch run on the host around each replay (never captured). capturable: the step may
    be a CUDA graph. The defaults serve weights that stay put (ResidentFeed);
    backends/cuda_stream.py has the streamed feeds."""

    capturable = True

    def __init__(self, weights):
        self.weights = weights

    def begin(self, stream) -> None:
        pass

    def acquire(self, i: int) -> types.SimpleNamespace:
        return self.weights.acquire(i)

    def release(self, i: int) -> None:
        self.weights.release(i)

    def before_launch(self, stream) -> None:
        pass

    def after_launch(self, stream) -> None:
        pass


class ResidentFeed(DecodeFeed):
    """Every layer resident in VRAM."""


# ---- launchers ------------------------------------------------------------------------------

def dequantize_rows(w: CudaTensor, rows=None, *, half: bool = False, out=None):
    """W[rows] (or all of W) as float32, or f16 with half=True: (len(rows), K)."""
    n, k = w.shape
    if rows is not None:
        _check(rows, cp.int32, 1, "dequantize_rows rows")
    m = n if rows is None else len(rows)
    dtype = cp.float16 if half else cp.float32
    if out is None:
        out = cp.empty((m, k), dtype)
    _check(out, dtype, 2, "dequantize_rows out")
    if out.shape != (m, k):
        raise ValueError(f"dequantize_rows: out {out.shape}, expected {(m, k)}")
    fn = kernel("quant", f"dequant_rows<{int(w.qtype)},{'true' if half else 'false'}>")
    subs = m * (k // 32)
    fn((_blocks(subs, 128),), (128,), (*w.ptrs(), rows if rows is not None else out, np.int32(rows is not None),
                                       np.int32(m), np.int32(k), out))
    return out


class QAct:
    """Activation rows (rows, K) quantized for the int8 matvecs: hi, lo (rows, K) int8 and
    d, s (rows, K/32) float32 in one device buffer (layout in kernels/quant_act.cuh)."""

    def __init__(self, rows: int, k: int):
        if k % 32:
            raise ValueError(f"QAct: K {k} is not a multiple of 32")
        self.rows, self.k = rows, k
        n, g = rows * k, rows * k // 32
        self.buf = cp.empty(2 * n + 8 * g, cp.uint8)
        self.hi, self.lo = self.buf[:n].view(cp.int8), self.buf[n:2 * n].view(cp.int8)
        self.d, self.s = self.buf[2 * n:2 * n + 4 * g].view(cp.float32), self.buf[2 * n + 4 * g:].view(cp.float32)

    def args(self) -> tuple:
        return (self.hi, self.lo, self.d, self.s)


_qscratch: dict[tuple, QAct] = {}


def _scratch_qact(rows: int, k: int) -> QAct:
    key = (cp.cuda.Device().id, rows, k)
    if key not in _qscratch:
        _qscratch[key] = QAct(rows, k)
    return _qscratch[key]


def quantize(x, q: QAct, *, n: int | None = None, ld: int | None = None) -> QAct:
    """q = the first n rows of x (row stride ld, q.k columns) quantized."""
    n = x.shape[0] if n is None else n
    ld = x.shape[1] if ld is None else ld
    if n > q.rows:
        raise ValueError(f"quantize: {n} rows into a QAct of {q.rows}")
    groups = n * (q.k // 32)
    kernel("quant", "quantize_rows")((_blocks(groups, 8),), (256,), (x, np.int32(ld), np.int32(n), np.int32(q.k),
                                                                    *q.args()))
    return q


def matvec(x, w: CudaTensor, *, out=None, res=None, nb: int | None = None, xq: QAct | None = None):
    """out = x @ W.T (+ res) for x (B ≤ 32, K) float32: the fused dequantize-multiply. For the
    int8 kernels x is quantized first, unless xq already holds x quantized; the f16 ones
    (F16_MATVEC, from bucket 4) read x itself and ignore xq."""
    n, k = w.shape
    _check(x, cp.float32, 2, "matvec x")
    b = x.shape[0] if nb is None else nb
    if x.shape[1] != k or not 1 <= b <= MATVEC_MAX_ROWS or b > x.shape[0]:
        raise ValueError(f"matvec: x {x.shape} (rows {b}) against W {w.shape}")
    if out is None:
        out = cp.empty((b, n), cp.float32)
    _check(out, cp.float32, 2, "matvec out")
    if out.shape[1] != n or out.shape[0] < b:
        raise ValueError(f"matvec: out {out.shape}, expected ({b}, {n})")
    if res is not None:
        _check(res, cp.float32, 2, "matvec res")
        if res.shape[1] != n or res.shape[0] < b:
            raise ValueError(f"matvec: res {res.shape}, expected ({b}, {n})")
    bucket = next(m for m in MATVEC_BUCKETS if m >= b)
    res_args = (res if res is not None else out, np.int32(res is not None), out, np.int32(n), np.int32(k), np.int32(b))
    name = FAST_MATVEC.get(w.qtype)
    if name is None:
        fn = kernel("quant", f"matvec_generic<{int(w.qtype)},{bucket}>")
        fn((_blocks(n, 4),), (128,), (*w.ptrs(), x, *res_args))
        return out
    if bucket >= MMA_MIN_BUCKET and w.qtype in F16_MATVEC and k % 256 == 0:  # reads x itself, not xq
        tiles, ks = mmh_grid(n, k, _sm_count())
        part, cnt = _mmh_scratch()
        kernel("quant", f"{F16_MATVEC[w.qtype]}<{bucket // 8 or 1}>")((tiles, ks), (256,), (
            *w.ptrs(), x, *res_args, part, cnt))
        return out
    if xq is None:
        xq = quantize(x, _scratch_qact(bucket, k), n=b)
    elif xq.k != k or xq.rows < b:
        raise ValueError(f"matvec: xq ({xq.rows}, {xq.k}) for {b} rows of K {k}")
    if bucket >= MMA_MIN_BUCKET:  # 16 or 32 rows per 256-thread block, ceil(bucket / 8) tiles of 8 batch rows
        mt = 1 if n <= MMA_ONE_TILE_ROWS else 2
        nt = bucket // 8 or 1
        kernel("quant", f"{MMA_MATVEC[w.qtype]}<{nt},{mt}>")((_blocks(n, 16 * mt),), (256,), (
            *w.ptrs(), *xq.args(), *res_args))
        return out
    r = WIDE_ROWS_PER_WARP if bucket == 1 and n <= MVQ_WIDE_MAX_N[w.qtype] else ROWS_PER_WARP[bucket]
    ks = 4 if _blocks(n, r) < SPLIT_K_WARPS else 1
    mb = MVQ_MIN_BLOCKS[w.qtype] if bucket == 1 else 1
    fn = kernel("quant", f"{name}<{r},{bucket},{ks},{mb}>")
    grid = _blocks(n, r * 4 // ks)
    if MVQ_PERSISTENT and w.qtype == Q.Q8_0:  # mvq_q8_0 takes row groups grid-stride
        grid = min(grid, fn.blocks_per_sm(128) * _sm_count())
    fn((grid,), (128,), (*w.ptrs(), *xq.args(), *res_args))
    return out


def reads_qact(weights, bucket: int) -> bool:
    """Whether a matvec of any of these weights at this batch bucket reads quantized (QAct)
    activations: the int8 kernels do, the f16 ones (F16_MATVEC) and the generic ones do not."""
    return any(t.qtype in FAST_MATVEC and not (bucket >= MMA_MIN_BUCKET and t.qtype in F16_MATVEC and t.shape[1] % 256 == 0)
               for t in weights)


def mmh_grid(n: int, k: int, sm_count: int) -> tuple[int, int]:
    """(row tiles, K splits) of an mmh launch for an (n, k) weight: about two blocks per SM where
    K allows, at most 8 splits, and never more partial sums (32 batch rows) than the scratch holds."""
    tiles = -(-n // MMH_ROWS)
    ks = max(1, min(8, k // 256, -(-2 * sm_count // tiles), MMH_PART_FLOATS // (32 * n)))
    return tiles, ks


_sm_counts: dict[int, int] = {}
_mmh: dict[tuple[int, int], tuple] = {}


def _sm_count() -> int:
    dev = cp.cuda.Device()
    if dev.id not in _sm_counts:
        _sm_counts[dev.id] = dev.attributes["MultiProcessorCount"]
    return _sm_counts[dev.id]


def _mmh_scratch() -> tuple:
    """Split-K partial sums and per-tile counters (zeroed; each launch leaves them zero) of the
    mmh kernels, one set per stream, so that launches on different streams never share them.
    Fixed once made: captured graphs hold their addresses."""
    key = (cp.cuda.Device().id, cp.cuda.get_current_stream().ptr)
    if key not in _mmh:
        _mmh[key] = (_device_alloc((MMH_PART_FLOATS,), cp.float32, "matvec split-K scratch"),
                     cp.zeros((MMH_PART_FLOATS // MMH_ROWS,), cp.int32))
    return _mmh[key]


def matmul(x, w: CudaTensor):
    """x @ W.T: fused for ≤ 32 rows, else f16 dequantization and cuBLAS (f32 accumulation)."""
    _check(x, cp.float32, 2, "matmul x")
    if x.shape[0] <= MATVEC_MAX_ROWS:
        return matvec(x, w)
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"matmul: x {x.shape} against W {w.shape}")
    w16 = dequantize_rows(w, half=True)  # (N, K) f16 scratch from the pool
    return cp.matmul(x.astype(cp.float16), w16.T).astype(cp.float32)


def _q_args(q: QAct | None, n: int, k: int, what: str) -> tuple:
    if q is None:
        return (np.intp(0),) * 4 + (np.int32(0),)
    if q.k != k or q.rows < n:
        raise ValueError(f"{what}: QAct ({q.rows}, {q.k}) for ({n}, {k})")
    return (*q.args(), np.int32(1))


def rms_norm(x, w, eps: float, *, out=None, q: QAct | None = None):
    """RMSNorm of x's rows; with q, the result is also quantized into q (for the int8 matvecs)."""
    _check(x, cp.float32, 2, "rms_norm x")
    _check(w, cp.float32, 1, "rms_norm w")
    if w.shape[0] != x.shape[1]:
        raise ValueError(f"rms_norm: x {x.shape}, w {w.shape}")
    out = cp.empty_like(x) if out is None else out
    kernel("norm", "rms_norm")((_blocks(x.shape[1], 1024), x.shape[0]), (1024,), (
        x, w, out, np.int32(x.shape[1]), np.float32(eps), *_q_args(q, x.shape[0], x.shape[1], "rms_norm")))
    return out


def swiglu(g, u, *, out=None, n: int | None = None, ld: int | None = None, f: int | None = None,
           q: QAct | None = None):
    """silu(g) * u. g, u are (N, F) arrays, or pointers into buffers with row stride ld (then
    n and f say the shape). With q, the result is also quantized into q."""
    if ld is None:
        _check(g, cp.float32, 2, "swiglu g")
        _check(u, cp.float32, 2, "swiglu u")
        if g.shape != u.shape:
            raise ValueError(f"swiglu: g {g.shape}, u {u.shape}")
        n, f, ld = g.shape[0], g.shape[1], g.shape[1]
    elif n is None or f is None:
        raise ValueError("swiglu: with ld, give n and f")
    out = cp.empty((n, f), cp.float32) if out is None else out
    _check(out, cp.float32, 2, "swiglu out")
    if out.shape != (n, f):
        raise ValueError(f"swiglu: out {out.shape}, expected {(n, f)}")
    kernel("activation", "swiglu")((_blocks(n * f, 256),), (256,), (g, u, out, np.int32(n), np.int32(f), np.int32(ld),
                                                                   *_q_args(q, n, f, "swiglu")))
    return out


def rope_(x, pos, freqs, cfg: LlamaConfig, n_heads: int, *, n: int | None = None, ld: int | None = None):
    """RoPE in place on rows of x (row stride ld) at positions pos (int32)."""
    _check(pos, cp.int32, 1, "rope positions")
    n = x.shape[0] if n is None else n
    ld = x.shape[1] if ld is None else ld
    pairs = n * n_heads * (cfg.rope_dim // 2)
    kernel("rope", "rope")((_blocks(pairs, 256),), (256,), (
        x, pos, freqs, np.int32(n), np.int32(n_heads), np.int32(cfg.head_dim), np.int32(cfg.rope_dim),
        np.int32(ld), np.int32(cfg.rope_neox)))
    return x


def argmax(logits, *, out=None):
    _check(logits, cp.float32, 2, "argmax logits")
    out = cp.empty((logits.shape[0],), cp.int32) if out is None else out
    kernel("sample", "argmax_rows")((logits.shape[0],), (1024,), (logits, out, np.int32(logits.shape[1])))
    return out


def top_rows(logits, n: int, *, stream=None, out=None):
    """The n largest logits of each row (B, V) and their ids, ties at the n-th resolved to the
    lowest ids, and each row's NaN count (kernels/sample.cu): host arrays (ids, vals, nan), the
    ids of a row in no particular order (sampler.TopLogits sorts them). One copy to the host;
    out: the device buffer for it, int32 (B, 2n + 1)."""
    _check(logits, cp.float32, 2, "top_rows logits")
    b, v = logits.shape
    if not 1 <= n <= v:
        raise ValueError(f"top_rows: n {n} for rows of {v}")
    res = cp.empty((b, 2 * n + 1), cp.int32) if out is None else out
    _check(res, cp.int32, 2, "top_rows out")
    if res.shape != (b, 2 * n + 1):
        raise ValueError(f"top_rows: out {res.shape}, expected {(b, 2 * n + 1)}")
    kernel("sample", "top_rows")((b,), (1024,), (logits, np.int32(v), np.int32(n), res))
    h = res.get(stream=stream)
    return h[:, :n], h[:, n:2 * n].view(np.float32), h[:, 2 * n]


ATTN_ND = (1, 2, 4, 8)  # head_dim / 32: the attn_partial instances


def attention_splits(n_rows: int, n_heads: int, max_pos: int, head_dim: int = 128) -> int:
    """How many splits a row's positions are cut into (at most 64, see attn_partial): for a few
    rows, enough that each split holds ~16 positions of the longest row; for a prefill chunk
    (rows × heads fill the GPU already) ~64 positions each, so that no warp walks a long
    history alone, within 256 MB of partial results."""
    per = 16 if n_rows * n_heads < 4096 else 64
    room = max(1, (256 << 20) // (n_rows * n_heads * (head_dim + 2) * 4))
    return max(1, min(64, -(-(max_pos + 1) // per), room))


def kv_append_(k, v, kv_layer, slots, pos, cfg: LlamaConfig, *, n: int, ldk: int, ldv: int):
    """Rows of k and v (row strides ldk, ldv) to the cache at (slot, pos)."""
    kc = kv_layer.k
    kernel("attention", "kv_append")((_blocks(n * cfg.kv_dim, 256),), (256,), (
        k, np.int32(ldk), v, np.int32(ldv), kc, kv_layer.v, slots, pos, np.int32(n), np.int32(cfg.kv_dim),
        np.int32(kc.shape[1])))


def attention_(q, k, v, kv_layer, slots, pos, cfg: LlamaConfig, *, n: int, n_splits: int,
               ldq: int, ldk: int, ldv: int, out, scratch: tuple, append: bool = True, q_out: QAct | None = None):
    """Append k, v at (slot, pos) (unless already there: append=False) then causal GQA attention
    of q's rows; writes out (n, H*hd), and with q_out that output quantized too."""
    if cfg.head_dim % 32 or cfg.head_dim > 256:
        raise ValueError(f"attention: head_dim {cfg.head_dim} must be a multiple of 32, at most 256")
    if not 1 <= n_splits <= 64:
        raise ValueError(f"attention: {n_splits} splits, expected 1 to 64")
    kc, vc = kv_layer.k, kv_layer.v
    max_ctx = kc.shape[1]
    if append:
        kv_append_(k, v, kv_layer, slots, pos, cfg, n=n, ldk=ldk, ldv=ldv)
    pm, pl, po = scratch[:3]
    warps = n * cfg.n_heads
    kernel("attention", f"attn_partial<{cfg.head_dim // 32}>")((_blocks(warps, 4), n_splits), (128,), (
        q, np.int32(ldq), kc, vc, slots, pos, pm, pl, po, np.int32(n), np.int32(cfg.n_heads),
        np.int32(cfg.n_kv_heads), np.int32(max_ctx), np.int32(n_splits), np.float32(1.0 / math.sqrt(cfg.head_dim))))
    kernel("attention", "attn_combine")((warps,), (128,), (  # a block per (row, head)
        pm, pl, po, out, pos, np.int32(n), np.int32(cfg.n_heads), np.int32(cfg.head_dim), np.int32(n_splits),
        *_q_args(q_out, n, cfg.q_dim, "attention")))
    return out


def rope_kv_(qkv, v, pos, slots, freqs, kv_layer, cfg: LlamaConfig, *, n: int, ld: int, ldv: int):
    """The decode step's RoPE + cache append in one launch: rows of qkv (row stride ld) hold q
    then k; both are rotated in place, and k and v (rows of v, stride ldv) go to the cache."""
    kc, vc = kv_layer.k, kv_layer.v
    _check(pos, cp.int32, 1, "rope_kv positions")
    per_row = (cfg.n_heads + 2 * cfg.n_kv_heads) * (cfg.head_dim // 2)
    kernel("attention", "rope_kv")((_blocks(n * per_row, 256),), (256,), (
        qkv, np.int32(ld), v, np.int32(ldv), kc, vc, slots, pos, freqs, np.int32(n), np.int32(cfg.n_heads),
        np.int32(cfg.n_kv_heads), np.int32(cfg.head_dim), np.int32(cfg.rope_dim), np.int32(cfg.rope_neox),
        np.int32(kc.shape[1])))


def attention_decode_(qkv, v, kv_layer, slots, pos, freqs, cfg: LlamaConfig, *, n: int, n_splits: int, ld: int,
                      ldv: int, out, scratch: tuple, q_out: QAct | None = None):
    """The decode step's attention in one launch (attn_decode: rope_kv_ + attention_): rows of
    qkv (row stride ld) hold q then k, rows of v stride ldv; q and k are rotated in registers
    (qkv is not written), k and v go to the cache at (slot, pos), and out (n, H*hd) gets the
    attention output, with q_out quantized too. scratch: attention_scratch(n, cfg, n_splits, counters=True)."""
    if cfg.head_dim % 32 or cfg.head_dim > 256:
        raise ValueError(f"attention_decode: head_dim {cfg.head_dim} must be a multiple of 32, at most 256")
    if not 1 <= n_splits <= 64:
        raise ValueError(f"attention_decode: {n_splits} splits, expected 1 to 64")
    _check(pos, cp.int32, 1, "attention_decode positions")
    if len(scratch) != 4:
        raise ValueError("attention_decode: the scratch needs its counters (attention_scratch(..., counters=True))")
    pm, pl, po, cnt = scratch
    warps = n * cfg.n_heads
    if cnt.size < _blocks(warps, 4) or pm.size < warps * n_splits:
        raise ValueError(f"attention_decode: scratch too small for {n} rows, {n_splits} splits")
    kc, vc = kv_layer.k, kv_layer.v
    kernel("attention", f"attn_decode<{cfg.head_dim // 32}>")((_blocks(warps, 4), n_splits), (128,), (
        qkv, np.int32(ld), v, np.int32(ldv), kc, vc, slots, pos, freqs, pm, pl, po, cnt, out, np.int32(n),
        np.int32(cfg.n_heads), np.int32(cfg.n_kv_heads), np.int32(kc.shape[1]), np.int32(n_splits),
        np.float32(1.0 / math.sqrt(cfg.head_dim)), np.int32(cfg.rope_dim), np.int32(cfg.rope_neox),
        *_q_args(q_out, n, cfg.q_dim, "attention")))
    return out


CHUNK_ROWS = 16  # rows per attn_chunk tile; a segment this long makes attention a prefill chunk's
CHUNK_HEAD_DIMS = (64, 128)  # the attn_chunk instances


def chunk_heads(cfg: LlamaConfig) -> int:
    """q heads per attn_chunk block: the most (≤ 8) that share one kv head and divide its group."""
    group = cfg.n_heads // cfg.n_kv_heads
    return max(d for d in range(1, 9) if group % d == 0)


def chunk_tiles(offsets: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """(2, T) int32: first row and row count of each ≤ CHUNK_ROWS-row tile of each segment, the
    tiles with the longest histories first (they take the longest; the GPU starts them first)."""
    starts, counts, last = [], [], []
    for a, b in zip(offsets[:-1], offsets[1:]):
        for r in range(int(a), int(b), CHUNK_ROWS):
            m = min(CHUNK_ROWS, int(b) - r)
            starts.append(r)
            counts.append(m)
            last.append(int(positions[r:r + m].max()))
    order = np.argsort(-np.asarray(last), kind="stable")
    return np.stack([np.asarray(starts)[order], np.asarray(counts)[order]]).astype(np.int32)


def attention_chunk_(q, kv_layer, slots, pos, tiles, cfg: LlamaConfig, *, ldq: int, out):
    """Causal GQA attention of q's rows (their k, v already in the cache) on tensor cores, tile by
    tile (chunk_tiles); f16 q and P, f32 accumulation. Writes out (n, H*hd)."""
    if cfg.head_dim not in CHUNK_HEAD_DIMS:
        raise ValueError(f"attention_chunk: head_dim {cfg.head_dim} not in {CHUNK_HEAD_DIMS}")
    hb = chunk_heads(cfg)
    t = cp.asarray(tiles)  # (2, T) int32 (already on the device from CudaOps)
    kc, vc = kv_layer.k, kv_layer.v
    kernel("attention", f"attn_chunk<{cfg.head_dim}>")((tiles.shape[1], cfg.n_heads // hb), (32 * hb,), (
        q, np.int32(ldq), kc, vc, slots, pos, t[0], t[1], out, np.int32(out.shape[1]), np.int32(cfg.n_heads),
        np.int32(cfg.n_kv_heads), np.int32(kc.shape[1]), np.float32(math.log2(math.e) / math.sqrt(cfg.head_dim))))
    return out


def attention_scratch(n: int, cfg: LlamaConfig, n_splits: int, *, counters: bool = False) -> tuple:
    """Split partials (max, sum, output) for n rows; with counters, also attn_decode's per-column
    counters (zero; each launch leaves them zero)."""
    s = n * cfg.n_heads * n_splits
    parts = (cp.empty((s,), cp.float32), cp.empty((s,), cp.float32), cp.empty((s, cfg.head_dim), cp.float32))
    return parts + (cp.zeros((_blocks(n * cfg.n_heads, 4),), cp.int32),) if counters else parts


# ---- the op set model.forward calls ---------------------------------------------------------

class CudaOps:
    name = "cuda"

    def __init__(self, cfg: LlamaConfig, freq_factors: np.ndarray | None = None):
        self.cfg = cfg
        self.freqs = cp.asarray(rope_frequencies(cfg, freq_factors))  # (rope_dim/2,) float64
        self._batch = None  # (batch, slots, positions) of the step in flight

    @staticmethod
    def to_host(x) -> np.ndarray:
        return cp.asnumpy(x)

    @staticmethod
    def step_context(batch: Batch):
        return contextlib.nullcontext()

    def embed(self, weights, tokens):
        return weights.embed_rows(tokens)  # (N, D)

    matmul = staticmethod(matmul)

    def rms_norm(self, x, w, eps: float):
        return rms_norm(cp.ascontiguousarray(x), w, eps)

    @staticmethod
    def swiglu(g, u):
        return swiglu(g, u)

    def rope_table(self, positions: np.ndarray):
        return cp.asarray(np.asarray(positions, np.int32))  # angles are made inside the rope kernel

    def rope(self, x, table, n_heads: int):
        return rope_(x.copy(), table, self.freqs, self.cfg, n_heads)

    def _rows(self, batch: Batch):
        """Slots, positions and (for a prefill chunk, else None) attention tiles of the batch's
        rows, on the device: made once per step, used by every layer."""
        if self._batch is None or self._batch[0] is not batch:
            slots = np.repeat([s.slot for s in batch.segments], np.diff(batch.offsets)).astype(np.int32)
            chunk = self.cfg.head_dim in CHUNK_HEAD_DIMS and int(np.diff(batch.offsets).max()) >= CHUNK_ROWS
            tiles = cp.asarray(chunk_tiles(batch.offsets, batch.positions)) if chunk else None
            self._batch = (batch, cp.asarray(slots), cp.asarray(batch.positions.astype(np.int32)), tiles)
        return self._batch[1:]

    def attention(self, q, k, v, kv_layer, batch: Batch):
        c = self.cfg
        slots, pos, tiles = self._rows(batch)
        n = q.shape[0]
        if tiles is not None:  # a prefill chunk: tensor cores
            kv_append_(cp.ascontiguousarray(k), cp.ascontiguousarray(v), kv_layer, slots, pos, c, n=n,
                       ldk=c.kv_dim, ldv=c.kv_dim)
            return attention_chunk_(cp.ascontiguousarray(q), kv_layer, slots, pos, tiles, c, ldq=c.q_dim,
                                    out=cp.empty((n, c.q_dim), cp.float32))
        n_splits = attention_splits(n, c.n_heads, int(batch.positions.max()), c.head_dim)
        out = cp.empty((n, c.q_dim), cp.float32)
        return attention_(cp.ascontiguousarray(q), cp.ascontiguousarray(k), cp.ascontiguousarray(v), kv_layer,
                          slots, pos, c, n=n, n_splits=n_splits, ldq=c.q_dim,
                          ldk=c.kv_dim, ldv=c.kv_dim, out=out, scratch=attention_scratch(n, c, n_splits))


# ---- KV cache ---------------------------------------------------------------------------------

class CudaKVLayer:
    """One layer's F16 cache, k and v of shape (slots, max_ctx, Hkv, hd)."""

    def __init__(self, shape):
        self.k = _device_alloc(shape, cp.float16, "KV cache")
        self.v = _device_alloc(shape, cp.float16, "KV cache")
        self.k.fill(0)
        self.v.fill(0)

    def read(self, slot: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        return (cp.asnumpy(self.k[slot, :end]).astype(np.float32), cp.asnumpy(self.v[slot, :end]).astype(np.float32))


class CudaKVCache(SlotTable):
    """Slot bookkeeping on the host (as the CPU cache), keys and values on the device. One more
    slot than asked for is kept as scratch: padded rows of a captured decode step write there."""

    def __init__(self, cfg: LlamaConfig, *, n_slots: int, max_ctx: int, dtype: str = "f16"):
        if dtype not in ("f16", "f32"):
            raise ValueError(f"KV cache dtype {dtype!r} is not one of f32, f16")
        if n_slots < 1 or max_ctx < 1:
            raise ValueError("the KV cache needs at least one slot and one position")
        super().__init__(n_slots)
        self.max_ctx, self.dtype = max_ctx, "f16"  # always F16 on the GPU
        self.scratch_slot = n_slots
        shape = (n_slots + 1, max_ctx, cfg.n_kv_heads, cfg.head_dim)
        need = 2 * cfg.n_layers * math.prod(shape) * 2
        free = cp.cuda.runtime.memGetInfo()[0]
        if need > free:
            raise MemoryError(f"KV cache of {n_slots} slots × {max_ctx} positions needs {need / 2**30:.2f} GiB, "
                              f"{free / 2**30:.2f} GiB free on the GPU; lower max_seqs or max_ctx")
        self.layers = [CudaKVLayer(shape) for _ in range(cfg.n_layers)]

    def layer(self, i: int) -> CudaKVLayer:
        return self.layers[i]


def load(model: GGUFModel) -> tuple[CudaOps, CudaWeights]:
    if not available():
        raise RuntimeError("the cuda backend needs CuPy and a visible NVIDIA GPU")
    freq = model.dequantize("rope_freqs.weight") if "rope_freqs.weight" in model.tensors else None
    return CudaOps(model.config, freq), CudaWeights(model)


def kv_cache(cfg: LlamaConfig, *, n_slots: int, max_ctx: int, dtype: str = "f16") -> CudaKVCache:
    return CudaKVCache(cfg, n_slots=n_slots, max_ctx=max_ctx, dtype=dtype)


def kernel_names() -> list[tuple[str, str]]:
    """Every kernel instance the backend can launch (for precompile)."""
    types = (0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 30)
    names = [("quant", f"dequant_rows<{t},{h}>") for t in types for h in ("true", "false")]
    for b in MATVEC_BUCKETS:
        if b >= MMA_MIN_BUCKET:
            names += [("quant", f"{n}<{b // 8 or 1},{mt}>") for n in MMA_MATVEC.values() for mt in (1, 2)]
            names += [("quant", f"{n}<{b // 8 or 1}>") for n in F16_MATVEC.values()]
        else:
            rows = (ROWS_PER_WARP[b], WIDE_ROWS_PER_WARP) if b == 1 else (ROWS_PER_WARP[b],)
            names += [("quant", f"{n}<{r},{b},{ks},{MVQ_MIN_BLOCKS[t] if b == 1 else 1}>")
                      for t, n in FAST_MATVEC.items() for ks in (1, 4) for r in rows]
        names += [("quant", f"matvec_generic<{t},{b}>") for t in types if t not in (8, 12, 14)]
    names += [("quant", "quantize_rows"), ("norm", "rms_norm"), ("rope", "rope"), ("activation", "swiglu"),
              ("sample", "argmax_rows"), ("sample", "top_rows"), ("attention", "kv_append"),
              ("attention", "rope_kv"), ("attention", "attn_combine")]
    names += [("attention", f"{k}<{nd}>") for nd in ATTN_ND for k in ("attn_partial", "attn_decode")]
    names += [("attention", f"attn_chunk<{hd}>") for hd in CHUNK_HEAD_DIMS]
    return names


def _compile_one(key: tuple[str, str]) -> str:
    kernel(*key)
    return key[1]


def precompile(jobs: int = 16) -> int:
    """Compile every kernel in parallel processes; CuPy's disk cache then serves later loads."""
    import concurrent.futures
    import multiprocessing
    names = kernel_names()
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as ex:
        for _ in ex.map(_compile_one, names):
            pass
    return len(names)


def decoder(ops: CudaOps, weights: CudaWeights, kv: CudaKVCache):
    """The graph-replayed decode step the engine uses when every sequence adds one token."""
    from ntransformerd.engine.backends.cuda_decode import DecodeGraphs
    return DecodeGraphs(ops, weights, kv)
