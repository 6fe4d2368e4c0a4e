"""A GGUF model file: metadata, the Llama config, and tensors by their GGUF names.

The header is parsed here (`_read_header`) with every count and length checked against the
bytes that remain, so a corrupted array length fails at once instead of looping through the
file; it is also several times faster than gguf-py's GGUFReader on a vocabulary of 50k-150k
strings. Tensor data is memory-mapped and stays in the page cache until a backend asks for it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import mmap
import os
import struct
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

from ntransformerd.engine.quants import BLOCK_DTYPES, QUANT_BLOCKS, dequantize, dequantize_rows

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHITECTURES = ("llama",)

# GGUF metadata value types: the struct format of each scalar one.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_SCALAR_SIZES = {t: struct.calcsize("<" + f) for t, f in _SCALAR_FORMATS.items()}
_T_STRING, _T_ARRAY = 8, 9
_MAX_DIMS = 4
DEFAULT_ALIGNMENT = 32


class GGUFError(ValueError):
    """A GGUF file that cannot be used; the message names the file, what and why."""

    def __init__(self, path: str | os.PathLike, problem: str):
        super().__init__(f"{os.fspath(path)}: {problem}")
        self.path = os.fspath(path)
        self.problem = problem


@dataclasses.dataclass
class _Header:
    metadata: dict[str, Any]
    tensors: list[tuple[str, list[int], int, int]]  # (name, GGUF dims, type, offset in the data section)
    data_offset: int
    alignment: int


def _quoted(text: str, limit: int = 80) -> str:
    """A name read from the file, for a message: bounded (a corrupt length makes it huge)."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}… ({len(text)} characters)"


def _read_header(path: str, buf: memoryview) -> _Header:
    """Parse the GGUF header with every count and length checked against the bytes that remain;
    raise GGUFError on the first lie. Values come back as Python objects (strings decoded as
    UTF-8, arrays as lists), the way gguf-py's ReaderField.contents() gives them."""
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

    def raw_string(what: str) -> bytes:
        nonlocal pos
        n = u64(f"{what} length")
        need(n, what)
        s = bytes(buf[pos:pos + n])
        pos += n
        return s

    def string(what: str) -> str:
        try:
            return raw_string(what).decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(path, f"{what} is not UTF-8 text ({e.reason} at byte {e.start})") from None

    def value(vtype: int, what: str, depth: int = 0) -> Any:
        nonlocal pos
        if vtype in _SCALAR_FORMATS:
            need(_SCALAR_SIZES[vtype], what)
            (v,) = struct.unpack_from("<" + _SCALAR_FORMATS[vtype], buf, pos)
            pos += _SCALAR_SIZES[vtype]
            return v
        if vtype == _T_STRING:
            return string(what)
        if vtype == _T_ARRAY:
            if depth > 0:
                raise GGUFError(path, f"{what}: nested arrays are not supported")
            itype = u32(f"{what} item type")
            count = u64(f"{what} count")
            if itype in _SCALAR_FORMATS:
                need(count * _SCALAR_SIZES[itype], f"{what} ({count} items)")
                items = np.frombuffer(buf, np.dtype("<" + _SCALAR_FORMATS[itype]), count, pos).tolist()
                pos += count * _SCALAR_SIZES[itype]
                return items
            if itype == _T_STRING:
                need(count * 8, f"{what} ({count} strings)")  # every string has an 8-byte length
                return [string(what) for _ in range(count)]
            raise GGUFError(path, f"{what}: unknown array item type {itype}")
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
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = string(f"metadata key #{i}")
        if key in metadata:
            raise GGUFError(path, f"duplicate metadata key {_quoted(key)}")
        metadata[key] = value(u32(f"type of {_quoted(key)}"), f"metadata {_quoted(key)}")
    tensors = []
    names: set[str] = set()
    for i in range(n_tensors):
        name = raw_string(f"tensor #{i} name").decode(errors="replace")
        if name in names:
            raise GGUFError(path, f"tensor {_quoted(name)} appears twice")
        names.add(name)
        n_dims = u32(f"tensor {_quoted(name)} dimension count")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise GGUFError(path, f"tensor {_quoted(name)}: {n_dims} dimensions (1..{_MAX_DIMS} allowed)")
        dims = [u64(f"tensor {_quoted(name)} dims") for _ in range(n_dims)]
        if any(d == 0 or d > 2**40 for d in dims) or math.prod(dims) > 2**42:
            raise GGUFError(path, f"tensor {_quoted(name)}: absurd shape {dims}")
        ttype = u32(f"tensor {_quoted(name)} type")
        try:
            GGMLQuantizationType(ttype)
        except ValueError:
            raise GGUFError(path, f"tensor {_quoted(name)}: unknown tensor type {ttype}") from None
        tensors.append((name, dims, ttype, u64(f"tensor {_quoted(name)} offset")))
    align = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(align, bool) or not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise GGUFError(path, f"general.alignment {align!r} is not a power of two")
    return _Header(metadata, tensors, -(-pos // align) * align, align)


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
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                    view = memoryview(mm)
                    try:
                        header = _read_header(self.path, view)
                    finally:
                        view.release()
            self.data = np.memmap(self.path, dtype=np.uint8, mode="r")
        except OSError as e:
            raise GGUFError(self.path, f"cannot open: {e.strerror or e}") from e
        self.metadata: dict[str, Any] = header.metadata
        self.data_offset, self.alignment = header.data_offset, header.alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, ttype, offset in header.tensors:
            self.tensors[name] = self._tensor_info(name, dims, GGMLQuantizationType(ttype),
                                                   header.data_offset + offset)
        self.file_size = size
        self.architecture = self.metadata.get("general.architecture")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise GGUFError(self.path, f"architecture {self.architecture!r} is not supported "
                                       f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        self.config = self._config()
        self._check_tensors()

    def _tensor_info(self, name: str, dims: list[int], qtype: GGMLQuantizationType, offset: int) -> TensorInfo:
        if qtype not in QUANT_BLOCKS:
            raise GGUFError(self.path, f"tensor {_quoted(name)}: type {qtype.name} is not supported "
                                       f"(supported: {', '.join(q.name for q in QUANT_BLOCKS)})")
        shape = tuple(reversed(dims))
        block_elems, block_bytes = QUANT_BLOCKS[qtype]
        if shape[-1] % block_elems:
            raise GGUFError(self.path, f"tensor {_quoted(name)}: row of {shape[-1]} is not a multiple of the "
                                       f"{qtype.name} block ({block_elems})")
        nbytes = math.prod(shape) // block_elems * block_bytes
        if offset % self.alignment or offset + nbytes > len(self.data):
            raise GGUFError(self.path, f"tensor {_quoted(name)}: data at {offset}+{nbytes} lies outside "
                                       f"the file ({len(self.data)} bytes) or is misaligned")
        return TensorInfo(name, qtype, shape, offset, nbytes, self.data[offset:offset + nbytes])

    @functools.cached_property
    def reader(self) -> GGUFReader:
        """gguf-py's reader of the same file, for tools and tests that want its field layout
        (slow: parsed on first use)."""
        return GGUFReader(self.path, "r")

    def _get(self, key: str, kind: type, default: Any = None) -> Any:
        value = self.metadata.get(key, default)
        if value is None:
            raise GGUFError(self.path, f"metadata key {key!r} is missing")
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise GGUFError(self.path, f"metadata {key!r} = {_quoted(repr(value))} is not an integer")
        if kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise GGUFError(self.path, f"metadata {key!r} = {_quoted(repr(value))} is not a finite number")
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
