"""Every kernel instance the CUDA backend can launch compiles with NVRTC for the H200 (sm_90)
and for the RTX 3090 class (sm_86: the 24 GB cards the tiers are for), on a machine without a GPU: NVRTC is a library (the `nvidia-cuda-nvrtc` wheel of the test
extra, the device's CUDA 13.0), so a kernel that does not compile fails here, in CI, not on the
next GPU machine. ptxas's report also holds the launch-bounds claims of backends/cuda/launch.py: the
one-row dp4a matvecs fit the blocks per SM they are compiled for without spilling.

Compiling every instance for both architectures costs ~60 s of CPU (quant.cu's 141 instances are
most of it). A family's report is kept in pytest's cache under the hash of everything that
decides it (the source as compiled, the instance names, the architecture, NVRTC's version), so a
checkout compiles again only what changed; a clean clone compiles everything."""
import ctypes
import glob
import hashlib
import os
import re

import pytest

from ntransformerd.engine.backends import cuda


def _nvrtc():
    try:
        import nvidia
    except ImportError:
        return None
    for root in nvidia.__path__:
        for lib in ("cu13/lib", "cuda_nvrtc/lib"):
            found = sorted(glob.glob(os.path.join(root, lib, "libnvrtc.so.1*")))
            if found:  # NVRTC dlopens its builtins by name: load them first, globally
                for b in glob.glob(os.path.join(root, lib, "libnvrtc-builtins.so.*")):
                    ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
                return ctypes.CDLL(found[0])
    return None


LIB = _nvrtc()
pytestmark = pytest.mark.skipif(LIB is None, reason="NVRTC (the nvidia-cuda-nvrtc wheel) is not installed")


def compile_family(family: str, names: list[str], arch: str) -> dict[str, tuple[int, int]]:
    """{instance: (registers, spill store bytes)} for `names` of kernels/<family>.cu on `arch`."""
    c = ctypes
    prog = c.c_void_p()
    src = cuda.kernel_source(family).encode()
    assert LIB.nvrtcCreateProgram(c.byref(prog), src, f"{family}.cu".encode(), 0, None, None) == 0
    try:
        for n in names:
            assert LIB.nvrtcAddNameExpression(prog, n.encode()) == 0
        options = (b"--std=c++17", f"-arch={arch}".encode(), b"--ptxas-options=-v")
        opts = (c.c_char_p * len(options))(*options)
        rc = LIB.nvrtcCompileProgram(prog, len(options), opts)
        size = c.c_size_t()
        LIB.nvrtcGetProgramLogSize(prog, c.byref(size))
        log = c.create_string_buffer(size.value)
        LIB.nvrtcGetProgramLog(prog, log)
        text = log.value.decode(errors="replace")
        assert rc == 0, f"{family}.cu does not compile for {arch}:\n{text[:4000]}"
        lowered = {}
        for n in names:
            p = c.c_char_p()
            assert LIB.nvrtcGetLoweredName(prog, n.encode(), c.byref(p)) == 0
            lowered[p.value.decode()] = n
    finally:
        LIB.nvrtcDestroyProgram(c.byref(prog))
    out, cur, spill = {}, None, 0
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            cur = lowered.get(m.group(1))
        m = re.search(r"(\d+) bytes spill stores", line)
        if m:
            spill = int(m.group(1))
        m = re.search(r"Used (\d+) registers", line)
        if m and cur:
            out[cur] = (int(m.group(1)), spill)
            cur = None
    return out


def nvrtc_version() -> str:
    major, minor = ctypes.c_int(), ctypes.c_int()
    assert LIB.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) == 0
    return f"{major.value}.{minor.value}"


def cached_compile(cache, family: str, names: list[str], arch: str) -> dict[str, tuple[int, int]]:
    """compile_family, or its report from an earlier compile of exactly these inputs."""
    key = hashlib.sha256("\0".join([cuda.kernel_source(family), *names, arch, nvrtc_version()]).encode()).hexdigest()
    path = f"ntx/nvrtc/{family}-{arch}-{key[:32]}"
    got = cache.get(path, None) if cache is not None else None
    if got is not None:
        return {name: tuple(v) for name, v in got.items()}
    rep = compile_family(family, names, arch)
    if cache is not None:
        cache.set(path, {name: list(v) for name, v in rep.items()})
    return rep


@pytest.fixture(scope="module", params=["sm_90", "sm_86"])
def report(request) -> dict[tuple[str, str], tuple[int, int]]:
    by_family: dict[str, list[str]] = {}
    for family, name in cuda.kernel_names():
        by_family.setdefault(family, []).append(name)
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    rep = {}
    for family, names in by_family.items():
        for name, v in cached_compile(cache, family, names, request.param).items():
            rep[(family, name)] = v
    return rep


def test_every_instance_compiles(report):
    missing = [k for k in cuda.kernel_names() if k not in report]
    assert not missing, f"no ptxas report for {missing[:5]}"


def test_one_row_matvecs_fit_their_blocks(report):
    """mvq_*<R,1,KS,MB>: MB blocks of 128 threads per SM, so at most 65536 / (128 MB) registers,
    and no spills (the point of compiling them for more blocks)."""
    checked = 0
    for (family, name), (regs, spill) in report.items():
        m = re.fullmatch(r"mvq_\w+<\d+,1,\d+,(\d+)>", name)
        if m and int(m.group(1)) > 1:
            assert regs <= 65536 // (128 * int(m.group(1))), (name, regs)
            assert spill == 0, (name, spill)
            checked += 1
    assert checked == 4 * len(cuda.FAST_MATVEC)  # K split and not, 2 and 4 rows per warp, per type
