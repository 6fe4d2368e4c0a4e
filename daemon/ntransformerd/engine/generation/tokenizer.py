"""Tokenizer built from GGUF metadata, matching llama.cpp's llama-vocab.cpp token for token.

Two vocabulary kinds are supported, named by ``tokenizer.ggml.model``:

* ``gpt2``: byte-level BPE. The pre-tokenizer regex splits depend on ``tokenizer.ggml.pre``
  (table ``_PRE_TYPES``, copied from llama.cpp's ``llm_tokenizer_bpe``); the BPE itself runs in
  the ``tokenizers`` library (Rust), which gives the same ids as llama.cpp's merge loop.
* ``llama``: SentencePiece BPE driven by token scores, spaces as ``▁``, ``<0xNN>`` byte
  fallback and ``add_space_prefix``. ``tokenizers`` cannot merge by score, so this part is
  written out here (``_spm_tokenize``), following llama.cpp's ``llm_tokenizer_spm_session``.

Special tokens (type CONTROL, USER_DEFINED, UNKNOWN) are cut out of the text first, longest
token first, exactly as llama.cpp's ``tokenizer_st_partition``; CONTROL and UNKNOWN tokens only
when ``parse_special`` is true, USER_DEFINED ones always.

Thread rule: a ``Tokenizer`` is immutable after construction and safe to share between
threads; a ``Detokenizer`` belongs to one sequence and one thread.
"""

from __future__ import annotations

import codecs
import heapq
import logging
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from tokenizers import Regex, Tokenizer as HFTokenizer, models, pre_tokenizers

log = logging.getLogger(__name__)

__all__ = ["Tokenizer", "Detokenizer", "TokenizerError", "PRE_TOKENIZER_NAMES"]


class TokenizerError(ValueError):
    """The GGUF's tokenizer metadata is missing, malformed or of an unsupported kind."""


# GGUF token types (gguf.TokenType / llama.h LLAMA_TOKEN_TYPE_*).
TOKEN_TYPE_UNDEFINED = 0
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

# Token attribute bits, as llama.h's LLAMA_TOKEN_ATTR_*. Bits rather than the bare type because
# llama.cpp ORs CONTROL into tokens that look like end-of-turn markers whatever their type.
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5

_TYPE_TO_ATTR = {
    TOKEN_TYPE_UNKNOWN: ATTR_UNKNOWN,
    TOKEN_TYPE_UNUSED: ATTR_UNUSED,
    TOKEN_TYPE_NORMAL: ATTR_NORMAL,
    TOKEN_TYPE_CONTROL: ATTR_CONTROL,
    TOKEN_TYPE_USER_DEFINED: ATTR_USER_DEFINED,
    TOKEN_TYPE_BYTE: ATTR_BYTE,
}
_ATTR_PARSED_SPECIAL = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN
_ATTR_HIDDEN = ATTR_CONTROL | ATTR_UNKNOWN  # rendered only when special=True

# ---------------------------------------------------------------------------------------------
# Pre-tokenizer regexes (llama.cpp src/llama-vocab.cpp, llm_tokenizer_bpe). Each list is applied
# in order; every regex splits each piece left by the previous one into matches and the gaps
# between them (the "isolated" behaviour), so no text is ever dropped.

_CONTRACTIONS_CI = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_RE_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_RE_LLAMA3 = (
    _CONTRACTIONS_CI
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_QWEN2 = (
    _CONTRACTIONS_CI
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_REGEXES: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _RE_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt2": (_RE_GPT2,),
    "llama3": (_RE_LLAMA3,),
    "starcoder": (r"\p{N}", _RE_GPT2),
    "qwen2": (_RE_QWEN2,),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _RE_GPT2, r"[0-9][0-9][0-9]"),
}


@dataclass(frozen=True)
class _PreType:
    regexes: str  # key of _REGEXES
    clean_spaces: bool = True  # llama.cpp's detokenize "clean_spaces" pass
    ignore_merges: bool = False  # a word already in the vocab is one token, merges skipped
    add_bos: bool = False  # default when the GGUF has no tokenizer.ggml.add_bos_token


_LLAMA3 = _PreType("llama3", ignore_merges=True, add_bos=True)
_PRE_TYPES: dict[str, _PreType] = {
    "default": _PreType("default"),
    # LLAMA_VOCAB_PRE_TYPE_LLAMA3
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "falcon3": _LLAMA3,
    "falcon-h1": _LLAMA3, "pixtral": _LLAMA3,
    "dbrx": _PreType("llama3"), "smaug-bpe": _PreType("llama3"),
    # LLAMA_VOCAB_PRE_TYPE_GPT2 / MPT / OLMO
    "gpt-2": _PreType("gpt2"), "phi-2": _PreType("gpt2"), "mpt": _PreType("gpt2"),
    "olmo": _PreType("gpt2"), "exaone4": _PreType("gpt2"),
    # LLAMA_VOCAB_PRE_TYPE_STARCODER and friends: digits one by one, then the GPT-2 regex
    "starcoder": _PreType("starcoder"), "refact": _PreType("starcoder"),
    "codeshell": _PreType("starcoder"), "exaone": _PreType("starcoder"),
    "minerva-7b": _PreType("starcoder"),
    "smollm": _PreType("starcoder", clean_spaces=False),
    "command-r": _PreType("starcoder", clean_spaces=False),
    # LLAMA_VOCAB_PRE_TYPE_QWEN2 / STABLELM2
    "qwen2": _PreType("qwen2", clean_spaces=False),
    "deepseek-r1-qwen": _PreType("qwen2", clean_spaces=False),
    "megrez": _PreType("qwen2"), "stablelm2": _PreType("qwen2"),
    "falcon": _PreType("falcon"),
}
PRE_TOKENIZER_NAMES = frozenset(_PRE_TYPES)

# ---------------------------------------------------------------------------------------------
# End-of-generation heuristics (llama-vocab.cpp, "auto-detect special tokens by text"). llama.cpp
# notes these are a workaround until converters write every id into the metadata.

_EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
)
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
_FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_FIM_SEP_TEXTS = ("<|file_sep|>",)
_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
))
# gpt-oss: llama.cpp always renders these as text
_FORCE_USER_DEFINED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")

_SPM_SPACE = "\u2581"  # ▁


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the ``Ġ`` for space)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_TO_CHAR = _bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


def _md_get(metadata: Mapping[str, Any], key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    value = metadata.get(key, default)
    if hasattr(value, "item") and not isinstance(value, (list, str)):
        value = value.item()  # a numpy scalar, where a caller kept GGUFReader's raw values
    if value is not default and not isinstance(value, kind):
        raise TokenizerError(f"GGUF metadata {key!r} has type {type(value).__name__}, expected {kind}")
    return value


class Tokenizer:
    """Encode text to token ids and back, as llama.cpp does for the same GGUF.

    Build with ``Tokenizer.from_metadata(metadata)``. Public attributes: ``vocab_size``,
    ``bos_id``, ``eos_id``, ``eot_id``, ``unk_id`` (``None`` where the model has none),
    ``eog_ids`` (every id that ends generation), ``add_bos``, ``add_eos`` (what add_special
    adds), ``model`` ("gpt2" or "llama"), ``pre`` (tokenizer.ggml.pre, None for "llama").
    """

    def __init__(self) -> None:  # use from_metadata
        raise TypeError("use Tokenizer.from_metadata(metadata)")

    # --- construction ---------------------------------------------------------------------

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> "Tokenizer":
        """Build from ``{key: field.contents()}`` of a GGUF file (see module docstring)."""
        self = object.__new__(cls)
        model = _md_get(metadata, "tokenizer.ggml.model", str)
        if model is None:
            raise TokenizerError("GGUF has no tokenizer.ggml.model; cannot build a tokenizer")
        if model not in ("gpt2", "llama"):
            raise TokenizerError(
                f"unsupported tokenizer.ggml.model {model!r}: ntransformer supports 'gpt2' "
                "(byte-level BPE) and 'llama' (SentencePiece BPE)")
        self.model = model

        tokens = _md_get(metadata, "tokenizer.ggml.tokens", list)
        if not tokens:
            raise TokenizerError("GGUF has no tokenizer.ggml.tokens; cannot build a tokenizer")
        n = len(tokens)
        scores = _md_get(metadata, "tokenizer.ggml.scores", list)
        types = _md_get(metadata, "tokenizer.ggml.token_type", list)
        for key, arr in (("tokenizer.ggml.scores", scores), ("tokenizer.ggml.token_type", types)):
            if arr is not None and len(arr) < n:
                raise TokenizerError(f"{key} has {len(arr)} entries for {n} tokens")

        texts: list[str] = []
        token_to_id: dict[str, int] = {}
        for i, t in enumerate(tokens):
            if not isinstance(t, str):
                raise TokenizerError(f"tokenizer.ggml.tokens[{i}] is not a string")
            if not t:
                t = f"[EMPTY_{i}]"  # as llama.cpp, so the text -> id map stays one-to-one
            if t in token_to_id:
                raise TokenizerError(f"duplicate token in vocabulary: {t!r} has ids {token_to_id[t]} and {i}")
            token_to_id[t] = i
            texts.append(t)
        attrs = [ATTR_NORMAL] * n if types is None else [_TYPE_TO_ATTR.get(int(x), 0) for x in types[:n]]
        self._texts = texts
        self._token_to_id = token_to_id
        self._scores = [0.0] * n if scores is None else [float(s) for s in scores[:n]]
        self.vocab_size = n

        # --- per-kind defaults, then the metadata overrides (llama_vocab::impl::load order)
        if model == "llama":
            self.pre = None
            pre_type = None
            bos, eos, unk = 1, 2, 0
            add_bos, add_eos, add_space_prefix, self._clean_spaces = True, False, True, False
        else:
            pre = _md_get(metadata, "tokenizer.ggml.pre", str)
            if not pre:
                log.warning("GGUF has no tokenizer.ggml.pre; using 'default' as llama.cpp does "
                            "(generation quality may be degraded; consider reconverting the model)")
                pre = "default"
            pre_type = _PRE_TYPES.get(pre)
            if pre_type is None:
                raise TokenizerError(
                    f"unknown pre-tokenizer type tokenizer.ggml.pre={pre!r}; supported: "
                    + ", ".join(sorted(_PRE_TYPES)))
            self.pre = pre
            bos, eos, unk = 11, 11, None
            add_bos, add_eos, add_space_prefix = pre_type.add_bos, False, False
            self._clean_spaces = pre_type.clean_spaces

        add_space_prefix = _md_get(metadata, "tokenizer.ggml.add_space_prefix", bool, add_space_prefix)

        def special_id(keys: Iterable[str], default: int | None) -> int | None:
            value = default if default is not None and 0 <= default < n else None
            for key in keys:
                got = _md_get(metadata, key, int)
                if got is None:
                    continue
                if 0 <= got < n:
                    value = int(got)
                else:
                    log.warning("bad special token %s = %d (vocab has %d); using %s", key, got, n, value)
            return value

        p = "tokenizer.ggml."
        self.bos_id = special_id([p + "bos_token_id"], bos)
        self.eos_id = special_id([p + "eos_token_id"], eos)
        self.unk_id = special_id([p + "unknown_token_id"], unk)
        eot_id = special_id([p + "eot_token_id"], None)
        eom_id = special_id([p + "eom_token_id"], None)
        fim_pad = special_id([p + "fim_pad_token_id"], None)
        fim_rep = special_id([p + "fim_rep_token_id"], None)
        fim_sep = special_id([p + "fim_sep_token_id"], None)

        self.add_bos = _md_get(metadata, p + "add_bos_token", bool, add_bos)
        self.add_eos = _md_get(metadata, p + "add_eos_token", bool, add_eos)
        if self.add_bos and self.bos_id is None:
            raise TokenizerError("tokenizer.ggml.add_bos_token is true, but the model has no BOS token")
        if self.add_eos and self.eos_id is None:
            raise TokenizerError("tokenizer.ggml.add_eos_token is true, but the model has no EOS token")
        self._add_space_prefix = add_space_prefix

        self.eot_id, self.eog_ids = _end_of_generation(
            texts, token_to_id, attrs, eos_id=self.eos_id, eot_id=eot_id, eom_id=eom_id,
            fim_ids={"pad": fim_pad, "rep": fim_rep, "sep": fim_sep})
        self._attrs = attrs

        # Special tokens cut out of the text before tokenizing, longest text first (llama.cpp's
        # cache_special_tokens; ties broken by id here, where llama.cpp's std::sort is unstable).
        special = [i for i in range(n) if attrs[i] & _ATTR_PARSED_SPECIAL]
        special.sort(key=lambda i: (-len(texts[i].encode("utf-8")), i))
        self._special_ids = special

        self._pieces = [self._piece(i) for i in range(n)]

        if model == "gpt2":
            merges = _md_get(metadata, p + "merges", list)
            if merges is None:
                raise TokenizerError("GGUF has no tokenizer.ggml.merges; a gpt2 tokenizer needs them")
            self._hf = _build_hf_bpe(token_to_id, merges, _REGEXES[pre_type.regexes], pre_type.ignore_merges)
        else:
            self._hf = None
            self._byte_ids = [self._spm_byte_token(b) for b in range(256)]
        return self

    def _spm_byte_token(self, b: int) -> int | None:
        i = self._token_to_id.get(f"<0x{b:02X}>")
        if i is None:
            i = self._token_to_id.get(chr(b)) if b < 0x80 else None
        return i

    def _piece(self, i: int) -> tuple[bytes, bytes]:
        """(text when special tokens are hidden, text when shown) of token i, llama.cpp's
        token_to_piece. CONTROL/UNKNOWN are empty unless shown; UNUSED tokens are always empty."""
        attr, text = self._attrs[i], self._texts[i]
        raw = text.encode("utf-8")
        if attr & (_ATTR_HIDDEN | ATTR_USER_DEFINED):
            return (b"" if attr & _ATTR_HIDDEN else raw), raw
        if attr & ATTR_NORMAL:
            if self.model == "llama":
                out = text.replace(_SPM_SPACE, " ").encode("utf-8")
            else:
                out = _byte_level_decode(text)
            return out, out
        if attr & ATTR_BYTE:
            out = bytes([int(text[3:5], 16)])
            return out, out
        return b"", b""

    # --- public API -----------------------------------------------------------------------

    def encode(self, text: str, *, parse_special: bool = True, add_special: bool = True) -> list[int]:
        """Token ids of ``text``.

        parse_special: special-token texts (``<|im_start|>``...) become their single id; when
        false, CONTROL tokens are tokenized as plain text (USER_DEFINED ones still are not).
        add_special: add BOS/EOS exactly where the GGUF asks (tokenizer.ggml.add_bos_token /
        add_eos_token and llama.cpp's per-model defaults); ``self.add_bos``/``add_eos`` say which.
        """
        self._check_text(text)
        return self._encode_fragments(self._partition(text, parse_special), add_special)

    def encode_parts(self, parts: Sequence[tuple[str, bool]], *, add_special: bool = True) -> list[int]:
        """Token ids of the texts of ``parts`` (text, literal) joined: special-token texts
        become their id only in parts that are not literal (a chat template's own text); a
        literal part (a message's content) is tokenized as with parse_special=False."""
        for text, _ in parts:
            self._check_text(text)
        return self._encode_fragments(self._partition_parts(parts), add_special)

    def _check_text(self, text: str) -> None:
        if not isinstance(text, str):
            raise TypeError(f"encode() takes str, not {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"text is not valid Unicode (lone surrogate at {e.start})") from None

    def _encode_fragments(self, fragments: list[str | int], add_special: bool) -> list[int]:
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self.bos_id)
        if self.model == "gpt2":
            raw = [f for f in fragments if isinstance(f, str)]
            encoded = iter(self._hf.encode_batch(raw, add_special_tokens=False)) if raw else iter(())
            for f in fragments:
                if isinstance(f, str):
                    out.extend(next(encoded).ids)
                else:
                    out.append(f)
        else:
            prev_special = True  # SentencePiece prefixes a space at the start and after a special token
            for f in fragments:
                if isinstance(f, str):
                    if self._add_space_prefix and prev_special:
                        f = " " + f
                    self._spm_tokenize(f.replace(" ", _SPM_SPACE), out)
                    prev_special = False
                else:
                    out.append(f)
                    prev_special = True
        if add_special and self.add_eos:
            out.append(self.eos_id)
        return out

    def decode(self, ids: Iterable[int], *, special: bool = True) -> str:
        """Text of ``ids``, as llama.cpp's llama_detokenize (remove_special=False) gives it.

        special: render CONTROL/UNKNOWN tokens (``<|im_end|>``) as their text; when false they
        are dropped. Bytes that do not form UTF-8 become U+FFFD. As in llama.cpp, a vocabulary
        with add_space_prefix drops one leading space of the first token, and the pre-types
        that ask for it (llama-bpe, gpt-2, default; not smollm or qwen2) get the "clean spaces"
        pass (" ," -> ","). For streamed output use ``Detokenizer``, which does neither.
        """
        parts = [self._pieces[self._check_id(i)][1 if special else 0] for i in ids]
        if parts and self._add_space_prefix and parts[0].startswith(b" "):
            parts[0] = parts[0][1:]
        data = b"".join(parts)
        if self._clean_spaces:
            data = _clean_spaces(data)
        return data.decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int, *, special: bool = True) -> bytes:
        """Raw bytes token ``token_id`` stands for (may be part of a UTF-8 character).
        special=False gives b"" for CONTROL/UNKNOWN tokens, as the streamed output shows them."""
        return self._pieces[self._check_id(token_id)][1 if special else 0]

    def token_text(self, token_id: int) -> str:
        """The token's string as stored in the GGUF (``Ġthe``, ``▁the``, ``<|im_end|>``)."""
        return self._texts[self._check_id(token_id)]

    def token_id(self, text: str) -> int | None:
        """Id of the token whose GGUF string is exactly ``text``, or None."""
        return self._token_to_id.get(text)

    def is_control(self, token_id: int) -> bool:
        """True for tokens hidden from output text (CONTROL or UNKNOWN type)."""
        return bool(self._attrs[self._check_id(token_id)] & _ATTR_HIDDEN)

    def pre_split(self, text: str) -> list[str]:
        """The pre-tokenizer's word split of ``text`` (gpt2 vocabularies; for tests and
        debugging). Pieces are plain text, before the byte-level mapping."""
        if self._hf is None:
            raise TokenizerError("pre_split() applies to gpt2 (byte-level BPE) vocabularies only")
        pieces = self._hf.pre_tokenizer.pre_tokenize_str(text)
        return [text[a:b] for _, (a, b) in pieces]

    def __repr__(self) -> str:
        return (f"Tokenizer(model={self.model!r}, pre={self.pre!r}, vocab_size={self.vocab_size}, "
                f"bos_id={self.bos_id}, eos_id={self.eos_id}, eog_ids={sorted(self.eog_ids)})")

    # --- internals ------------------------------------------------------------------------

    def _check_id(self, i: int) -> int:
        if not 0 <= i < self.vocab_size:
            raise ValueError(f"token id {i} out of range [0, {self.vocab_size})")
        return i

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        return self._partition_parts([(text, not parse_special)])

    def _partition_parts(self, parts: Iterable[tuple[str, bool]]) -> list[str | int]:
        """Cut special tokens out of the texts of ``parts`` (text, literal): each special token in
        turn (longest first) splits every remaining text fragment at all its occurrences
        (llama.cpp tokenizer_st_partition); CONTROL tokens only outside literal parts. Text
        fragments that end up next to each other are joined again, so the literal marks change
        nothing but which special tokens are found."""
        fragments: list[tuple[str, bool] | int] = [(t, lit) for t, lit in parts if t]
        for sid in self._special_ids:
            hidden = bool(self._attrs[sid] & _ATTR_HIDDEN)
            st = self._texts[sid]

            def splits(f) -> bool:
                return isinstance(f, tuple) and not (f[1] and hidden) and st in f[0]

            if not any(splits(f) for f in fragments):
                continue
            cut: list[tuple[str, bool] | int] = []
            for f in fragments:
                if not splits(f):
                    cut.append(f)
                    continue
                for j, part in enumerate(f[0].split(st)):
                    if j:
                        cut.append(sid)
                    if part:
                        cut.append((part, f[1]))
            fragments = cut
        out: list[str | int] = []
        for f in fragments:
            if isinstance(f, int):
                out.append(f)
            elif out and isinstance(out[-1], str):
                out[-1] += f[0]
            else:
                out.append(f[0])
        return out

    def _spm_tokenize(self, text: str, out: list[int]) -> None:
        """SentencePiece BPE over one fragment (spaces already ``▁``): start from single
        characters and keep merging the adjacent pair whose merged text is the highest-scoring
        vocabulary token, leftmost first on ties (llama.cpp llm_tokenizer_spm_session)."""
        if not text:
            return
        to_id, scores = self._token_to_id, self._scores
        sym = list(text)  # symbol text; "" once merged into its left neighbour
        prev = list(range(-1, len(sym) - 1))
        nxt = list(range(1, len(sym) + 1))
        nxt[-1] = -1
        heap: list[tuple[float, int, int, str]] = []

        def push(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            merged = sym[left] + sym[right]
            tid = to_id.get(merged)
            if tid is not None:
                heapq.heappush(heap, (-scores[tid], left, right, merged))

        for i in range(1, len(sym)):
            push(i - 1, i)
        while heap:
            _, left, right, merged = heapq.heappop(heap)
            # stale entry: one side already merged elsewhere
            if not sym[left] or not sym[right] or sym[left] + sym[right] != merged or nxt[left] != right:
                continue
            sym[left], sym[right] = merged, ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            push(prev[left], left)
            push(left, nxt[left])

        i = 0
        while i != -1:
            s = sym[i]
            tid = to_id.get(s)
            if tid is not None:
                out.append(tid)
            else:
                # Only a single character can be left without a token (every merge produced a
                # vocabulary token): spell it in byte tokens.
                for b in s.encode("utf-8"):
                    bid = self._byte_ids[b]
                    if bid is None:
                        raise TokenizerError(f"character {s!r} has no token and the vocabulary "
                                             f"has no byte token <0x{b:02X}>")
                    out.append(bid)
            i = nxt[i]


def _end_of_generation(texts: list[str], token_to_id: dict[str, int], attrs: list[int], *,
                       eos_id: int | None, eot_id: int | None, eom_id: int | None,
                       fim_ids: dict[str, int | None]) -> tuple[int | None, frozenset[int]]:
    """(eot id, end-of-generation ids) by llama.cpp's text heuristics (llama_vocab::impl::load),
    marking the tokens found CONTROL in ``attrs`` as it does. Where llama.cpp takes "the first"
    match while walking a hash map (unspecified order), the lowest id is taken here."""

    def first_of(names: Sequence[str]) -> int | None:
        ids = [token_to_id[t] for t in names if t in token_to_id]
        if not ids:
            return None
        attrs[min(ids)] |= ATTR_CONTROL
        return min(ids)

    if eot_id is None:
        eot_id = first_of(_EOT_TEXTS)
    if eom_id is None:
        eom_id = first_of(_EOM_TEXTS)
    fim = [fim_ids.get(k) if fim_ids.get(k) is not None else first_of(names)
           for k, names in (("pad", _FIM_PAD_TEXTS), ("rep", _FIM_REP_TEXTS), ("sep", _FIM_SEP_TEXTS))]

    eog = {i for i in fim if i is not None}
    for text in _EOG_TEXTS:
        i = token_to_id.get(text)
        if i is not None:
            eog.add(i)
            attrs[i] |= ATTR_CONTROL
    for text in _FORCE_USER_DEFINED:
        if text in token_to_id:
            attrs[token_to_id[text]] = ATTR_USER_DEFINED
    eog.update(i for i in (eos_id, eot_id, eom_id) if i is not None)

    by_text = {texts[i]: i for i in eog}
    has_call = "<|call|>" in by_text or "<|calls|>" in by_text
    # o200k_harmony / solar-open: "<|end|>" ends a message there, not the generation
    if "<|end|>" in by_text and has_call and ("<|return|>" in by_text or "<|flush|>" in by_text):
        eog.discard(by_text["<|end|>"])
        attrs[by_text["<|end|>"]] = ATTR_USER_DEFINED
    # gemma4 / paddleocr: "</s>" is ordinary text there
    if "<|tool_response>" in by_text and "</s>" in by_text:
        eog.discard(by_text["</s>"])
        attrs[by_text["</s>"]] = ATTR_NORMAL
    return eot_id, frozenset(eog)


def _byte_level_decode(text: str) -> bytes:
    """Undo the GPT-2 byte -> character map of a NORMAL token (llama_decode_text)."""
    try:
        return bytes(_CHAR_TO_BYTE[c] for c in text)
    except KeyError:
        out = bytearray()
        for c in text:
            b = _CHAR_TO_BYTE.get(c)
            if b is not None:
                out.append(b)
            else:  # llama.cpp's marker for a character outside the byte map
                out += b"[UNK_BYTE_0x" + c.encode("utf-8").hex().encode() + text.encode("utf-8") + b"]"
        return bytes(out)


def _clean_spaces(text: bytes) -> bytes:
    """llama.cpp detokenize's clean_spaces passes, ported literally (in place, as there): drop
    the space in " ?", " !", " .", " ,"; in " ' " both spaces; before "'s", "'m", "'re", "'ve"."""
    t = bytearray(text)
    # first pass: " ?", " !", " .", " ,"
    n, total = len(t), (1 if t else 0)
    for i in range(1, n):
        x = t[i]
        if t[i - 1] == 0x20 and x in b"?!.,":
            total -= 1
        t[total] = x
        total += 1
    # second pass: a lone apostrophe between spaces
    n, total = total, (1 if total else 0)
    i = 1
    while i < n:
        x = t[i]
        if x == 0x27 and i + 1 < n and t[i - 1] == 0x20 and t[i + 1] == 0x20:
            total -= 1
            i += 1
            t[i] = 0  # llama.cpp blanks the next space so later checks do not see it
        t[total] = x
        total += 1
        i += 1
    # third pass: contractions
    n, total = total, (1 if total else 0)
    for i in range(1, n):
        x = t[i]
        if t[i - 1] == 0x20 and x == 0x27 and i + 1 < n:
            x1 = t[i + 1]
            if x1 in b"sm":
                total -= 1
            elif x1 not in b"td" and i + 2 < n and bytes(t[i + 1:i + 3]) in (b"re", b"ve"):
                total -= 1
        t[total] = x
        total += 1
    return bytes(t[:total])


def _build_hf_bpe(token_to_id: dict[str, int], merges: list, regexes: Sequence[str], ignore_merges: bool):
    pairs = []
    for k, m in enumerate(merges):
        if not isinstance(m, str):
            raise TokenizerError(f"tokenizer.ggml.merges[{k}] is not a string")
        cut = m.find(" ", 1)  # as llama.cpp: the first space after the first character
        if cut < 0:
            raise TokenizerError(f"tokenizer.ggml.merges[{k}] = {m!r} has no space")
        pairs.append((m[:cut], m[cut + 1:]))
    try:
        bpe = models.BPE(vocab=token_to_id, merges=pairs, ignore_merges=ignore_merges)
    except Exception as e:  # tokenizers raises its own exception type for bad merges
        raise TokenizerError(f"cannot build the BPE model from the GGUF vocabulary: {e}") from e
    hf = HFTokenizer(bpe)
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    return hf


class Detokenizer:
    """Streaming text of one generated sequence: ``feed(id)`` returns the new text, never half a
    UTF-8 character (incomplete bytes are held until the next token); ``flush()`` at the end
    returns what is left (invalid bytes as U+FFFD).

    special: show CONTROL tokens such as ``<|im_end|>`` as text. Off by default, as llama.cpp's
    server streams: they are markup, not part of the answer. No clean_spaces pass and no
    leading-space strip here, so the concatenated deltas are the exact bytes of the tokens.

    Thread rule: one Detokenizer per sequence, used by one thread at a time.
    """

    def __init__(self, tokenizer: Tokenizer, *, special: bool = False) -> None:
        self._tok = tokenizer
        self._special = special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._utf8.decode(self._tok.token_bytes(token_id, special=self._special))

    def flush(self) -> str:
        """Text still held back (a trailing incomplete character, as U+FFFD); resets the state."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
