"""Who runs next: the scheduler's decisions, as pure functions of the queue and the running set.

    admits(head, running, room)         the queue's head joins the running set now, or waits
    compose(running, prefill_chunk,     what the next step holds: a row for each decoding
            overlap=…)                  request, then prompt chunks from one budget of
                                        `prefill_chunk` tokens, oldest request first; on a
                                        device (overlap) composed while the step in flight
                                        runs, of the requests whose next step does not wait
                                        for its draws (see `compose`)
    victim(running)                     who gives its KV blocks back when a step's cannot be
                                        reserved (kv_cache.KVPoolFull)

The loop (server/loop.py) describes its requests as Queued and Running records each
iteration and carries the decisions out. Nothing here holds state, takes a lock or calls an
engine: tests/server/test_policy.py drives it with records alone.

Thread rule: pure functions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Queued:
    """The queue's head as admission sees it."""

    blocks: int  # KV blocks its positions need (its prompt; after a preemption its whole history)
    waits_for_costs: bool = False  # it speculates and the step-cost table is not measured yet
    resume_below: int | None = None  # preempted: back only once fewer than this many run


@dataclasses.dataclass(frozen=True)
class Room:
    """What the running set leaves for a new request."""

    max_batch: int
    slots_open: int  # KV slots a new sequence could take (free, or kept by the prefix cache)
    blocks_free: int  # blocks the pool can hand out now


@dataclasses.dataclass(slots=True)
class Running:
    """An admitted request as the step's composition sees it, oldest first in every list. The
    loop keeps one per live request and brings what changes up to date in place each step (a
    record made anew for every live request every step was the loop's largest cost), so not
    frozen; nothing here changes one."""

    key: int  # Request.id
    decoding: bool  # its whole prompt is in (DECODE); else it is prefilling (PREFILL)
    ready: bool = True  # no error, not finished: it may run
    admitted_at: float = 0.0
    owed_blocks: int = 0  # blocks its positions so far still need (admission leaves them free)
    left: int = 0  # prompt positions still to prefill
    prompt: Sequence[int] = ()
    prefilled: int = 0
    scope: str | None = None  # its prefix-cache scope; None: it shares no prefix (cache off or declined)
    in_flight: bool = False  # it has a row in the step in flight (launched, not finished)
    runs_ahead: bool = False  # in flight: its next step may be launched before that one is finished (a decode
    # row's token the draw where it is; a prompt's next chunk)
    host: bool = False  # its rows need logits on the host (a draft verified, a constraint, log-probabilities)


@dataclasses.dataclass(slots=True)
class Row:
    """A request's share of the next step: `tokens` prompt tokens, or 1 to decode. One per row
    every step, so not frozen (as Running)."""

    key: int
    tokens: int


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading token ids a and b share."""
    n = min(len(a), len(b))
    i, head = 0, min(n, 16)
    while i < head:  # one id at a time first: most pairs differ early, or are short
        if a[i] != b[i]:
            return i
        i += 1
    if i == n:
        return n
    if type(a) is not type(b):  # a list's slice never equals a tuple's
        a, b = list(a[:n]), list(b[:n])
    # then runs of ids compared in C (a shared prompt runs to thousands of ids), doubling while
    # they match, then halving down to the first difference
    step, grow = 16, True
    while step:
        j = i + step
        if j <= n and a[i:j] == b[i:j]:
            i = j
            if grow:
                step *= 2
                continue
        else:
            grow = False
        step //= 2
    return i


def admits(head: Queued, running: Sequence[Running], room: Room) -> bool:
    """The head joins now: the batch and a slot have room, it is not waiting for the cost table
    or (preempted) for requests to leave, and, unless it would run alone, the blocks its
    positions need are free beside those the running requests still owe."""
    n = len(running)
    if n >= room.max_batch or room.slots_open <= 0 or head.waits_for_costs:
        return False
    if head.resume_below is not None and n >= head.resume_below:
        return False
    return not running or head.blocks + sum(r.owed_blocks for r in running) <= room.blocks_free


def waits_for_shared_prefill(r: Running, running: Sequence[Running]) -> bool:
    """An older request of r's prefix scope is still prefilling prompt positions r shares: r
    waits and copies them next iteration instead of computing them twice."""
    if r.scope is None:
        return False
    for o in running:
        if o.key == r.key:
            return False
        if o.decoding or o.scope != r.scope:  # the prompts are compared only where it could matter
            continue
        if min(common_prefix(r.prompt, o.prompt), len(r.prompt) - 1) > max(o.prefilled, r.prefilled):
            return True
    return False


def compose(running: Sequence[Running], prefill_chunk: int, *, overlap: bool = False) -> list[Row]:
    """The next step: every ready decoding request's row, then ready prefilling requests' prompt
    chunks, oldest first, sharing `prefill_chunk` tokens so a long prompt cannot stall the
    others; a request whose shared prefix an older one is computing waits.

    overlap (a device runs the step in flight while this one is composed): a request in the step
    in flight waits for it unless its next step runs ahead of it (a plain decode row, its token
    the draw still on the device; a prompt's next chunk, `left` and `prefilled` counting the
    chunk in flight); and steps whose logits go to the host (`host` rows: a draft
    verified, a constraint's mask) hold no request in flight (they would all wait for them next),
    so such rows and the others take turns: the device runs one group's step while the host
    finishes the other's and composes it again. With nothing in flight, a step of several rows of
    which some need the host starts that alternation: the others alone, or, where every row
    needs the host, the older half (a lone request steps alone). An empty list with a step in
    flight: finish it first."""
    flying = any(r.in_flight for r in running)
    ready = [r for r in running if r.ready and not (overlap and r.in_flight and not r.runs_ahead)]
    rows = [Row(r.key, 1) for r in ready if r.decoding]
    budget = prefill_chunk
    for r in ready:
        if not r.decoding and budget > 0 and not waits_for_shared_prefill(r, running):
            n = min(budget, r.left) if r.left else 1
            rows.append(Row(r.key, n))
            budget -= n
    if not overlap:
        return rows
    by_key = {r.key: r for r in running}
    host = [row for row in rows if by_key[row.key].host]
    if not host:
        return rows
    if flying:
        return [row for row in rows if not by_key[row.key].in_flight]
    others = [row for row in rows if not by_key[row.key].host]
    if others:
        return others
    return host[:(len(host) + 1) // 2]


def victim(running: Sequence[Running]) -> int | None:
    """The youngest running request, which yields its slot and recomputes later; None where it
    runs alone (there is nothing to take blocks from)."""
    if len(running) < 2:
        return None
    return max(running, key=lambda r: r.admitted_at).key


def measures_costs(*, queued_speculating: int, speculates_by_default: bool, running: int) -> bool:
    """The step-cost table is worth measuring now: a queued request speculates, or the daemon
    speculates by default and nothing runs."""
    return queued_speculating > 0 or (speculates_by_default and running == 0)


__all__ = ["Queued", "Room", "Row", "Running", "admits", "common_prefix", "compose", "measures_costs", "victim",
           "waits_for_shared_prefill"]
