"""Which streamed layers the host computes, per step shape, from measured figures.

A layer the GPU does not hold either crosses the link (pinned RAM → device, once per step
whatever the batch) or is computed by the host where it lies (at the host's memory bandwidth at
batch 1; a large batch makes the host compute-bound and the link the cheaper path again). A
step uses both paths at once, so the slower of the two sets its time: for each step shape this
module picks the host's share that makes the pass shortest.

    figures = Figures(link_bps=55e9, host_bps={1: 68e9, 4: 60e9}, gpu_bps={1: 3e12})
    plan = with_schedule(plan, figures, rows=(1, 2, 4, 8, 16, 32, 512))
    print(plan.explain())                      # the placement at each step shape

A step's shape is its number of token rows: B for a decode step at batch B, R × T for R
sequences verifying T tokens, the chunk length for a prefill chunk; the weights' cost depends on
it. The host's attention also grows with the context, the positions each row attends to: a host
layer costs its bytes at the host's rate plus rows × context × `Figures.host_attn_s`, so the
longer the context the fewer layers the host takes (`with_schedule(..., context=)`). The figures
are measured at load (the link, the host's rate and the GPU's per shape, the host's attention
per position); `Figures.assumed` stands in, and says so, until they are.

The pass is simulated as the slot ring runs it (`pass_seconds`): copies start when the pass
begins and run `depth` streamed layers ahead of the GPU, each waiting for its slot's last user;
layers are computed in order, resident and streamed ones on the GPU, host ones on the host; a
change of device costs a hand-off. The candidates spread the host's layers over the streamed ones
in stretches (`spread`), so that each stretch of host work hides the copies of the
streamed layers after it; the fastest candidate wins, ties going to fewer host layers, then to
fewer hand-offs; the host takes none unless that saves HYBRID_MARGIN of the pass (a step on the
GPU alone replays a captured graph).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence

from ntransformerd.engine.tiers.planner import (ASSUMED_DISK_BPS, ASSUMED_H2D_BPS, HOST, PINNED, SKIP, STORAGE, Plan,
                                                layer_span)

# What the H200 machine's host read (14 threads summing an 8 GiB array) while its link copied
# (issue 23): the one assumed host figure, for decode at batch 1 only.
ASSUMED_HOST_BPS = 64.2e9
# A step the GPU runs alone replays one captured graph; a step over the GPU and the host runs
# the GPU's streamed layers eagerly: the host takes layers only where that saves more than this
# share of the pass.
HYBRID_MARGIN = 0.05
STEP_ROWS = (1, 2, 4, 8, 16, 32)  # decode and verify steps: the shapes a schedule covers besides prefill
# The steering places again when the context has moved by CONTEXT_STEP since the last placement;
# below CONTEXT_FLOOR positions it counts as CONTEXT_FLOOR (there the attention costs little), so
# a context growing from 0 to 4096 is weighed at most log(4096 / 256) / log(1.25) = 12 times.
CONTEXT_STEP = 1.25
CONTEXT_FLOOR = 256
# A period longer than 4 expected steps and than this is taken for a wait for work (Steering)
WAIT_S = 0.25


def _interpolate(table: Mapping[int, float], rows: int, beyond: float | None) -> float:
    """The rate at `rows` from rates measured at some row counts: time per byte linear between
    two measured shapes; below the smallest, its rate; above the largest, `beyond` (None: its rate)."""
    pts = sorted(table.items())
    if rows <= pts[0][0]:
        return pts[0][1]
    if rows > pts[-1][0]:
        return pts[-1][1] if beyond is None else beyond
    for (r0, b0), (r1, b1) in zip(pts, pts[1:]):
        if r0 <= rows <= r1:
            if b0 <= 0 or b1 <= 0:
                return 0.0
            w = (rows - r0) / (r1 - r0)
            return 1.0 / ((1 - w) / b0 + w / b1)
    raise AssertionError("unreachable")


@dataclasses.dataclass(frozen=True)
class Figures:
    """The rates a placement is planned from, in bytes of layer weights per second. host_bps
    and gpu_bps are by step rows; beyond the largest measured shape the host computes nothing
    (it was not measured there), the GPU keeps its last rate. gpu_bps empty: GPU compute not
    counted (the bound from the bytes alone)."""

    link_bps: float  # pinned host memory → device
    host_bps: Mapping[int, float]
    gpu_bps: Mapping[int, float] = dataclasses.field(default_factory=dict)
    disk_bps: float = ASSUMED_DISK_BPS  # storage reads, for a storage layer streamed or computed by the host
    handoff_s: float = 0.0  # one hand-off of the activation between the GPU and the host
    measured: bool = True
    host_attn_s: float = 0.0  # the host's attention: seconds per position one row attends to, per layer
    # what each host layer costs the step beyond its own time: the host's threads slowing the rest
    # of the step and the loop around it (learned from the steps' periods by Steering; 0 at load)
    host_layer_s: float = 0.0

    def __post_init__(self):
        if self.link_bps <= 0 or self.disk_bps <= 0 or self.handoff_s < 0 or self.host_attn_s < 0 or \
                self.host_layer_s < 0:
            raise ValueError(f"figures: link {self.link_bps} and disk {self.disk_bps} B/s must be positive, "
                             f"hand-off {self.handoff_s} s and host attention {self.host_attn_s} s not negative")
        if not self.host_bps or any(r < 1 or b < 0 for r, b in self.host_bps.items()) or any(
                r < 1 or b <= 0 for r, b in self.gpu_bps.items()):
            raise ValueError("figures: host rates by step rows (≥ 1) are needed, not negative; GPU rates positive")

    @classmethod
    def assumed(cls) -> "Figures":
        """Stand-ins until the rates are measured: the H200 machine's link and what its host
        read beside it, at batch 1 only; compute not counted."""
        return cls(ASSUMED_H2D_BPS, {1: ASSUMED_HOST_BPS}, measured=False)

    def host(self, rows: int) -> float:
        return _interpolate(self.host_bps, rows, 0.0)

    def gpu(self, rows: int) -> float:
        return _interpolate(self.gpu_bps, rows, None) if self.gpu_bps else math.inf

    def to_dict(self) -> dict:
        return {"link_bps": self.link_bps, "host_bps": {str(r): b for r, b in self.host_bps.items()},
                "gpu_bps": {str(r): b for r, b in self.gpu_bps.items()}, "disk_bps": self.disk_bps,
                "handoff_s": self.handoff_s, "measured": self.measured, "host_attn_s": self.host_attn_s,
                "host_layer_s": self.host_layer_s}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Figures":
        return cls(float(d["link_bps"]), {int(r): float(b) for r, b in d["host_bps"].items()},
                   {int(r): float(b) for r, b in d.get("gpu_bps", {}).items()},
                   float(d.get("disk_bps", ASSUMED_DISK_BPS)), float(d.get("handoff_s", 0.0)),
                   bool(d.get("measured", True)), float(d.get("host_attn_s", 0.0)), float(d.get("host_layer_s", 0.0)))

    def describe(self) -> str:
        host = ", ".join(f"{b / 1e9:.1f} GB/s at {r}" for r, b in sorted(self.host_bps.items()))
        return (f"{'measured' if self.measured else 'assumed, not measured'}: link {self.link_bps / 1e9:.1f} GB/s, "
                f"host {host} rows, attention {self.host_attn_s * 1e9:.2f} ns per position per layer"
                + (f", {self.host_layer_s * 1e3:.2f} ms more a host layer" if self.host_layer_s else "")
                + ("" if self.gpu_bps else "; GPU compute not counted"))


@dataclasses.dataclass(frozen=True)
class PassTime:
    seconds: float  # the simulated pass over the layers (embedding and output not counted)
    link_seconds: float  # the link busy with the streamed layers
    host_seconds: float  # the host busy with its layers
    handoffs: int


def _time(nbytes: float, rate: float) -> float:
    return nbytes / rate if rate > 0 else math.inf


def pass_seconds(plan: Plan, host: set[int], figures: Figures, rows: int, context: float = 0.0) -> PassTime:
    """One pass of a step of `rows` rows, each attending to `context` positions, with the layers
    in `host` computed by the host and the plan's other streamed layers brought over the link
    (module docstring)."""
    gpu, cpu = figures.gpu(rows), figures.host(rows)
    attn = rows * context * figures.host_attn_s  # each host layer's attention
    depth = max(plan.depth, 1)
    t = link_end = link_s = host_s = 0.0
    released: list[float] = []  # when each streamed position's slot was given back
    on_host, handoffs = False, 0
    for i, (tier, b) in enumerate(zip(plan.tiers, plan.layer_bytes)):
        if tier == SKIP:
            continue
        if (i in host) != on_host:
            on_host, handoffs, t = i in host, handoffs + 1, t + figures.handoff_s
        if i in host:
            dt = _time(b, min(cpu, figures.disk_bps) if tier == STORAGE else cpu) + attn
            t, host_s = t + dt, host_s + dt
        elif tier in (PINNED, STORAGE):
            j = len(released)
            start = max(link_end, released[j - depth] if j >= depth else 0.0)
            dt = _time(b, figures.link_bps if tier == PINNED else min(figures.link_bps, figures.disk_bps))
            link_end, link_s = start + dt, link_s + dt
            t = max(t, link_end) + _time(b, gpu)
            released.append(t)
        else:
            t += _time(b, gpu)
    if on_host:  # the output is on the GPU
        handoffs, t = handoffs + 1, t + figures.handoff_s
    # what the host layers cost the rest of the step and the loop, on top (as Steering reads it)
    t += figures.host_layer_s * len(host & {i for i, tier in enumerate(plan.tiers) if tier != SKIP})
    return PassTime(t, link_s, host_s, handoffs)


def spread(m: int, chunk: int, k: int, phase: float = 0.0) -> list[bool]:
    """Which of m positions the host takes: the positions in chunks of `chunk`, k of the chunks
    spread evenly (Bresenham); phase 0 ends each period with the host's chunk (the ring's first
    copies, made while the resident layers compute, are used first), 0.5 centres it."""
    n = -(-m // chunk)
    take = [math.floor((c + 1) * k / n + phase) > math.floor(c * k / n + phase) for c in range(n)]
    return [take[p // chunk] for p in range(m)]


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where each layer is computed at one step shape: the plan's tiers with `host` where the
    host computes the layer, and the simulated pass beside the all-streamed one."""

    rows: int
    tiers: tuple[str, ...]
    time: PassTime
    streamed: PassTime  # the same pass with every streamed layer crossing the link

    @property
    def host_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.tiers) if t == HOST]


def place_rows(plan: Plan, figures: Figures, rows: int, context: float = 0.0) -> Placement:
    """The fastest placement of the plan's streamed layers at a step of `rows` rows, each
    attending to `context` positions."""
    streamed = plan.streamed
    m = len(streamed)
    none = pass_seconds(plan, set(), figures, rows, context)
    best_key, best = (none.seconds, 0, none.handoffs), (set(), none)
    if m and figures.host(rows) > 0:
        for chunk in sorted({1 << e for e in range(m.bit_length())} | {m}):
            n = -(-m // chunk)
            for k in range(1, n + 1):
                for phase in (0.0, 0.5):
                    host = {i for i, h in zip(streamed, spread(m, chunk, k, phase)) if h}
                    pt = pass_seconds(plan, host, figures, rows, context)
                    key = (round(pt.seconds, 12), len(host), pt.handoffs)
                    if key < best_key:
                        best_key, best = key, (host, pt)
    host, pt = best
    if host and pt.seconds > none.seconds * (1 - HYBRID_MARGIN):
        host, pt = set(), none
    tiers = tuple(HOST if i in host else t for i, t in enumerate(plan.tiers))
    return Placement(rows, tiers, pt, none)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The placement at each step shape, by increasing rows: a step of n rows runs the first
    with rows ≥ n (any larger step: the last). Placed for rows attending to `context` positions."""

    placements: tuple[Placement, ...]
    figures: Figures
    context: float = 0.0

    @property
    def host_layers(self) -> list[int]:
        """The layers the host computes at some shape (it holds them all)."""
        return sorted({i for p in self.placements for i in p.host_layers})

    def explain(self) -> list[str]:
        lines = [f"  host compute   by step rows ({self.figures.describe()}; context {self.context:.0f} positions):"]
        for p in self.placements:
            hl = p.host_layers
            streamed = sum(1 for t in p.tiers if t in (PINNED, STORAGE))
            lines.append(f"    {p.rows:5d} rows  host {len(hl):3d}, link {streamed:3d} layers  "
                         f"{p.time.seconds * 1e3:8.2f} ms (all over the link {p.streamed.seconds * 1e3:.2f} ms; "
                         f"link {p.time.link_seconds * 1e3:.2f}, host {p.time.host_seconds * 1e3:.2f}, "
                         f"{p.time.handoffs} hand-offs)  host [{layer_span(hl)}]")
        return lines

    def to_dict(self) -> dict:
        return {"figures": {"link_bps": self.figures.link_bps, "host_bps": dict(self.figures.host_bps),
                            "gpu_bps": dict(self.figures.gpu_bps), "measured": self.figures.measured,
                            "host_attn_s": self.figures.host_attn_s},
                "context": self.context,
                "by_rows": [{"rows": p.rows, "host": p.host_layers, "seconds": p.time.seconds,
                             "streamed_seconds": p.streamed.seconds, "link_seconds": p.time.link_seconds,
                             "host_seconds": p.time.host_seconds, "handoffs": p.time.handoffs}
                            for p in self.placements]}


def with_schedule(plan: Plan, figures: Figures, rows: Sequence[int], *, context: float = 0.0) -> Plan:
    """The plan with its placement at each of the step shapes `rows` (plan.schedule), for rows
    attending to `context` positions."""
    if any(r < 1 for r in rows):
        raise ValueError(f"step rows {list(rows)}: each is at least 1")
    placements = tuple(place_rows(plan, figures, r, context) for r in sorted(set(rows)))
    return dataclasses.replace(plan, schedule=Schedule(placements, figures, context))


def save_figures(path: str, figures: Figures) -> None:
    """Write the figures to `path` (a small JSON file; written whole, then renamed into place)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(figures.to_dict(), f)
    os.replace(tmp, path)


def load_figures(path: str) -> Figures | None:
    """The figures saved at `path`, or None where there are none or they cannot be read (then
    they are measured again)."""
    try:
        with open(path) as f:
            return Figures.from_dict(json.load(f))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


# ---- the placement follows the steps -------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Observation:
    """One hybrid step as it ran: the host's pieces (wall time of its layers, how many) and the
    link's copies (their busy time), each with the layer bytes it moved; and the positions its
    rows attended to, summed over the rows (0: not told)."""

    rows: int
    host_seconds: float
    host_bytes: int
    link_seconds: float
    link_bytes: int
    keys: int = 0
    host_layers: int = 0
    # seconds from the previous step's start to this one's where the loop ran them back to back
    # (0: not known, or the loop waited for work between them): the previous step's cost as the
    # loop paid it, its launches, the host's threads and the loop's own work included
    period: float = 0.0  # (longer than 4 expected steps and WAIT_S: taken for a wait)


class Steering:
    """Keeps a plan's placement in line with what its steps show.

    The figures measured at load (or cached) are a first guess: the host's memory bandwidth moves
    with its neighbours' load from minute to minute, and its attention grows with the context.
    Every hybrid step reports the rate its host pieces and its copies ran at (`observe`); each is
    folded into a factor on the load-time figure (an exponential average, `alpha` of the new
    reading). The host's reading is its time against what the figures predict for that step,
    its layers' bytes and their attention over the step's context, so a longer context is not
    taken for a slower host. When a factor has moved by more than `noise` since the placement
    was last weighed, or the context by CONTEXT_STEP, and at least `dwell` steps ran since (the
    placement does not flap on one slow step), the placement at every step shape is made again
    from the corrected figures at the step's context and taken where it beats the current one,
    weighed on the same figures, by more than HYBRID_MARGIN at some shape (hysteresis: a change
    must pay).

    The figures model the bytes; what they leave out is read off the steps' periods (the loop's
    time from one step's start to the next's, which the user pays per token): a step on the GPU
    alone shows the loop's own cost beyond its predicted pass (`loop_s`), and a hybrid step beyond
    that shows what its host layers cost the rest of the step and the loop (threads competing for
    cores, launches waiting), folded in per host layer as `Figures.host_layer_s`. A host
    layer then costs the placement its bytes, its attention and that, so a host that slows
    everything else takes fewer layers or none even when its own pieces run fast. To know the
    loop's cost beside a hybrid placement the steering runs a short trial on the GPU alone
    (`trial` steps): once early, again after the context doubled, and every `check` steps where
    the hybrid's predicted saving is under `worth`. After a trial the placement is weighed again;
    under HYBRID_MARGIN of saving it stays on the GPU alone. Only where the pipeline reports
    periods (Observation.period).

    A host that computes nothing (found slow, or placed out by figures from a busy moment) reports
    nothing: after `probe` steps without a host reading, its factor is moved halfway back towards
    the figure at load (geometrically: the square root) and at least to where the host would
    match the link, which gives it layers again, so the next steps measure it; a probe that finds
    it still slow doubles the wait before the next (up to `max_probe`), one that finds it well
    resets it. So a slow host costs a few steps every `probe`..`max_probe` steps, and a recovered
    or underrated one gets its layers.

    Pure policy: no device, no clock. Thread rule: the engine's owner thread.
    """

    def __init__(self, plan: Plan, *, alpha: float = 0.3, noise: float = 0.2, dwell: int = 4, probe: int = 64,
                 max_probe: int = 4096, trial: int = 6, check: int = 512, worth: float = 0.25):
        """plan: one with its schedule (with_schedule), the placement at load."""
        if plan.schedule is None:
            raise ValueError("steering needs a plan with a schedule (placement.with_schedule)")
        if not 0 < alpha <= 1 or noise <= 0 or dwell < 1 or probe < 1 or trial < 2 or check < 1 or worth < 0:
            raise ValueError("steering: alpha in (0, 1], noise > 0, dwell and probe at least 1, trial at least 2, "
                             "check at least 1, worth not negative")
        self.plan, self.schedule, self.base = plan, plan.schedule, plan.schedule.figures
        self.rows = tuple(p.rows for p in self.schedule.placements)
        self.alpha, self.noise, self.dwell = alpha, noise, dwell
        self.probe, self.max_probe, self._wait = probe, max_probe, probe
        self.host_scale = self.link_scale = 1.0
        self.context = float(self.schedule.context)  # positions per row of the last step that said
        self._weighed = (1.0, 1.0)  # the factors the placement was last weighed with
        self._placed_context = max(self.context, CONTEXT_FLOOR)  # and the context, floored
        self._since = 0  # steps since then
        self._unheard = 0  # steps since the host last reported
        self._probing = False
        self._probe_steps = 0  # host readings since the last probe
        self.changes = 0
        self.weighs = 0  # placements made again (taken or not)
        # what the periods show (class docstring)
        self.trial, self.check, self.worth = trial, check, worth
        self.loop_s: float | None = None  # the loop's cost a step beyond the predicted pass, GPU alone
        self.host_layer_s = base_h = self.base.host_layer_s
        self._weighed_h = base_h
        self._periods = False  # the pipeline reports them
        self._prev: tuple[int, int, float] | None = None  # the last steady step: rows, host layers, predicted pass
        self._settle = 0  # steps whose period is not attributed (the ring still fed for the old placement)
        self._trial_left = 0
        self._trial_context = 0.0  # the context at the last trial
        self._since_trial = 0
        self.trials = 0

    def figures(self) -> Figures:
        """The load-time figures corrected by what the steps showed."""
        b = self.base
        return dataclasses.replace(
            b, link_bps=b.link_bps * self.link_scale,
            host_bps={r: v * self.host_scale for r, v in b.host_bps.items()},
            host_attn_s=b.host_attn_s / self.host_scale, host_layer_s=self.host_layer_s)

    @property
    def trying(self) -> bool:
        """A trial on the GPU alone runs (or has just ended): its moves are not news."""
        return self._trial_left > 0 or self._since_trial <= self.trial

    def _placement(self, rows: int) -> Placement:
        return next((p for p in self.schedule.placements if p.rows >= rows), self.schedule.placements[-1])

    def _learn(self, obs: Observation) -> None:
        """Attribute obs.period to the step before obs (its placement and predicted pass)."""
        prev, self._prev = self._prev, None
        if obs.period > 0:
            self._periods = True
        if not self._periods:
            return
        hosted = self._placement(obs.rows).host_layers
        bare = dataclasses.replace(self.figures(), host_layer_s=0.0)
        if self._settle > 0:
            self._settle -= 1
        elif obs.rows <= STEP_ROWS[-1]:  # decode and verify shapes: prompt chunks teach nothing here
            self._prev = (obs.rows, len(hosted),
                          pass_seconds(self.plan, set(hosted), bare, obs.rows, self.context).seconds)
        if prev is None or obs.period <= 0 or prev[0] != obs.rows:
            return
        _, n, predicted = prev
        expected = predicted + (self.loop_s or 0.0) + n * self.host_layer_s
        if obs.period > max(4 * expected, WAIT_S):  # the loop waited for work after that step
            return
        excess, a = obs.period - predicted, self.alpha
        if n == 0:
            self.loop_s = excess if self.loop_s is None else (1 - a) * self.loop_s + a * excess
        elif self.loop_s is not None:
            self.host_layer_s = (1 - a) * self.host_layer_s + a * max(0.0, (excess - self.loop_s) / n)

    def _moved(self, schedule: Schedule) -> Schedule:
        self.schedule, self._settle, self._prev = schedule, 1, None
        return schedule

    def _trial_due(self, rows: int) -> bool:
        """Whether to run the step shape `rows` on the GPU alone for a trial now."""
        if not self._periods or not self._placement(rows).host_layers or self._since_trial < 4 * self.dwell:
            return False
        if self.loop_s is None or self.context >= 2 * max(self._trial_context, CONTEXT_FLOOR):
            return True
        if self._since_trial < self.check:
            return False
        figures = self.figures()
        none = pass_seconds(self.plan, set(), figures, rows, self.context).seconds
        mine = pass_seconds(self.plan, set(self._placement(rows).host_layers), figures, rows, self.context).seconds
        return mine > none * (1 - self.worth)

    def _start_trial(self, rows: int) -> Schedule:
        figures = self.figures()
        none = pass_seconds(self.plan, set(), figures, rows, self.context)
        alone = Placement(self._placement(rows).rows, self.plan.tiers, none, none)
        placements = tuple(alone if p.rows == alone.rows else p for p in self.schedule.placements)
        self._trial_left, self._trial_context, self._since_trial = self.trial, self.context, 0
        self.trials += 1
        return self._moved(Schedule(placements, figures, self.context))

    def _fold(self, scale: float, expected_seconds: float, seconds: float) -> float:
        if seconds <= 0 or not 0 < expected_seconds < math.inf:
            return scale
        seen = expected_seconds / seconds  # this step's speed against the figures at load
        return math.exp((1 - self.alpha) * math.log(scale) + self.alpha * math.log(seen))

    def _context_moved(self) -> bool:
        """The context has moved by CONTEXT_STEP since the last placement, where the host's
        attention counts at all."""
        if self.base.host_attn_s <= 0:
            return False
        return abs(math.log(max(self.context, CONTEXT_FLOOR) / self._placed_context)) >= math.log(CONTEXT_STEP)

    def observe(self, obs: Observation) -> Schedule | None:
        """Fold one step in; the new schedule where the placement moves, else None."""
        if obs.keys > 0:
            self.context = obs.keys / obs.rows
        self._learn(obs)
        self._since_trial += 1
        if self._trial_left > 0:  # a trial on the GPU alone: the link's reading only
            if obs.link_bytes > 0:
                self.link_scale = self._fold(self.link_scale, obs.link_bytes / self.base.link_bps, obs.link_seconds)
            self._trial_left -= 1
            if self._trial_left == 0:  # weighed again from here, the trial's placement the one to beat
                self._since = 0
                return self._weigh()
            return None
        if self._trial_due(obs.rows):
            return self._start_trial(obs.rows)
        if obs.host_bytes > 0:
            host = self.base.host(obs.rows)
            expected = (obs.host_bytes / host if host > 0 else math.inf) + \
                obs.host_layers * obs.keys * self.base.host_attn_s
            self.host_scale = self._fold(self.host_scale, expected, obs.host_seconds)
            self._unheard = 0
            if self._probing:
                self._probe_steps += 1
                # the probe found the host well again: its pieces at speed and, over a few steps,
                # its layers kept (a host that slows the rest loses them again first: host_layer_s)
                if self._probe_steps >= 3 * self.dwell and self.host_scale >= self._weighed[0] / (1 + self.noise):
                    self._wait, self._probing = self.probe, False
        else:
            self._unheard += 1
        if obs.link_bytes > 0:
            self.link_scale = self._fold(self.link_scale, obs.link_bytes / self.base.link_bps, obs.link_seconds)
        self._since += 1
        if self._since < self.dwell:
            return None
        limit = math.log1p(self.noise)
        drift = max(abs(math.log(self.host_scale / self._weighed[0])),
                    abs(math.log(self.link_scale / self._weighed[1])))
        if drift <= limit and not self._context_moved() and not self._host_cost_moved(obs.rows):
            if self._unheard < self._wait:
                return None
            # A probe: the host silent for a while. Its factor goes halfway back to the figure at
            # load, and at least to where the host would match the link (where the placement gives
            # it layers again), so the next steps measure it.
            if self._probing:
                self._wait = min(2 * self._wait, self.max_probe)
            even = self.base.link_bps * self.link_scale / max(self.base.host(self.rows[0]), 1.0)
            self.host_scale = max(math.sqrt(min(self.host_scale, 1.0)), self.host_scale, even)
            self.host_layer_s /= 2  # and what its layers cost the rest halves, so that the probe runs
            self._probing, self._unheard, self._probe_steps = True, 0, 0
        return self._weigh()

    def _host_cost_moved(self, rows: int) -> bool:
        """host_layer_s has moved, since the last placement, by HYBRID_MARGIN of the step at
        `rows` over the host layers placed there (or one where none is)."""
        delta = abs(self.host_layer_s - self._weighed_h)
        if delta == 0 or self._prev is None or self._prev[0] != rows:
            return False
        _, n, bare = self._prev  # this step's predicted pass, from _learn: no second simulation a step
        return delta * max(1, n) > HYBRID_MARGIN * (bare + n * self.host_layer_s)

    def _weigh(self) -> Schedule | None:
        """The placement made again from the corrected figures; the new schedule where it beats
        the current one (on the same figures) by HYBRID_MARGIN at some shape, else None."""
        figures, context = self.figures(), self.context
        self._weighed, self._since, self._weighed_h = (self.host_scale, self.link_scale), 0, self.host_layer_s
        self._placed_context, self.weighs = max(context, CONTEXT_FLOOR), self.weighs + 1
        best = tuple(place_rows(self.plan, figures, r, context) for r in self.rows)
        pays = False
        for new, old in zip(best, self.schedule.placements):
            if new.tiers != old.tiers:
                now = pass_seconds(self.plan, set(old.host_layers), figures, old.rows, context).seconds
                pays = pays or new.time.seconds < now * (1 - HYBRID_MARGIN)
        if not pays:
            return None
        self.changes += 1
        return self._moved(Schedule(best, figures, context))

    def status(self) -> str:
        loop = "" if self.loop_s is None else (
            f"; the loop {self.loop_s * 1e3:.2f} ms a step beyond the pass, a host layer {self.host_layer_s * 1e3:.2f} "
            f"ms more ({self.trials} trials on the GPU alone)")
        return (f"host at {self.host_scale:.2f}x and link at {self.link_scale:.2f}x of the figures at load, "
                f"context {self.context:.0f}; placement moved {self.changes} times in {self.weighs} weighs" + loop)
