"""Dequantization: our row-range path and block layouts against gguf.quants (the oracle)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants as gguf_quants

from ntransformerd.engine import quants
from ntransformerd.engine.quants import BLOCK_DTYPES, QUANT_BLOCKS, SUPPORTED_TYPES


def random_blocks(qtype: Q, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random raw blocks with finite scales: some all-zero blocks and some outlier scales."""
    block_elems, block_bytes = QUANT_BLOCKS[qtype]
    if qtype in (Q.F32, Q.F16, Q.BF16):
        x = rng.standard_normal(n_blocks * 64).astype(np.float32)
        x[::97] *= 1e4  # outliers
        x[:64] = 0.0
        if qtype == Q.F32:
            return x.view(np.uint8)
        if qtype == Q.F16:
            return x.astype(np.float16).view(np.uint8)
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    raw = rng.integers(0, 256, n_blocks * block_bytes, dtype=np.uint8)
    blocks = raw.view(BLOCK_DTYPES[qtype])
    for field in ("d", "dmin", "m"):
        if field in blocks.dtype.names:
            v = rng.standard_normal(n_blocks).astype(np.float16) * np.float16(0.01)
            v[::13] = np.float16(60000.0)  # outlier scales near the f16 limit
            blocks[field] = v
    raw.reshape(n_blocks, block_bytes)[:3] = 0  # all-zero blocks
    return raw


def worst_block(a: np.ndarray, b: np.ndarray, block: int) -> str:
    bad = np.flatnonzero(~((a == b) | (np.isnan(a) & np.isnan(b))))
    return f"first mismatch at element {bad[0]} (block {bad[0] // block}): {a[bad[0]]} vs {b[bad[0]]}" if bad.size else ""


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda q: q.name)
def test_table_matches_gguf(qtype):
    from gguf import GGML_QUANT_SIZES
    assert QUANT_BLOCKS[qtype] == GGML_QUANT_SIZES[qtype]
    if qtype in BLOCK_DTYPES:
        assert BLOCK_DTYPES[qtype].itemsize == QUANT_BLOCKS[qtype][1]


def test_all_thirteen_types_supported():
    assert len(SUPPORTED_TYPES) == 13


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda q: q.name)
def test_dequantize_is_gguf_bit_exact(qtype):
    rng = np.random.default_rng()
    raw = random_blocks(qtype, 64, rng)
    block_elems, block_bytes = QUANT_BLOCKS[qtype]
    n = raw.size // block_bytes * block_elems
    rows = 4
    ours = quants.dequantize(raw, qtype, (rows, n // rows))
    ref = gguf_quants.dequantize(raw.copy(), qtype).astype(np.float32).reshape(rows, n // rows)
    assert ours.dtype == np.float32
    assert np.array_equal(ours, ref, equal_nan=True), worst_block(ours.ravel(), ref.ravel(), block_elems)


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda q: q.name)
def test_dequantize_rows_bit_exact(qtype):
    rng = np.random.default_rng()
    block_elems, block_bytes = QUANT_BLOCKS[qtype]
    n_rows, blocks_per_row = 37, 3 if block_elems > 1 else 256
    raw = random_blocks(qtype, n_rows * blocks_per_row, rng)
    n = blocks_per_row * block_elems
    raw = raw[: n_rows * quants.row_bytes(qtype, n)]
    full = gguf_quants.dequantize(raw.copy(), qtype).astype(np.float32).reshape(n_rows, n)
    picks = np.array([36, 0, 5, 5, 17])
    got = quants.dequantize_rows(raw.reshape(n_rows, -1), qtype, picks, n)
    assert np.array_equal(got, full[picks], equal_nan=True), worst_block(got.ravel(), full[picks].ravel(), block_elems)


def test_dequantize_rows_rejects_out_of_range():
    raw = np.zeros((4, 34), np.uint8)
    with pytest.raises(IndexError):
        quants.dequantize_rows(raw, Q.Q8_0, np.array([4]), 32)


@pytest.mark.parametrize("qtype", sorted(BLOCK_DTYPES, key=int), ids=lambda q: q.name)
def test_block_layout_scale_fields(qtype):
    """Doubling every scale field named in BLOCK_DTYPES doubles every value exactly.

    Values are linear in (d, dmin/m) for every type, so this holds only if the layout puts
    those fields where ggml does: a wrong offset would change quant bits instead.
    """
    rng = np.random.default_rng()
    raw = random_blocks(qtype, 32, rng)
    blocks = raw.view(BLOCK_DTYPES[qtype])
    for f in ("d", "dmin", "m"):
        if f in blocks.dtype.names:
            blocks[f] = (rng.standard_normal(len(blocks)) * 0.01).astype(np.float16)
    before = gguf_quants.dequantize(raw.copy(), qtype)
    for f in ("d", "dmin", "m"):
        if f in blocks.dtype.names:
            blocks[f] = blocks[f] * np.float16(2)
    after = gguf_quants.dequantize(raw.copy(), qtype)
    assert np.array_equal(after, 2 * before)


def test_real_model_tensors_bit_exact(default_model):
    """Every distinct type in the default model, through our path, against gguf.quants."""
    seen = set()
    for name, t in default_model.tensors.items():
        if t.qtype in seen:
            continue
        seen.add(t.qtype)
        ours = default_model.dequantize(name)
        ref = gguf_quants.dequantize(np.array(t.data), t.qtype).astype(np.float32).reshape(t.shape)
        assert np.array_equal(ours, ref), name
        if len(t.shape) == 2:
            rows = np.array([0, t.shape[0] - 1, t.shape[0] // 2])
            assert np.array_equal(default_model.dequantize_rows(name, rows), ref[rows]), name
    assert {Q.Q4_1, Q.Q8_0, Q.F32} <= seen
