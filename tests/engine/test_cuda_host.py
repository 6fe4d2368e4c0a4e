"""Host-side planning of the CUDA backend that needs no GPU: prefill attention tiles and heads."""
import numpy as np
import pytest

from ntransformerd.engine.backends import cuda
from ntransformerd.engine.gguf_file import LlamaConfig
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


def test_chunk_heads():
    base = dict(n_layers=1, d_model=64, d_ff=64, n_heads=8, n_kv_heads=2, head_dim=64, vocab_size=10,
                context_length=64, rms_eps=1e-5, rope_base=1e4, rope_dim=64, rope_neox=False, rope_scale=1.0,
                tied_output=True)
    for heads, kv, want in ((8, 2, 4), (32, 8, 4), (9, 3, 3), (4, 4, 1), (64, 8, 8), (32, 2, 8), (24, 2, 6)):
        cfg = LlamaConfig(**{**base, "n_heads": heads, "n_kv_heads": kv})
        assert cuda.chunk_heads(cfg) == want


@pytest.mark.parametrize("sms", (1, 16, 132, 1000))
def test_mmh_grid(sms):
    """Split-K launches of the f16 matvecs stay inside their scratch (partials for 32 batch rows,
    one counter per row tile), take whole K blocks, and give every SM work where K allows."""
    for n in (1, 7, 128, 129, 1024, 4096, 6144, 14336, 28672, 65536, 65537, 131072, 152064):
        for k in (256, 512, 4096, 14336, 28672):
            tiles, ks = cuda.mmh_grid(n, k, sms)
            assert tiles * cuda.MMH_ROWS >= n > (tiles - 1) * cuda.MMH_ROWS
            assert 1 <= ks <= min(8, k // 256)
            if ks > 1:
                assert ks * 32 * n <= cuda.MMH_PART_FLOATS
                assert tiles <= cuda.MMH_PART_FLOATS // cuda.MMH_ROWS  # the counters _mmh_scratch makes
            if k // 256 >= 8 and 32 * 8 * n <= cuda.MMH_PART_FLOATS:
                assert tiles * ks >= min(2 * sms, 8 * tiles)


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


@pytest.mark.parametrize("deterministic", (False, True))
@pytest.mark.parametrize("f16_mma", (True, False))
def test_every_chosen_kernel_is_precompiled(deterministic, f16_mma):
    """Each instance choose() can pick, in either mode, is one kernel_names() lists (precompile)."""
    from gguf import GGMLQuantizationType as Q
    s = cuda.CudaSettings(deterministic=deterministic, f16_mma=f16_mma)
    names = {name for family, name in cuda.kernel_names(s) if family == "quant"}
    for qtype in (Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.Q4_1, Q.Q5_0, Q.BF16):
        for n, k in SHAPES:
            if qtype in (Q.Q4_K, Q.Q6_K) and k % 256:
                continue
            for rows in range(1, cuda.MATVEC_MAX_ROWS + 1):
                c = cuda.choose(qtype, n, k, rows, s, 132)
                assert c.instance in names, c


def test_reads_qact_deterministic():
    """With deterministic on, whole 256-blocks multiply on f16 tensor cores from one row (no QAct
    read); Q8_0 rows of 576 stay on the int8 tensor cores, which read it."""
    from gguf import GGMLQuantizationType as Q
    t = lambda q, k: type("T", (), {"qtype": q, "shape": (64, k)})()  # noqa: E731
    det = cuda.CudaSettings(deterministic=True)
    assert not cuda.reads_qact([t(Q.Q4_K, 4096), t(Q.Q8_0, 4096)], 1, det)
    assert cuda.reads_qact([t(Q.Q8_0, 576)], 1, det)
    assert cuda.reads_qact([t(Q.Q4_K, 4096)], 1)  # the default: dp4a at one row
