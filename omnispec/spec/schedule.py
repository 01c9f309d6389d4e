"""Noise schedules: omnispec's own flow-matching schedule, the checkpoint's scheduler, or a segment.

``flow_match_sigmas`` is pure Python so that ``omnispec explain`` can show sigma ranges without torch;
the runtime uses the same function, so what ``explain`` prints is what runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, ClassVar, Literal, Union

from pydantic import Field, model_validator

from .base import MAX_STEPS, SpecModel, Steps, Unit
from .kinds import Kinds

ConfigValue = Union[bool, int, float, str, None]
# A value the spec takes from the checkpoint's own config files at build (shown by ``explain --source``).
FROM_CHECKPOINT = "from_checkpoint"
FromCheckpoint = Literal["from_checkpoint"]


class ScheduleSpec(SpecModel):
    """What every schedule kind answers, so that no caller asks which kind it holds.

    ``schedules`` is the recipe's shared schedules (what a segment walks)."""

    # Whether the checkpoint's scheduler config is compared against this schedule's own settings before loading.
    checked_against_checkpoint: ClassVar[bool] = False

    @property
    def segment_of(self) -> str | None:
        """The shared schedule this one is a segment of (None: it makes its own steps)."""
        return None

    @property
    def scheduler_component(self) -> str | None:
        """The scheduler component whose own ``set_timesteps`` makes the steps (None: omnispec's)."""
        return None

    @property
    def unresolved(self) -> bool:
        """Whether a value still comes from the checkpoint (``from_checkpoint``), resolved at build."""
        return False

    def walked(self, schedules: dict) -> ScheduleSpec:
        """The schedule whose steps a walk over this one takes: itself, or the shared one a segment is part of."""
        return self

    def step_count(self, steps: int) -> int | None:
        """Steps of a walk of a request of ``steps`` steps; None where only the checkpoint's scheduler knows."""
        return None

    @property
    def takes_request_steps(self) -> bool:
        """Whether a walk on it takes the request's step count (and so a request's ``sigmas``)."""
        return False


class OwnSteps:
    """What a schedule with its own ``steps`` and ``sigmas`` fields says of its walks."""

    steps: int | None
    sigmas: list[float] | None

    def step_count(self, steps: int) -> int | None:
        return len(self.sigmas) if self.sigmas is not None else self.steps or steps

    @property
    def takes_request_steps(self) -> bool:
        return self.steps is None and self.sigmas is None

    def static_sigmas(self, steps: int, schedules: dict) -> list[float] | None:
        """Step sigmas (without the terminal 0) when they follow from the spec alone, else None."""
        return None

    def describe(self, schedules: dict) -> str:
        """How explain names it."""
        raise NotImplementedError

    def brief(self, schedules: dict) -> str:
        """How explain names it inside a segment's description."""
        return self.describe(schedules)


class FlowMatchSchedule(OwnSteps, ScheduleSpec):
    """Euler flow matching on ``sigmas = linspace(1, 1/steps, steps)`` (or explicit ``sigmas``), shifted.

    ``shift`` is a static shift ``s*x / (1 + (s-1)*x)`` or ``dynamic``: the exponential time shift
    with ``mu`` interpolated from the image sequence length between ``base_seq_len`` and
    ``max_seq_len`` (FLUX.1's ``calculate_shift``), or ``empirical``: the same time shift with FLUX.2's ``mu``,
    fitted to both the sequence length and the step count. ``shift_terminal`` stretches the schedule so the
    last sigma equals it (LTX-style terminal stretch). ``shift: from_checkpoint`` takes the shift, its
    dynamic range and the terminal from the checkpoint's scheduler config at build.
    """

    kind: Literal["flow_match"]
    steps: Steps | None = Field(default=None, description="Defaults to the request's steps.")
    sigmas: list[Unit] | None = Field(default=None, min_length=1, max_length=MAX_STEPS)
    shift: float | Literal["dynamic", "empirical"] | FromCheckpoint = 1.0
    base_shift: float = 0.5
    max_shift: float = 1.15
    base_seq_len: int = 256
    max_seq_len: int = 4096
    shift_terminal: Unit | None = None

    checked_against_checkpoint: ClassVar[bool] = True

    @property
    def unresolved(self) -> bool:
        return self.shift == FROM_CHECKPOINT

    def static_sigmas(self, steps: int, schedules: dict) -> list[float] | None:
        if self.shift in ("dynamic", "empirical", FROM_CHECKPOINT):
            return None
        return flow_match_sigmas(self, self.step_count(steps))[:-1]  # type: ignore[arg-type]

    def brief(self, schedules: dict) -> str:
        return "flow_match"

    def describe(self, schedules: dict) -> str:
        shift = {"dynamic": "dynamic shift", "empirical": "empirical shift", FROM_CHECKPOINT:
                 "shift from the checkpoint"}.get(
            self.shift, f"shift {self.shift}")  # type: ignore[arg-type]
        return f"flow_match ({shift}{', explicit sigmas' if self.sigmas else ''})"

    @model_validator(mode="after")
    def _positive_shift(self) -> FlowMatchSchedule:
        if isinstance(self.shift, float) and self.shift <= 0:
            raise ValueError(f"shift must be positive or 'dynamic', got {self.shift}")
        if self.max_seq_len <= self.base_seq_len:
            raise ValueError("max_seq_len must exceed base_seq_len")
        return self


class SchedulerSchedule(OwnSteps, ScheduleSpec):
    """Use a scheduler component's own ``set_timesteps``/``step`` (Wan's UniPC, or any diffusers scheduler).

    ``config`` overrides entries of the checkpoint's scheduler config (e.g. ``flow_shift``). ``sigmas`` are
    handed to ``set_timesteps(sigmas=...)`` as diffusers pipelines hand a caller's ``sigmas`` (the scheduler
    shifts them as its config says); a scheduler whose ``set_timesteps`` takes none is refused at the first run.
    """

    kind: Literal["scheduler"]
    component: str = "scheduler"
    steps: Steps | None = Field(default=None, description="Defaults to the request's steps.")
    sigmas: list[Unit] | None = Field(default=None, min_length=1, max_length=MAX_STEPS)
    config: dict[str, ConfigValue] = Field(default_factory=dict)

    @property
    def scheduler_component(self) -> str | None:
        return self.component

    def describe(self, schedules: dict) -> str:
        return f"scheduler component {self.component!r}"


class SegmentSchedule(ScheduleSpec):
    """The steps of a shared schedule whose normalised timestep ``t/T`` lies in ``[low, high)``.

    ``high == 1`` includes ``t/T == 1``. Wan2.2 A14B: the high-noise expert takes ``[0.875, 1]``, the
    low-noise expert ``[0, 0.875)``; one scheduler state runs through both, as in diffusers. A bound of
    ``from_checkpoint`` is the checkpoint's ``boundary_ratio`` (``model_index.json``), resolved at build.
    """

    kind: Literal["segment"]
    of: str
    low: Unit | FromCheckpoint = 0.0
    high: Unit | FromCheckpoint = 1.0

    @model_validator(mode="after")
    def _ordered(self) -> SegmentSchedule:
        if self.low == self.high == FROM_CHECKPOINT:
            raise ValueError("only one bound of a segment can be the checkpoint's boundary")
        if isinstance(self.low, float) and isinstance(self.high, float) and self.low >= self.high:
            raise ValueError(f"segment low {self.low} must be below high {self.high}")
        return self

    @property
    def resolved(self) -> bool:
        return FROM_CHECKPOINT not in (self.low, self.high)

    @property
    def unresolved(self) -> bool:
        return not self.resolved

    @property
    def segment_of(self) -> str | None:
        return self.of

    def walked(self, schedules: dict) -> ScheduleSpec:
        return schedules[self.of]

    def step_count(self, steps: int) -> int | None:
        return None  # the shared walk's steps split between the segments by the scheduler's timesteps

    def static_sigmas(self, steps: int, schedules: dict) -> list[float] | None:
        """The shared schedule's static sigmas whose ``t/T`` (= sigma for flow matching) lies in this segment."""
        shared = schedules.get(self.of)
        if not self.resolved or shared is None:
            return None
        sigmas = shared.static_sigmas(steps, schedules)
        return None if sigmas is None else [s for s in sigmas if self.contains(s)]

    def describe(self, schedules: dict) -> str:
        shared = schedules[self.of]
        inner = shared.brief(schedules)
        low, high = (f"{b:g}" if isinstance(b, float) else "the checkpoint's boundary" for b in (self.low, self.high))
        return f"segment [{low}, {high}{']' if self.high == 1 else ')'} of {self.of!r} ({inner})"

    def contains(self, t_norm: float) -> bool:
        assert isinstance(self.low, float) and isinstance(self.high, float), "resolve from_checkpoint bounds first"
        return self.low <= t_norm < self.high or (self.high == 1.0 and t_norm >= 1.0)


# A phase walks a schedule of its own (``SCHEDULES``: any kind, a segment included) or shares one in
# ``recipe.schedules`` (``SHARED_SCHEDULES``: the kinds that make their own steps). Each walk's steps are made by its
# implementation in the runtime (runtime/schedule.py).
SCHEDULES = Kinds("schedule")
SHARED_SCHEDULES = Kinds("shared schedule")
for _registry in (SCHEDULES, SHARED_SCHEDULES):
    _registry.register(FlowMatchSchedule, "omnispec.runtime.schedule:FLOW_MATCH")
    _registry.register(SchedulerSchedule, "omnispec.runtime.schedule:SCHEDULER")
SCHEDULES.register(SegmentSchedule, "omnispec.runtime.schedule:SEGMENT")
SharedSchedule = Annotated[ScheduleSpec, SHARED_SCHEDULES]
Schedule = Annotated[ScheduleSpec, SCHEDULES]


def dynamic_mu(schedule: FlowMatchSchedule, seq_len: int) -> float:
    slope = (schedule.max_shift - schedule.base_shift) / (schedule.max_seq_len - schedule.base_seq_len)
    return seq_len * slope + schedule.base_shift - slope * schedule.base_seq_len


def empirical_mu(seq_len: int, steps: int) -> float:
    """FLUX.2's ``mu``: linear in the sequence length at 10 and at 200 steps (two fitted lines), interpolated
    linearly in the step count between them; past 4,300 tokens the 200-step line alone (diffusers'
    ``compute_empirical_mu``, whose constants these are)."""
    a1, b1, a2, b2 = 8.73809524e-05, 1.89833333, 0.00016927, 0.45666666
    if seq_len > 4300:
        return a2 * seq_len + b2
    m_200, m_10 = a2 * seq_len + b2, a1 * seq_len + b1
    slope = (m_200 - m_10) / 190.0
    return slope * steps + m_200 - 200.0 * slope


def flow_match_times(schedule: FlowMatchSchedule, steps: int) -> list[float]:
    """The schedule's points before its shift, one per step: explicit ``sigmas``, or ``linspace(1, 1/steps, steps)``
    (evenly spaced, so with the terminal 0 the grid is ``linspace(1, 0, steps + 1)`` without its last point)."""
    if schedule.sigmas is not None:
        return [float(s) for s in schedule.sigmas]
    return [1.0 - i * (1.0 - 1.0 / steps) / max(steps - 1, 1) for i in range(steps)] if steps > 1 else [1.0]


def flow_match_warp(schedule: FlowMatchSchedule, steps: int, seq_len: int | None = None) -> Callable[[float], float]:
    """The time warp of a walk of ``steps`` steps: a point of ``flow_match_times`` to its sigma (the static or
    time shift, then the terminal stretch, whose factor the walk's last point fixes)."""
    if schedule.shift == FROM_CHECKPOINT:
        raise ValueError("shift: from_checkpoint is resolved from the checkpoint's scheduler config at build")
    if schedule.shift in ("dynamic", "empirical"):
        if seq_len is None:
            raise ValueError(f"a {schedule.shift} shift needs the image sequence length")
        mu = dynamic_mu(schedule, seq_len) if schedule.shift == "dynamic" else empirical_mu(seq_len, steps)

        def shift(s: float) -> float:
            return math.exp(mu) / (math.exp(mu) + (1.0 / s - 1.0)) if s > 0 else 0.0
    else:
        k = float(schedule.shift)  # type: ignore[arg-type]

        def shift(s: float) -> float:
            return k * s / (1.0 + (k - 1.0) * s)
    last = shift(flow_match_times(schedule, steps)[-1])
    if schedule.shift_terminal is None or last >= 1.0:  # a lone sigma of 1 has nothing to stretch
        return shift
    factor = (1.0 - last) / (1.0 - schedule.shift_terminal)
    return lambda t: 1.0 - (1.0 - shift(t)) / factor


def flow_match_sigmas(schedule: FlowMatchSchedule, steps: int, seq_len: int | None = None) -> list[float]:
    """Sigmas of each step followed by the terminal 0 (length ``steps + 1``)."""
    warp = flow_match_warp(schedule, steps, seq_len)
    return [warp(t) for t in flow_match_times(schedule, steps)] + [0.0]


def flow_match_compressed(schedule: FlowMatchSchedule, steps: int, seq_len: int | None, point: int,
                          count: int) -> list[float]:
    """The walk's sigmas up to its point ``point``, then ``count`` points from there to the terminal 0 evenly spaced
    in the schedule's time before its warp (``flow_match_times`` with 0 after the last) and warped as the walk's own
    points are: MixGRPO-Flash's fewer, larger ODE steps after its window. The points up to ``point`` are the walk's
    own, so the steps before it don't change."""
    if count < 2 or not 0 <= point < steps:
        raise ValueError(f"compressing needs 2 or more points from a point before the terminal, got {count} from "
                         f"{point} of {steps} steps")
    warp = flow_match_warp(schedule, steps, seq_len)
    sigmas = flow_match_sigmas(schedule, steps, seq_len)
    start = flow_match_times(schedule, steps)[point]
    tail = [warp(start * (count - 1 - j) / (count - 1)) for j in range(1, count - 1)]
    return sigmas[:point + 1] + tail + [0.0]
