"""Decode attention is batch-invariant by construction: a row's positions are cut into splits of
split_len(max_ctx) positions and merged in split order, so its output has the same bits alone
and among 2, 16 or 64 rows at other positions, in the fused launch (RoPE, cache append and
attention in one) and the unfused one (rope_kv, then attention), which also agree with each
other; a decode row equals the same token as the first row of a verify step. The output is
also checked against a numpy reference over the cache's own contents.

Run: python -m pytest -q tests/gpu/test_attention_invariance.py"""

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from ntransformerd.engine.backends import cpu, cuda  # noqa: E402
from ntransformerd.engine.gguf_file import LlamaConfig  # noqa: E402
from ntransformerd.engine.runtime.model import Batch, Segment  # noqa: E402

from .bits import first_difference, same_bits  # noqa: E402

MAX_CTX = 4096 + 64  # splits of 128 positions, 33 of them
ROWS = (1, 2, 16, 64)
SHAPES = ((32, 8, 128), (12, 4, 64))  # (heads, kv heads, head_dim): the 8B's, and groups of 3 (6-warp blocks)


def config(heads: int, kv: int, hd: int) -> LlamaConfig:
    return LlamaConfig(n_layers=1, d_model=heads * hd, d_ff=64, n_heads=heads, n_kv_heads=kv, head_dim=hd,
                       vocab_size=100, context_length=MAX_CTX, rms_eps=1e-5, rope_base=500000.0, rope_dim=hd,
                       rope_neox=False, rope_scale=1.0, tied_output=True)


class Setup:
    """A cache of 65 slots (max_ctx MAX_CTX), slot 0 the row under test at position p0, the others
    with random histories at random positions; a fixed q|k|v row for slot 0."""

    def __init__(self, cfg: LlamaConfig, dtype: str, rng):
        self.cfg, self.rng = cfg, rng
        self.p0 = int(rng.integers(2000, 3000))
        self.pos = np.concatenate([[self.p0], rng.integers(0, 3000, 64)]).astype(np.int64)
        blocks = int(sum(-(-(p + 5) // 16) for p in self.pos))  # room for a verify step's 4 tokens
        self.kv = cuda.CudaKVCache(cfg, n_slots=len(self.pos), max_ctx=MAX_CTX, dtype=dtype, n_blocks=blocks)
        layer = self.kv.layer(0)
        for s, p in enumerate(self.pos):
            if p:
                layer.write(s, 0, rng.standard_normal((p, cfg.n_kv_heads, cfg.head_dim)).astype(np.float16),
                            rng.standard_normal((p, cfg.n_kv_heads, cfg.head_dim)).astype(np.float16))
        self.width = cfg.q_dim + 2 * cfg.kv_dim
        self.qkv0 = rng.standard_normal(self.width).astype(np.float32)
        self.ops = cuda.CudaOps(cfg)

    def rows(self, n: int) -> tuple[np.ndarray, np.ndarray, int]:
        """Slots of an n-row step holding slot 0 at a random row, its q|k|v rows, and that row."""
        others = self.rng.permutation(np.arange(1, len(self.pos)))[:n - 1]
        j = int(self.rng.integers(n))
        slots = np.insert(others, j, 0).astype(np.int32)
        qkv = self.rng.standard_normal((n, self.width)).astype(np.float32) * self.rng.uniform(0.5, 2)
        qkv[j] = self.qkv0
        return slots, qkv, j

    def run(self, slots, qkv, positions, *, fused: bool, turn: int = cuda.DECODE_ROWS) -> np.ndarray:
        """The launchers straight: attention_decode_ (fused) or rope_kv_ then attention_, `turn`
        rows at a time (the scratch's rows); (n, q_dim)."""
        c, n = self.cfg, len(slots)
        for s, p in zip(slots, positions):
            self.kv.reserve(int(s), int(p) + 1)
        self.kv.tables.refresh()
        dq = cp.asarray(qkv)
        v = dq[:, c.q_dim + c.kv_dim:]
        dslots, dpos = cp.asarray(slots), cp.asarray(np.asarray(positions, np.int32))
        out = cp.full((n, c.q_dim), np.nan, cp.float32)
        scratch = cuda.attention_scratch(min(n, turn), c, MAX_CTX)
        layer = self.kv.layer(0)
        if fused:
            cuda.attention_decode_(dq, v, layer, dslots, dpos, self.ops.freqs, c, n=n, ld=self.width, ldv=self.width,
                                   out=out, scratch=scratch)
        else:
            cuda.rope_kv_(dq, v, dpos, dslots, self.ops.freqs, layer, c, n=n, ld=self.width, ldv=self.width)
            cuda.attention_(dq, dq[:, c.q_dim:], v, layer, dslots, dpos, c, n=n, ldq=self.width, ldk=self.width,
                            ldv=self.width, out=out, scratch=scratch, append=False)
        assert not scratch.cnt.any()  # every launch leaves its counters zero
        return out.get()

    def reference(self) -> np.ndarray:
        """Slot 0's attention in float64 over the cache's contents (the new row as it was stored)."""
        c = self.cfg
        k, v = self.kv.layer(0).read(0, self.p0 + 1)  # (p0 + 1, Hkv, hd)
        ref = cpu.CpuOps(c)
        q = ref.rope(self.qkv0[None, :c.q_dim], ref.rope_table(np.array([self.p0])), c.n_heads)[0]
        q = q.reshape(c.n_heads, c.head_dim).astype(np.float64)
        g = c.n_heads // c.n_kv_heads
        out = np.empty_like(q)
        for h in range(c.n_heads):
            s = k[:, h // g].astype(np.float64) @ q[h] / np.sqrt(c.head_dim)
            w = np.exp(s - s.max())
            out[h] = w @ v[:, h // g].astype(np.float64) / w.sum()
        return out.reshape(-1)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", ("f16", "q8_0"))
def test_a_decode_row_alone_equals_the_row_among_others(shape, dtype):
    rng = np.random.default_rng()
    t = Setup(config(*shape), dtype, rng)
    alone = {}
    for fused in (True, False):
        slots, qkv, j = t.rows(1)
        alone[fused] = t.run(slots, qkv, t.pos[slots], fused=fused)[j]
        for n in ROWS[1:]:
            slots, qkv, j = t.rows(n)
            got = t.run(slots, qkv, t.pos[slots], fused=fused)
            assert np.isfinite(got).all()
            assert same_bits(got[j], alone[fused]), (fused, n, j, first_difference(got[j], alone[fused]))
        slots, qkv, j = t.rows(64)  # 64 rows through a scratch of 16: four launches
        got = t.run(slots, qkv, t.pos[slots], fused=fused, turn=16)
        assert same_bits(got[j], alone[fused]), (fused, "turns", j, first_difference(got[j], alone[fused]))
    assert same_bits(alone[True], alone[False]), first_difference(alone[True], alone[False])
    ref = t.reference()
    err = np.linalg.norm(alone[True] - ref) / np.linalg.norm(ref)
    assert err < 1e-4, err  # the reference reads the same cache: only f32 sums and __expf differ


@pytest.mark.parametrize("dtype", ("f16", "q8_0"))
def test_a_decode_row_equals_the_first_row_of_a_verify_step(dtype):
    """Slot 0 decoding its token at p0, against slot 0 verifying 4 tokens at p0 .. p0 + 3 (the
    first with the same q|k|v): the verify step's first row has the decode row's bits."""
    rng = np.random.default_rng()
    t = Setup(config(32, 8, 128), dtype, rng)
    decode = t.run(np.zeros(1, np.int32), t.qkv0[None], [t.p0], fused=True)[0]
    qkv = rng.standard_normal((4, t.width)).astype(np.float32)
    qkv[0] = t.qkv0
    verify = t.run(np.zeros(4, np.int32), qkv, t.p0 + np.arange(4), fused=False)
    assert same_bits(verify[0], decode), first_difference(verify[0], decode)


@pytest.mark.parametrize("dtype", ("f16", "q8_0"))
def test_the_ops_give_a_row_the_same_bits_in_any_step(dtype):
    """Through CudaOps.attention (the eager step's op): one row alone, among 16 (one launch) and
    among 64 (RoPE and append, then attention: past the one-launch bucket), and with the one
    launch turned off (NTX_ATTN_ONE_LAUNCH=0)."""
    rng = np.random.default_rng()
    t = Setup(config(32, 8, 128), dtype, rng)
    c = t.cfg
    got = []
    for n, settings in ((1, None), (16, None), (64, None), (16, cuda.CudaSettings(attn_one_launch_max_bucket=0))):
        slots, qkv, j = t.rows(n)
        ops = cuda.CudaOps(c, settings=settings or cuda.CudaSettings())
        batch = Batch.of([Segment(int(s), int(t.pos[s]), np.zeros(1, np.int64)) for s in slots])
        dq = cp.asarray(qkv)
        q, k, v = dq[:, :c.q_dim], dq[:, c.q_dim:c.q_dim + c.kv_dim], dq[:, c.q_dim + c.kv_dim:]
        out = ops.attention(q, k, v, t.kv.layer(0), batch, rope=ops.rope_table(batch.positions))
        got.append(out.get()[j])
    for n, g in zip((16, 64, "16 unfused"), got[1:]):
        assert same_bits(g, got[0]), (n, first_difference(g, got[0]))
