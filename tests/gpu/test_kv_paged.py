"""The paged KV cache on the GPU (backends/cuda/kv.py): q8_0 rows written as gguf.quants rounds
them; whatever order the pool hands blocks out in, the engine's greedy ids are the contiguous
cache's and the CPU reference's; captured steps through the block tables equal eager ones
(64-row decode buckets too); copy_prefix and truncation exact; q8_0 KV against the CPU
backend's q8_0 attention."""
import os

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import quants as gguf_quants  # noqa: E402

from ntransformerd.engine.runtime import model as llama  # noqa: E402
from ntransformerd.engine.backends import cuda  # noqa: E402
from ntransformerd.engine.runtime.engine import Engine, EngineConfig  # noqa: E402
from ntransformerd.engine.gguf_file import GGUFModel, LlamaConfig  # noqa: E402
from ntransformerd.engine.runtime.kv_cache import KVCache  # noqa: E402
from ntransformerd.engine.runtime.model import Batch, Segment  # noqa: E402
from ntransformerd.tools.synth import synthesize  # noqa: E402

from .real_weights import greedy, real_slice, teacher_forced  # noqa: E402,F401 (real_slice: a fixture)


def config(**kw):
    base = dict(n_layers=2, d_model=256, d_ff=512, n_heads=8, n_kv_heads=2, head_dim=64, vocab_size=100,
                context_length=4096, rms_eps=1e-5, rope_base=10000.0, rope_dim=64, rope_neox=False,
                rope_scale=1.0, tied_output=True)
    base.update(kw)
    return LlamaConfig(**base)


def scramble(cache, seed: int) -> None:
    """Make the pool hand its free blocks out in a shuffled order (BlockTable takes them from a
    heap, lowest id first: a shuffled list is a valid pool whose order is no longer sorted)."""
    pool = cache.blocks._pool
    pool[:] = np.random.default_rng(seed).permutation(sorted(pool)).tolist()


def raw_rows(layer, slot: int, p0: int, p1: int):
    """The stored rows (bytes of q8_0 blocks, or f16) of positions [p0, p1), host (n, Hkv, row)."""
    b, o = layer.table.locate(slot, p0, p1)
    return cp.asnumpy(layer.k[cp.asarray(b), :, cp.asarray(o)]), cp.asnumpy(layer.v[cp.asarray(b), :, cp.asarray(o)])


@pytest.mark.parametrize("head_dim", (64, 128))
def test_q8_0_rows_bit_exact(head_dim):
    """kv_append<1> against gguf.quants.quantize: normal values, exact halves after scaling
    (amax 127 gives d = 1: x.5 rounds away from zero), all-zero blocks (d = 0), tiny and huge scales."""
    rng = np.random.default_rng(0)
    cfg = config(head_dim=head_dim, n_heads=4, n_kv_heads=2, d_model=4 * head_dim, rope_dim=head_dim)
    kv = cuda.CudaKVCache(cfg, n_slots=2, max_ctx=64, dtype="q8_0")
    n = 40
    k = rng.standard_normal((n, 2, head_dim)).astype(np.float32)
    v = rng.standard_normal((n, 2, head_dim)).astype(np.float32) * 1e-3
    k[0, 0, :32] = np.arange(32) - 15.5  # halves against a scale that is not 1
    k[1] = np.where(np.arange(head_dim) % 2, 2.5, -3.5)  # d = amax / 127: quants round at exact halves
    k[1, :, 0] = 127.0
    k[2] = 0.0  # d = 0
    k[3] *= 1e6  # scales near f16's largest
    v[4] *= 1e-1  # subnormal f16 scales
    kv.layer(0).write(1, 0, k, v)
    got_k, got_v = raw_rows(kv.layer(0), 1, 0, n)
    want_k = gguf_quants.quantize(k, Q.Q8_0)
    want_v = gguf_quants.quantize(v, Q.Q8_0)
    np.testing.assert_array_equal(got_k, want_k)
    np.testing.assert_array_equal(got_v, want_v)
    host = KVCache(cfg, n_slots=2, max_ctx=64, dtype="q8_0")  # the host cache's reading of the same rows
    host.layer(0).write(1, 0, k, v)
    for a, b in zip(kv.layer(0).read(1, n), host.layer(0).read(1, n)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="kv_dtype"):
        cuda.kv_cache(cfg, n_slots=1, max_ctx=16, dtype="f32")


def test_device_tables_follow_the_host():
    """The device copy is refreshed from the host table for the slots asked for, only when they
    changed; the scratch slot's row points at the scratch block."""
    cfg = config()
    kv = cuda.CudaKVCache(cfg, n_slots=3, max_ctx=64, n_blocks=7)
    assert kv.layer(0).k.shape[0] == 8 and kv.scratch_block == 7
    assert (kv.tables.dev[kv.scratch_slot].get() == 7).all()
    kv.reserve(1, 40)
    kv.tables.refresh([0])
    assert (kv.tables.dev[1].get() == -1).all()  # not asked for
    kv.tables.refresh([1])
    np.testing.assert_array_equal(kv.tables.dev[:3].get(), kv.blocks.tables)
    before = kv.tables.copies
    kv.tables.refresh([0, 1, 2])
    assert kv.tables.copies == before  # nothing changed: no copy
    kv.trim(1, 10)
    kv.tables.refresh([1])
    np.testing.assert_array_equal(kv.tables.dev[:3].get(), kv.blocks.tables)


@pytest.mark.parametrize("dtype", ("f16", "q8_0"))
def test_copy_prefix_and_trim_exact(dtype):
    """copy_prefix gives the destination the source's whole blocks by reference and a copy of
    the partial last one; a later write into a shared block copies it first (the source stays as
    it was); a start inside a block copies the rest row by row; every position exact. trim gives
    back the blocks past n and the kept positions stay."""
    rng = np.random.default_rng(1)
    cfg = config()
    kv = cuda.CudaKVCache(cfg, n_slots=3, max_ctx=128, dtype=dtype, n_blocks=20)
    scramble(kv, 3)
    a, b = kv.alloc(), kv.alloc()
    k = rng.standard_normal((50, 2, 64)).astype(np.float32)
    v = rng.standard_normal((50, 2, 64)).astype(np.float32)
    for layer in kv.layers:
        layer.write(a, 0, k, v)
    src = [layer.read(a, 50) for layer in kv.layers]
    kv.copy_prefix(a, b, 37)
    ta, tb = kv.blocks.tables[a], kv.blocks.tables[b]
    assert (tb[:2] == ta[:2]).all() and tb[2] != ta[2] and tb[2] >= 0  # 0..31 shared, 32..36 copied
    for layer, (sk, sv) in zip(kv.layers, src):
        gk, gv = layer.read(b, 37)
        np.testing.assert_array_equal(gk, sk[:37])
        np.testing.assert_array_equal(gv, sv[:37])
    for layer in kv.layers:
        layer.write(b, 30, k[:7] * 2, v[:7] * 2)  # into the shared block 1 (and the copied block 2)
    assert tb[1] != ta[1] and kv.blocks.stats["cow"] >= 1  # copied on write
    for layer, (sk, sv) in zip(kv.layers, src):
        np.testing.assert_array_equal(layer.read(a, 50)[0], sk)  # the source is untouched
    kv.copy_prefix(a, b, 45, start=37)  # the rest, from inside a block
    for layer, (sk, sv) in zip(kv.layers, src):
        gk, _ = layer.read(b, 45)
        np.testing.assert_array_equal(gk[37:], sk[37:45])
    free = kv.blocks.free_blocks
    kv.trim(b, 17)
    assert kv.kept(b) == 32 and kv.blocks.free_blocks == free + 1
    for layer, (sk, sv) in zip(kv.layers, src):
        gk, gv = layer.read(b, 17)
        np.testing.assert_array_equal(gk, sk[:17])
        np.testing.assert_array_equal(gv, sv[:17])


@pytest.mark.parametrize("kv_blocks", (None, 12))
def test_real_slice_greedy_paged_scrambled(real_slice, kv_blocks):
    """Greedy ids on the real-weights slice: the GPU with blocks handed out in a shuffled order
    (and a pool smaller than max_batch × max_ctx) equals the GPU cache as it fills in order and
    the CPU reference; two sequences at once, the second opened after the first has blocks."""
    m = GGUFModel(real_slice)
    cpu_e = Engine(m, config=EngineConfig(backend="cpu-ref", max_batch=2, max_ctx=256))
    plain = Engine(m, config=EngineConfig(backend="cuda", max_batch=2, max_ctx=256))
    shuffled = Engine(m, config=EngineConfig(backend="cuda", max_batch=2, max_ctx=256, kv_blocks=kv_blocks))
    scramble(shuffled.kv, 11)
    prompts = [cpu_e.tokenizer.encode(t) for t in ("The capital of France is", "def fibonacci(n):")]
    want = [greedy(cpu_e, p, 32) for p in prompts]
    assert [greedy(plain, p, 32) for p in prompts] == want
    assert [greedy(shuffled, p, 32) for p in prompts] == want
    # two at once: interleaved growth gives each slot a non-contiguous, unsorted table
    slots = [shuffled.open(), shuffled.open()]
    try:
        logits = [shuffled.prefill(s, p) for s, p in zip(slots, prompts)]
        out = [[], []]
        for _ in range(32):
            toks = [int(np.argmax(x)) for x in logits]
            for o, t in zip(out, toks):
                o.append(t)
            logits = shuffled.step([(s, [t]) for s, t in zip(slots, toks)])
        table = shuffled.kv.blocks.tables[slots[0]]
        held = table[table >= 0]
        assert len(held) >= 2 and (np.diff(held) != 1).any(), table  # really not one run of blocks
    finally:
        for s in slots:
            shuffled.close(s)
    assert out == want


def test_real_slice_q8_0_kv_close_to_cpu(real_slice):
    """kv_dtype q8_0 on the GPU against the CPU reference's q8_0 attention, teacher-forced over the
    same tokens: logits within 2% of their largest (the f16 GPU-vs-CPU bound of
    test_engine_cuda), top-1 agreeing on ≥ 97% of positions (the two sides' f32 rounding may
    move a quant of k by one step now and then), and greedy ids on a short prompt identical."""
    m = GGUFModel(real_slice)
    cpu_e = Engine(m, config=EngineConfig(backend="cpu-ref", kv_dtype="q8_0", max_batch=1, max_ctx=256))
    gpu_e = Engine(m, config=EngineConfig(backend="cuda", kv_dtype="q8_0", max_batch=1, max_ctx=256))
    assert gpu_e.kv.dtype == "q8_0" and gpu_e.kv.layer(0).q8
    tokens = cpu_e.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 6)[:96]
    a, b = teacher_forced(cpu_e, tokens), teacher_forced(gpu_e, tokens)
    rel = np.abs(a - b).max() / np.abs(a).max()
    top1 = float((a.argmax(-1) == b.argmax(-1)).mean())
    assert rel < 2e-2, rel
    assert top1 >= 0.97, top1
    prompt = cpu_e.tokenizer.encode("The capital of France is")
    assert greedy(gpu_e, prompt, 16) == greedy(cpu_e, prompt, 16)


@pytest.mark.parametrize("dtype", ("f16", "q8_0"))
def test_captured_steps_with_block_tables_equal_eager(tmp_path, dtype):
    """Captured steps (buckets of 1..64 one-token rows, and 4 rows × 4 tokens) over a scrambled
    pool against model.forward run eagerly on a cache filling in order: the same logits within
    the matvec rounding bound of test_model (f16 matvecs: 1e-3) and the same greedy ids; a
    64-row decode step is a captured one."""
    path = str(tmp_path / "small-q8_0.gguf")
    synthesize(path, shape="small", ftype="q8_0", seed=9)
    model = GGUFModel(path)
    cfg = model.config
    rng = np.random.default_rng(5)
    ops, w = cuda.load(model)
    n = 64
    kv_a = cuda.kv_cache(cfg, n_slots=n, max_ctx=96, dtype=dtype)
    kv_b = cuda.kv_cache(cfg, n_slots=n, max_ctx=96, dtype=dtype)
    scramble(kv_b, 2)
    dec = cuda.StepGraphs(ops, w, kv_b)
    for kv in (kv_a, kv_b):
        for _ in range(n):
            kv.alloc()
    prompts = [rng.integers(0, cfg.vocab_size, int(x)) for x in rng.integers(1, 40, n)]
    for i in range(0, n, 8):  # prefill in eager batches of 8
        segs = [Segment(j, 0, prompts[j]) for j in range(i, i + 8)]
        for kv in (kv_a, kv_b):
            ops.to_host(llama.forward(ops, cfg, w, kv, Batch.of(segs), all_logits=False))
            for s in segs:
                kv.lengths[s.slot] = len(s.tokens)
    toks = rng.integers(0, cfg.vocab_size, n)
    f16 = any(model.tensor(t.name).qtype in cuda.F16_MATVEC for t in model.reader.tensors)
    for live in (list(range(n)), list(range(0, n, 2)), [3], list(range(40)), list(range(n))):
        ref = ops.to_host(llama.forward(ops, cfg, w, kv_a, Batch.of(
            [Segment(i, int(kv_a.lengths[i]), [int(toks[i])]) for i in live]), all_logits=True))
        kv_a.lengths[live] += 1
        got = dec.logits(live, toks[live]).get()
        kv_b.lengths[live] += 1
        tol = 1e-3 if f16 and len(live) >= 4 else 1e-4
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < tol, len(live)
        assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.98, len(live)
        toks[live] = ref.argmax(-1)
    assert (64, 1, None, False) in dec.captured and dec.captured[(64, 1, None, False)].graph is not None
    live = [0, 5, 9, 60]  # verifying drafts: 4 rows × 4 tokens, captured
    t4 = rng.integers(0, cfg.vocab_size, (4, 4))
    ref = ops.to_host(llama.forward(ops, cfg, w, kv_a, Batch.of(
        [Segment(i, int(kv_a.lengths[i]), t4[j]) for j, i in enumerate(live)]), all_logits=True))
    got = dec.logits(live, t4, last_only=False).get()
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-3
    assert dec.captured[(4, 4, None, False)].graph is not None


def test_wide_decode_matmul_chunks_equal_each_chunk(tmp_path):
    """A 33..128-row matmul runs as fused matvecs of ≤ 32 rows: each chunk's rows equal the
    same rows multiplied alone (the same kernel at the same bucket), residual added in place."""
    path = str(tmp_path / "small-q4_k_m.gguf")
    synthesize(path, shape="small", ftype="q4_k_m", seed=4)
    model = GGUFModel(path)
    _, wts = cuda.load(model)
    w = wts.acquire(0).ffn_down
    w = getattr(w, "pieces", (w,))[0]  # one matrix (a stack of one where the layout stacks it)
    rng = np.random.default_rng(2)
    for n in (33, 64, 100, 128):
        x = cp.asarray(rng.standard_normal((n, w.shape[1])).astype(np.float32))
        res = cp.asarray(rng.standard_normal((n, w.shape[0])).astype(np.float32))
        chunks = cp.concatenate([cuda.matvec(x[a:a + 32], w) for a in range(0, n, 32)])
        tol = 1e-5 * float(cp.abs(chunks).max())
        out = res.copy()
        cuda.matvec_rows(x, w, out=out, res=out)
        cp.testing.assert_allclose(out, chunks + res, rtol=0, atol=tol)
        cp.testing.assert_allclose(cuda.matmul(x, w), chunks, rtol=0, atol=tol)
        assert n <= cuda.CHUNKED_MAX_ROWS


@pytest.mark.parametrize("dtype", ("f16", "q8_0"))
def test_whole_block_moves(dtype):
    """copy_blocks, save_blocks and load_blocks (sharing's copy on write, spilling): whole blocks
    in the storage type, bit for bit, every head and position; the blocks not named untouched."""
    rng = np.random.default_rng(3)
    cfg = config()
    kv = cuda.CudaKVCache(cfg, n_slots=2, max_ctx=64, dtype=dtype, n_blocks=8)
    layer = kv.layer(0)
    k = rng.standard_normal((64, 2, 64)).astype(np.float32)
    layer.write(0, 0, k, -k)  # blocks 0..3
    before = cp.asnumpy(layer.k), cp.asnumpy(layer.v)
    layer.copy_blocks(np.array([0, 2]), np.array([5, 6]))
    after = cp.asnumpy(layer.k), cp.asnumpy(layer.v)
    for b, a in zip(before, after):
        np.testing.assert_array_equal(a[[5, 6]], b[[0, 2]])
        np.testing.assert_array_equal(np.delete(a, [5, 6], 0), np.delete(b, [5, 6], 0))
    sk, sv = layer.save_blocks(np.array([1, 3]))
    assert isinstance(sk, np.ndarray) and sk.shape == (2,) + layer.k.shape[1:] and sk.dtype == layer.k.dtype
    layer.load_blocks(np.array([4, 7]), sk, sv)
    np.testing.assert_array_equal(cp.asnumpy(layer.k[cp.asarray([4, 7])]), before[0][[1, 3]])
    np.testing.assert_array_equal(cp.asnumpy(layer.v[cp.asarray([4, 7])]), before[1][[1, 3]])


def test_real_slice_shared_prefix_greedy(real_slice):
    """The prefix cache's path on the GPU: a second sequence given the first's prompt by
    Engine.copy_prefix (whole blocks by reference, the partial one copied) then decoding, alone
    and beside the first, gives the ids of a sequence prefilled from scratch."""
    m = GGUFModel(real_slice)
    e = Engine(m, config=EngineConfig(backend="cuda", max_batch=3, max_ctx=256))
    prompt = e.tokenizer.encode("Once upon a time, in a land far away, there lived a king who " * 3)[:40]
    want = greedy(e, prompt, 24)
    a = e.open()
    b = e.open()
    try:
        la = e.prefill(a, prompt)
        e.copy_prefix(a, b, len(prompt) - 1)  # b runs the prompt's last token itself
        assert e.kv.blocks.shared_blocks >= 2
        lb = e.prefill(b, prompt[-1:])
        ids_a, ids_b = [], []
        for _ in range(24):
            ta, tb = int(np.argmax(la)), int(np.argmax(lb))
            ids_a.append(ta)
            ids_b.append(tb)
            la, lb = e.step([(a, [ta]), (b, [tb])])
    finally:
        e.close(a)
        e.close(b)
    assert ids_a == want and ids_b == want


FULL_MODEL = os.environ.get("NTX_FULL_MODEL")  # the whole default model where it was carried (64 MiB a call)


@pytest.mark.skipif(not (FULL_MODEL and os.path.exists(FULL_MODEL)), reason="NTX_FULL_MODEL names no file")
@pytest.mark.parametrize("kv_dtype", ("f16", "q8_0"))
def test_six_reference_prompts_paged_on_the_full_model(kv_dtype):
    """The real model on the GPU, the six reference prompts (tests/golden/forward_smollm2.json),
    32 greedy tokens each: a small pool (two sequences' worth of blocks) handed out shuffled, with
    a second sequence growing beside each prompt so that its table interleaves, gives the ids of
    the pool as it fills in order; and f16 KV keeps llama.cpp's Q4_1 continuation wherever that
    one's top-2 margin is decisive (> 1.0), as the host backend does; both equal the exact
    float32 reference's ids (cpu-ref)."""
    import json
    with open(os.path.join(os.path.dirname(__file__), "..", "golden", "forward_smollm2.json")) as f:
        golden = json.load(f)["prompts"]
    m = GGUFModel(FULL_MODEL)
    plain = Engine(m, config=EngineConfig(backend="cuda", max_batch=2, max_ctx=512, kv_dtype=kv_dtype))
    paged = Engine(m, config=EngineConfig(backend="cuda", max_batch=2, max_ctx=512, kv_dtype=kv_dtype, kv_blocks=64))
    exact = Engine(m, config=EngineConfig(backend="cpu-ref", max_batch=1, max_ctx=512))
    scramble(paged.kv, 5)
    compared = []
    for p in golden:
        want = greedy(plain, p["prompt_ids"], 32)
        other = paged.open()
        try:
            paged.prefill(other, golden[0]["prompt_ids"])  # takes blocks between this prompt's
            got = greedy(paged, p["prompt_ids"], 32)
        finally:
            paged.close(other)
        assert got == want, (p["name"], got, want)
        if kv_dtype == "f16":
            assert want == greedy(exact, p["prompt_ids"], 32), p["name"]
            n = min(len(want), next((i for i, x in enumerate(p["q4_1_margins"]) if x <= 1.0), len(want)))
            assert want[:n] == p["q4_1_continuation"][:n], (p["name"], want, p["q4_1_continuation"][:n])
            compared.append(n)
    assert kv_dtype != "f16" or max(compared) >= 16, compared
