"""A step's draws on the device: sampler.SampleRows in, sampler.Drawn out (kernels/sample.cu).

    drawn = draw(rows, sample)     # rows: the step's last-token logits (B, V) on the device

What crosses to the device: one int32 buffer (the ignore_eos bans and each row's penalty window
as (id, count) pairs, packed by offsets) and one float64 buffer (each row's chain: kind, top-k,
top-p, log min-p, temperature and the uniform the host drew from the request's generator); what
comes back: 2 int32 a row (id, fault). Where rows have bans or penalties they are applied to the
step's rows in place (penalize_rows; the rows copied first); top_rows then picks
each row's n most likely ids (n: the largest top-k of the step, 1 when all are greedy) and
draw_rows draws from them as sampler.sample_rows does (greedy: exactly; filtered: the same ids
wherever float64 rounding of exp does not move a boundary). A row the device cannot settle
exactly (a ban hiding a non-finite logit, penalties overflowing: FAULT_REDO) is drawn on the host
from the copy of its row, by sample_rows. draw_async queues all of it and returns a Drawing: its
ids stay on the device for the next step's tokens (the scheduler's overlap), its result() waits.

`eligible` says which steps the device draws: every drawing row greedy, or filtered with a top-k
of at most DRAW_MAX, and none masked (a constraint's mask stays on the host path, as do
log-probabilities and speculation, whose rows the caller takes as logits).
"""

from __future__ import annotations

import math

import numpy as np

try:
    import cupyx  # pinned host memory (CuPy's, the gpu extra)
except ImportError:  # no CuPy: nothing here runs
    cupyx = None

from ntransformerd.engine.backends.cuda.nvrtc import check_array, cp, kernel
from ntransformerd.engine.generation.sampler import Drawn, SampleRows, sample_rows

DRAW_MAX = 256  # the most candidates a row draws from on the device (draw_rows' block)
FAULT_REDO = 9  # draw_rows: the host draws this row itself


def eligible(sample: SampleRows) -> bool:
    """Whether the device draws every drawing row of `sample` (see the module's text)."""
    d = sample.draws
    if not d.any():
        return False
    filtered = d & ~sample.greedy
    if ((sample.top_k[filtered] < 1) | (sample.top_k[filtered] > DRAW_MAX)).any():
        return False
    return all(sample.masks[i] is None for i in np.flatnonzero(d))


def pack(sample: SampleRows) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(ipack int32, fpack float32 (B, 3), prm float64 (B, 6), n) of penalize_rows and draw_rows:
    the bans and penalty windows by offsets, the penalties' factors, each row's chain; n the
    candidates top_rows picks per row."""
    b = len(sample)
    d = sample.draws
    bans = [sample.banned[i] if d[i] else np.zeros(0, np.int64) for i in range(b)]
    pens = [sample.penalty[i] if d[i] and sample.penalty[i] is not None else None for i in range(b)]
    boff = np.concatenate([[0], np.cumsum([x.size for x in bans])])
    poff = np.concatenate([[0], np.cumsum([0 if x is None else x[0].size for x in pens])])
    pids = [x[0] for x in pens if x is not None]
    pcnt = [x[1] for x in pens if x is not None]
    ipack = np.concatenate([boff, poff, *bans, *pids, *pcnt]).astype(np.int32)
    fpack = np.stack([sample.repetition, sample.frequency, sample.presence], 1).astype(np.float32)
    prm = np.zeros((b, 6), np.float64)
    prm[:, 0] = np.where(d, np.where(sample.greedy, 1, 2), 0)
    prm[:, 1] = sample.top_k
    prm[:, 2] = sample.top_p
    prm[:, 3] = [float(np.float32(math.log(m))) if m > 0 else math.nan for m in sample.min_p]  # as filter_candidates
    prm[:, 4] = sample.temperature
    prm[:, 5] = np.where(np.isnan(sample.uniform), 0.0, sample.uniform)
    filtered = d & ~sample.greedy
    n = int(sample.top_k[filtered].max()) if filtered.any() else 1
    return ipack, fpack, prm, n


def draw(rows, sample: SampleRows, *, stream=None) -> Drawn:
    """Each row's draw from its logits `rows` (B, V) float32 on the device (eligible(sample)):
    kernels on the current stream, one copy of 8 bytes a row to the host."""
    return draw_async(rows, sample, stream=stream).result()


class Drawing:
    """A step's draws queued on the device: `ids` stay there for a next step's tokens
    (ids_at), `result` waits for their copy to the host."""

    def __init__(self, out, host, event, orig, sample: SampleRows):
        self.out, self.host, self.event, self.orig, self.sample = out, host, event, orig, sample

    def ids_at(self, rows):
        """The drawn ids of `rows` (indices), int32 on the device, in the current stream's order."""
        return self.out[0][cp.asarray(np.asarray(rows, np.int64))]

    def result(self) -> Drawn:
        """The ids and faults (waits for the copy); the rows the device could not settle drawn
        on the host from their own logits (a copy kept for them)."""
        self.event.synchronize()
        ids, fault = self.host[0].astype(np.int64), self.host[1].astype(np.int8)
        redo = np.flatnonzero(fault == FAULT_REDO)
        if redo.size:
            again = sample_rows(cp.asnumpy(self.orig[cp.asarray(redo)]), self.sample.take(redo))
            ids[redo], fault[redo] = again.ids, again.fault
        return Drawn(ids, fault)


def draw_async(rows, sample: SampleRows, *, stream=None) -> Drawing:
    """draw() without waiting: the kernels and the copy to pinned host memory are queued on the
    current stream (`stream`: that stream, for the event), and nothing here waits for the device.
    Bans and penalties are applied to `rows` in place (a step's own buffer, read by nothing
    after); a copy of the rows they touch is kept for a row the host redoes."""
    check_array(rows, cp.float32, 2, "draw rows")
    b, v = rows.shape
    if len(sample) != b:
        raise ValueError(f"draw: {len(sample)} sampling rows for {b} rows of logits")
    if not eligible(sample):
        raise ValueError("draw: a row is masked or filtered without a top-k of 1..256: draw it on the host")
    ipack, fpack, prm, n = pack(sample)
    n = min(n, v)
    orig = odd = None
    if ipack.size > 2 * (b + 1):  # bans or penalties
        orig = cp.array(rows)
        odd = cp.empty((b,), cp.int32)
        kernel("sample", "penalize_rows")((b,), (256,), (rows, np.int32(v), np.int32(b), cp.asarray(ipack),
                                                         cp.asarray(fpack), odd))
    res = cp.empty((b, 2 * n + 1), cp.int32)
    kernel("sample", "top_rows")((b,), (1024,), (rows, np.int32(v), np.int32(n), res))
    out = cp.empty((2, b), cp.int32)
    kernel("sample", "draw_rows")((b,), (DRAW_MAX,), (res, np.int32(n), np.int32(b), cp.asarray(prm),
                                                      odd if odd is not None else np.uintp(0), out))
    host = cupyx.empty_pinned((2, b), np.int32)
    out.get(stream=stream, out=host, blocking=False)
    event = (stream or cp.cuda.get_current_stream()).record()
    return Drawing(out, host, event, orig, sample)


def reference_mismatches(rows_host: np.ndarray, sample: SampleRows, drawn: Drawn) -> np.ndarray:
    """The rows whose device draw differs from sampler.sample_rows' on the same logits (tests,
    benchmarks): indices."""
    want = sample_rows(np.asarray(rows_host, np.float32), sample)
    return np.flatnonzero((want.ids != drawn.ids) | (want.fault != drawn.fault))

