"""Samplers: turn (x, prediction, step) into the next x. One object per phase run.

``EulerSampler`` is omnispec's flow-matching ODE step; ``SchedulerSampler`` defers to a diffusers
scheduler's ``step`` (Wan's UniPC, or any scheduler a spec names). A sampler returns a ``StepResult``
so that stochastic samplers can add the step's log-probability, mean and std.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class StepResult:
    next: torch.Tensor
    log_prob: torch.Tensor | None = None
    mean: torch.Tensor | None = None
    std: torch.Tensor | None = None


class Sampler(Protocol):
    def step(self, x: torch.Tensor, pred: torch.Tensor, i: int) -> StepResult: ...


class EulerSampler:
    """``x_next = x + (sigma_next - sigma) * v`` in float32, cast back to the latents' dtype (as diffusers)."""

    def __init__(self, sigmas: torch.Tensor):
        self.sigmas = sigmas.to(torch.float32)

    def step(self, x: torch.Tensor, pred: torch.Tensor, i: int) -> StepResult:
        dt = self.sigmas[i + 1] - self.sigmas[i]
        return StepResult((x.to(torch.float32) + dt * pred.to(torch.float32)).to(x.dtype))


class SchedulerSampler:
    def __init__(self, scheduler: Any, timesteps: torch.Tensor):
        self.scheduler = scheduler
        self.timesteps = timesteps

    def step(self, x: torch.Tensor, pred: torch.Tensor, i: int) -> StepResult:
        out = self.scheduler.step(pred, self.timesteps[i], x, return_dict=False)[0]
        return StepResult(out)
