"""A GGUF model file: metadata, the Llama config, and tensors by their GGUF names.

The file is memory-mapped through `gguf.GGUFReader`; tensor data stays in the page cache
until a backend asks for it. GGUFReader trusts the file's counts and lengths (a
corrupted array length makes it loop for a very long time), so `_scan_header` first walks
the header with every count checked against the bytes that remain, and only a header that
passes is handed to the reader.
"""

from __future__ import annotations

import dataclasses
import math
import os
import struct
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

from ntransformerd.engine.quants import BLOCK_DTYPES, QUANT_BLOCKS, dequantize, dequantize_rows

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHITECTURES = ("llama",)

# GGUF metadata value types and the fixed sizes of the scalar ones.
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_T_STRING, _T_ARRAY = 8, 9
_MAX_DIMS = 4


class GGUFError(ValueError):
    """A GGUF file that cannot be used; the message names the file, what and why."""

    def __init__(self, path: str | os.PathLike, problem: str):
        super().__init__(f"{os.fspath(path)}: {problem}")
        self.path = os.fspath(path)
        self.problem = problem


def _scan_header(path: str, buf: memoryview) -> None:
    """Walk the GGUF header with bounds checks; raise GGUFError on the first lie."""
    size = len(buf)
    pos = 0

    def need(n: int, what: str) -> None:
        if n < 0 or pos + n > size:
            raise GGUFError(path, f"truncated: {what} needs {n} bytes at offset {pos}, file is {size} bytes")

    def u32(what: str) -> int:
        nonlocal pos
        need(4, what)
        (v,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        return v

    def u64(what: str) -> int:
        nonlocal pos
        need(8, what)
        (v,) = struct.unpack_from("<Q", buf, pos)
        pos += 8
        return v

    def string(what: str) -> bytes:
        nonlocal pos
        n = u64(f"{what} length")
        need(n, what)
        s = bytes(buf[pos:pos + n])
        pos += n
        return s

    def value(vtype: int, what: str, depth: int = 0) -> None:
        nonlocal pos
        if vtype in _SCALAR_SIZES:
            need(_SCALAR_SIZES[vtype], what)
            pos += _SCALAR_SIZES[vtype]
        elif vtype == _T_STRING:
            string(what)
        elif vtype == _T_ARRAY:
            if depth > 0:
                raise GGUFError(path, f"{what}: nested arrays are not supported")
            itype = u32(f"{what} item type")
            count = u64(f"{what} count")
            if itype in _SCALAR_SIZES:
                need(count * _SCALAR_SIZES[itype], f"{what} ({count} items)")
                pos += count * _SCALAR_SIZES[itype]
            elif itype == _T_STRING:
                need(count * 8, f"{what} ({count} strings)")  # every string has an 8-byte length
                for _ in range(count):
                    string(what)
            else:
                raise GGUFError(path, f"{what}: unknown array item type {itype}")
        else:
            raise GGUFError(path, f"{what}: unknown metadata value type {vtype}")

    need(4, "magic")
    if bytes(buf[0:4]) != GGUF_MAGIC:
        raise GGUFError(path, f"not a GGUF file (magic {bytes(buf[0:4])!r}, expected {GGUF_MAGIC!r})")
    pos = 4
    version = u32("version")
    if version not in (2, 3):
        raise GGUFError(path, f"GGUF version {version} is not supported (2 and 3 are)")
    n_tensors = u64("tensor count")
    n_kv = u64("metadata count")
    # Every tensor info takes at least 8+4+8+4+8 bytes, every key/value at least 8+4+1.
    if n_tensors * 32 > size or n_kv * 13 > size:
        raise GGUFError(path, f"absurd counts: {n_tensors} tensors, {n_kv} metadata entries in {size} bytes")
    keys: set[bytes] = set()
    for i in range(n_kv):
        key = string(f"metadata key #{i}")
        if key in keys:
            raise GGUFError(path, f"duplicate metadata key {key!r}")
        keys.add(key)
        value(u32(f"type of {key!r}"), f"metadata {key.decode(errors='replace')!r}")
    for i in range(n_tensors):
        name = string(f"tensor #{i} name").decode(errors="replace")
        n_dims = u32(f"tensor {name!r} dimension count")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise GGUFError(path, f"tensor {name!r}: {n_dims} dimensions (1..{_MAX_DIMS} allowed)")
        dims = [u64(f"tensor {name!r} dims") for _ in range(n_dims)]
        if any(d == 0 or d > 2**40 for d in dims) or math.prod(dims) > 2**42:
            raise GGUFError(path, f"tensor {name!r}: absurd shape {dims}")
        ttype = u32(f"tensor {name!r} type")
        try:
            GGMLQuantizationType(ttype)
        except ValueError:
            raise GGUFError(path, f"tensor {name!r}: unknown tensor type {ttype}") from None
        u64(f"tensor {name!r} offset")


# Where a value is NaN or infinite: all exponent bits set (IEEE 754), per float type by its bits.
_NONFINITE_BITS = {GGMLQuantizationType.F16: (np.uint16, 0x7C00), GGMLQuantizationType.BF16: (np.uint16, 0x7F80),
                   GGMLQuantizationType.F32: (np.uint32, 0x7F800000)}


def nonfinite_scales(t: "TensorInfo") -> tuple[int, str] | None:
    """(first block, field) of `t` whose float is NaN or infinite, or None.

    For a quantized tensor, its blocks' f16 scale fields (d, dmin, m: every float a block
    holds; the K-quants' sub-block scales are small integers); for F32, F16 and BF16 every value
    (their "block" is one value). Reads 2 of every 18-210 bytes of a quantized tensor.
    """
    if t.qtype in _NONFINITE_BITS:
        utype, mask = _NONFINITE_BITS[t.qtype]
        bad = np.flatnonzero((np.asarray(t.data).view(utype) & mask) == mask)
        return (int(bad[0]), "value") if bad.size else None
    dtype = BLOCK_DTYPES[t.qtype]
    blocks = np.asarray(t.data).view(np.uint8).reshape(-1).view(dtype)
    for field in dtype.names:
        if dtype[field] == np.float16:
            bad = np.flatnonzero((blocks[field].view(np.uint16) & 0x7C00) == 0x7C00)
            if bad.size:
                return int(bad[0]), field
    return None


def _metadata_value(field) -> Any:
    value = field.contents()
    if isinstance(value, np.generic):
        value = value.item()
    return value


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor as stored: numpy-order shape (rows last is the contiguous axis)."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order: GGUF's ne[] reversed, e.g. (n_out, n_in)
    offset: int  # absolute byte offset in the file
    nbytes: int
    data: np.ndarray  # raw bytes as stored (a view of the memory map)

    @property
    def row_bytes(self) -> int:
        block_elems, block_bytes = QUANT_BLOCKS[self.qtype]
        return self.shape[-1] // block_elems * block_bytes


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama-architecture model, from `llama.*` metadata."""

    n_layers: int
    d_model: int
    d_ff: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    rms_eps: float
    rope_base: float
    rope_dim: int
    rope_neox: bool  # False: rotate adjacent pairs (Llama's GGUF order); True: halves (NeoX)
    rope_scale: float  # linear position scaling factor (1.0 = none)
    tied_output: bool

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


def _layer_tensor_shapes(c: LlamaConfig) -> dict[str, tuple[int, ...]]:
    return {
        "attn_norm.weight": (c.d_model,),
        "attn_q.weight": (c.q_dim, c.d_model),
        "attn_k.weight": (c.kv_dim, c.d_model),
        "attn_v.weight": (c.kv_dim, c.d_model),
        "attn_output.weight": (c.d_model, c.q_dim),
        "ffn_norm.weight": (c.d_model,),
        "ffn_gate.weight": (c.d_ff, c.d_model),
        "ffn_up.weight": (c.d_ff, c.d_model),
        "ffn_down.weight": (c.d_model, c.d_ff),
    }


# The tensors of one block, by their GGUF names without the "blk.N." prefix and ".weight".
LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                 "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")


class GGUFModel:
    """An opened GGUF Llama model. Cheap to keep open: nothing is read until asked."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._on_layer_loaded: Callable[[int], None] | None = None
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    raise GGUFError(self.path, "empty file")
                import mmap
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                    view = memoryview(mm)
                    try:
                        _scan_header(self.path, view)
                    finally:
                        view.release()
        except OSError as e:
            raise GGUFError(self.path, f"cannot open: {e.strerror or e}") from e
        try:
            self.reader = GGUFReader(self.path, "r")
            self.metadata: dict[str, Any] = {
                k: _metadata_value(f) for k, f in self.reader.fields.items() if not k.startswith("GGUF.")}
            self.tensors: dict[str, TensorInfo] = {}
            for t in self.reader.tensors:
                self.tensors[t.name] = self._tensor_info(t)
        except GGUFError:
            raise
        except (ValueError, KeyError, IndexError, OverflowError, TypeError) as e:
            raise GGUFError(self.path, f"malformed GGUF: {type(e).__name__}: {e}") from e
        self.file_size = size
        self.architecture = self.metadata.get("general.architecture")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise GGUFError(self.path, f"architecture {self.architecture!r} is not supported "
                                       f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        self.config = self._config()
        self._check_tensors()

    def _tensor_info(self, t) -> TensorInfo:
        if t.tensor_type not in QUANT_BLOCKS:
            raise GGUFError(self.path, f"tensor {t.name!r}: type {t.tensor_type.name} is not supported "
                                       f"(supported: {', '.join(q.name for q in QUANT_BLOCKS)})")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        block_elems, block_bytes = QUANT_BLOCKS[t.tensor_type]
        if shape[-1] % block_elems:
            raise GGUFError(self.path, f"tensor {t.name!r}: row of {shape[-1]} is not a multiple of the "
                                       f"{t.tensor_type.name} block ({block_elems})")
        nbytes = math.prod(shape) // block_elems * block_bytes
        if t.data_offset % self.reader.alignment or t.data_offset + nbytes > len(self.reader.data):
            raise GGUFError(self.path, f"tensor {t.name!r}: data at {t.data_offset}+{nbytes} lies outside "
                                       f"the file ({len(self.reader.data)} bytes) or is misaligned")
        raw = self.reader.data[t.data_offset:t.data_offset + nbytes]
        return TensorInfo(t.name, t.tensor_type, shape, t.data_offset, nbytes, raw)

    def _get(self, key: str, kind: type, default: Any = None) -> Any:
        value = self.metadata.get(key, default)
        if value is None:
            raise GGUFError(self.path, f"metadata key {key!r} is missing")
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise GGUFError(self.path, f"metadata {key!r} = {value!r} is not an integer")
        if kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise GGUFError(self.path, f"metadata {key!r} = {value!r} is not a finite number")
            value = float(value)
        return value

    def _config(self) -> LlamaConfig:
        a = self.architecture
        n_heads = self._get(f"{a}.attention.head_count", int)
        d_model = self._get(f"{a}.embedding_length", int)
        n_layers = self._get(f"{a}.block_count", int)
        for key, v in (("attention.head_count", n_heads), ("embedding_length", d_model), ("block_count", n_layers)):
            if not 0 < v < 1 << 20:
                raise GGUFError(self.path, f"metadata {a}.{key} = {v} is out of range")
        if d_model % n_heads:
            raise GGUFError(self.path, f"{a}.embedding_length {d_model} is not divisible by head_count {n_heads}")
        head_dim = self._get(f"{a}.attention.key_length", int, d_model // n_heads)
        n_kv = self._get(f"{a}.attention.head_count_kv", int, n_heads)
        if not 0 < n_kv <= n_heads or n_heads % n_kv:
            raise GGUFError(self.path, f"head_count_kv {n_kv} does not divide head_count {n_heads}")
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        vocab_default = len(tokens) if isinstance(tokens, list) else None
        if "token_embd.weight" in self.tensors:
            vocab_default = self.tensors["token_embd.weight"].shape[0]
        vocab = self._get(f"{a}.vocab_size", int, vocab_default)
        rope_dim = self._get(f"{a}.rope.dimension_count", int, head_dim)
        if rope_dim > head_dim or rope_dim % 2:
            raise GGUFError(self.path, f"rope.dimension_count {rope_dim} must be even and ≤ head dim {head_dim}")
        scaling = self.metadata.get(f"{a}.rope.scaling.type", "none")
        rope_scale = 1.0
        if scaling == "linear":
            factor = self._get(f"{a}.rope.scaling.factor", float, 1.0)
            rope_scale = factor if factor > 0 else 1.0
        elif scaling not in ("none", None):
            raise GGUFError(self.path, f"rope scaling {scaling!r} is not supported (none, linear; "
                                       "Llama 3.1 scaling comes through the rope_freqs tensor)")
        return LlamaConfig(
            n_layers=n_layers, d_model=d_model, d_ff=self._get(f"{a}.feed_forward_length", int),
            n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, vocab_size=vocab,
            context_length=self._get(f"{a}.context_length", int, 2048),
            rms_eps=self._get(f"{a}.attention.layer_norm_rms_epsilon", float, 1e-5),
            rope_base=self._get(f"{a}.rope.freq_base", float, 10000.0),
            rope_dim=rope_dim, rope_neox=False, rope_scale=rope_scale,
            tied_output="output.weight" not in self.tensors)

    def _check_tensors(self) -> None:
        c = self.config
        expected = {"token_embd.weight": (c.vocab_size, c.d_model), "output_norm.weight": (c.d_model,)}
        if not c.tied_output:
            expected["output.weight"] = (c.vocab_size, c.d_model)
        if "rope_freqs.weight" in self.tensors:
            expected["rope_freqs.weight"] = (c.rope_dim // 2,)
        for i in range(c.n_layers):
            for name, shape in _layer_tensor_shapes(c).items():
                expected[f"blk.{i}.{name}"] = shape
        for name, shape in expected.items():
            t = self.tensors.get(name)
            if t is None:
                raise GGUFError(self.path, f"tensor {name!r} is missing")
            if t.shape != shape:
                raise GGUFError(self.path, f"tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
            if len(shape) == 1 and t.qtype not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16,
                                                  GGMLQuantizationType.BF16):
                raise GGUFError(self.path, f"tensor {name!r} is {t.qtype.name}; norms must be F32/F16/BF16")

    def check_finite(self) -> None:
        """Raise GGUFError naming the first tensor whose scales (or, for float tensors, values)
        hold NaN or infinity: such a model can only produce invalid logits. See nonfinite_scales."""
        for t in self.tensors.values():
            bad = nonfinite_scales(t)
            if bad is not None:
                i, field = bad
                where = f"value {i}" if field == "value" else f"block {i} has a {field} scale that"
                raise GGUFError(self.path, f"tensor {t.name!r} ({t.qtype.name}): {where} is NaN or infinite; "
                                           "the file is corrupt or was written wrong: download or convert it again")

    # ---- tensor access --------------------------------------------------------------------

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(self.path, f"tensor {name!r} is missing") from None

    def dequantize(self, name: str) -> np.ndarray:
        """The whole tensor as float32 in numpy order."""
        t = self.tensor(name)
        return dequantize(t.data, t.qtype, t.shape)

    def dequantize_rows(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Rows of a 2-D tensor as float32 (rows, n_in): an embedding lookup."""
        t = self.tensor(name)
        return dequantize_rows(t.data.reshape(t.shape[0], t.row_bytes), t.qtype, rows, t.shape[-1])

    def layer_tensors(self, i: int) -> dict[str, TensorInfo]:
        return {n: self.tensors[f"blk.{i}.{n}.weight"] for n in LAYER_TENSORS}

    def on_layer_loaded(self, callback: Callable[[int], None] | None) -> None:
        """Have callback(i) called as a backend finishes loading layer i (load progress); None
        stops it. Planning and size queries (layer_tensors, layer_bytes) are not loading."""
        self._on_layer_loaded = callback

    def layer_loaded(self, i: int) -> None:
        """Backends call this once layer i's weights are in place (or, for a layer streamed from
        storage, once its reads are planned)."""
        if self._on_layer_loaded is not None:
            self._on_layer_loaded(i)

    def layer_bytes(self, i: int) -> int:
        return sum(t.nbytes for t in self.layer_tensors(i).values())

    def describe(self) -> Mapping[str, Any]:
        """What `ntx-model info` prints."""
        types: dict[str, int] = {}
        for t in self.tensors.values():
            types[t.qtype.name] = types.get(t.qtype.name, 0) + 1
        return {
            "path": self.path, "architecture": self.architecture,
            "name": self.metadata.get("general.name"),
            "config": dataclasses.asdict(self.config), "tensor_types": types,
            "file_bytes": self.file_size,
            "tensor_bytes": sum(t.nbytes for t in self.tensors.values()),
            "layer_bytes": [self.layer_bytes(i) for i in range(self.config.n_layers)],
        }
