"""KV that spills to host RAM and comes back, against prefilling it again (issue 36).

    python bench/kv_spill.py --dir /tmp/ntx               # GPU: a llama3-8b-shaped Q4_K_M (synth), all resident
    python bench/kv_spill.py --model smollm2.gguf         # a real model: its greedy ids mean something
    python bench/kv_spill.py --smoke                      # CPU, a tiny synthetic model: does it run?

For each chat (--chats tokens of random ids, default 4096 8192 16384), on one engine:
turn 1, the chat, prefilled into a slot, and its KV blocks copied to the host as they are (the
never-spilled blocks); turn 2 (--question tokens, then --generate greedy ids) from those blocks,
shared by reference with a second slot; the chat's slot parked and spilled (KVCache.spill: its
blocks to the host pool, as the pool does when it runs short), timed; reopened (Engine.reopen:
its blocks restored into fresh ones), timed; its blocks compared with the never-spilled ones
bit for bit, and turn 2 run again from them, its ids compared; then the chat prefilled again
into a fresh slot, timed. PASS: blocks and ids equal and the restore faster than the re-prefill
(the smoke run: equal only). A chat that does not fit the model's context with its turn 2 is
skipped, and the table says so."""

from __future__ import annotations

import os
import sys
import tempfile
import time

import numpy as np

import common
from ntransformerd.engine.runtime.engine import Engine, EngineConfig
from ntransformerd.engine.gguf_file import GGUFModel
from ntransformerd.engine.runtime.kv_cache import BLOCK_SIZE


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def blocks(n: int) -> int:
    return -(-n // BLOCK_SIZE)


def sync(engine: Engine) -> None:
    """Wait for the device's work (a GPU's copies and steps run behind the host)."""
    if not engine.backend.is_host:
        from ntransformerd.engine.backends.cuda.nvrtc import cp  # lazy: optional, the [gpu] extra
        cp.cuda.Device().synchronize()


def greedy(engine: Engine, slot: int, prompt: list[int], n: int) -> list[int]:
    """n greedy ids after `prompt` appended to `slot`."""
    logits, ids = engine.prefill(slot, prompt), []
    for _ in range(n):
        ids.append(int(np.argmax(logits)))
        logits = engine.decode([slot], [ids[-1]])[0]
    return ids


def blocks_of(engine: Engine, slot: int) -> list:
    """The slot's KV blocks, every layer, copied to the host as stored."""
    table = engine.kv.blocks
    return engine.kv.save_blocks(table.tables[slot, :table.held[slot]].copy())


def same_bytes(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
        for (ka, va), (kb, vb) in zip(a, b) for x, y in ((ka, kb), (va, vb)))


def poison(engine: Engine, ids, like: list) -> None:
    """Blocks `ids` (back in the pool) overwritten with a byte pattern: the restore takes the
    lowest free ids, often the same ones, and one that loaded nothing would not show otherwise."""
    engine.kv.load_blocks(ids, [tuple(np.full(x.nbytes, 0x5A, np.uint8).view(x.dtype).reshape(x.shape) for x in kv)
                                for kv in like])


def chat_row(e: Engine, chat: list[int], question: list[int], n_gen: int) -> dict:
    """One chat spilled and restored, against prefilled again (module docstring)."""
    a = e.open()
    t = time.perf_counter()
    e.prefill(a, chat)
    sync(e)
    prefill_1 = time.perf_counter() - t
    n = e.length(a)
    before = blocks_of(e, a)
    b = e.open()
    e.copy_prefix(a, b, n)
    kept = greedy(e, b, question, n_gen)
    e.close(b)
    e.park(a)
    ids = e.kv.blocks.tables[a, :blocks(n)].copy()
    t = time.perf_counter()
    if not e.kv.spill(a):
        raise SystemExit(f"the chat's {blocks(n)} blocks did not fit the host pool ({e.kv.spill_limit} bytes)")
    sync(e)
    spill_s = time.perf_counter() - t
    poison(e, ids, before)
    t = time.perf_counter()
    e.reopen(a, keep=n)
    sync(e)
    restore_s = time.perf_counter() - t
    same = same_bytes(blocks_of(e, a), before)
    restored = greedy(e, a, question, n_gen)
    e.close(a)
    d = e.open()
    t = time.perf_counter()
    e.prefill(d, chat)
    sync(e)
    reprefill_s = time.perf_counter() - t
    e.close(d)
    return dict(chat_tokens=n, blocks=blocks(n), bytes=blocks(n) * e.kv.blocks.block_bytes,
                prefill_seconds=prefill_1, spill_seconds=spill_s, restore_seconds=restore_s,
                reprefill_seconds=reprefill_s, restore_vs_reprefill=restore_s / reprefill_s,
                blocks_equal=same, ids_equal=restored == kept, turn2_ids=len(kept))


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__file__, __doc__)
    p.add_argument("--model", help="a GGUF (default: the llama3-8b shape in q4_k_m, synthesized into --dir)")
    p.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "ntx-synth"), help="where synthetic models go")
    p.add_argument("--shape", default="llama3-8b", help="the synthetic shape without --model (default llama3-8b)")
    p.add_argument("--backend", help="cuda (default), or cpu (the default with --smoke)")
    p.add_argument("--kv-dtype", default="auto")
    p.add_argument("--chats", type=int, nargs="+", default=[4096, 8192, 16384], help="turn 1's tokens, one row each")
    p.add_argument("--question", type=int, default=32, help="turn 2's new tokens (default 32)")
    p.add_argument("--generate", type=int, default=16, help="turn 2's greedy ids compared (default 16)")
    p.add_argument("--chunk", type=int, default=512, help="prefill_chunk (default 512)")
    a = p.parse_args(argv)
    a.backend = a.backend or ("cpu" if a.smoke else "cuda")
    if a.backend == "cuda":
        common.require_gpu(__file__)
    if a.smoke:
        a.chats, a.question, a.generate, a.chunk = [64, 128, 256], 8, 4, 32
        path = common.synthetic(a.dir, "tiny", "q8_0", vocab=2048)
    else:
        path = a.model or common.synthetic(a.dir, a.shape, "q4_k_m")
    model = GGUFModel(path)
    turn2 = a.question + a.generate
    fit = [n for n in a.chats if n + turn2 <= model.config.context_length]
    skipped = [n for n in a.chats if n not in fit]
    if not fit:
        raise SystemExit(f"no chat of {a.chats} fits the context of {model.config.context_length} with turn 2")
    longest = max(fit)
    # one slot's chat, a second's turn 2 beside it (its own blocks), and room to spare
    pool = blocks(longest + turn2) + 2 * blocks(turn2) + 4
    e = Engine(model, config=EngineConfig(backend=a.backend, max_batch=3, max_ctx=longest + turn2 + BLOCK_SIZE,
                                          kv_dtype=a.kv_dtype, kv_blocks=pool, prefill_chunk=a.chunk))
    e.kv.spill_limit = 2 * pool * e.kv.blocks.block_bytes  # the host pool (kv_spill): the longest chat, twice
    log(f"{os.path.basename(path)} on {e.backend_name}, KV {e.config.kv_dtype}, {e.kv.blocks.block_bytes / 2**20:.2f} "
        f"MiB per block, pool {pool} blocks")
    rng = np.random.default_rng(0)
    vocab = e.cfg.vocab_size
    warm = e.open()  # kernels compiled and steps captured before anything is timed
    greedy(e, warm, rng.integers(1, vocab, 2 * a.chunk + 3).tolist(), 2)
    e.close(warm)
    rows = []
    for n in fit:
        chat = rng.integers(1, vocab, n).tolist()
        question = rng.integers(1, vocab, a.question).tolist()
        r = chat_row(e, chat, question, a.generate)
        r["pass"] = r["blocks_equal"] and r["ids_equal"] and (a.smoke or r["restore_seconds"] < r["reprefill_seconds"])
        rows.append(r)
        log(f"chat {n}: restore {r['restore_seconds'] * 1e3:.1f} ms, re-prefill {r['reprefill_seconds'] * 1e3:.1f} ms, "
            f"{'PASS' if r['pass'] else 'FAIL'}")
    e.unload()
    print(f"\n{os.path.basename(path)}, {e.backend_name}, KV {e.config.kv_dtype}; turn 2: {a.question} tokens + "
          f"{a.generate} greedy ids")
    print("| chat | blocks | MiB | spill ms | restore ms | re-prefill ms | restore/re-prefill | blocks equal | ids equal | |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['chat_tokens']} | {r['blocks']} | {r['bytes'] / 2**20:.1f} | {r['spill_seconds'] * 1e3:.1f} | "
              f"{r['restore_seconds'] * 1e3:.1f} | {r['reprefill_seconds'] * 1e3:.1f} | {r['restore_vs_reprefill']:.3f} | "
              f"{r['blocks_equal']} | {r['ids_equal']} | {'PASS' if r['pass'] else 'FAIL'} |")
    for n in skipped:
        print(f"| {n} | skipped: with turn 2 past the model's context of {model.config.context_length} |")
    ok = all(r["pass"] for r in rows)
    print("PASS" if ok else "FAIL", flush=True)
    common.write_json(a.json, dict(model=os.path.basename(path), backend=e.backend_name, kv_dtype=e.config.kv_dtype,
                                   question=a.question, generate=a.generate, smoke=a.smoke, rows=rows,
                                   skipped=skipped, passed=ok))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
