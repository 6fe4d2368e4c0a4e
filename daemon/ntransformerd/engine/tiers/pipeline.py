"""The layer stream: `depth` device slots in a ring, reader threads `depth` ahead.

The streamed layers (every layer not resident) are visited in a fixed cyclic order, step after
step: position k is layer order[k % m] in slot k % depth. For each position:

    read     storage layers only: a reader thread waits until the staging buffer's previous
             copy is done (host_wait), then fills it from the source (depth positions ahead)
    copy     host (pinned layer, or staging) → device slot, on the copy stream, after the slot's
             previous user released it (device event); records copy_done
    acquire  the compute stream waits for copy_done (a device wait, no host sync)
    release  the compute stream records the slot's release event; the copy of position k+depth
             into that slot is enqueued right away when its bytes are on the host

Because the order wraps, the first slots of the next step fill while this step finishes.

Between steps another user may write the slots (the captured CUDA decode step copies into them
inside its graph: GraphFeed in backends/cuda_stream.py). Its stream first waits for
pending_events() (each slot's release and the copies in flight); after it, invalidate(e) drops
the copies queued ahead, so the next acquire copies again, into slots free once event e passed.

`Device` is the only part that differs between backends: on the CPU, copies are plain memcpy
and events are None; on the GPU (backends/cuda_stream.py) they are cudaMemcpyAsync on a copy
stream and CUDA events. The compute thread never blocks in steady state except on data that is
truly not there yet (a storage read behind).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable

import numpy as np


class Device:
    """The device side of the stream (STYLE rule 8: alloc, alignment, is_host, copy)."""

    name = "host"
    is_host = True
    alignment = 256

    def alloc(self, nbytes: int):
        """A device buffer (a slot)."""
        return np.zeros(nbytes, np.uint8)

    def copy(self, slot, src: np.ndarray, nbytes: int, after):
        """Copy src[:nbytes] into slot once event `after` (or None) passed; return a done event."""
        np.copyto(slot[:nbytes], src[:nbytes])
        return None

    def compute_wait(self, event) -> None:
        """Order the compute stream after `event`."""

    def record(self):
        """An event on the compute stream after the work enqueued so far."""
        return None

    def host_wait(self, event) -> None:
        """Block this (reader) thread until `event` passed."""

    def poison(self, slot) -> None:
        """Overwrite a released slot (tests): on the compute stream, before the release event."""
        slot.fill(0xFF)


class StreamError(RuntimeError):
    pass


class LayerStream:
    """Streams the layers `order` through `depth` slots of `slot_bytes` each.

    host_layer(i) → a host array holding layer i in device layout (the pinned tier), or None
    for a storage layer; read(i, e) fills staging entry e with layer i (device layout) from
    storage and returns that host array. Only the compute thread calls acquire/release.
    """

    def __init__(self, order: list[int], *, depth: int, slot_bytes: int, nbytes: dict[int, int],
                 device: Device, host_layer: Callable[[int], np.ndarray | None],
                 read: Callable[[int, int], np.ndarray] | None = None, readers: int | None = None,
                 poison: bool = False):
        if depth < 1:
            raise ValueError(f"stream depth {depth} must be at least 1")
        self.order, self.m, self.depth = list(order), len(order), depth
        self._index = {layer: j for j, layer in enumerate(self.order)}
        self.device, self.host_layer, self.read, self.nbytes = device, host_layer, read, nbytes
        self.poison = poison
        self.slots = [device.alloc(slot_bytes) for _ in range(depth)]
        self._slot_free = [None] * depth  # release event of each slot's last user
        self._copy_done: dict[int, object] = {}  # position → event
        self._reads: dict[int, concurrent.futures.Future] = {}  # position → future (storage layers)
        self._base = 0  # position of order[0] in the current cycle numbering
        self._next = 0  # the position acquire expects next
        self._copied = 0  # positions < this have their copy enqueued
        self._held: int | None = None  # position acquired and not yet released
        self._pool = (concurrent.futures.ThreadPoolExecutor(readers or depth, thread_name_prefix="ntx-reader")
                      if read is not None and any(host_layer(i) is None for i in order) else None)
        self.stats = {"copies": 0, "reads": 0, "blocked": 0, "restarts": 0, "handoffs": 0}
        self._lock = threading.Lock()

    # ---- positions --------------------------------------------------------------------------

    def layer_at(self, k: int) -> int:
        return self.order[(k - self._base) % self.m]

    def _is_storage(self, k: int) -> bool:
        return self.host_layer(self.layer_at(k)) is None

    # ---- the pump ---------------------------------------------------------------------------

    def _submit_reads(self) -> None:
        """Reads for storage positions whose staging entry's previous copy is enqueued."""
        if self._pool is None:
            return
        for k in range(self._copied, self._copied + self.depth):
            if k in self._reads or not self._is_storage(k):
                continue
            prev = self._copy_done.get(k - self.depth, None) if k - self.depth >= 0 else None
            if k - self.depth >= self._copied:
                break  # the staging entry still waits for its copy
            self._reads[k] = self._pool.submit(self._read_task, k, self.layer_at(k), prev)
            self.stats["reads"] += 1

    def _read_task(self, k: int, layer: int, prev_copy):
        self.device.host_wait(prev_copy)  # the staging entry's previous copy has left it
        return self.read(layer, k % self.depth)

    def _pump(self, need: int | None = None) -> None:
        """Enqueue copies in order while slots are free and bytes are on the host; block only
        for position `need`."""
        released = self._next if self._held is None else self._held  # positions < this are released
        while self._copied < released + self.depth:
            k = self._copied
            if self._is_storage(k):
                self._submit_reads()
                fut = self._reads.get(k)
                if fut is None or (not fut.done() and (need is None or k > need)):
                    break
                if not fut.done():
                    self.stats["blocked"] += 1
                src = fut.result()
                del self._reads[k]
            else:
                src = self.host_layer(self.layer_at(k))
            s = k % self.depth
            self._copy_done[k] = self.device.copy(self.slots[s], src, self.nbytes[self.layer_at(k)],
                                                  self._slot_free[s])
            self._copy_done.pop(k - 2 * self.depth, None)
            self.stats["copies"] += 1
            self._copied += 1
        self._submit_reads()
        if need is not None and need >= self._copied:
            raise StreamError(f"position {need} (layer {self.layer_at(need)}) could not be copied: "
                              f"{self._copied} copied, {released} released, depth {self.depth}")

    def _drain_reads(self) -> None:
        """Wait out the reads in flight and drop them (their staging entries are refilled)."""
        for fut in self._reads.values():
            try:
                fut.result()
            except Exception:
                pass
        self._reads.clear()

    def _restart(self, layer: int) -> None:
        """Renumber so that the next position is `layer` (the forward pass did not visit layers
        in order: an error mid-step, or a partial pass). Copies already queued for positions ≥
        next are redone; the copy stream orders them after the old ones."""
        self._drain_reads()
        self._base = self._next - self._index[layer]
        self._copied = min(self._copied, self._next)
        self.stats["restarts"] += 1

    # ---- the interface model.forward drives ---------------------------------------------------

    def acquire(self, layer: int):
        """The slot holding `layer`, with the compute stream ordered after its copy."""
        if self._held is not None:  # a step ended without release (an exception): release it now
            self.release(self.layer_at(self._held))
        if layer not in self._index:
            raise StreamError(f"layer {layer} is not streamed")
        k = self._next
        if self.layer_at(k) != layer:
            self._restart(layer)
        self._pump(need=k)
        self.device.compute_wait(self._copy_done[k])
        self._held = k
        return self.slots[k % self.depth]

    def release(self, layer: int) -> None:
        k = self._held
        if k is None or self.layer_at(k) != layer:
            raise StreamError(f"release of layer {layer}, which is not the layer held "
                              f"({None if k is None else self.layer_at(k)})")
        s = k % self.depth
        if self.poison:
            self.device.poison(self.slots[s])
        self._slot_free[s] = self.device.record()
        self._held = None
        self._next = k + 1
        self._pump()

    # ---- handing the slots to another user between steps ----------------------------------------

    def pending_events(self) -> list:
        """What a user that writes the slots must wait for first: each slot's last release and
        the copies queued for positions not acquired yet (no events on the host: empty)."""
        start = self._next if self._held is None else self._held
        events = self._slot_free + [self._copy_done[k] for k in range(start, self._copied)]
        return [e for e in events if e is not None]

    def invalidate(self, after) -> None:
        """Another user wrote every slot: forget the copies queued ahead (the next acquire copies
        again) and copy into a slot only once event `after` (or None) passed. A position still
        held (a forward pass that raised) counts as released."""
        if self._held is not None:
            self._next, self._held = self._held + 1, None
        self._drain_reads()
        for k in range(self._next, self._copied):
            self._copy_done.pop(k, None)
        self._copied = self._next
        self._slot_free = [after] * self.depth
        self.stats["handoffs"] += 1

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
