"""Batch invariance with the `deterministic` setting: a row's results the same bits whichever rows
share its step. (a) The matmuls: a row alone against the same row inside batches of 2 to 300
other random rows (decode steps, wide decode steps, prefill chunks), for the types of the 8B
files (Q8_0, Q4_K, Q6_K) and of the default model (Q4_1, and its Q8_0 rows of 576). (b) The
engine through its captured steps: a row's logits alone and inside 16- and 64-row decode steps,
a verify-shaped step (4 tokens of one row) against four decode steps, and a greedy generation
alone against the same prompt among 8 others (prefilled together, decoded together).

Run: python -m pytest -q tests/gpu/test_batch_invariance.py (about a minute on an H200)."""

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import quants as gq  # noqa: E402

from ntransformerd.engine.backends import cuda  # noqa: E402
from ntransformerd.engine.runtime.engine import Engine, EngineConfig  # noqa: E402
from ntransformerd.engine.gguf_file import GGUFModel  # noqa: E402
from ntransformerd.tools.synth import synthesize  # noqa: E402

from .bits import first_difference, same_bits  # noqa: E402
from .real_weights import real_slice  # noqa: E402,F401 (a fixture)
from .test_quant import random_tensor, to_device  # noqa: E402

DET = cuda.CudaSettings(deterministic=True)
BATCHES = (2, 4, 16, 32, 33, 64, 128, 300)  # 300: a prefill chunk past CHUNKED_MAX_ROWS
# (type, n, k): the 8B shape's widths, a vocabulary-sized output, the default model's 576
CASES = [(Q.Q8_0, 4096, 4096), (Q.Q4_K, 14336, 4096), (Q.Q6_K, 4096, 14336), (Q.Q6_K, 32000, 512),
         (Q.Q4_1, 1536, 576), (Q.Q4_1, 576, 1536), (Q.Q8_0, 1536, 576), (Q.Q8_0, 769, 4096)]


@pytest.mark.parametrize("qtype,n,k", CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_a_row_alone_equals_the_row_in_any_batch(qtype, n, k):
    rng = np.random.default_rng()
    raw = random_tensor(rng, qtype, n, k)
    w = to_device(qtype, raw, n, k)
    x0 = rng.standard_normal((1, k), dtype=np.float32)
    res0 = rng.standard_normal((1, n), dtype=np.float32)
    alone = cuda.matmul(cp.asarray(x0), w, DET).get()
    alone_res = cuda.matvec_rows(cp.asarray(x0), w, res=cp.asarray(res0), out=cp.empty((1, n), cp.float32), s=DET).get()
    ref = x0 @ gq.dequantize(raw, qtype).reshape(n, k).astype(np.float32).T  # the path computes the product at all
    assert np.abs(alone - ref).max() <= 3e-3 * np.abs(ref).max()
    for b in BATCHES:
        x = rng.standard_normal((b, k), dtype=np.float32) * rng.uniform(0.1, 10)
        j = int(rng.integers(b))
        x[j] = x0[0]
        got = cuda.matmul(cp.asarray(x), w, DET).get()
        assert same_bits(got[j], alone[0]), (b, j, first_difference(got[j], alone[0]))
        if b <= cuda.CHUNKED_MAX_ROWS:  # the residual epilogue of the decode step (x += W a)
            res = rng.standard_normal((b, n), dtype=np.float32)
            res[j] = res0[0]
            out = cp.empty((b, n), cp.float32)
            got = cuda.matvec_rows(cp.asarray(x), w, res=cp.asarray(res), out=out, s=DET).get()
            assert same_bits(got[j], alone_res[0]), (b, j, "with residual", first_difference(got[j], alone_res[0]))


@pytest.fixture(scope="module", params=["small-q4_k_m", "small-q8_0", "real"])
def model_path(request, tmp_path_factory):
    if request.param == "real":  # the default model's first 4 layers: Q4_1, Q8_0 rows of 576
        return request.getfixturevalue("real_slice")
    shape, ftype = request.param.split("-", 1)
    path = str(tmp_path_factory.mktemp("m") / f"{request.param}.gguf")
    synthesize(path, shape=shape, ftype=ftype, seed=11)
    return path


@pytest.fixture(scope="module")
def engine(model_path):
    e = Engine(GGUFModel(model_path), config=EngineConfig(backend="cuda", max_batch=66, max_ctx=256,
                                                          deterministic=True))
    assert e.report().deterministic and e.ops.settings.deterministic and e.steps is not None
    return e


def _prompts(rng, vocab, lengths):
    return [[int(t) for t in rng.integers(100, min(vocab, 40000), m)] for m in lengths]


def test_decode_row_alone_equals_the_row_in_16_and_64_row_steps(engine):
    rng = np.random.default_rng(5)
    vocab = engine.cfg.vocab_size
    slots = [engine.open() for _ in range(64)]
    try:
        for s, p in zip(slots, _prompts(rng, vocab, rng.integers(3, 40, 64))):
            engine.prefill(s, p)
        tokens = [int(t) for t in rng.integers(100, min(vocab, 40000), 64)]
        start = [engine.length(s) for s in slots]
        alone = np.stack([engine.step([(s, [t])])[0] for s, t in zip(slots[:3], tokens[:3])])
        for s, n in zip(slots[:3], start[:3]):
            engine.truncate(s, n)
        for width in (16, 64):
            order = [0, 1, 2] + list(rng.permutation(np.arange(3, 64))[:width - 3])
            order = list(rng.permutation(order))
            got = engine.step([(slots[i], [tokens[i]]) for i in order])
            for i in range(3):
                row = got[order.index(i)]
                assert same_bits(row, alone[i]), (width, i, first_difference(row, alone[i]))
            for i, s in enumerate(slots):
                engine.truncate(s, start[i])
    finally:
        for s in slots:
            engine.close(s)


def test_verify_rows_equal_decode_rows(engine):
    """A speculative verify step (4 tokens of one row, and of 4 rows at once) gives each position
    the logits four one-token decode steps give it."""
    rng = np.random.default_rng(6)
    vocab = engine.cfg.vocab_size
    slots = [engine.open() for _ in range(4)]
    try:
        for s, p in zip(slots, _prompts(rng, vocab, (17, 5, 30, 9))):
            engine.prefill(s, p)
        drafts = [[int(t) for t in rng.integers(100, min(vocab, 40000), 4)] for _ in slots]
        start = [engine.length(s) for s in slots]
        one_by_one = [np.stack([engine.step([(s, [t])])[0] for t in d]) for s, d in zip(slots, drafts)]
        for s, n in zip(slots, start):
            engine.truncate(s, n)
        alone = engine.step([(slots[0], drafts[0])], all_logits=True)
        engine.truncate(slots[0], start[0])
        together = engine.step(list(zip(slots, drafts)), all_logits=True).reshape(4, 4, -1)
        assert same_bits(alone, one_by_one[0]), first_difference(alone, one_by_one[0])
        for i in range(4):
            assert same_bits(together[i], one_by_one[i]), (i, first_difference(together[i], one_by_one[i]))
    finally:
        for s in slots:
            engine.close(s)


def _generate(engine, prompts, n):
    """n greedy ids of each prompt, all prefilled in one step and decoded together."""
    slots = [engine.open() for _ in prompts]
    try:
        logits = engine.step(list(zip(slots, prompts)))
        ids = [[int(np.argmax(row))] for row in logits]
        for _ in range(n - 1):
            logits = engine.step([(s, [out[-1]]) for s, out in zip(slots, ids)])
            for out, row in zip(ids, logits):
                out.append(int(np.argmax(row)))
        return ids
    finally:
        for s in slots:
            engine.close(s)


def test_greedy_alone_equals_among_eight_others(engine):
    rng = np.random.default_rng(7)
    prompts = _prompts(rng, engine.cfg.vocab_size, (23, 7, 61, 2, 140, 15, 33, 9, 48))  # 338 rows: cuBLAS-sized
    alone = _generate(engine, prompts[:1], 32)[0]
    among = _generate(engine, prompts, 32)
    assert among[0] == alone, f"alone {alone}\namong {among[0]}"
    assert _generate(engine, prompts[4:5], 32)[0] == among[4]  # a long prompt, prefilled alone


def test_a_prompt_gives_the_same_bits_however_it_was_cut(engine):
    """With the setting, a prompt's rows run the same attention kernel whether it comes whole
    (a segment past attn_chunk's 16 rows), cut after a prefix (the prefix cache's case), or in one
    step beside another prompt: its last logits and the next decode step are the same bits."""
    rng = np.random.default_rng(7)
    vocab = engine.cfg.vocab_size
    prompt, other = _prompts(rng, vocab, (40, 23))
    token = int(rng.integers(100, min(vocab, 40000)))
    slots = [engine.open() for _ in range(4)]
    try:
        whole = engine.step([(slots[0], prompt)])[0]
        engine.step([(slots[1], prompt[:7])])
        cut = engine.step([(slots[1], prompt[7:])])[0]
        beside = engine.step([(slots[3], other), (slots[2], prompt)])[1]
        for got, how in ((cut, "cut after 7"), (beside, "beside another prompt")):
            assert same_bits(got, whole), (how, first_difference(got, whole))
        nxt = engine.step([(s, [token]) for s in slots[:3]])
        for i in (1, 2):
            assert same_bits(nxt[i], nxt[0]), (i, first_difference(nxt[i], nxt[0]))
    finally:
        for s in slots:
            engine.close(s)
