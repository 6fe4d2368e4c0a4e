"""The prefix cache: a prompt that repeats what is already in the KV cache is not prefilled again.

A finished sequence's slot goes back to the free list with its keys and values in place; this
table remembers which token ids they are for, least recently freed first. A new request takes
the slot whose tokens share the longest prefix with its prompt and keeps those positions (or,
when that cached sequence goes on past the shared part and an empty slot is free, a copy of
them, so the cached one stays for others), or, when a live sequence shares more, gets a slot
and a copy of them. Either way only the rest of the prompt is prefilled; at least its last token always is, so
there are logits to sample from. A request with no hit takes a slot that holds nothing, else the
least recently freed one (an eviction). Slots are allocated with the cache, so keeping finished
sequences costs no memory.

Concurrent requests sharing a prefix both benefit: while an older request is still prefilling
positions a younger one shares, the younger waits and then copies them (`catch_up`).

Thread rule: the scheduler thread only, like the engine.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    def __init__(self, engine, *, enabled: bool):
        self.engine = engine
        # an engine without copy_prefix (a test double) has no way to share KV
        self.enabled = enabled and hasattr(engine, "copy_prefix")
        self.held: collections.OrderedDict[int, list[int]] = collections.OrderedDict()  # free slot → its tokens
        self.hit_tokens = 0
        self.evictions = 0

    def open(self, prompt: Sequence[int], live: Sequence[tuple[int, Sequence[int]]], *, use: bool) -> tuple[int, int]:
        """(slot, positions already filled) for a new sequence with `prompt`; `live` is
        (slot, token ids in its KV) of the running sequences."""
        if not self.enabled:
            return self.engine.open(), 0
        limit = len(prompt) - 1
        held_slot, held_n = self._best(prompt, self.held.items(), limit) if use else (None, 0)
        live_slot, live_n = self._best(prompt, live, limit) if use else (None, 0)
        if held_n and held_n >= live_n:
            self.hit_tokens += held_n
            empty = self._empty()
            if held_n < len(self.held[held_slot]) and empty:
                # the cached sequence goes on past the shared part: keep it for others, copy
                slot = self.engine.open(empty[-1])
                self.engine.copy_prefix(held_slot, slot, held_n)
                return slot, held_n
            del self.held[held_slot]
            return self.engine.open(held_slot, keep=held_n), held_n
        slot = self._fresh()
        if live_n:
            self.engine.copy_prefix(live_slot, slot, live_n)
            self.hit_tokens += live_n
        return slot, live_n

    def catch_up(self, slot: int, prompt: Sequence[int], filled: int,
                 live: Sequence[tuple[int, Sequence[int]]]) -> int:
        """Copy into `slot` what another live sequence has computed of `prompt` past `filled`;
        the new number of filled positions."""
        if not self.enabled:
            return filled
        src, n = self._best(prompt, [(s, t) for s, t in live if s != slot], len(prompt) - 1)
        if n <= filled:
            return filled
        self.engine.copy_prefix(src, slot, n)
        self.hit_tokens += n - filled
        return n

    def close(self, slot: int, tokens: Sequence[int], *, keep: bool) -> None:
        """Free `slot`; with `keep`, remember that its KV holds `tokens`."""
        self.engine.close(slot)
        if self.enabled and keep and tokens:
            self.held[slot] = list(tokens)

    @staticmethod
    def _best(prompt, candidates, limit: int) -> tuple[int | None, int]:
        best_slot, best_n = None, 0
        for slot, tokens in candidates:
            n = min(common_prefix(prompt, tokens), limit)
            if n > best_n:
                best_slot, best_n = slot, n
        return best_slot, best_n

    def _empty(self) -> list[int]:
        return [s for s in self.engine.free_slot_ids() if s not in self.held]

    def _fresh(self) -> int:
        empty = self._empty()
        if empty:
            return self.engine.open(empty[-1])
        slot, _ = self.held.popitem(last=False)  # least recently freed
        self.evictions += 1
        return self.engine.open(slot)
