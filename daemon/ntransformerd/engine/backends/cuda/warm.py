"""The GPU kernels a model needs, compiled at load and in parallel, once per machine.

Kernels compile on first use (nvrtc.kernel, one NVRTC program per instance, CuPy's disk cache
keeping the binary). Left to first use, a fresh machine compiled them inside the first request,
one after another: 5.9 s for a 4-token prompt of the 8B, and a first decode at 25 tok/s. Here the
instances a model can launch (every instance of kernel_names whose weight type the file holds)
compile before the first request, in parallel processes, each instance through the same
nvrtc.kernel call, so that CuPy's cache then serves the first use of each in the serving
process. A marker named by the hash of everything the binaries depend on (the sources as
compiled, the instance names, CuPy's and the driver's versions, the device) says it was done:
a second load checks one file and compiles nothing.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import multiprocessing
import os
import re
import sys
import time

from ntransformerd import dirs
from ntransformerd.engine.backends.cuda import attention
from ntransformerd.engine.backends.cuda.launch import matvec_kernel_names
from ntransformerd.engine.backends.cuda.nvrtc import cp, kernel, kernel_source
from ntransformerd.engine.backends.cuda.settings import DEFAULT, CudaSettings
from ntransformerd.engine.gguf_file import LlamaConfig

log = logging.getLogger(__name__)

TYPE_SUFFIX = {"q8_0": 8, "q4_k": 12, "q6_k": 14, "q4_1": 3}  # the fused matvecs named by their weight type
TYPED_SUFFIX = re.compile(r"^\w+?_(" + "|".join(TYPE_SUFFIX) + r")<")
TYPED = re.compile(r"^(dequant_rows|matvec_generic)<(\d+),")  # instances whose first argument is a GGML type id


def needed(names: list[tuple[str, str]], types: set[int], cfg: LlamaConfig | None = None) -> list[tuple[str, str]]:
    """The instances of `names` a model with weight types `types` (GGML ids) can launch: every
    one that is not tied to a weight type, and those tied to a type the model holds; with its
    shape `cfg`, the attention instances of its head_dim and GQA group only (either KV type)."""
    attn = None
    if cfg is not None:
        attn = ({attention.decode_kernel(cfg, q8) for q8 in (False, True)}
                | {f"attn_chunk<{cfg.head_dim},{q8}>" for q8 in (0, 1)})
    out = []
    for family, name in names:
        m = TYPED.match(name)
        if m and int(m.group(2)) not in types:
            continue
        suffix = TYPED_SUFFIX.match(name)
        if suffix and TYPE_SUFFIX[suffix.group(1)] not in types:
            continue
        if attn is not None and name.startswith(("attn_decode<", "attn_chunk<")) and name not in attn:
            continue
        out.append((family, name))
    return out


def marker(names: list[tuple[str, str]]) -> str:
    """The hash of what the binaries of `names` depend on on this machine."""
    h = hashlib.sha256()
    for family in sorted({f for f, _ in names}):
        h.update(kernel_source(family).encode())
    for key in names:
        h.update(repr(key).encode())
    dev = cp.cuda.Device()
    h.update(f"{cp.__version__} {cp.cuda.runtime.driverGetVersion()} {dev.compute_capability}".encode())
    return h.hexdigest()[:20]


def kernel_names(s: CudaSettings = DEFAULT) -> list[tuple[str, str]]:
    """Every kernel instance the backend can launch under settings s."""
    return matvec_kernel_names(s) + attention.kernel_names()


def _compile(key: tuple[str, str]) -> str:
    kernel(*key)
    return key[1]


def compile_for(types: set[int], cfg: LlamaConfig | None = None, *, jobs: int | None = None,
                quiet: bool = False) -> int:
    """Compile, in parallel, the instances a model of weight types `types` (and shape `cfg`) can
    launch, unless this machine's cache already holds them; returns how many were compiled (0:
    cached)."""
    names = needed(kernel_names(), types, cfg)
    root = os.path.join(dirs.cache_dir(), "cuda-kernels")
    done = os.path.join(root, f"compiled-{marker(names)}")
    if os.path.exists(done):
        return 0
    jobs = max(1, min(jobs or os.cpu_count() or 1, 16, len(names)))
    tty = not quiet and sys.stderr.isatty()
    t0 = time.monotonic()
    log.info("compiling %d GPU kernels in %d processes (once for this machine)", len(names), jobs)
    ctx = multiprocessing.get_context("spawn")  # a CUDA context does not survive fork
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as ex:
        for i, _ in enumerate(ex.map(_compile, names, chunksize=max(1, len(names) // (4 * jobs))), 1):
            if tty:
                print(f"\rntransformer: compiling the GPU kernels, once for this machine: {i}/{len(names)}",
                      end="" if i < len(names) else "\n", file=sys.stderr, flush=True)
    log.info("compiled %d GPU kernels in %.1f s", len(names), time.monotonic() - t0)
    try:
        os.makedirs(root, exist_ok=True)
        with open(done, "w") as f:
            f.write("\n".join(f"{a} {b}" for a, b in names) + "\n")
    except OSError as e:  # a read-only cache costs the next load the same compile, nothing worse
        log.warning("could not record the compiled kernels in %s: %s", root, e)
    return len(names)


def precompile(jobs: int = 16) -> int:
    """Compile every instance kernel_names lists, whatever the model (compile_for compiles a
    model's own at load)."""
    names = kernel_names()
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
        for _ in ex.map(_compile, names, chunksize=max(1, len(names) // (4 * jobs))):
            pass
    return len(names)
