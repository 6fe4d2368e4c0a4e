"""The layer stream: `depth` device slots in a ring, reader threads `depth` ahead.

A forward pass announces the layers it will visit (`begin(layers)`: all of them, a prefix for a
self-draft, or the plan minus skipped layers); position k of the pass is its k-th streamed
layer, in slot k % depth. For each position:

    read     storage layers only: a reader thread waits until the staging entry's previous
             copy is done (host_wait), then fills it from the source (depth positions ahead)
    copy     host (pinned layer, or staging) → device slot, on the copy stream, after the slot's
             previous user released it (device event); records copy_done
    acquire  the compute stream waits for copy_done (a device wait, no host sync)
    release  the compute stream records the slot's release event; the copy of position k+depth
             into that slot is enqueued right away when its bytes are on the host

A pass's first copies wait for an event recorded on the compute stream when it begins, so
whatever wrote the slots before (an earlier pass, a replayed CUDA graph) is done with them. A
pass that acquires a layer it did not announce (or none was announced) starts a new pass there,
through the rest of the order.

`Device` is the only part that differs between backends: on the CPU, copies are plain memcpy
and events are None; on the GPU (backends/cuda/weights.py) they are cudaMemcpyAsync on a copy
stream and CUDA events. The compute thread never blocks in steady state except on data that is
truly not there yet (a storage read behind).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable

import numpy as np

from ntransformerd.settings import parse_rate as parse_rate_setting


class Device:
    """The device side of the stream (STYLE rule 8: alloc, alignment, is_host, copy)."""

    name = "host"
    is_host = True
    alignment = 256

    def alloc(self, nbytes: int):
        """A device buffer (a slot)."""
        return np.zeros(nbytes, np.uint8)

    def copy(self, slot, src: np.ndarray, nbytes: int, after, *, hold: float | None = None,
             timed: list | None = None):
        """Copy src[:nbytes] into slot once event `after` (or None) passed; return a done event.
        hold: the copy is not done, nor the next begun, before `hold` seconds after it started
        (pace_start / pace_hold around it). timed: (start, end, nbytes) of the copy itself (after
        the wait; marks that `elapsed` reads) is appended there."""
        start = time.perf_counter()
        if hold is not None:
            self.pace_start()
        np.copyto(slot[:nbytes], src[:nbytes])
        if hold is not None:
            self.pace_hold(hold)
        if timed is not None:
            timed.append((start, time.perf_counter(), nbytes))
        return None

    def elapsed(self, start, end) -> float:
        """Seconds between a copy's two marks (read after the step that made them: passed)."""
        return end - start

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

    # A slower link, emulated (LayerStream's link_cap): each copy holds the copy stream until
    # B / cap seconds after it started, so no copy completes, and the next cannot start, earlier.
    _copy_started = 0.0

    def pace_start(self) -> None:
        """In copy order, just before a copy: note when it starts."""
        self._copy_started = time.perf_counter()

    def pace_hold(self, seconds: float) -> None:
        """In copy order, just after the copy: hold until `seconds` after it started."""
        _sleep_until(self._copy_started + seconds)


def _sleep_until(t: float) -> None:
    while (left := t - time.perf_counter()) > 0:
        time.sleep(left)


def parse_rate(value) -> float | None:
    """A link cap in bytes per second (settings.parse_rate: "6.5GB/s", "800MiB/s", a number);
    None, "" or "off": no cap."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "off")):
        return None
    return parse_rate_setting(value, setting="link_cap")


class StreamError(RuntimeError):
    pass


class LayerStream:
    """Streams the layers `order` through `depth` slots of `slot_bytes` each.

    host_layer(i) → a host array holding layer i in device layout (the pinned tier), or None
    for a storage layer; read(i, e) fills staging entry e with layer i (device layout) from
    storage and returns that host array. Only the compute thread calls begin/acquire/release.
    """

    def __init__(self, order: list[int], *, depth: int, slot_bytes: int, nbytes: dict[int, int],
                 device: Device, host_layer: Callable[[int], np.ndarray | None],
                 read: Callable[[int, int], np.ndarray] | None = None, readers: int | None = None,
                 poison: bool = False, link_cap: float | None = None):
        if depth < 1:
            raise ValueError(f"stream depth {depth} must be at least 1")
        self.order, self.depth = list(order), depth
        self._index = {layer: j for j, layer in enumerate(self.order)}
        self.device, self.host_layer, self.read, self.nbytes = device, host_layer, read, nbytes
        self.poison = poison
        self.link_cap = link_cap  # bytes per second the copies are paced to (None: the link's own)
        self.slots = [device.alloc(slot_bytes) for _ in range(depth)]
        self._slot_free = [None] * depth  # release event of each slot's last user
        self._entry_free = [None] * depth  # last copy out of each staging entry (storage reads)
        self._pass: list[int] = []  # the streamed layers of the pass, in order
        self._copy_done: dict[int, object] = {}  # position → event
        self._reads: dict[int, concurrent.futures.Future] = {}  # position → future (storage layers)
        self._next = 0  # the position acquire expects next
        self._copied = 0  # positions < this have their copy enqueued
        self._held: int | None = None  # position acquired and not yet released
        self._pool = (concurrent.futures.ThreadPoolExecutor(readers or depth, thread_name_prefix="ntx-reader")
                      if read is not None and any(host_layer(i) is None for i in order) else None)
        self.stats = {"passes": 0, "copies": 0, "reads": 0, "blocked": 0, "restarts": 0}
        self._timed: list[tuple[object, object, int]] = []  # (start mark, end mark, bytes) per copy since busy()
        self._timing = False  # copies are timed once someone reads busy()

    def streamed_of(self, layers) -> list[int]:
        """The streamed layers among `layers`, in their order."""
        return [i for i in layers if i in self._index]

    def _is_storage(self, k: int) -> bool:
        return self.host_layer(self._pass[k]) is None

    # ---- the pump ---------------------------------------------------------------------------

    def _submit_reads(self) -> None:
        """Reads for the storage positions of the next `depth` not yet copied."""
        if self._pool is None:
            return
        for k in range(self._copied, min(len(self._pass), self._copied + self.depth)):
            if k in self._reads or not self._is_storage(k):
                continue
            # the entry's latest copy (position k - depth or earlier) is enqueued: wait for it
            self._reads[k] = self._pool.submit(self._read_task, k, self._pass[k], self._entry_free[k % self.depth])
            self.stats["reads"] += 1

    def _read_task(self, k: int, layer: int, prev_copy):
        self.device.host_wait(prev_copy)  # the staging entry's previous copy has left it
        return self.read(layer, k % self.depth)

    def _pump(self, need: int | None = None) -> None:
        """Enqueue copies in order while slots are free and bytes are on the host; block only
        for position `need`."""
        released = self._next if self._held is None else self._held  # positions < this are released
        while self._copied < min(len(self._pass), released + self.depth):
            k = self._copied
            storage = self._is_storage(k)
            if storage:
                self._submit_reads()
                fut = self._reads.get(k)
                if fut is None or (not fut.done() and (need is None or k > need)):
                    break
                if not fut.done():
                    self.stats["blocked"] += 1
                src = fut.result()
                del self._reads[k]
            else:
                src = self.host_layer(self._pass[k])
            s = k % self.depth
            nbytes = self.nbytes[self._pass[k]]
            timed = self._timed if self._timing else None
            if self.link_cap is None:
                done = self.device.copy(self.slots[s], src, nbytes, self._slot_free[s], timed=timed)
            else:
                done = self.device.copy(self.slots[s], src, nbytes, self._slot_free[s], timed=timed,
                                        hold=nbytes / self.link_cap)
            self._copy_done[k] = done
            if storage:
                self._entry_free[s] = done
            self.stats["copies"] += 1
            self._copied += 1
        self._submit_reads()
        if need is not None and need >= self._copied:
            raise StreamError(f"position {need} (layer {self._pass[need]}) could not be copied: "
                              f"{self._copied} copied, {released} released, depth {self.depth}")

    def _drain_reads(self) -> None:
        """Wait out the reads in flight and drop them (their staging entries are refilled)."""
        for fut in self._reads.values():
            try:
                fut.result()
            except Exception:
                pass
        self._reads.clear()

    def busy(self) -> tuple[float, int]:
        """(seconds the copies took, their bytes) since the last call: the link's share of the
        steps that ran since (read after a step: its copies are done)."""
        timed, self._timed, self._timing = self._timed, [], True
        return sum(self.device.elapsed(a, b) for a, b, _ in timed), sum(n for _, _, n in timed)

    # ---- the interface model.forward drives ---------------------------------------------------

    def begin(self, layers) -> None:
        """A pass will acquire `layers` in this order (those not streamed are ignored)."""
        self._drain_reads()  # a pass that ended early (a prefix, an error) may leave reads behind
        self._pass = self.streamed_of(layers)
        self._copy_done.clear()
        self._next = self._copied = 0
        self._held = None
        start = self.device.record()  # everything before this pass on the compute stream
        self._slot_free = [start] * self.depth
        self.stats["passes"] += 1
        self._pump()

    def acquire(self, layer: int):
        """The slot holding `layer`, with the compute stream ordered after its copy."""
        if self._held is not None:  # a pass ended without release (an exception): release it now
            self.release(self._pass[self._held])
        if layer not in self._index:
            raise StreamError(f"layer {layer} is not streamed")
        k = self._next
        if k >= len(self._pass) or self._pass[k] != layer:  # not announced: a new pass from here
            self.begin(self.order[self._index[layer]:])
            self.stats["restarts"] += 1
            k = 0
        self._pump(need=k)
        self.device.compute_wait(self._copy_done[k])
        self._held = k
        return self.slots[k % self.depth]

    def release(self, layer: int) -> None:
        k = self._held
        if k is None or self._pass[k] != layer:
            raise StreamError(f"release of layer {layer}, which is not the layer held "
                              f"({None if k is None else self._pass[k]})")
        s = k % self.depth
        if self.poison:
            self.device.poison(self.slots[s])
        self._slot_free[s] = self.device.record()
        self._held = None
        self._next = k + 1
        self._pump()

    def close(self) -> None:
        self._drain_reads()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
