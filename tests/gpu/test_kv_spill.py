"""KV that spills to pinned host RAM and comes back on the GPU (backends/cuda/kv.py's save_blocks
and load_blocks under kv_cache.KVCache.spill and Engine.reopen): on the real-weights slice, a
chat's blocks after a spill and a restore are the never-spilled blocks bit for bit, and its next
turn's greedy ids are those of the same turn run from the never-spilled blocks (f16 and q8_0).
tests/engine/test_kv_spill.py is the same on the cpu backend."""
import importlib.util
import os

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from ntransformerd.engine.runtime.engine import Engine, EngineConfig  # noqa: E402
from ntransformerd.engine.gguf_file import GGUFModel  # noqa: E402
from ntransformerd.engine.runtime.kv_cache import BLOCK_SIZE  # noqa: E402

from .real_weights import real_slice  # noqa: E402,F401 (a fixture)


_spec = importlib.util.spec_from_file_location(
    "cpu_kv_spill", os.path.join(os.path.dirname(__file__), os.pardir, "engine", "test_kv_spill.py"))
_cpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_cpu)
spill_round_trip = _cpu.spill_round_trip  # the same round trip as on the cpu backend


@pytest.mark.parametrize("kv_dtype", ["f16", "q8_0"])
def test_restored_kv_is_the_never_spilled_kv(real_slice, kv_dtype):
    rng = np.random.default_rng(7)
    chat, question = rng.integers(1, 4000, 1000).tolist(), rng.integers(1, 4000, 24).tolist()
    e = Engine(GGUFModel(real_slice), config=EngineConfig(backend="cuda", max_batch=3, max_ctx=2048,
                                                          kv_dtype=kv_dtype, prefill_chunk=256, kv_blocks=128,
                                                          kv_spill="1GiB"))
    r = spill_round_trip(e, chat, question, 12)
    assert r["n"] == len(chat) and r["blocks"] == -(-len(chat) // BLOCK_SIZE) == r["spilled"]
    assert r["same_blocks"], "restored KV blocks differ from the never-spilled ones"
    assert r["restored"] == r["kept"], r
