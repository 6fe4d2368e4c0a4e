"""Compiling and launching our kernels: NVRTC through CuPy, and programmatic dependent launch.

Kernels are compiled on first use (kernels/<family>.cu with kernels/common.cuh and the family's
headers prepended; CuPy caches the binaries on disk; warm.precompile builds them all in
parallel). Inside a captured step they may be launched with programmatic dependent launch
(`pdl()`, through cuLaunchKernelEx), which every kernel of kernels/ is written to allow.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import os

import numpy as np

try:
    import cupy as cp
except ImportError:  # CI and CPU-only hosts
    cp = None

KERNEL_DIR = os.environ.get("NTX_KERNEL_DIR") or os.path.join(
    os.path.dirname(__file__), *([os.pardir] * 5), "kernels")
PRELUDE = {"quant": ("quant_act.cuh",), "norm": ("quant_act.cuh",), "activation": ("quant_act.cuh",),
           "attention": ("quant_act.cuh",)}  # headers prepended to a family's .cu, after common.cuh


def available() -> bool:
    if cp is None:
        return False
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver, no device
        return False


_modules: dict[tuple[str, str], "Kernel"] = {}


@functools.cache
def _libcuda():
    """The CUDA driver library, for what CuPy does not wrap (launch attributes, occupancy)."""
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


def n_blocks(n: int, per: int) -> int:
    return (n + per - 1) // per


def check_array(x, dtype, ndim: int, what: str):
    if not isinstance(x, cp.ndarray) or x.dtype != dtype or x.ndim != ndim:
        raise TypeError(f"{what}: expected a {ndim}-D cupy {np.dtype(dtype).name} array, got "
                        f"{type(x).__name__} {getattr(x, 'dtype', '')} {getattr(x, 'shape', '')}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{what}: must be C-contiguous")


def device_alloc(shape, dtype, what: str):
    try:
        return cp.empty(shape, dtype)
    except cp.cuda.memory.OutOfMemoryError:
        free, total = cp.cuda.runtime.memGetInfo()
        need = math.prod(shape) * np.dtype(dtype).itemsize
        raise MemoryError(f"{what}: {need / 2**30:.2f} GiB does not fit on the GPU "
                          f"({free / 2**30:.2f} of {total / 2**30:.2f} GiB free); use a smaller "
                          "model, fewer KV slots or a shorter context") from None


