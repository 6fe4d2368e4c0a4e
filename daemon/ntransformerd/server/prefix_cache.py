"""The prefix cache: a prompt that repeats what is already in the KV cache is not prefilled again.

A finished sequence's slot is parked (engine.park): it stays this cache's, with its keys and
values in place, and this table remembers which token ids they are for, least recently parked
first. Nothing else can be handed that slot: engine.open gives out free slots only, so a
measurement or any other job that asks for a slot never writes over a cached prompt. A new
request takes the slot whose tokens share the longest prefix with its prompt and keeps those
positions (engine.reopen; or, when that cached sequence goes on past the shared part and a free
slot exists, shares their blocks, so the cached one stays for others), or, when a live sequence
shares more, gets a slot sharing its blocks (engine.copy_prefix: by block reference, the last
partial block copied). Either way only the rest of the prompt is prefilled; at least its last
token always is, so there are logits to sample from. A request with no hit takes a free slot,
else this cache forgets its least recently parked one (`evict`) and frees it. Keeping finished
sequences costs no memory of its own: a paged pool takes a parked slot's blocks back when it
runs short, or spills them to host RAM (kv_cache.py); `engine.kept` counts spilled positions as
held, and reopening the slot restores them.

Concurrent requests sharing a prefix both benefit: while an older request is still prefilling
positions a younger one shares, the younger waits and then copies them (`catch_up`).

Private by default: a sequence is reused only by requests of its own scope, so one user can
never learn from a faster first token or from `cached_prompt_tokens` what another sent. The
scope of a caller (callers.py) follows `prefix_cache_share`: "none", the caller itself (a unix
uid, a TLS identity, a gateway's API key under the gateway's uid); "group", the uid's primary
group (what a caller names below itself stays split); "all", everyone (one cache for all).

Thread rule: the scheduler thread only, like the engine.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence

from ntransformerd.server.policy import common_prefix
from ntransformerd.server.served import KVSlots

SHARE = ("none", "group", "all")  # prefix_cache_share

# the running sequences: (slot, token ids it has run, how many of them its KV holds, its caller);
# read at most once, as far as a choice needs (a generator's entries past that are never made)
Live = Iterable[tuple[int, Sequence[int], int, object]]


def scope(caller, share: str) -> str:
    """The key under which `caller`'s sequences are reused: equal keys share. A caller of None
    is the daemon's own process (a request made in-process, as tests and tools do)."""
    if share == "all" or caller is None:
        return ""
    if share == "group" and caller.gid is not None:
        return f"gid:{caller.gid}/{caller.on_behalf_of}" if caller.on_behalf_of else f"gid:{caller.gid}"
    return caller.id


class PrefixCache:
    def __init__(self, engine: KVSlots, *, enabled: bool, share: str = "none"):
        if share not in SHARE:
            raise ValueError(f"prefix_cache_share {share!r}: use none, group or all")
        self.engine = engine
        self.enabled = enabled
        self.share = share
        # free slot → (its scope, its tokens), least recently freed first
        self.held: collections.OrderedDict[int, tuple[str, list[int]]] = collections.OrderedDict()
        self.hit_tokens = 0
        self.evictions = 0

    def shares(self, a, b) -> bool:
        """Whether callers `a` and `b` may reuse each other's sequences."""
        return scope(a, self.share) == scope(b, self.share)

    def open(self, prompt: Sequence[int], live: Live, *, use: bool, caller=None) -> tuple[int, int]:
        """(slot, positions already filled) for a new sequence of `caller` with `prompt`; `live`
        the running sequences (Live)."""
        if not self.enabled:
            return self.engine.open(), 0
        limit, key = len(prompt) - 1, scope(caller, self.share)
        held_slot, held_n = self._best_held(prompt, key, limit) if use else (None, 0)
        # a live sequence is taken only where it shares more than the held one: none can once
        # the held one shares all it may
        live_slot, live_n = self._best_live(prompt, live, key, limit, held_n) if use and held_n < limit else (None, 0)
        if held_n and held_n >= live_n:
            self.hit_tokens += held_n
            if held_n < self._kept(held_slot, len(self.held[held_slot][1])) and self.engine.free_slots:
                # the cached sequence goes on past the shared part: keep it for others, copy
                slot = self.engine.open()
                self.engine.copy_prefix(held_slot, slot, held_n)
                return slot, held_n
            del self.held[held_slot]
            self.engine.reopen(held_slot, keep=held_n)
            return held_slot, held_n
        slot = self.open_free()
        if live_n:
            self.engine.copy_prefix(live_slot, slot, live_n)
            self.hit_tokens += live_n
        return slot, live_n

    def open_free(self) -> int:
        """A slot holding nothing, for a new sequence or an internal job (a measurement): a free
        one, else the least recently parked one, forgotten first (an eviction)."""
        if not self.engine.free_slots:
            self.evict()
        return self.engine.open()

    def evict(self) -> bool:
        """Forget the least recently parked sequence, freeing its slot; False if none is kept."""
        if not self.held:
            return False
        slot, _ = self.held.popitem(last=False)
        self.engine.close(slot)
        self.evictions += 1
        return True

    def clear(self) -> None:
        """Forget every kept sequence, freeing their slots (the engine outlives this cache:
        another scheduler, or none, may serve it next)."""
        while self.evict():
            pass

    @property
    def slots_open(self) -> int:
        """Slots a new sequence could take now: free ones and those this cache would evict."""
        return self.engine.free_slots + len(self.held)

    def catch_up(self, slot: int, prompt: Sequence[int], filled: int, live: Live, *, caller=None) -> int:
        """Copy into `slot` what another live sequence of `caller`'s scope has computed of
        `prompt` past `filled`; the new number of filled positions."""
        if not self.enabled:
            return filled
        src, n = self._best_live(prompt, live, scope(caller, self.share), len(prompt) - 1, filled, but=slot)
        if src is None:
            return filled
        self.engine.copy_prefix(src, slot, n)
        self.hit_tokens += n - filled
        return n

    def close(self, slot: int, tokens: Sequence[int], *, keep: bool, caller=None) -> None:
        """A sequence ended: with `keep`, its slot is parked, this cache's to reopen, and its KV
        holds `tokens`, for `caller`'s scope; else the slot is freed."""
        if self.enabled and keep and tokens:
            self.engine.park(slot)
            self.held[slot] = (scope(caller, self.share), list(tokens))
        else:
            self.engine.close(slot)

    def _kept(self, slot: int, n: int) -> int:
        """How many of a held slot's n positions its KV still holds (a paged pool may have
        reclaimed its blocks since it was parked)."""
        return min(n, self.engine.kept(slot))

    # The first candidate sharing the most with the prompt wins, as far as `limit` (and above
    # `beyond`: what the caller has already); one that holds no more positions than the best so
    # far is passed over unread, and none can beat one that shares `limit`.

    def _best_held(self, prompt: Sequence[int], key: str, limit: int) -> tuple[int | None, int]:
        best_slot, best_n = None, 0
        for slot, (k, tokens) in self.held.items():
            if k != key:
                continue
            bound = min(limit, self._kept(slot, len(tokens)))
            if bound > best_n:
                n = min(common_prefix(prompt, tokens), bound)
                if n > best_n:
                    best_slot, best_n = slot, n
                    if n == limit:
                        break
        return best_slot, best_n

    def _best_live(self, prompt: Sequence[int], live: Live, key: str, limit: int, beyond: int,
                   but: int = -1) -> tuple[int | None, int]:
        best_slot, best_n = None, beyond
        for slot, tokens, held, caller in live:
            bound = min(limit, held)
            if bound > best_n and slot != but and scope(caller, self.share) == key:
                n = min(common_prefix(prompt, tokens), bound)
                if n > best_n:
                    best_slot, best_n = slot, n
                    if n == limit:
                        break
        return best_slot, best_n
