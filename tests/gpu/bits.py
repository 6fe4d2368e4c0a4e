"""Bit-for-bit comparison of float32 arrays for the invariance tests, with a message that names
the first element that differs."""

from __future__ import annotations

import numpy as np


def same_bits(a, b) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def first_difference(got, want) -> str:
    bad = np.argwhere(got.view(np.uint32) != want.view(np.uint32))
    at = tuple(bad[0])
    return f"{len(bad)} of {got.size} differ, first at {at}: {got[at]!r} vs {want[at]!r}"
