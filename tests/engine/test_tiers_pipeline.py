"""The slot ring (tiers/layer_stream.py) on its own: layers are byte patterns, the device is host
memory, and a logging device stands in for CUDA events, so passes over any layer list and the
ordering of their copies are checked on the CPU."""

from __future__ import annotations

import numpy as np
import pytest

from ntransformerd.engine.tiers.layer_stream import Device, LayerStream

NBYTES = 64


def _layer(i: int) -> np.ndarray:
    return np.full(NBYTES, 10 + i, np.uint8)


class LoggingDevice(Device):
    """Host copies, with named events: ("copy", n) per copy, ("free", n) per release."""

    def __init__(self):
        self.copies, self.frees, self.waits = 0, 0, []
        self.after = []  # the event each copy waited for

    def copy(self, slot, src, nbytes, after, **kw):
        super().copy(slot, src, nbytes, after, **kw)
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


def _pass(ls, layers):
    ls.begin(layers)
    _step(ls, [i for i in layers if i in ls.order])


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("storage", [(), (1, 3)])
def test_passes_of_any_layer_list(depth, storage):
    """Full passes, prefixes (a self-draft), passes with layers skipped, and a pass cut short
    (an error): every acquired slot holds its layer."""
    order = [0, 1, 2, 3, 5]
    ls = _stream(order, depth, Device(), storage=storage)
    for layers in ([0, 1, 2, 3, 4, 5], [0, 1], [0, 2, 5], [1, 3], [0, 1, 2, 3, 4, 5], [5]):
        _pass(ls, layers)
    ls.begin(order)
    ls.acquire(0)  # a pass that raised before release
    _pass(ls, order)
    assert ls.stats["restarts"] == 0 and ls.stats["passes"] == 8
    ls.close()


def test_a_pass_waits_for_the_compute_stream_before_its_first_copies():
    """The first copy into each slot waits for the event recorded when the pass began (so a
    graph replayed before it is done with the slots); later copies wait for the slot's release."""
    dev = LoggingDevice()
    ls = _stream([0, 1, 2], 2, dev)
    _pass(ls, [0, 1, 2])
    assert dev.after[:2] == [("free", 1)] * 2  # record #1: the pass's start
    assert dev.after[2] == ("free", 2)  # layer 2 into slot 0 after layer 0's release (record #2)
    frees = dev.frees
    ls.begin([1, 2])
    assert dev.after[3:5] == [("free", frees + 1)] * 2
    assert dev.waits[-2:] == [("copy", 2), ("copy", 3)]  # the last pass's acquires waited on their copies


def test_unannounced_acquire_starts_a_pass_there():
    """Callers that never call begin (or acquire out of order) still get the right layers: a new
    pass from that layer through the rest of the order."""
    ls = _stream([0, 1, 2, 3], 2, Device(), storage=(2,))
    _step(ls, [0, 1, 2, 3])
    _step(ls, [2, 3])
    assert ls.stats["restarts"] == 2
    ls.close()
