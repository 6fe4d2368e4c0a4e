"""GGUF loading: config from metadata, tensor checks, and clear errors for broken files."""

from __future__ import annotations

import resource
import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter

from ntransformerd.engine.gguf_file import GGUFError, GGUFModel


def write_micro(path, *, n_layers=2, d=32, ff=64, heads=2, kv_heads=1, vocab=64, arch="llama",
                drop=(), reshape=None, extra_kv=None):
    """A tiny valid Llama GGUF (F32 and one Q8_0 tensor), optionally with a defect."""
    w = GGUFWriter(str(path), arch=arch)
    w.add_block_count(n_layers)
    w.add_context_length(128)
    w.add_embedding_length(d)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    for k, v in (extra_kv or {}).items():
        w.add_string(k, v)
    rng = np.random.default_rng(0)
    hd = d // heads
    shapes = {"token_embd.weight": (vocab, d), "output_norm.weight": (d,)}
    for i in range(n_layers):
        shapes.update({f"blk.{i}.attn_norm.weight": (d,), f"blk.{i}.attn_q.weight": (d, d),
                       f"blk.{i}.attn_k.weight": (kv_heads * hd, d), f"blk.{i}.attn_v.weight": (kv_heads * hd, d),
                       f"blk.{i}.attn_output.weight": (d, d), f"blk.{i}.ffn_norm.weight": (d,),
                       f"blk.{i}.ffn_gate.weight": (ff, d), f"blk.{i}.ffn_up.weight": (ff, d),
                       f"blk.{i}.ffn_down.weight": (d, ff)})
    for name, shape in shapes.items():
        if name in drop:
            continue
        if reshape and name in reshape:
            shape = reshape[name]
        data = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if name == "blk.0.ffn_up.weight":
            from gguf import quants
            w.add_tensor(name, quants.quantize(data, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture
def micro(tmp_path):
    return write_micro(tmp_path / "micro.gguf")


def test_config_from_metadata(default_model):
    c = default_model.config
    assert (c.n_layers, c.d_model, c.d_ff, c.n_heads, c.n_kv_heads, c.head_dim) == (30, 576, 1536, 9, 3, 64)
    assert c.vocab_size == 49152 and c.rope_base == 100000.0 and c.tied_output
    assert abs(c.rms_eps - 1e-5) < 1e-9
    t = default_model.tensor("blk.3.ffn_down.weight")
    assert t.shape == (576, 1536) and t.qtype == Q.Q4_1


def test_tensors_are_memory_mapped(default_model):
    t = default_model.tensor("token_embd.weight")
    assert isinstance(t.data.base, np.memmap) or isinstance(t.data, np.memmap)


def test_micro_loads(micro):
    m = GGUFModel(micro)
    assert m.config.n_layers == 2 and m.config.tied_output
    assert m.dequantize("blk.0.ffn_up.weight").shape == (64, 32)


@pytest.mark.parametrize("defect,needle", [
    (dict(drop=("blk.1.ffn_down.weight",)), "'blk.1.ffn_down.weight' is missing"),
    (dict(reshape={"blk.0.attn_k.weight": (32, 32)}), "'blk.0.attn_k.weight' has shape [32, 32], expected [16, 32]"),
    (dict(arch="mamba"), "architecture 'mamba' is not supported"),
    (dict(heads=3), "not divisible by head_count"),
    (dict(extra_kv={"llama.rope.scaling.type": "yarn"}), "rope scaling 'yarn' is not supported"),
])
def test_model_defects_named(tmp_path, defect, needle):
    path = write_micro(tmp_path / "bad.gguf", **defect)
    with pytest.raises(GGUFError) as e:
        GGUFModel(path)
    assert needle in str(e.value) and str(path) in str(e.value)


def test_truncated_at_every_section(micro, tmp_path):
    data = open(micro, "rb").read()
    m = GGUFModel(micro)
    tensor_info_start = min(f.offset for f in (t.field for t in m.reader.tensors))
    cuts = {"empty": 0, "in magic": 2, "in version": 6, "in counts": 12, "in kv": 40,
            "in tensor infos": tensor_info_start + 10, "before data": m.reader.data_offset,
            "in data": len(data) - 100}
    for where, cut in cuts.items():
        p = tmp_path / f"cut-{cut}.gguf"
        p.write_bytes(data[:cut])
        with pytest.raises(GGUFError) as e:
            GGUFModel(p)
        msg = str(e.value)
        assert str(p) in msg, where
        assert any(w in msg for w in ("truncated", "outside the file", "empty file")), (where, msg)


@pytest.mark.parametrize("patch,needle", [
    ((0, b"GGML"), "not a GGUF file"),
    ((4, struct.pack("<I", 7)), "version 7"),
    ((8, struct.pack("<Q", 2**60)), "absurd counts"),
    ((16, struct.pack("<Q", 2**60)), "absurd counts"),
])
def test_header_lies(micro, tmp_path, patch, needle):
    data = bytearray(open(micro, "rb").read())
    off, b = patch
    data[off:off + len(b)] = b
    p = tmp_path / "lie.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=needle):
        GGUFModel(p)


def test_unknown_tensor_type(micro, tmp_path):
    m = GGUFModel(micro)
    t = m.reader.tensors[0]
    type_off = t.field.offset + 8 + len(t.name.encode()) + 4 + 8 * len(t.shape)
    data = bytearray(open(micro, "rb").read())
    data[type_off:type_off + 4] = struct.pack("<I", 77)
    p = tmp_path / "type.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="unknown tensor type 77"):
        GGUFModel(p)


def test_unsupported_tensor_type(tmp_path):
    w = GGUFWriter(str(tmp_path / "iq.gguf"), arch="llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 256), np.uint8)[:, :66], raw_dtype=Q.IQ2_XXS)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(GGUFError, match="IQ2_XXS is not supported"):
        GGUFModel(tmp_path / "iq.gguf")


@pytest.mark.timeout(60)  # a hang guard: reading 2^40 items would never end
def test_absurd_array_length(micro, tmp_path):
    """A metadata array claiming 2^40 items must fail at once, not loop through the file."""
    w = GGUFWriter(str(tmp_path / "arr.gguf"), arch="llama")
    w.add_array("tokenizer.ggml.scores", [0.5, 0.25])
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    data = bytearray((tmp_path / "arr.gguf").read_bytes())
    at = data.find(b"tokenizer.ggml.scores") + len("tokenizer.ggml.scores") + 4 + 4
    data[at:at + 8] = struct.pack("<Q", 2**40)
    (tmp_path / "arr.gguf").write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="truncated"):  # said before reading a single item
        GGUFModel(tmp_path / "arr.gguf")


def test_missing_file(tmp_path):
    with pytest.raises(GGUFError, match="cannot open"):
        GGUFModel(tmp_path / "nope.gguf")


def _mutate(data: bytes, rng: np.random.Generator, header_end: int) -> bytes:
    b = bytearray(data)
    kind = rng.integers(0, 6)
    if kind == 0:  # random byte flips in the header
        for _ in range(rng.integers(1, 8)):
            b[rng.integers(0, header_end)] = rng.integers(0, 256)
    elif kind == 1:  # truncate anywhere
        return bytes(b[: rng.integers(0, len(b))])
    elif kind == 2:  # a huge or odd 64-bit value where a count or length may be
        at = rng.integers(0, header_end - 8)
        b[at:at + 8] = struct.pack("<Q", int(rng.choice([2**63 - 1, 2**32, 2**40, 0, 1, 255])))
    elif kind == 3:  # a 32-bit type/dim count replaced
        at = rng.integers(0, header_end - 4)
        b[at:at + 4] = struct.pack("<I", int(rng.integers(0, 64)))
    elif kind == 4:  # bytes inserted or deleted inside the header
        at = rng.integers(0, header_end)
        if rng.random() < 0.5:
            b[at:at] = rng.integers(0, 256, rng.integers(1, 16), dtype=np.uint8).tobytes()
        else:
            del b[at:at + rng.integers(1, 16)]
    else:  # random garbage over the data section
        at = rng.integers(header_end, len(b) - 16)
        b[at:at + 16] = rng.integers(0, 256, 16, dtype=np.uint8).tobytes()
    return bytes(b)


def test_fuzz_mutated_files(micro, tmp_path):
    """2,000 mutated files: each loads or raises GGUFError; none hangs or eats memory."""
    data = open(micro, "rb").read()
    header_end = GGUFModel(micro).reader.data_offset
    rng = np.random.default_rng()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    outcomes = {"loaded": 0, "GGUFError": 0}
    p = tmp_path / "fuzz.gguf"
    for i in range(2000):
        p.write_bytes(_mutate(data, rng, header_end))
        try:
            GGUFModel(p)
            outcomes["loaded"] += 1
        except GGUFError as e:
            assert str(p) in str(e)
            outcomes["GGUFError"] += 1
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    assert grown_mb < 200, f"peak RSS grew by {grown_mb:.0f} MB"
    assert outcomes["GGUFError"] > 1000, outcomes


# ---- finite scales --------------------------------------------------------------------------

def _tensor(qtype: Q, n_blocks: int, rng) -> "TensorInfo":
    """A tensor of random blocks whose float fields hold finite values."""
    from ntransformerd.engine.gguf_file import TensorInfo
    from ntransformerd.engine.quants import BLOCK_DTYPES, QUANT_BLOCKS
    elems, nbytes = QUANT_BLOCKS[qtype]
    if qtype == Q.F32:
        data = rng.standard_normal(n_blocks).astype(np.float32).view(np.uint8)
    elif qtype in (Q.F16, Q.BF16):
        data = (rng.integers(0, 0x7000, n_blocks) if qtype == Q.F16 else rng.integers(0, 0x7F00, n_blocks)
                ).astype(np.uint16).view(np.uint8)
    else:
        blocks = rng.integers(0, 256, n_blocks * nbytes, dtype=np.uint8).view(BLOCK_DTYPES[qtype])
        for f in BLOCK_DTYPES[qtype].names:
            if BLOCK_DTYPES[qtype][f] == np.float16:
                blocks[f] = rng.standard_normal(n_blocks).astype(np.float16)
        data = blocks.view(np.uint8)
    return TensorInfo("blk.0.attn_q.weight", qtype, (n_blocks * elems,), 0, data.size, data)


@pytest.mark.parametrize("qtype", [q for q in Q if q.name in (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")],
    ids=lambda q: q.name)
def test_nonfinite_scales_are_found_in_every_block_field(qtype):
    from ntransformerd.engine.gguf_file import nonfinite_scales
    from ntransformerd.engine.quants import BLOCK_DTYPES
    rng = np.random.default_rng()
    assert nonfinite_scales(_tensor(qtype, 301, rng)) is None
    if qtype in (Q.F32, Q.F16, Q.BF16):
        cases = [("value", v) for v in ("nan", "inf", "-inf")]
    else:
        cases = [(f, v) for f in BLOCK_DTYPES[qtype].names if BLOCK_DTYPES[qtype][f] == np.float16
                 for v in ("nan", "inf", "-inf")]
    for field, value in cases:
        t = _tensor(qtype, 301, rng)
        i = int(rng.integers(0, 301))
        if field == "value":
            vals = t.data.view({Q.F32: np.float32, Q.F16: np.float16}.get(qtype, np.uint16))
            vals[i] = {"nan": 0x7FC0, "inf": 0x7F80, "-inf": 0xFF80}[value] if qtype == Q.BF16 else float(value)
        else:
            t.data.view(BLOCK_DTYPES[qtype])[field][i] = float(value)
        assert nonfinite_scales(t) == (i, field), (field, value)


def test_a_model_with_random_bytes_in_its_weights_is_refused(micro, tmp_path):
    model = GGUFModel(micro)
    model.check_finite()
    t = model.tensors["blk.0.ffn_up.weight"]
    data = bytearray(open(micro, "rb").read())
    data[t.offset:t.offset + 64] = np.random.default_rng(5).integers(0, 256, 64, dtype=np.uint8).tobytes()
    data[t.offset + 2 * t.row_bytes:t.offset + 2 * t.row_bytes + 2] = struct.pack("<e", float("nan"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=r"tensor 'blk.0.ffn_up.weight' \(.*\): block \d+ has a d scale that is NaN "
                                        "or infinite; the file is corrupt"):
        GGUFModel(bad).check_finite()
