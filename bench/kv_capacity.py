"""KV capacity and spill: a paged pool against whole slots, and a spilled chat's second turn.

    python bench/kv_capacity.py --dir /data/synth        # GPU: a llama3-8b-shaped Q4_K_M (synth), every layer resident
    python bench/kv_capacity.py --model 8B.gguf --backend cuda
    python bench/kv_capacity.py --smoke                  # CPU, a tiny synthetic model: does it run?
    python bench/kv_capacity.py --smoke --backend cuda   # the same on the GPU

capacity: a KV pool of what --slots contiguous slots of --ctx positions held (kv_blocks = slots x
ctx / 16), --requests requests of --prompt prompt tokens and --generate generated ones, greedy,
through the engine's decode loop (engine/generation/decode.py: Sequence, step) composed as the scheduler
composes a step (every decoding row, then prompt chunks from a budget of prefill_chunk tokens).
A request is admitted when a slot is free and the pool has the blocks of its whole length
beside those of the running ones. Paged: max_batch = requests, so every request runs at once
(`queued` counts those that waited); whole slots: max_batch = slots, as many at a time. Every
request's ids are compared with its solo run (`--solo` of them); tok/s is generated tokens over
the wall time from the first step to the last.

spill: turn 1 of a chat of --chat tokens, then another sequence takes the pool, so the chat's
blocks go to the host pool (kv_spill); turn 2 (turn 1, its reply and a question) through the
prefix cache (server/prefix_cache.py), which restores them, against the same turn 2 prefilled
in full: the time to the first token of each, their ratio, and whether the greedy ids agree.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time

import numpy as np

import common
from ntransformerd.engine.generation import decode
from ntransformerd.engine.runtime.engine import Engine, EngineConfig
from ntransformerd.engine.runtime.kv_cache import BLOCK_SIZE
from ntransformerd.engine.generation.sampler import SamplingParams
from ntransformerd.server.prefix_cache import PrefixCache


def blocks(n: int) -> int:
    return -(-n // BLOCK_SIZE)


def drive(engine: Engine, prompts: list[list[int]], n_gen: int, max_live: int) -> dict:
    """Every prompt to n_gen greedy tokens, at most max_live at once: ids, peak, queued, time."""
    params = SamplingParams(temperature=0, max_tokens=n_gen, ignore_eos=True)
    pool, chunk = engine.kv.blocks.n_blocks, engine.config.prefill_chunk
    queue, live, ids = list(range(len(prompts))), [], [None] * len(prompts)
    peak = queued = steps = 0
    t0 = time.perf_counter()
    while queue or live:
        while queue and len(live) < max_live and engine.kv.free_slots:
            i = queue[0]
            held = sum(blocks(len(prompts[j]) + n_gen) for j, _ in live)
            if held + blocks(len(prompts[i]) + n_gen) > pool:
                break  # waits for blocks
            queue.pop(0)
            if steps:
                queued += 1
            seq = decode.Sequence(engine, prompts[i], params)
            seq.open()
            live.append((i, seq))
        peak = max(peak, len(live))
        rows = [seq.row(1) for _, seq in live if seq.decoding]
        budget = chunk
        for _, seq in live:
            if not seq.decoding and budget > 0:
                rows.append(seq.row(budget))
                budget -= len(rows[-1].tokens)
        decode.step(engine, rows)
        steps += 1
        for r in rows:
            if r.error is not None:
                raise RuntimeError(f"{r.doing}: {r.error}") from r.error
        for i, seq in list(live):
            if seq.finish is not None:
                ids[i] = seq.history[len(prompts[i]):]
                seq.close()
                live.remove((i, seq))
    seconds = time.perf_counter() - t0
    return dict(ids=ids, peak=peak, queued=queued, steps=steps, seconds=seconds,
                tokens_per_second=len(prompts) * n_gen / seconds)


def capacity(path: str, a, prompts: list[list[int]]) -> dict:
    pool = blocks(a.slots * a.ctx)
    out = {"pool_blocks": pool, "pool_tokens": pool * BLOCK_SIZE, "requests": len(prompts),
           "prompt_tokens": a.prompt, "generated_tokens": a.generate}
    solo_ids = None
    for name, max_batch in (("paged", len(prompts)), ("slots", a.slots)):
        e = Engine.load(path, config=EngineConfig(backend=a.backend, max_batch=max_batch, max_ctx=a.ctx,
                                                  kv_blocks=pool, prefill_chunk=a.chunk, kv_dtype=a.kv_dtype,
                                                  deterministic=a.deterministic))
        drive(e, prompts[:1], 2, 1)  # warm: kernels compiled, steps captured
        run = drive(e, prompts, a.generate, max_batch)
        if solo_ids is None:
            solo_ids = [drive(e, [p], a.generate, 1)["ids"][0] for p in prompts[:a.solo]]
        same = [got == want for got, want in zip(run["ids"], solo_ids)]
        out[name] = {k: v for k, v in run.items() if k != "ids"} | {
            "max_batch": max_batch, "solo_compared": len(same), "solo_equal": sum(same)}
        print(f"{name:>5}: {len(prompts)} requests, peak {run['peak']} at once, {run['queued']} queued, "
              f"{run['tokens_per_second']:.1f} tok/s ({run['seconds']:.2f} s), ids equal to solo "
              f"{sum(same)}/{len(same)}", flush=True)
        e.unload()
        del e
        gc.collect()
    out["speedup"] = out["paged"]["tokens_per_second"] / out["slots"]["tokens_per_second"]
    return out


def run_turn(engine: Engine, seq: decode.Sequence, n_gen: int, *, close: bool = True) -> tuple[float, list[int]]:
    """Steps seq (its slot open, its prefilled set) to n_gen tokens: (seconds to its first token
    from now, its ids); its slot closed, or left to the caller."""
    t0, first = time.perf_counter(), None
    while seq.finish is None:
        row = seq.row(1 if seq.decoding else engine.config.prefill_chunk)
        decode.step(engine, [row])
        if row.error is not None:
            raise RuntimeError(f"{row.doing}: {row.error}") from row.error
        if first is None and seq.generated:
            first = time.perf_counter() - t0
    ids = seq.history[len(seq.prompt_ids):]
    if close:
        seq.close()
    if len(ids) != n_gen:
        raise RuntimeError(f"{len(ids)} tokens generated, not {n_gen}")
    return first, ids


def spill(path: str, a, rng) -> dict:
    reply, question = a.generate, 32
    turn2_len = a.chat + reply + question
    pool = blocks(turn2_len + reply) + 2  # the chat, or the other sequence, not both
    e = Engine.load(path, config=EngineConfig(backend=a.backend, max_batch=2, max_ctx=turn2_len + reply + BLOCK_SIZE,
                                              kv_blocks=pool, prefill_chunk=a.chunk, kv_dtype=a.kv_dtype,
                                              deterministic=a.deterministic))
    if not hasattr(e.kv, "spill_limit"):
        raise SystemExit(f"the {e.backend_name} backend's KV cache has no host pool to spill to "
                         "(engine/runtime/kv_cache.py: a paged KVCache has)")
    e.kv.spill_limit = 4 * pool * BLOCK_SIZE * e.kv.blocks.block_bytes // BLOCK_SIZE
    vocab = e.cfg.vocab_size
    params = SamplingParams(temperature=0, max_tokens=reply, ignore_eos=True)
    chat = [int(x) for x in rng.integers(1, vocab, a.chat)]
    pc = PrefixCache(e, enabled=True)

    warm = decode.Sequence(e, chat[:32], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    warm.open()
    run_turn(e, warm, 2)

    s1 = decode.Sequence(e, chat, params)
    s1.slot, s1.prefilled = pc.open(chat, [], use=True)
    slot1 = s1.slot
    _, ids1 = run_turn(e, s1, reply, close=False)
    n1 = e.length(slot1)  # what its KV holds: all but the last token
    turn2 = chat + ids1 + [int(x) for x in rng.integers(1, vocab, question)]
    # the same turn 2 from the chat's blocks while they are still in the pool (shared by reference,
    # as the prefix cache shares them): what the restored run must give bit for bit
    kept = decode.Sequence(e, turn2, params)
    kept.slot = e.open()  # slot1 is live: a free slot is another
    e.copy_prefix(slot1, kept.slot, n1)
    kept.prefilled = n1
    _, ids_kept = run_turn(e, kept, reply)
    pc.close(slot1, (chat + ids1)[:n1], keep=True)
    other = e.open()  # slot1 is parked: a free slot is another
    e.prefill(other, [int(x) for x in rng.integers(1, vocab, turn2_len)])  # needs the chat's blocks
    e.close(other)
    spilled = int(e.kv.blocks.stats["spilled"])
    if not spilled or e.kv.kept(slot1) < a.chat:
        raise SystemExit(f"the chat's blocks were not spilled (spilled {spilled}, kept {e.kv.kept(slot1)})")

    t0 = time.perf_counter()
    s2 = decode.Sequence(e, turn2, params)
    s2.slot, s2.prefilled = pc.open(turn2, [], use=True)
    restore_s, reused = time.perf_counter() - t0, s2.prefilled
    ttft_restored, ids_restored = run_turn(e, s2, reply)
    ttft_restored += restore_s
    restored = int(e.kv.blocks.stats["restored"])

    s3 = decode.Sequence(e, turn2, params)  # the same turn, no cache: every position prefilled
    s3.open()
    ttft_prefill, ids_prefill = run_turn(e, s3, reply)
    e.unload()
    out = dict(chat_tokens=a.chat, turn2_tokens=len(turn2), reused_positions=reused, spilled_blocks=spilled,
               restored_blocks=restored, restore_seconds=restore_s, ttft_restored_seconds=ttft_restored,
               ttft_prefill_seconds=ttft_prefill, ratio=ttft_restored / ttft_prefill,
               ids_equal_kept=ids_restored == ids_kept, ids_equal=ids_restored == ids_prefill)
    print(f"spill: turn 2 of {len(turn2)} tokens, {reused} restored ({restored} blocks, {restore_s * 1e3:.1f} ms): "
          f"first token {ttft_restored * 1e3:.1f} ms vs {ttft_prefill * 1e3:.1f} ms prefilled "
          f"({out['ratio']:.3f}x); ids equal to the unspilled blocks' {out['ids_equal_kept']}, to the full "
          f"prefill's {out['ids_equal']} (other kernels: a prefill's rounding differs from a decode's)", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__file__, __doc__)
    p.add_argument("--model", help="a GGUF (default: the llama3-8b shape in q4_k_m, synthesized into --dir)")
    p.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "ntx-synth"), help="where synthetic models go")
    p.add_argument("--backend", help="cuda (default), or cpu (the default with --smoke)")
    p.add_argument("--kv-dtype", default="auto")
    p.add_argument("--slots", type=int, default=8, help="the whole slots the pool amounts to (default 8)")
    p.add_argument("--ctx", type=int, default=4096, help="positions of one slot, and max_ctx (default 4096)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--generate", type=int, default=256)
    p.add_argument("--solo", type=int, default=32, help="requests whose ids are compared with their solo run")
    p.add_argument("--chunk", type=int, default=512, help="prefill_chunk")
    p.add_argument("--chat", type=int, default=4096, help="tokens of the spilled chat's turn 1")
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                   help="the deterministic setting (default on: ids equal to solo runs are its promise)")
    a = p.parse_args(argv)
    a.backend = a.backend or ("cpu" if a.smoke else "cuda")
    if a.backend == "cuda":
        common.require_gpu(__file__)
    if a.smoke:
        a.slots, a.ctx, a.requests, a.prompt, a.generate, a.solo, a.chunk, a.chat = 2, 128, 6, 24, 8, 6, 16, 64
        path = common.synthetic(a.dir, "tiny", "q8_0", vocab=2048)
    elif a.model:
        path = a.model
    else:
        path = common.synthetic(a.dir, "llama3-8b", "q4_k_m")
    rng = np.random.default_rng(0)
    e = Engine.load(path, config=EngineConfig(backend=a.backend, max_batch=1, max_ctx=16))
    vocab, backend, kv_dtype = e.cfg.vocab_size, e.backend_name, e.config.kv_dtype
    e.unload()
    del e
    prompts = [[int(x) for x in rng.integers(1, vocab, a.prompt)] for _ in range(a.requests)]
    result = dict(model=os.path.basename(path), backend=backend, kv_dtype=kv_dtype, smoke=a.smoke,
                  deterministic=a.deterministic,
                  capacity=capacity(path, a, prompts), spill=spill(path, a, rng))
    common.write_json(a.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
