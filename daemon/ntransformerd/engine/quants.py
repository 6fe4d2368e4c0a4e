"""The quant types ntransformer reads: one table of block layouts, dequantization.

`QUANT_BLOCKS` is the single table of (elements per block, bytes per block). `BLOCK_DTYPES`
spells each block as a numpy structured dtype; the GPU kernels and the quantizers share them,
and the size asserts below are the same ones ggml-common.h makes. Dequantization of whole
tensors is gguf.quants' (bit-exact with ggml); what is ours is the row-range path for
embedding lookups, tested bit-exact against it.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf import quants as gguf_quants

QK = 32  # elements per block of the legacy types
QK_K = 256  # elements per super-block of the K types

SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
                   Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)

QUANT_BLOCKS: dict[Q, tuple[int, int]] = {q: GGML_QUANT_SIZES[q] for q in SUPPORTED_TYPES}

_f16, _u8, _i8 = np.float16, np.uint8, np.int8
BLOCK_DTYPES: dict[Q, np.dtype] = {
    Q.Q4_0: np.dtype([("d", _f16), ("qs", _u8, QK // 2)]),
    Q.Q4_1: np.dtype([("d", _f16), ("m", _f16), ("qs", _u8, QK // 2)]),
    Q.Q5_0: np.dtype([("d", _f16), ("qh", _u8, 4), ("qs", _u8, QK // 2)]),
    Q.Q5_1: np.dtype([("d", _f16), ("m", _f16), ("qh", _u8, 4), ("qs", _u8, QK // 2)]),
    Q.Q8_0: np.dtype([("d", _f16), ("qs", _i8, QK)]),
    Q.Q2_K: np.dtype([("scales", _u8, QK_K // 16), ("qs", _u8, QK_K // 4), ("d", _f16), ("dmin", _f16)]),
    Q.Q3_K: np.dtype([("hmask", _u8, QK_K // 8), ("qs", _u8, QK_K // 4), ("scales", _u8, 12), ("d", _f16)]),
    Q.Q4_K: np.dtype([("d", _f16), ("dmin", _f16), ("scales", _u8, 12), ("qs", _u8, QK_K // 2)]),
    Q.Q5_K: np.dtype([("d", _f16), ("dmin", _f16), ("scales", _u8, 12), ("qh", _u8, QK_K // 8),
                      ("qs", _u8, QK_K // 2)]),
    Q.Q6_K: np.dtype([("ql", _u8, QK_K // 2), ("qh", _u8, QK_K // 4), ("scales", _i8, QK_K // 16), ("d", _f16)]),
}
for _q, _dt in BLOCK_DTYPES.items():
    assert _dt.itemsize == QUANT_BLOCKS[_q][1], f"{_q.name} block is {_dt.itemsize} bytes"
    assert _dt.isalignedstruct is False  # packed, like ggml's structs


def row_bytes(qtype: Q, n: int) -> int:
    """Bytes of one row of n elements."""
    block_elems, block_bytes = QUANT_BLOCKS[qtype]
    if n % block_elems:
        raise ValueError(f"a {qtype.name} row of {n} is not a multiple of its block ({block_elems})")
    return n // block_elems * block_bytes


def dequantize(raw: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> np.ndarray:
    """Raw bytes as stored → float32 of `shape` (numpy order)."""
    if qtype == Q.F32:
        return np.asarray(raw).view(np.float32).reshape(shape)
    out = gguf_quants.dequantize(np.asarray(raw).view(np.uint8).reshape(-1), qtype)
    return out.astype(np.float32, copy=False).reshape(shape)


def dequantize_rows(raw_rows: np.ndarray, qtype: Q, rows: np.ndarray, n: int) -> np.ndarray:
    """Selected rows of a (n_rows, row_bytes) raw matrix → float32 (len(rows), n).

    Reads only the bytes of the rows asked for, so an embedding lookup on a 128k-vocabulary
    table touches a few kilobytes, not the table.
    """
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    if rows.size and (rows.min() < 0 or rows.max() >= raw_rows.shape[0]):
        raise IndexError(f"row ids must lie in [0, {raw_rows.shape[0]})")
    picked = np.ascontiguousarray(raw_rows[rows])  # (R, row_bytes) copy of just those rows
    return dequantize(picked, qtype, (rows.size, n))
