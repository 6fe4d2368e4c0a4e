"""The CPU backend's compiled kernels: built from kernels/cpu/*.c on first use, loaded with ctypes.

One source tree is compiled per instruction set (`VARIANTS`); `load()` picks the best one this
CPU runs (AVX-512 with VNNI, AVX2/FMA/F16C, or portable C) unless told which (the cpu_kernels
setting: each variant sums in its own order, so hosts that must agree pin one). A variant the
CPU cannot run is refused by name with the flags it lacks, never loaded. The shared object
is cached under the cache directory keyed by the sources, the flags and the compiler, so a
build (a few seconds with gcc -O3) happens once per machine and source change. The structures
below mirror kernels/cpu/ntx_step.h field by field.

Thread rule: the loaded library is shared by every engine of the process; `ntx_step` runs one
step on a team of threads and returns when it is done, so callers serialize steps per engine.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile

from ntransformerd import dirs

KERNEL_DIR = os.path.normpath(os.path.join(os.path.dirname(__file__), *([os.pardir] * 5), "kernels", "cpu"))

COMMON_FLAGS = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno", "-Wall", "-Wno-unused-function")


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    flags: tuple[str, ...]
    needs: tuple[str, ...]  # /proc/cpuinfo flags the CPU must have


VARIANTS = (
    Variant("avx512", ("-march=x86-64-v4", "-mavx512vnni", "-mtune=generic"),
            ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c")),
    Variant("avx2", ("-march=x86-64-v3", "-mtune=generic"), ("avx2", "fma", "f16c", "bmi2")),
    Variant("generic", ("-mtune=generic",), ()),
)


class BuildError(RuntimeError):
    """The CPU kernels could not be built (no C compiler, or a compile error)."""


class UnsupportedVariant(ValueError):
    """A variant named that this CPU cannot run (its instructions would kill the process)."""


def cache_dir() -> str:
    """Where built kernels are kept: cpu-kernels/ of the cache directory (dirs.cache_dir)."""
    return os.path.join(dirs.cache_dir(), "cpu-kernels")


def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def best_variant(flags: frozenset[str] | None = None) -> Variant:
    """The fastest variant this CPU can run (x86-64 flags; anything else gets the portable one)."""
    flags = cpu_flags() if flags is None else flags
    for v in VARIANTS:
        if all(f in flags for f in v.needs):
            return v
    return VARIANTS[-1]


def choose(name: str | None = None, flags: frozenset[str] | None = None) -> Variant:
    """The variant called `name` (a VARIANTS name; None or "auto": best_variant()), if this CPU
    (`flags`, default /proc/cpuinfo's) runs it; an UnsupportedVariant naming the flags it lacks."""
    flags = cpu_flags() if flags is None else flags
    if name is None or name == "auto":
        return best_variant(flags)
    v = next((x for x in VARIANTS if x.name == name), None)
    if v is None:
        raise ValueError(f"CPU kernel variant {name!r} is not one of {', '.join(x.name for x in VARIANTS)}")
    missing = [f for f in v.needs if f not in flags]
    if missing:
        raise UnsupportedVariant(f"this CPU lacks {' '.join(missing)}, which the {name} kernels need: use auto "
                                 f"({best_variant(flags).name} here) or a variant this CPU runs")
    return v


def sources() -> list[str]:
    return sorted(os.path.join(KERNEL_DIR, f) for f in os.listdir(KERNEL_DIR) if f.endswith(".c"))


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _key(cc: str, variant: Variant) -> str:
    h = hashlib.sha256()
    for path in sorted(os.path.join(KERNEL_DIR, f) for f in os.listdir(KERNEL_DIR)):
        with open(path, "rb") as f:
            h.update(os.path.basename(path).encode() + b"\0" + f.read())
    h.update(" ".join(COMMON_FLAGS + variant.flags).encode())
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BuildError(f"cannot run the C compiler {cc}: {e}") from e
    h.update(version.encode())
    return h.hexdigest()[:16]


def build(variant: Variant, *, out_dir: str | None = None, quiet: bool = False) -> str:
    """Path of the shared object for `variant`, compiling it if this cache has none."""
    cc = compiler()
    if cc is None:
        raise BuildError("the CPU backend compiles its kernels with a C compiler and none was found: "
                         "install gcc (apt install gcc), or use --backend cpu-ref")
    out_dir = out_dir or cache_dir()
    path = os.path.join(out_dir, f"ntx_cpu_{variant.name}_{_key(cc, variant)}.so")
    if os.path.exists(path):
        return path
    os.makedirs(out_dir, mode=0o755, exist_ok=True)
    if not quiet and sys.stderr.isatty():
        print(f"ntransformer: compiling the CPU kernels ({variant.name}), once for this machine", file=sys.stderr)
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
    os.close(fd)
    cmd = [cc, *COMMON_FLAGS, *variant.flags, "-I", KERNEL_DIR, *sources(), "-o", tmp, "-lm"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise BuildError(f"compiling the CPU kernels failed ({' '.join(cmd)}):\n{r.stderr[-4000:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)  # another process building the same key writes the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


class Instr(ctypes.Structure):
    _fields_ = [("op", ctypes.c_int32), ("flags", ctypes.c_int32), ("rows", ctypes.c_int32),
                ("wtype", ctypes.c_int32), ("n", ctypes.c_int32), ("m", ctypes.c_int32),
                ("x", ctypes.c_int64), ("y", ctypes.c_int64), ("res", ctypes.c_int64), ("out", ctypes.c_int64),
                ("w", ctypes.c_void_p), ("w_row_bytes", ctypes.c_int64),
                ("kv_k", ctypes.c_void_p), ("kv_v", ctypes.c_void_p),
                ("eps", ctypes.c_float), ("pad", ctypes.c_int32)]


class Header(ctypes.Structure):
    _fields_ = [("n_rows", ctypes.c_int64), ("n_out", ctypes.c_int64),
                ("tokens", ctypes.c_void_p), ("positions", ctypes.c_void_p),
                ("slots", ctypes.c_void_p), ("out_rows", ctypes.c_void_p)]


class ModelConsts(ctypes.Structure):
    _fields_ = [("n_heads", ctypes.c_int32), ("n_kv_heads", ctypes.c_int32), ("head_dim", ctypes.c_int32),
                ("rope_dim", ctypes.c_int32), ("rope_neox", ctypes.c_int32), ("kv_type", ctypes.c_int32),
                ("max_ctx", ctypes.c_int64), ("attn_scale", ctypes.c_float), ("kv_block", ctypes.c_int32),
                ("rope_cos", ctypes.c_void_p), ("rope_sin", ctypes.c_void_p),
                ("kv_tables", ctypes.c_void_p), ("kv_max_blocks", ctypes.c_int64), ("kv_row_bytes", ctypes.c_int64)]


_p, _i32, _i64, _sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_size_t


class Library:
    """The loaded kernels of one variant, with typed entry points."""

    def __init__(self, path: str, variant: Variant):
        self.path, self.variant = path, variant
        # The team's threads sleep between steps instead of spinning (OpenMP reads this when
        # its runtime loads): on a host whose cores are shared, a spinning idle thread takes
        # the core the step's other threads need; waking them costs microseconds per step.
        # An explicit OMP_WAIT_POLICY in the environment wins.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        lib = ctypes.CDLL(path)  # CDLL releases the GIL for each call
        self._lib = lib
        sig = {
            "ntx_act_row_bytes": (_sz, [_i32, _i32]),
            "ntx_quantize_act": (None, [_i32, _p, _i32, _i32, _i32, _p]),
            "ntx_gemm": (None, [_i32, _p, _sz, _i32, _i32, _i32, _p, _i32, _p, _i32, _p]),
            "ntx_dequantize_rows": (None, [_i32, _p, _sz, _i32, _p, _i32, _p]),
            "ntx_isa": (ctypes.c_char_p, []),
            "ntx_step": (_i32, [_p, _i32, _p, _p, _p, _p, _i64, _i32, _p, _i64]),
            "ntx_topk": (None, [_p, _i64, _i64, _i32, _p, _p, _p, _i32]),
            "ntx_struct_sizes": (None, [_p]),
            "ntx_read_probe": (ctypes.c_double, [_p, _i64, _i32, _i32]),
            "ntx_attn_scratch": (_i64, [_p]),
            "ntx_attn_parts": (_i64, [_p]),
            "ntx_attention": (_i32, [_p, _p, _p, _p, _p, _p, _i32, _i32]),
            "ntx_kv_store_rows": (None, [_i32, _p, _i64, _i32, _p]),
            "ntx_kv_load_rows": (None, [_i32, _p, _i64, _i32, _p]),
        }
        for name, (res, args) in sig.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
            setattr(self, name.removeprefix("ntx_"), fn)
        sizes = (ctypes.c_int64 * 3)()
        self.struct_sizes(sizes)
        mine = (ctypes.sizeof(Instr), ctypes.sizeof(Header), ctypes.sizeof(ModelConsts))
        if tuple(sizes) != mine:
            raise BuildError(f"{path}: structure sizes {tuple(sizes)} differ from Python's {mine}")


def load(variant: str | None = None) -> Library:
    """The kernels for `variant` (a VARIANTS name; None or "auto": the best this CPU runs), built
    if needed; one library per variant per process."""
    return _library(choose(variant))


@functools.lru_cache(maxsize=None)
def _library(v: Variant) -> Library:
    return Library(build(v), v)


def available() -> bool:
    """Whether the CPU kernels can be built or are built already (a C compiler is present)."""
    return compiler() is not None
