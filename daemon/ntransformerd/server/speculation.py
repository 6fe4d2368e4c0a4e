"""Speculative decoding as the daemon serves it: the default mode (of requests that do not say),
the draft engine, the step-cost table, and one Speculator per mode, made when a request first
asks for it and shared by every request of that mode.

Thread rule: the scheduler's; callers' threads ask for a speculator under the scheduler's lock,
the loop's thread measures and sets the cost table.
"""

from __future__ import annotations

from ntransformerd.engine.generation import speculative
from ntransformerd.engine.generation.speculative import Mode
from ntransformerd.server.errors import InvalidRequest
from ntransformerd.server.metrics import SpeculationStatus


class Speculation:
    def __init__(self, default_mode: Mode):
        self.default_mode = default_mode  # parsed by config.py
        self.draft_engine = None  # --draft: a small same-vocabulary model
        self.costs: speculative.StepCosts | None = None  # kept from an earlier start, or measured when first needed
        self._speculators: dict[str, speculative.Speculator] = {}  # str(mode) → its Speculator

    def attach(self, *, draft_engine=None, costs=None) -> None:
        self.draft_engine, self.costs, self._speculators = draft_engine, costs, {}

    @property
    def by_default(self) -> bool:
        """Requests that do not say speculate."""
        return not self.default_mode.off

    def speculator(self, mode: Mode | None, engine):
        """The Speculator for a request's mode (None: the default) on `engine`, None for off;
        InvalidRequest for a mode this daemon cannot serve."""
        mode = (mode or self.default_mode).within(self.default_mode)
        if mode.off:
            return None
        spec = self._speculators.get(str(mode))
        if spec is None:
            try:
                draft = speculative.make_draft(mode, engine, draft_engine=self.draft_engine)
            except ValueError as e:
                raise InvalidRequest(f"{e}") from None
            spec = speculative.Speculator(engine, draft, costs=self.costs)
            self._speculators[str(mode)] = spec
        return spec

    def use_costs(self, costs: speculative.StepCosts) -> None:
        self.costs = costs
        for spec in self._speculators.values():
            spec.use_costs(costs)

    def status(self) -> SpeculationStatus:
        specs = [sp.stats() for sp in self._speculators.values()]
        passes = sum(x["passes"] for x in specs)
        proposed, accepted = sum(x["proposed"] for x in specs), sum(x["accepted"] for x in specs)
        return SpeculationStatus(
            default_mode=str(self.default_mode), passes=passes, proposed=proposed, accepted=accepted,
            acceptance=accepted / proposed if proposed else 0.0,
            tokens_per_pass=sum(x["tokens_per_pass"] * x["passes"] for x in specs) / passes if passes else 0.0,
            draft_model=self.draft_engine.model.path if self.draft_engine is not None else "", costs=self.costs)


__all__ = ["Speculation"]
