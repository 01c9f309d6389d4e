"""Turn a phase's schedule into concrete steps: timesteps, sigmas, and the stepper that walks them."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..spec import FlowMatchSchedule, SchedulerSchedule, SpecError, flow_match_sigmas
from ..spec.schedule import SHARED_SCHEDULES, dynamic_mu, flow_match_compressed
from .samplers import EulerStepper, SchedulerStepper, Stepper

# Schedulers whose ``step`` is the plain Euler step on their own sigmas, so a stochastic sampler can take
# any of their steps in its place without desynchronising the scheduler (multistep solvers keep history).
EULER_SCHEDULERS = ("FlowMatchEulerDiscreteScheduler",)
# Schedulers whose ``step`` takes a model output that is not a velocity (PiFlow's several grid predictions per
# channel, which its policy integrates): no Euler or SDE step can take one of their steps, whatever the sampler asks.
POLICY_SCHEDULERS = ("PiflowScheduler",)


@dataclass
class Steps:
    """A walk over a schedule: ``timesteps[i]`` in the denoiser's units (sigma * T for flow matching) and
    ``sigmas`` (float32, terminal included, so ``len(sigmas) == len(timesteps) + 1``)."""

    timesteps: torch.Tensor
    sigmas: torch.Tensor
    num_train_timesteps: int
    scheduler: Any | None = None  # a fresh copy for this walk (kind ``scheduler``), else None
    # Streams on sigmas of their own, one per entry of ``sigmas`` (``Family.stream_sigmas``); the others walk ``sigmas``.
    stream_sigmas: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.timesteps)

    def target(self, i: int) -> torch.Tensor:
        """The timestep step ``i`` lands on: the next step's, 0 after the last (what a flow map takes)."""
        return self.timesteps[i + 1] if i + 1 < len(self.timesteps) else torch.zeros_like(self.timesteps[i])

    @property
    def step_sigmas(self) -> list[float]:
        """The sigma each step starts from."""
        return self.sigmas[:-1].tolist()

    def stepper(self, streams: Sequence[str], begin: int) -> Stepper:
        """The deterministic stepper of this walk, positioned at step ``begin``."""
        if self.scheduler is None:
            return EulerStepper(self.sigmas, self.stream_sigmas)
        stepper = SchedulerStepper(self.scheduler, self.timesteps, streams)
        stepper.start_at(begin)
        return stepper

    def check_own_sigmas(self, where: str) -> None:
        """A scheduler's own ``step`` walks its one schedule: streams on sigmas of their own need Euler steps."""
        if self.scheduler is not None and self.stream_sigmas:
            raise SpecError.single(f"stream(s) {', '.join(self.stream_sigmas)} walk sigmas of their own, which "
                                   f"{type(self.scheduler).__name__}.step cannot take: use a flow_match schedule", where)

    def check_velocity(self, where: str) -> None:
        """Refuse replacing this walk's steps by Euler or SDE steps when its model output is no velocity."""
        name = type(self.scheduler).__name__
        if self.scheduler is not None and name in POLICY_SCHEDULERS:
            raise SpecError.single(f"stochastic samplers step a velocity, but the model a {name} walks predicts "
                                   "what only that scheduler's own step takes (a distilled policy's grid points); "
                                   "rollouts need an undistilled checkpoint", where)

    def check_stochastic(self, where: str) -> None:
        """Stochastic samplers replace steps with SDE steps on these sigmas: fine for Euler walks only."""
        if self.scheduler is not None and type(self.scheduler).__name__ not in EULER_SCHEDULERS:
            raise SpecError.single(
                f"stochastic samplers step the schedule's sigmas with their own SDE; {type(self.scheduler).__name__}"
                " is a multistep solver whose state the SDE steps would desynchronise (use a flow_match schedule "
                f"or a {' / '.join(EULER_SCHEDULERS)})", where)


def resolve_steps(
    schedule: FlowMatchSchedule | SchedulerSchedule,
    steps: int,
    seq_len: int,
    components: dict[str, Any],
    device: torch.device,
) -> Steps:
    """The walk over ``schedule`` for a request of ``steps`` steps (``seq_len``: image tokens, for dynamic shift)."""
    return SHARED_SCHEDULES.implementation(schedule).steps(schedule, steps, seq_len, components, device)


class FlowMatchWalk:
    """omnispec's flow-matching schedule: ``flow_match_sigmas`` (the same pure function explain shows) as tensors,
    timesteps ``1000 sigma``, Euler steps."""

    def steps(self, schedule: FlowMatchSchedule, steps: int, seq_len: int, components: dict[str, Any],
              device: torch.device) -> Steps:
        return self._steps(flow_match_sigmas(schedule, self._count(schedule, steps), seq_len), device)

    def compressed(self, schedule: FlowMatchSchedule, steps: int, seq_len: int, point: int, count: int,
                   device: torch.device) -> Steps:
        """The walk ``steps`` makes, up to its point ``point``, then ``count`` points to 0 on the schedule's own time
        warp (``flow_match_compressed``): the same sigmas and timesteps up to there."""
        n = self._count(schedule, steps)
        return self._steps(flow_match_compressed(schedule, n, seq_len, point, count), device)

    @staticmethod
    def _count(schedule: FlowMatchSchedule, steps: int) -> int:
        return len(schedule.sigmas) if schedule.sigmas is not None else (schedule.steps or steps)

    @staticmethod
    def _steps(sigmas: list[float], device: torch.device) -> Steps:
        tensor = torch.tensor(sigmas, dtype=torch.float32, device=device)
        return Steps(tensor[:-1] * 1000.0, tensor, 1000)


class SchedulerWalk:
    """A scheduler component's own ``set_timesteps`` and ``step``."""

    def steps(self, schedule: SchedulerSchedule, steps: int, seq_len: int, components: dict[str, Any],
              device: torch.device) -> Steps:
        return _scheduler_steps(schedule, schedule.steps or steps, seq_len, components, device)

    def compressed(self, schedule: SchedulerSchedule, steps: int, seq_len: int, point: int, count: int,
                   device: torch.device) -> Steps:
        raise SpecError.single("compressing the steps after the window needs the schedule's time warp, which "
                               f"omnispec knows for flow_match schedules, not for scheduler component "
                               f"{schedule.component!r}'s own set_timesteps: use a flow_match schedule, or compress: 1",
                               "sampler.outside_window.compress")


class SegmentWalk:
    """A segment walks the schedule it names, shared with the other segments (``phases.group_steps`` owns the steps
    out to each); it makes no steps of its own."""

    def steps(self, schedule: Any, steps: int, seq_len: int, components: dict[str, Any], device: torch.device) -> Steps:
        raise ValueError("a segment's steps are its shared schedule's (phases.group_steps)")


FLOW_MATCH, SCHEDULER, SEGMENT = FlowMatchWalk(), SchedulerWalk(), SegmentWalk()


def _scheduler_steps(
    schedule: SchedulerSchedule, steps: int, seq_len: int, components: dict[str, Any], device: torch.device
) -> Steps:
    """A fresh copy of the scheduler component per walk: schedulers keep state between steps."""
    base = components[schedule.component]
    scheduler = base.__class__.from_config({**dict(base.config), **schedule.config}) if schedule.config else copy.deepcopy(base)
    kwargs: dict[str, Any] = {}
    config = scheduler.config
    if config.get("use_dynamic_shifting", False) and "mu" in inspect.signature(scheduler.set_timesteps).parameters:
        flow = FlowMatchSchedule(
            kind="flow_match", shift="dynamic",
            base_shift=config.get("base_shift", 0.5), max_shift=config.get("max_shift", 1.16),
            base_seq_len=config.get("base_image_seq_len", 256), max_seq_len=config.get("max_image_seq_len", 4096),
        )
        kwargs["mu"] = dynamic_mu(flow, seq_len)
    if schedule.sigmas is not None:
        if "sigmas" not in inspect.signature(scheduler.set_timesteps).parameters:
            raise SpecError.single(f"{type(scheduler).__name__}.set_timesteps takes no sigmas, so this walk can't "
                                   "start from given ones", "request.sigmas")
        kwargs["sigmas"] = [float(s) for s in schedule.sigmas]
        steps = len(schedule.sigmas)
    scheduler.set_timesteps(steps, device=device, **kwargs)
    timesteps = scheduler.timesteps
    T = int(config.get("num_train_timesteps", 1000))
    own = getattr(scheduler, "sigmas", None)
    if own is not None and len(own) > len(timesteps):
        sigmas = own[: len(timesteps) + 1].to(device=device, dtype=torch.float32)
    else:
        sigmas = torch.cat([timesteps.to(device, torch.float32) / T, torch.zeros(1, device=device)])
    return Steps(timesteps, sigmas, T, scheduler)
