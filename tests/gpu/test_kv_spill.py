"""KV that spills to pinned host RAM and comes back on the GPU (backends/cuda/kv.py's save_blocks
and load_blocks under kv_cache.KVCache.spill and Engine.reopen): on the real-weights slice, a
chat's blocks after a spill and a restore are the never-spilled blocks bit for bit, and its next
turn's greedy ids are those of the same turn run from the never-spilled blocks (f16 and q8_0).
tests/engine/test_kv_spill.py is the same on the cpu backend."""
import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from ntransformerd.engine.runtime.engine import Engine, EngineConfig  # noqa: E402
from ntransformerd.engine.gguf_file import GGUFModel  # noqa: E402
from ntransformerd.engine.runtime.kv_cache import BLOCK_SIZE  # noqa: E402

from .real_weights import real_slice  # noqa: E402,F401 (a fixture)


def greedy(engine: Engine, slot: int, prompt: list[int], n: int) -> list[int]:
    """n greedy ids after `prompt` appended to `slot`."""
    logits, ids = engine.prefill(slot, prompt), []
    for _ in range(n):
        ids.append(int(np.argmax(logits)))
        logits = engine.decode([slot], [ids[-1]])[0]
    return ids


def blocks_of(engine: Engine, slot: int) -> list:
    """The slot's KV blocks, every layer, as host arrays of their stored bytes."""
    table = engine.kv.blocks
    return engine.kv.save_blocks(table.tables[slot, :table.held[slot]].copy())


def poison(engine: Engine, ids, like: list) -> None:
    """Blocks `ids` (back in the pool) overwritten: the restore takes the lowest free ids, often
    the same ones, and one that loaded nothing would not show otherwise."""
    engine.kv.load_blocks(ids, [tuple(np.full(x.nbytes, 0x5A, np.uint8).view(x.dtype).reshape(x.shape) for x in kv)
                                for kv in like])


def same_bytes(a: list, b: list) -> bool:
    return all(np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
               for (ka, va), (kb, vb) in zip(a, b, strict=True) for x, y in ((ka, kb), (va, vb)))


@pytest.mark.parametrize("kv_dtype", ["f16", "q8_0"])
def test_restored_kv_is_the_never_spilled_kv(real_slice, kv_dtype):
    rng = np.random.default_rng(7)
    chat, question = rng.integers(1, 4000, 1000).tolist(), rng.integers(1, 4000, 24).tolist()
    e = Engine(GGUFModel(real_slice), config=EngineConfig(backend="cuda", max_batch=3, max_ctx=2048,
                                                          kv_dtype=kv_dtype, prefill_chunk=256, kv_blocks=128,
                                                          kv_spill="1GiB"))
    a = e.open()
    e.prefill(a, chat)
    before = blocks_of(e, a)
    b = e.open()
    e.copy_prefix(a, b, len(chat))  # turn 2 from the never-spilled blocks, shared by reference
    kept = greedy(e, b, question, 12)
    e.close(b)
    e.park(a)
    ids = e.kv.blocks.tables[a, :len(before[0][0])].copy()
    assert e.kv.spill(a) and int(e.kv.blocks.held[a]) == 0 and e.kv.kept(a) >= len(chat)
    assert e.kv.blocks.stats["spilled"] == -(-len(chat) // BLOCK_SIZE) == len(before[0][0])
    poison(e, ids, before)  # the blocks it let go overwritten: a restore must bring the bytes back
    e.reopen(a, keep=len(chat))  # restored into fresh blocks
    assert same_bytes(blocks_of(e, a), before), "restored KV blocks differ from the never-spilled ones"
    assert greedy(e, a, question, 12) == kept
    e.close(a)
