"""One step over several devices: the model's layers in stages, each on its device's ops, weights
and KV cache, the activation handed from one device to the next.

Pipeline is model.forward as backend-neutral logic: embed on the first device, each stage's
layers (model.run_layers), a hand-off between devices, the output on the last. On the CPU
backend every "device" is host memory, the hand-off a host copy (its source poisoned afterwards
in tests), and the output is bit-identical to the one-device run (tests/engine/test_tiers_multi*.py).
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np

from ntransformerd.engine import model as llama
from ntransformerd.engine.kv_cache import KV_DTYPES, KVLayer


class Handoff:
    """The device-to-device step: the activation leaves device `src` for device `dst`.

    Host memory here (the CPU backend: every "device" is host memory), a real copy so the next
    stage never aliases the last one's buffer; `poison` fills the source with NaN afterwards
    (tests: any read of the old buffer shows). The CUDA path implements `copy` as
    cudaMemcpyPeerAsync into a buffer on `dst`, on dst's compute stream after an event recorded
    on src's, so no host sync sits between the stages.
    """

    def __init__(self, poison: bool = False):
        self.poison = poison
        self.stats = {"copies": 0, "bytes": 0}

    def copy(self, x: np.ndarray, src: int, dst: int) -> np.ndarray:
        y = np.array(x, copy=True, order="C")
        if self.poison:
            x.fill(np.nan)
        self.stats["copies"] += 1
        self.stats["bytes"] += y.nbytes
        return y


class StageKV:
    """The KV cache of one stage: only its layers' KVLayer, on its device."""

    def __init__(self, cfg, start: int, stop: int, *, n_slots: int, max_ctx: int, dtype: str = "f32"):
        shape = (n_slots, max_ctx, cfg.n_kv_heads, cfg.head_dim)
        self._layers = {i: KVLayer(shape, KV_DTYPES[dtype]) for i in range(start, stop)}

    def layer(self, i: int):
        return self._layers[i]


@dataclasses.dataclass
class Stage:
    """Device `device` runs layers [start, stop) with its own ops, weights and KV cache."""

    device: int
    start: int
    stop: int
    ops: object
    weights: object  # acquire(i) / release(i) for i in [start, stop); embedding on the first, output on the last
    kv: object  # .layer(i)


class Pipeline:
    """model.forward over stages: embed on the first, each stage's layers, hand off, output on the last."""

    def __init__(self, stages: list[Stage], cfg, handoff: Handoff | None = None):
        if not stages or stages[0].start != 0 or stages[-1].stop != cfg.n_layers or any(
                a.stop != b.start for a, b in zip(stages, stages[1:])):
            raise ValueError("pipeline stages must cover the layers contiguously, in order")
        self.stages, self.cfg, self.handoff = list(stages), cfg, handoff or Handoff()

    def forward(self, batch, *, all_logits: bool = False):
        """model.forward with each stage's range of layers on its device, x handed between them."""
        first, last = self.stages[0], self.stages[-1]
        x = first.ops.embed(first.weights, batch.tokens)  # (N, D) on the first device
        prev = None
        for st in self.stages:
            if prev is not None:
                x = self.handoff.copy(x, prev.device, st.device)
            x = llama.run_layers(st.ops, self.cfg, st.weights, st.kv, batch, x, range(st.start, st.stop))
            prev = st
        return llama.head(last.ops, self.cfg, last.weights, x, batch, all_logits=all_logits)

    def run(self, batch, *, all_logits: bool = False):
        """forward inside every stage's step context; host logits."""
        with contextlib.ExitStack() as stack:
            for st in self.stages:
                stack.enter_context(st.ops.step_context(batch))
            logits = self.forward(batch, all_logits=all_logits)
        return self.stages[-1].ops.to_host(logits)

    def close(self) -> None:
        for st in self.stages:
            close = getattr(st.weights, "close", None)
            if close:
                close()
