"""Make the end-to-end golden file the forward-pass tests compare against (run once; CI reads it).

    .venv/bin/pip install llama-cpp-python      # builds llama.cpp, ~5 minutes
    .venv/bin/python tests/golden/make_forward_golden.py

llama.cpp rounds activations to 8 bits when it multiplies by quantized weights, so the exact
reference is llama.cpp run on an all-F32 copy of the default model (made with our
`quantize_file(..., "f32")`, which only dequantizes; gguf.quants is bit-exact with ggml) with
an F32 KV cache. For every prompt it records llama.cpp's prompt ids, the logits of the last
prompt position, and the 64-token greedy continuation (argmax, end-of-generation ignored).

It also runs the original Q4_1 file and records llama.cpp's greedy continuation there with
the top-1/top-2 logit margin at every step: our float32 engine must agree wherever llama.cpp
itself was not close to a tie.

Writes tests/golden/forward_smollm2.json and tests/golden/forward_smollm2_logits.npz.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
N_GENERATE = 64

LONG = (
    "The history of computing is a story of layers. At the bottom sit transistors, switching "
    "billions of times a second; above them, logic gates and adders; above those, processors "
    "with caches, pipelines and branch predictors. Operating systems manage memory, files and "
    "processes so that programs need not. Compilers translate languages people can read into "
    "instructions machines can run. Networks join machines across rooms and oceans, and the web "
    "joined documents into one vast library. Each layer hides the complexity of the one below "
    "and offers a simpler promise to the one above. Today large language models add another "
    "layer: they read and write text, answer questions, and translate between languages, and "
    "they run on the same silicon, bound by the same memory bandwidth that limited the first "
    "computers. A model with seventy billion parameters must move every weight through the "
    "processor for every word it writes. When the weights do not fit in the fast memory of a "
    "graphics card, they must be streamed from slower memory, layer by layer, and the speed of "
    "that stream sets the pace of the whole system. Engineers therefore cache what they can, "
    "overlap reading with computing, and batch many requests so each byte read serves many "
    "users at once. The same pattern appears in storage: a disk is slow, so the operating system "
    "keeps recently used blocks in memory, and a database keeps its hottest pages in a buffer "
    "pool. Processors keep the most recent data in small caches close to the arithmetic units, "
    "because a trip to main memory costs hundreds of cycles. Good systems are designed around "
    "these costs rather than in spite of them. In summary, the lesson of every layer is the same:"
)

PROMPTS = [
    {"name": "capital", "text": "The capital of France is"},
    {"name": "chat", "text": "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                             "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is gravity? Answer in two "
                             "sentences.<|im_end|>\n<|im_start|>assistant\n",
     "messages": [{"role": "user", "content": "What is gravity? Answer in two sentences."}]},
    {"name": "code", "text": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"},
    {"name": "numbers", "text": "Count from one to twenty: 1, 2, 3, 4, 5,"},
    {"name": "unicode", "text": "Les élèves ont mangé ½ gâteau 🍰 et dit: «C'est délicieux!» Puis"},
    {"name": "long", "text": LONG},
]


def run_llama(path: str, prompt_ids: list[int], n: int) -> tuple[np.ndarray, list[int], list[float]]:
    import llama_cpp

    llm = llama_cpp.Llama(path, n_ctx=1024, n_batch=1024, logits_all=True, verbose=False, n_threads=2,
                          type_k=0, type_v=0, flash_attn=False)  # ggml type 0 = F32 KV cache
    llm.reset()
    llm.eval(prompt_ids)
    first = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
    logits, ids, margins = first, [], []
    for _ in range(n):
        top2 = np.sort(logits)[-2:]
        margins.append(float(top2[1] - top2[0]))
        tok = int(np.argmax(logits))
        ids.append(tok)
        llm.eval([tok])
        logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
    return first, ids, margins


def main() -> int:
    import llama_cpp

    from ntransformerd.engine.runtime.engine import default_model_path
    from ntransformerd.tools.quantize import quantize_file

    src = default_model_path()
    vocab = llama_cpp.Llama(src, vocab_only=True, verbose=False)
    out = {"model": os.path.basename(src), "n_generate": N_GENERATE,
           "llama_cpp_version": llama_cpp.__version__, "prompts": []}
    logits = {}
    with tempfile.TemporaryDirectory() as tmp:
        f32 = os.path.join(tmp, "f32.gguf")
        quantize_file(src, f32, "f32")
        for p in PROMPTS:
            ids = vocab.tokenize(p["text"].encode(), add_bos=False, special=True)
            first, cont, _ = run_llama(f32, ids, N_GENERATE)
            _, q_cont, q_margins = run_llama(src, ids, N_GENERATE)
            logits[p["name"]] = first
            entry = dict(p, prompt_ids=ids, f32_continuation=cont, q4_1_continuation=q_cont,
                         q4_1_margins=[round(m, 4) for m in q_margins])
            out["prompts"].append(entry)
            print(f"{p['name']}: {len(ids)} prompt tokens, f32 → {vocab.detokenize(cont)[:60]!r}", file=sys.stderr)
    with open(os.path.join(HERE, "forward_smollm2.json"), "w") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
    np.savez_compressed(os.path.join(HERE, "forward_smollm2_logits.npz"), **logits)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
