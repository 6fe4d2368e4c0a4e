"""Tokenizer against llama.cpp: golden ids from tests/golden/make_tokenizer_golden.py, the
pre-tokenizer splits on hand-picked strings, and SentencePiece on a hand-made vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ntransformerd.engine.generation.tokenizer import Detokenizer, Tokenizer, TokenizerError

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


@pytest.fixture(scope="module")
def smollm2_metadata(default_model) -> dict:
    return default_model.metadata


@pytest.fixture(scope="module")
def smollm2(smollm2_metadata) -> Tokenizer:
    return Tokenizer.from_metadata(smollm2_metadata)


def _golden(name: str) -> dict:
    return json.loads((GOLDEN / name).read_text(encoding="utf-8"))


def _first_difference(ours: list[int], want: list[int]) -> str:
    for k, (a, b) in enumerate(zip(ours, want)):
        if a != b:
            return f"first difference at position {k}: ours {ours[k:k + 8]} vs llama.cpp {want[k:k + 8]}"
    return f"lengths differ: ours {len(ours)} vs llama.cpp {len(want)} (common prefix equal)"


def _check_golden(tok: Tokenizer, golden: dict) -> None:
    failures = []
    for case in golden["cases"]:
        s = case["text"]
        for key, parse_special, add_special in (("ids", True, False),
                                                 ("ids_parse_special_false", False, False),
                                                 ("ids_add_special", True, True)):
            if key not in case:
                continue
            ours = tok.encode(s, parse_special=parse_special, add_special=add_special)
            if ours != case[key]:
                failures.append(f"{key} of {s[:60]!r}: {_first_difference(ours, case[key])}")
        for special, key in ((True, "detokenized"), (False, "detokenized_no_special")):
            got = tok.decode(case["ids"], special=special)
            if got != case[key]:
                failures.append(f"decode(special={special}) of {s[:60]!r}: {got[:60]!r} != {case[key][:60]!r}")
        d = Detokenizer(tok, special=True)
        streamed = "".join(d.feed(i) for i in case["ids"]) + d.flush()
        if streamed != case["pieces"]:
            failures.append(f"Detokenizer of {s[:60]!r}: {streamed[:60]!r} != {case['pieces'][:60]!r}")
    assert sorted(tok.eog_ids) == golden["eog_ids"], "end-of-generation ids differ from llama.cpp"
    assert not failures, f"{len(failures)} mismatches with llama.cpp:\n" + "\n".join(failures)


# ---- the real model ---------------------------------------------------------------------------

def test_smollm2_matches_llama_cpp(smollm2):
    golden = _golden("tokenizer_smollm2.json")
    assert len(golden["cases"]) >= 40
    _check_golden(smollm2, golden)


def test_smollm2_round_trip(smollm2):
    for case in _golden("tokenizer_smollm2.json")["cases"]:
        s = case["text"]
        assert smollm2.decode(smollm2.encode(s)) == s, s
        assert smollm2.decode(smollm2.encode(s, parse_special=False)) == s, s


def test_smollm2_properties(smollm2):
    t = smollm2
    assert (t.vocab_size, t.bos_id, t.eos_id, t.add_bos, t.add_eos) == (49152, 1, 2, False, False)
    # <|endoftext|>, <|im_end|>, and <reponame> (llama.cpp's FIM-repo heuristic)
    assert t.eog_ids == frozenset({0, 2, 4})
    assert t.encode("hi", add_special=True) == t.encode("hi", add_special=False)  # add_bos_token=false
    assert t.encode("<|im_start|>") == [1]
    assert t.token_bytes(1) == b"<|im_start|>" and t.token_bytes(1, special=False) == b""
    assert t.token_bytes(t.token_id("Ġthe")) == b" the"
    assert t.is_control(2) and not t.is_control(t.token_id("Ġthe"))
    with pytest.raises(ValueError, match="out of range"):
        t.decode([49152])


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "default", "gpt-2"])
def test_other_pre_types_match_llama_cpp(smollm2_metadata, pre):
    """Same vocabulary, other tokenizer.ggml.pre: llama.cpp's splits, ignore_merges, clean-up."""
    golden = _golden(f"tokenizer_pre_{pre}.json")
    tok = Tokenizer.from_metadata({**smollm2_metadata, "tokenizer.ggml.pre": pre})
    _check_golden(tok, golden)


def test_detokenizer_never_splits_a_character(smollm2):
    text = "½ 日本語 😀 👨‍👩‍👧 café"
    ids = smollm2.encode(text)
    d = Detokenizer(smollm2)
    deltas = [d.feed(i) for i in ids]
    assert "".join(deltas) + d.flush() == text
    assert all("\ufffd" not in x for x in deltas)
    # the emoji is spelled in several byte tokens: the first ones give no text yet
    emoji = smollm2.encode("😀")
    assert len(emoji) > 1
    d = Detokenizer(smollm2)
    assert [d.feed(i) for i in emoji][:-1] == [""] * (len(emoji) - 1)
    # an unfinished character is flushed as U+FFFD, and the detokenizer is reusable after
    d = Detokenizer(smollm2)
    assert d.feed(emoji[0]) == "" and d.flush() == "\ufffd"
    assert d.feed(smollm2.encode("a")[0]) == "a"


def test_detokenizer_hides_control_tokens_by_default(smollm2):
    ids = smollm2.encode("Hi<|im_end|>")
    d = Detokenizer(smollm2)
    assert "".join(d.feed(i) for i in ids) == "Hi"
    d = Detokenizer(smollm2, special=True)
    assert "".join(d.feed(i) for i in ids) == "Hi<|im_end|>"


# ---- pre-tokenizer regexes on hand-picked strings ---------------------------------------------

def _with_pre(md: dict, pre: str) -> Tokenizer:
    return Tokenizer.from_metadata({**md, "tokenizer.ggml.pre": pre})


def test_llama3_splits_digits_in_threes_and_contractions_any_case(smollm2_metadata):
    t = _with_pre(smollm2_metadata, "llama-bpe")
    assert t.pre_split("1234567") == ["123", "456", "7"]
    assert t.pre_split("I'M HERE, it's") == ["I", "'M", " HERE", ",", " it", "'s"]
    assert t.pre_split("a\n\n  b") == ["a", "\n\n", " ", " b"]
    assert not t.add_bos  # the GGUF's tokenizer.ggml.add_bos_token=false wins...
    md = {k: v for k, v in smollm2_metadata.items() if k != "tokenizer.ggml.add_bos_token"}
    t = _with_pre(md, "llama-bpe")
    assert t.add_bos and t.encode("hi")[0] == t.bos_id  # ...over llama3's default of true


def test_qwen2_splits_single_digits(smollm2_metadata):
    t = _with_pre(smollm2_metadata, "qwen2")
    assert t.pre_split("x=2024!") == ["x", "=", "2", "0", "2", "4", "!"]
    assert t.pre_split("Don'T") == ["Don", "'T"]


def test_smollm_splits_single_digits_and_lowercase_contractions_only(smollm2_metadata):
    t = _with_pre(smollm2_metadata, "smollm")
    assert t.pre_split("year 2024") == ["year", " ", "2", "0", "2", "4"]
    assert t.pre_split("it's IT'S") == ["it", "'s", " IT", "'", "S"]
    assert t.pre_split("a   b") == ["a", "  ", " b"]


def test_default_splits_punctuation_and_digit_triples(smollm2_metadata):
    t = _with_pre(smollm2_metadata, "default")
    assert t.pre_split("hello, world!!") == ["hello", ",", " world", "!!"]
    assert t.pre_split("x 1234567") == ["x", " ", "123", "456", "7"]


def test_unknown_pre_type_is_a_clear_error(smollm2_metadata):
    with pytest.raises(TokenizerError, match=r"unknown pre-tokenizer type.*'no-such-pre'.*supported: .*llama-bpe"):
        _with_pre(smollm2_metadata, "no-such-pre")


def test_bad_metadata_is_a_clear_error(smollm2_metadata):
    with pytest.raises(TokenizerError, match="unsupported tokenizer.ggml.model 'bert'"):
        Tokenizer.from_metadata({**smollm2_metadata, "tokenizer.ggml.model": "bert"})
    with pytest.raises(TokenizerError, match="no tokenizer.ggml.model"):
        Tokenizer.from_metadata({})
    md = {k: v for k, v in smollm2_metadata.items() if k != "tokenizer.ggml.merges"}
    with pytest.raises(TokenizerError, match="merges"):
        Tokenizer.from_metadata(md)
    with pytest.raises(TokenizerError, match="add_bos_token is true, but the model has no BOS"):
        _spm([("<unk>", 0.0, 2)])  # the default BOS id 1 is outside a 1-token vocabulary


# ---- SentencePiece (tokenizer.ggml.model = llama) ---------------------------------------------

def _spm(tokens: list[tuple[str, float, int]], **extra) -> Tokenizer:
    return Tokenizer.from_metadata({
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [t for t, _, _ in tokens],
        "tokenizer.ggml.scores": [s for _, s, _ in tokens],
        "tokenizer.ggml.token_type": [k for _, _, k in tokens],
        **extra,
    })


HAND_VOCAB = (
    [("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3)]
    + [(f"<0x{b:02X}>", 0.0, 6) for b in range(256)]
    + [("▁", -1.0, 1), ("h", -2.0, 1), ("i", -2.0, 1), ("a", -2.0, 1), ("b", -2.0, 1),
       ("▁h", -3.0, 1), ("hi", -0.5, 1), ("▁hi", -0.1, 1), ("ab", -4.0, 1), ("ba", -4.0, 1),
       ("<x>", 0.0, 4)]
)


def test_spm_hand_vocabulary():
    t = _spm(HAND_VOCAB)
    tid = t.token_id
    assert (t.bos_id, t.eos_id, t.add_bos, t.add_eos) == (1, 2, True, False)  # llama defaults
    # add_space_prefix: "hi" -> "▁hi"; "hi" (-0.5) merges before "▁h" (-3.0), then "▁"+"hi"
    assert t.encode("hi") == [1, tid("▁hi")]
    assert t.encode("hi", add_special=False) == [tid("▁hi")]
    # ties go to the leftmost pair: "aba" -> "ab" + "a", not "a" + "ba"
    assert t.encode("aba", add_special=False) == [tid("▁"), tid("ab"), tid("a")]
    # no token for "é": byte fallback, UTF-8 bytes C3 A9
    assert t.encode("é", add_special=False) == [tid("▁"), tid("<0xC3>"), tid("<0xA9>")]
    # a special token resets the space prefix; USER_DEFINED is parsed even without parse_special
    assert t.encode("<s>hi", add_special=False) == [1, tid("▁hi")]
    assert t.encode("a<x>hi", add_special=False, parse_special=False)[-2:] == [tid("<x>"), tid("▁hi")]
    # decode drops the prefix space of the first token, renders bytes, hides control tokens
    assert t.decode([tid("▁hi"), tid("▁"), tid("<0xC3>"), tid("<0xA9>")]) == "hi é"
    assert t.decode([1, tid("▁hi")], special=False) == " hi"  # as llama_detokenize(remove_special=False)
    assert t.eog_ids == frozenset({2})


def test_spm_without_space_prefix_and_byte_tokens():
    t = _spm(HAND_VOCAB, **{"tokenizer.ggml.add_space_prefix": False, "tokenizer.ggml.add_bos_token": False})
    assert t.encode("hi") == [t.token_id("hi")]
    no_bytes = [x for x in HAND_VOCAB if not x[0].startswith("<0x")]
    t = _spm(no_bytes)
    with pytest.raises(TokenizerError, match="no byte token <0xC3>"):
        t.encode("é")


def test_spm_matches_llama_cpp():
    golden = _golden("tokenizer_spm_tiny.json")
    _check_golden(Tokenizer.from_metadata(golden["metadata"]), golden)


def test_end_of_generation_heuristics():
    extra = [("<|eot_id|>", 0.0, 1), ("<|eom_id|>", 0.0, 3), ("<|fim_pad|>", 0.0, 3), ("<|end|>", 0.0, 3)]
    t = _spm(HAND_VOCAB + extra)
    eot, eom, pad, end = (t.token_id(x[0]) for x in extra)
    assert t.eot_id == eot and t.eog_ids == frozenset({2, eot, eom, pad, end})
    assert t.is_control(eot)  # typed NORMAL in the GGUF, forced CONTROL as llama.cpp does
    # an explicit eot id in the metadata wins over the text heuristics
    assert _spm(HAND_VOCAB + extra, **{"tokenizer.ggml.eot_token_id": 3}).eot_id == 3
    # o200k_harmony: with <|return|> and <|call|>, "<|end|>" ends a message, not the generation
    harmony = extra + [("<|return|>", 0.0, 3), ("<|call|>", 0.0, 3)]
    t = _spm(HAND_VOCAB + harmony)
    assert end not in t.eog_ids and {t.token_id("<|return|>"), t.token_id("<|call|>")} <= t.eog_ids
    assert t.token_bytes(end, special=False) == b"<|end|>"  # now USER_DEFINED: always shown
