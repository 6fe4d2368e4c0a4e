"""Host-side planning of the CUDA backend that needs no GPU: attention splits, grids and tiles, heads."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from ntransformerd.engine.backends import cuda
from ntransformerd.engine.gguf_file import LlamaConfig
from ntransformerd.engine.quants import QUANT_BLOCKS
from ntransformerd.engine.runtime.model import Batch, Segment


@pytest.mark.parametrize("lens", ([(0, 83)], [(0, 16), (37, 40), (5, 1)], [(700, 33), (0, 7)], [(9, 1)] * 5))
def test_chunk_tiles(lens):
    """Every row in exactly one tile of ≤ CHUNK_ROWS rows of one segment; longest histories first."""
    batch = Batch.of([Segment(s, start, np.zeros(n, np.int64)) for s, (start, n) in enumerate(lens)])
    tiles = cuda.chunk_tiles(batch.offsets, batch.positions)
    assert tiles.dtype == np.int32 and tiles.shape[0] == 2
    rows = np.concatenate([np.arange(a, a + m) for a, m in tiles.T])
    np.testing.assert_array_equal(np.sort(rows), np.arange(len(batch.tokens)))
    seg = np.searchsorted(batch.offsets, np.arange(len(batch.tokens)), side="right") - 1
    last = []
    for a, m in tiles.T:
        assert 1 <= m <= cuda.CHUNK_ROWS
        assert len(set(seg[a:a + m])) == 1  # one slot per tile
        last.append(batch.positions[a:a + m].max())
    assert last == sorted(last, reverse=True)


def test_group_heads():
    base = dict(n_layers=1, d_model=64, d_ff=64, n_heads=8, n_kv_heads=2, head_dim=64, vocab_size=10,
                context_length=64, rms_eps=1e-5, rope_base=1e4, rope_dim=64, rope_neox=False, rope_scale=1.0,
                tied_output=True)
    for heads, kv, want in ((8, 2, 4), (32, 8, 4), (9, 3, 3), (4, 4, 1), (64, 8, 8), (32, 2, 8), (24, 2, 6)):
        cfg = LlamaConfig(**{**base, "n_heads": heads, "n_kv_heads": kv})
        assert cuda.group_heads(cfg) == want


def _cfg(**kw) -> LlamaConfig:
    base = dict(n_layers=1, d_model=4096, d_ff=64, n_heads=32, n_kv_heads=8, head_dim=128, vocab_size=10,
                context_length=8192, rms_eps=1e-5, rope_base=1e4, rope_dim=128, rope_neox=False, rope_scale=1.0,
                tied_output=True)
    return LlamaConfig(**{**base, **kw})


CONTEXTS = (1, 2, 15, 16, 127, 128, 129, 4096, 8192, 16383, 16384, 16385, 20000, 32768, 65536, 131072, 131073, 1 << 20)


def test_split_len_follows_the_context_alone():
    """A decode row's splits: 128 positions up to 16k of context, then doubled so that at most
    MAX_SPLITS cover it (1024 at 128k); growing with max_ctx, never with anything else."""
    assert cuda.split_len(4096) == cuda.split_len(16384) == 128
    assert cuda.split_len(131072) == 1024
    prev = 0
    for ctx in CONTEXTS:
        sl = cuda.split_len(ctx)
        assert sl >= prev and sl % 128 == 0 and sl & (sl - 1) == 0
        assert 1 <= cuda.max_splits(ctx) <= cuda.MAX_SPLITS
        assert cuda.max_splits(ctx) * sl >= ctx > (cuda.max_splits(ctx) - 1) * sl
        prev = sl
    with pytest.raises(ValueError, match="max_ctx"):
        cuda.split_len(0)


@pytest.mark.parametrize("heads,kv,hd", ((32, 8, 128), (64, 8, 128), (8, 2, 64), (9, 3, 96), (4, 4, 128),
                                         (2, 1, 32), (6, 2, 256), (24, 2, 64)))
@pytest.mark.parametrize("max_ctx", (64, 4096, 8192, 16384, 131072))
def test_decode_launch_takes_the_same_splits_for_any_row_count(heads, kv, hd, max_ctx):
    """What fixes a row's sums in attn_decode (its instance, split length, heads per block, warps
    per block: the pieces of a split) is the same for 1 row and 64; only the columns (one per row
    and head block) and how many blocks share a column's splits follow the row count."""
    cfg = _cfg(n_heads=heads, n_kv_heads=kv, head_dim=hd, d_model=heads * hd, rope_dim=hd)
    hb = cuda.decode_heads(cfg)
    assert hb in (1, 2, 4, 8) and (heads // kv) % hb == 0
    fixed = set()
    for n in range(1, cuda.DECODE_ROWS + 1):
        (cols, ys), (threads,) = cuda.decode_launch(n, cfg, max_ctx, 132)
        assert cols == n * heads // hb and 1 <= ys <= cuda.max_splits(max_ctx)
        assert threads == 32 * 8
        fixed.add((threads, cuda.split_len(max_ctx), cuda.decode_kernel(cfg, False)))
    assert len(fixed) == 1
    assert cuda.split_len(max_ctx) % (fixed.pop()[0] // 32) == 0  # whole pieces per warp


def test_scratch_bytes():
    """The shared scratch of the 8B at Llama 3's 8192: 64 splits of (max, sum, 128 outputs) per
    (row, head), and a counter per (row, head); 68 MB for 64 rows, at most twice that."""
    cfg = _cfg()
    assert cuda.scratch_bytes(64, cfg, 8192) == 64 * 32 * (64 * 130 + 1) * 4
    assert cuda.scratch_bytes(64, cfg, 131072) == cuda.scratch_bytes(64, cfg, 16384)  # MAX_SPLITS from 16k on


def test_every_attention_instance_is_precompiled():
    """Each attn_decode instance a launcher can pick (every head_dim the kernels take, each cache
    type the cache allows for it, every group size up to 16) is one kernel_names() lists."""
    names = set(cuda.kernel_names())
    for hd in (32, 64, 96, 128, 256):
        for group in range(1, 17):
            cfg = _cfg(head_dim=hd, d_model=8 * group * hd, rope_dim=hd, n_heads=8 * group, n_kv_heads=8)
            for q8 in (False, True):
                if q8 and hd not in (32, 64, 128, 256):  # kv.Q8_HEAD_DIMS: the cache refuses the rest
                    continue
                assert ("attention", cuda.decode_kernel(cfg, q8)) in names
    for hd in cuda.CHUNK_HEAD_DIMS:
        for q8 in (0, 1):
            assert ("attention", f"attn_chunk<{hd},{q8}>") in names


@pytest.mark.parametrize("sms", (1, 16, 132, 1000))
def test_mmh_grid(sms):
    """Split-K launches of the f16 matvecs stay inside their scratch (partials for 32 batch rows,
    one counter per row tile), take whole K blocks, and give every SM work where K allows."""
    for n in (1, 7, 128, 129, 1024, 4096, 6144, 14336, 28672, 65536, 65537, 131072, 152064):
        for k in (96, 256, 512, 576, 1536, 4096, 14336, 28672):  # 96, 576: Q4_1's partial last K block
            tiles, ks = cuda.mmh_grid(n, k, sms)
            assert tiles * cuda.MMH_ROWS >= n > (tiles - 1) * cuda.MMH_ROWS
            assert 1 <= ks <= min(8, -(-k // 256))  # no split without a K block of its own
            if ks > 1:
                assert ks * 32 * n <= cuda.MMH_PART_FLOATS
                assert tiles <= cuda.MMH_PART_FLOATS // cuda.MMH_ROWS  # the counters _mmh_scratch makes
            if k // 256 >= 8 and 32 * 8 * n <= cuda.MMH_PART_FLOATS:
                assert tiles * ks >= min(2 * sms, 8 * tiles)


@pytest.mark.parametrize("sms", (132, 78, 1))
def test_mmh_chunks(sms):
    """A step of 33-128 rows on the f16 tensor cores is one launch of ceil(rows / 32) chunks where
    every chunk's split-K partials and tile counters fit the scratch (else 0: a launch per
    chunk); 32 rows or fewer, and more than the chunked path takes, are never chunked."""
    for n in (7, 576, 960, 3072, 4096, 14336, 28672, 65536, 152064):
        for k in (96, 576, 1536, 4096, 14336):
            tiles, ks = cuda.mmh_grid(n, k, sms)
            for rows in (1, 31, 32, 33, 64, 65, 100, 128, 129, 512):
                z = cuda.mmh_chunks(rows, n, k, tiles, ks)
                if rows <= cuda.MATVEC_MAX_ROWS or rows > cuda.CHUNKED_MAX_ROWS:
                    assert z == 0
                    continue
                if z:
                    assert z == -(-rows // cuda.MATVEC_MAX_ROWS) and (z - 1) * 32 < rows <= z * 32
                    if ks > 1:
                        assert z * ks * 32 * n <= cuda.MMH_PART_FLOATS
                        assert z * tiles <= cuda.MMH_PART_FLOATS // cuda.MMH_ROWS
                else:  # only where the scratch is short
                    assert ks > 1 and -(-rows // 32) * ks * 32 * n > cuda.MMH_PART_FLOATS
    # the default model's matrices (576 wide) at 64 rows: one launch each
    for n, k in ((576, 576), (960, 576), (3072, 576), (576, 1536)):
        assert cuda.mmh_chunks(64, n, k, *cuda.mmh_grid(n, k, sms)) == 2


@pytest.mark.parametrize("deterministic", (False, True))
def test_chunked_launch_leaves_out_a_chunk_its_own_launch_would_sum_otherwise(deterministic):
    """The one launch of a 33-128-row step covers the rows whose chunks a launch per chunk would
    run on the same kernel order: a last chunk of 1-2 rows (the 1-row kernels, unless
    deterministic) gets its own launch; 3+ rows (mmh at bucket 4) join. Every covered chunk's
    order is the 32-row chunk's, and nothing is covered off the f16 tensor cores."""
    s = cuda.CudaSettings(deterministic=deterministic)
    for qtype in (Q.Q4_1, Q.Q4_K, Q.Q8_0, Q.Q6_K, Q.F32):
        for n, k in ((576, 576), (960, 576), (576, 1536), (4096, 4096)):
            if k % QUANT_BLOCKS[qtype][0]:
                continue
            for rows in (33, 34, 35, 64, 65, 66, 67, 100, 127, 128):
                c, z, one = cuda.chunked_launch(qtype, rows, n, k, s, 132)
                rem = rows % 32
                if c.family != "mmh":
                    assert (z, one) == (0, 0)
                    continue
                alone = [cuda.choose(qtype, n, k, min(32, rows - a), s, 132).order for a in range(0, rows, 32)]
                joins = rem == 0 or alone[-1] == c.order
                assert joins == (deterministic or rem == 0 or rem >= 3), (qtype, rows)
                want = rows if joins else rows - rem
                if z:
                    assert one == want and z == -(-want // 32) and want > 32
                    assert all(o == c.order for o in alone[:z])
                else:
                    assert one == 0 and (want <= 32 or cuda.mmh_chunks(want, n, k, *c.grid) == 0)
    # the default model's 64- and 65-row steps: one launch of 64 rows
    assert cuda.chunked_launch(Q.Q4_1, 65, 576, 576, cuda.CudaSettings(), 132)[1:] == (2, 64)
    assert cuda.chunked_launch(Q.Q4_1, 64, 576, 576, cuda.CudaSettings(), 132)[1:] == (2, 64)


def test_reads_qact():
    """The decode step skips quantizing activations nobody reads: the int8 matvecs (batch 1-2,
    and Q8_0 rows of 576) read QAct, the f16 ones (whole 256-blocks from bucket 4) and the generic
    ones do not."""
    from gguf import GGMLQuantizationType as Q
    t = lambda q, k: type("T", (), {"qtype": q, "shape": (64, k)})()  # noqa: E731
    assert cuda.reads_qact([t(Q.Q4_K, 4096)], 1) and cuda.reads_qact([t(Q.Q8_0, 4096)], 2)
    assert not cuda.reads_qact([t(Q.Q4_K, 4096), t(Q.Q6_K, 4096)], 16)
    assert cuda.reads_qact([t(Q.Q4_K, 4096), t(Q.Q8_0, 576)], 4)  # one int8 reader is enough
    assert not cuda.reads_qact([t(Q.Q4_0, 4096), t(Q.F16, 4096)], 1)
    no_f16 = cuda.CudaSettings(f16_mma=False)  # NTX_F16_MMA=0: the int8 tensor-core kernels read QAct
    assert cuda.reads_qact([t(Q.Q4_K, 4096)], 16, no_f16)


def test_settings_from_env():
    """The NTX_* overrides land in the one settings object, each in its field; unset: defaults."""
    from gguf import GGMLQuantizationType as Q
    assert cuda.CudaSettings.from_env({}) == cuda.CudaSettings()
    s = cuda.CudaSettings.from_env({"NTX_F16_MMA": "0", "NTX_MVQ_WIDE_MAX_N": "0", "NTX_PDL": "0",
                                    "NTX_ATTN_ONE_LAUNCH": "0", "NTX_SPLIT_K_WARPS": "7", "NTX_MVQ_MIN_BLOCKS": "1",
                                    "NTX_MVQ_PERSISTENT": "0", "NTX_MMA_ONE_TILE_ROWS": "5"})
    assert (s.f16_mma, s.pdl, s.attn_one_launch_max_bucket, s.split_k_warps, s.mvq_persistent,
            s.mma_one_tile_rows) == (False, False, 0, 7, False, 5)
    assert s.mvq_wide_max_n == {Q.Q8_0: 0, Q.Q4_K: 0, Q.Q6_K: 0} and set(s.mvq_min_blocks.values()) == {1}


SHAPES = ((7, 256), (576, 576), (896, 4864), (4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336),
          (28672, 4096), (128256, 4096))  # (n, k): awkward ones, small models', the 8B shape's


def _launches(rows: int) -> list[int]:
    """The row counts of the launches matvec_rows makes for `rows` rows (chunks of ≤ 32)."""
    return [min(cuda.MATVEC_MAX_ROWS, rows - a) for a in range(0, rows, cuda.MATVEC_MAX_ROWS)]


@pytest.mark.parametrize("f16_mma", (True, False))
def test_deterministic_choice_follows_the_weight_alone(f16_mma):
    """With deterministic on, what fixes a row's sums (kernel family, rows per tile, K splits) is
    the same for every row count a launch or a step can have, 1 to 512 (prefill chunks: no
    cuBLAS), for every type and shape; only the batch width of the instance changes."""
    from gguf import GGMLQuantizationType as Q
    s = cuda.CudaSettings(deterministic=True, f16_mma=f16_mma)
    for qtype in (Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.Q4_1, Q.Q4_0, Q.Q5_K, Q.F16):
        for n, k in SHAPES:
            if qtype in (Q.Q4_K, Q.Q6_K, Q.Q5_K) and k % 256:
                continue
            orders = set()
            for rows in range(1, 513):
                assert not cuda.uses_cublas(rows, s)
                for m in _launches(rows):
                    c = cuda.choose(qtype, n, k, m, s, 132)
                    orders.add((c.family, c.order))
                    assert c.family != "mvq"
            assert len(orders) == 1, (qtype.name, n, k, orders)
            family = orders.pop()[0]
            if qtype in cuda.FAST_MATVEC:
                assert family == ("mmh" if f16_mma and k % 256 == 0 else "mma"), (qtype.name, n, k)
            elif qtype in cuda.F16_LEGACY:
                assert family == ("mmh" if f16_mma and s.f16_legacy else "generic"), (qtype.name, n, k)
            else:
                assert family == "generic"


def test_default_choice_follows_the_row_count():
    """The default mode keeps the fastest kernel per row count: dp4a at 1-2 rows, f16 tensor
    cores from 4, cuBLAS past 128 rows; so a row's sums there do depend on the batch (what the
    check above would catch)."""
    from gguf import GGMLQuantizationType as Q
    s = cuda.CudaSettings()
    assert not s.deterministic
    for qtype in cuda.FAST_MATVEC:
        assert cuda.choose(qtype, 4096, 4096, 1, s, 132).family == "mvq"
        assert cuda.choose(qtype, 4096, 4096, 2, s, 132).family == "mvq"
        assert cuda.choose(qtype, 4096, 4096, 4, s, 132).family == "mmh"
    assert cuda.choose(Q.Q8_0, 4096, 4096, 1, s, 132).order != cuda.choose(Q.Q8_0, 4096, 4096, 32, s, 132).order
    assert cuda.uses_cublas(cuda.CHUNKED_MAX_ROWS + 1, s) and not cuda.uses_cublas(cuda.CHUNKED_MAX_ROWS, s)


@pytest.mark.parametrize("f16_legacy", (False, True))
@pytest.mark.parametrize("deterministic", (False, True))
@pytest.mark.parametrize("f16_mma", (True, False))
def test_every_chosen_kernel_is_precompiled(deterministic, f16_mma, f16_legacy):
    """Each instance choose() can pick, in either mode, is one kernel_names() lists (precompile)."""
    from gguf import GGMLQuantizationType as Q
    s = cuda.CudaSettings(deterministic=deterministic, f16_mma=f16_mma, f16_legacy=f16_legacy)
    names = {name for family, name in cuda.kernel_names(s) if family == "quant"}
    for qtype in (Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.Q4_1, Q.Q5_0, Q.BF16):
        for n, k in SHAPES:
            if qtype in (Q.Q4_K, Q.Q6_K) and k % 256:
                continue
            for rows in range(1, cuda.MATVEC_MAX_ROWS + 1):
                c = cuda.choose(qtype, n, k, rows, s, 132)
                assert c.instance in names, c


@pytest.mark.parametrize("deterministic", (False, True))
def test_f16_legacy_choice(deterministic):
    """settings.f16_legacy: Q4_1 rows of any width (32-element blocks: 96, 576 too) multiply on the f16
    tensor cores from bucket 4 (from one row when deterministic, one sum order for every row
    count), else on the generic kernel as before; the other legacy types, and everything with
    f16_mma off, stay where they were; the f16 path reads x, not QAct."""
    from gguf import GGMLQuantizationType as Q
    on = cuda.CudaSettings(f16_legacy=True, deterministic=deterministic)
    off = cuda.CudaSettings(f16_legacy=False, deterministic=deterministic)
    # on by default: the default model's 64-row step 13.52 -> 4.87 ms on an H100 (bench/RESULTS.md)
    assert cuda.CudaSettings().f16_legacy
    for n, k in ((7, 96), (576, 576), (192, 576), (1536, 576), (576, 1536), (4096, 4096)):
        families = {}
        for rows in range(1, cuda.MATVEC_MAX_ROWS + 1):
            c = cuda.choose(Q.Q4_1, n, k, rows, on, 132)
            families[rows] = c.family
            if c.family == "mmh":
                tiles, ks = cuda.mmh_grid(n, k, 132)
                assert c.instance == f"mmh_q4_1<{cuda.bucket_of(rows) // 8 or 1}>" and c.grid == (tiles, ks)
            assert cuda.choose(Q.Q4_1, n, k, rows, off, 132).family == "generic"
            assert cuda.choose(Q.Q4_1, n, k, rows, on.replace(f16_mma=False), 132).family == "generic"
            for other in (Q.Q4_0, Q.Q5_0, Q.Q5_1):
                assert cuda.choose(other, n, k, rows, on, 132).family == "generic"
        want = {r: "mmh" if deterministic or cuda.bucket_of(r) >= cuda.MMA_MIN_BUCKET else "generic" for r in families}
        assert families == want, (n, k, families)
        if deterministic:
            assert len({cuda.choose(Q.Q4_1, n, k, r, on, 132).order for r in families}) == 1
    t = type("T", (), {"qtype": Q.Q4_1, "shape": (576, 576)})()
    assert cuda.reads_f16(t, 16, on) and not cuda.reads_f16(t, 16, off) and not cuda.reads_qact([t], 16, on)


def test_reads_qact_deterministic():
    """With deterministic on, whole 256-blocks multiply on f16 tensor cores from one row (no QAct
    read); Q8_0 rows of 576 stay on the int8 tensor cores, which read it."""
    from gguf import GGMLQuantizationType as Q
    t = lambda q, k: type("T", (), {"qtype": q, "shape": (64, k)})()  # noqa: E731
    det = cuda.CudaSettings(deterministic=True)
    assert not cuda.reads_qact([t(Q.Q4_K, 4096), t(Q.Q8_0, 4096)], 1, det)
    assert cuda.reads_qact([t(Q.Q8_0, 576)], 1, det)
    assert cuda.reads_qact([t(Q.Q4_K, 4096)], 1)  # the default: dp4a at one row
