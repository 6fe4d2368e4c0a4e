"""The slot ring (tiers/pipeline.py) on its own: layers are byte patterns, the device is host
memory, and a logging device stands in for CUDA events, so the handoff of the slots to another
writer between steps (pending_events, invalidate) is checked on the CPU."""

from __future__ import annotations

import numpy as np
import pytest

from ntransformerd.engine.tiers.pipeline import Device, LayerStream

NBYTES = 64


def _layer(i: int) -> np.ndarray:
    return np.full(NBYTES, 10 + i, np.uint8)


class LoggingDevice(Device):
    """Host copies, with named events: ("copy", n) per copy, ("free", n) per release."""

    def __init__(self):
        self.copies, self.frees, self.waits = 0, 0, []
        self.after = []  # the event each copy waited for

    def copy(self, slot, src, nbytes, after):
        super().copy(slot, src, nbytes, after)
        self.after.append(after)
        self.copies += 1
        return ("copy", self.copies)

    def record(self):
        self.frees += 1
        return ("free", self.frees)

    def compute_wait(self, event) -> None:
        self.waits.append(event)


def _stream(order, depth, device, *, storage=(), poison=True):
    def read(i, entry):
        return _layer(i)

    return LayerStream(order, depth=depth, slot_bytes=NBYTES, nbytes={i: NBYTES for i in order}, device=device,
                       host_layer=lambda i: None if i in storage else _layer(i),
                       read=read if storage else None, poison=poison)


def _step(ls, layers):
    for i in layers:
        assert np.array_equal(ls.acquire(i), _layer(i)), i
        ls.release(i)


def _other_writer(ls):
    """What the captured decode step leaves in the slots: other layers, or poison."""
    for s in ls.slots:
        s.fill(0xAB)


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("storage", [(), (1, 3)])
def test_invalidate_recopies_after_another_writer(depth, storage):
    order = [0, 1, 2, 3, 5]
    ls = _stream(order, depth, Device(), storage=storage)
    for _ in range(3):
        _step(ls, order)
        assert ls.pending_events() == []  # host device: no events
        _other_writer(ls)
        ls.invalidate(None)
    _step(ls, order)
    assert ls.stats["handoffs"] == 3
    ls.close()


def test_pending_events_are_releases_and_copies_in_flight():
    dev = LoggingDevice()
    ls = _stream([0, 1, 2], 2, dev)
    _step(ls, [0, 1, 2])  # positions 3, 4 (layers 0, 1 of the next step) are copied ahead
    assert ls._copied == 5 and dev.copies == 5
    pending = ls.pending_events()
    assert ("copy", 4) in pending and ("copy", 5) in pending  # the prefetches
    assert ("copy", 3) not in pending  # acquired: the compute stream already waited on it
    assert [e for e in pending if e[0] == "free"] == ls._slot_free  # each slot's last release

    _other_writer(ls)
    ls.invalidate("graph done")
    assert ls.pending_events() == ["graph done"] * 2
    before = dev.copies
    _step(ls, [0, 1, 2])
    assert dev.after[before:before + 2] == ["graph done"] * 2  # the redone copies wait for the writer
    assert dev.copies == before + 5


def test_invalidate_mid_step_counts_the_held_layer_released():
    ls = _stream([0, 1, 2], 2, Device())
    ls.acquire(0)  # a forward pass that raised before release
    _other_writer(ls)
    ls.invalidate(None)
    _step(ls, [1, 2])
    _step(ls, [0, 1, 2])
    ls.close()


def test_handoff_then_restart():
    """After a handoff the forward pass may start anywhere (a partial pass): it renumbers."""
    ls = _stream([0, 1, 2, 3], 2, Device(), storage=(2,))
    _step(ls, [0, 1])
    _other_writer(ls)
    ls.invalidate(None)
    _step(ls, [0, 1, 2, 3])
    assert ls.stats["restarts"] == 1
    ls.close()
