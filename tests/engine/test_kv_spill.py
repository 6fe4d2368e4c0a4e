"""KV that spills to the host pool and comes back (kv_cache.KVCache.spill, Engine.reopen): on the
default model, a chat's blocks after a spill and a restore are the never-spilled blocks bit for
bit, and its next turn's greedy ids are those of the same turn run from the never-spilled blocks.
tests/gpu/test_kv_spill.py runs the same on the cuda backend."""

from __future__ import annotations

import numpy as np
import pytest

from ntransformerd.engine.runtime.engine import Engine, EngineConfig
from ntransformerd.engine.runtime.kv_cache import BLOCK_SIZE


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


def spill_round_trip(engine: Engine, chat: list[int], question: list[int], n_gen: int) -> dict:
    """Turn 1 (`chat`) prefilled; turn 2 (`question`, then n_gen greedy ids) run from its blocks
    shared by reference; the chat parked, spilled (the blocks it let go overwritten), reopened
    (restored); turn 2 again."""
    e = engine
    e.kv.spill_limit = 1 << 30
    a = e.open()
    e.prefill(a, chat)
    n = e.length(a)
    before = blocks_of(e, a)
    b = e.open()
    e.copy_prefix(a, b, n)
    kept = greedy(e, b, question, n_gen)
    e.close(b)
    e.park(a)
    ids = e.kv.blocks.tables[a, :len(before[0][0])].copy()
    assert e.kv.spill(a) and e.kv.kept(a) >= n and int(e.kv.blocks.held[a]) == 0
    spilled = int(e.kv.blocks.stats["spilled"])
    poison(e, ids, before)
    e.reopen(a, keep=n)
    after = blocks_of(e, a)
    restored = greedy(e, a, question, n_gen)
    e.close(a)
    return dict(n=n, blocks=len(before[0][0]), spilled=spilled, same_blocks=same_bytes(before, after),
                kept=kept, restored=restored)


@pytest.mark.parametrize("kv_dtype", ["auto", "q8_0"])
def test_restored_kv_is_the_never_spilled_kv(default_model, kv_dtype):
    rng = np.random.default_rng(7)
    chat, question = rng.integers(1, 4000, 90).tolist(), rng.integers(1, 4000, 9).tolist()
    e = Engine(default_model, config=EngineConfig(backend="cpu", max_batch=3, max_ctx=256, kv_dtype=kv_dtype,
                                                  prefill_chunk=32, kv_blocks=24))
    r = spill_round_trip(e, chat, question, 6)
    assert r["n"] == 90 and r["blocks"] == -(-90 // BLOCK_SIZE) == r["spilled"]
    assert r["same_blocks"], "restored KV blocks differ from the never-spilled ones"
    assert r["restored"] == r["kept"], r


def test_a_live_slot_does_not_spill(default_model):
    e = Engine(default_model, config=EngineConfig(backend="cpu", max_batch=2, max_ctx=64, kv_blocks=8))
    a = e.open()
    e.prefill(a, [1, 2, 3])
    with pytest.raises(ValueError, match="live, not parked"):
        e.kv.spill(a)
    e.park(a)
    e.kv.spill_limit = 0
    assert not e.kv.spill(a) and e.kv.kept(a) == 0  # no host pool: the blocks are dropped
