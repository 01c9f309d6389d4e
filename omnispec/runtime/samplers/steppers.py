"""Deterministic steppers: omnispec's flow-matching Euler step, or a diffusers scheduler's own ``step``; and the
``StepResult`` every stepper returns.

One stepper per walk. ``EulerStepper`` is omnispec's flow-matching ODE step; ``SchedulerStepper`` defers to a
diffusers scheduler's ``step`` (one copy per stream: multistep schedulers keep per-stream history). A stepper returns
a ``StepResult`` so that stochastic steps (``stochastic.py``) can add their log-probability, mean and std.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..families import Streams


@dataclass
class StepResult:
    next: Streams
    log_prob: torch.Tensor | None = None  # (B,) float32: the sum of the streams' log-probs
    stream_log_probs: dict[str, torch.Tensor] | None = None  # (B,) per stream
    mean: Streams | None = None  # float32: the mean of the transition to ``next``
    std: dict[str, torch.Tensor] | None = None  # (B,) per stream: the std of the transition
    std_t: dict[str, torch.Tensor] | None = None  # (B,) per stream: Flow-GRPO's std_dev_t (see ``Transition``)
    x0: Streams | None = None  # float32 clean-sample estimate ``x - sigma v`` (a walk's last step, on request)


class Stepper(Protocol):
    def step(self, x: Streams, pred: Streams, i: int) -> StepResult: ...


def euler(x: torch.Tensor, pred: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
    """``x + dt * v`` in float32 (diffusers' FlowMatchEulerDiscreteScheduler arithmetic)."""
    return x.to(torch.float32) + dt * pred.to(torch.float32)


class EulerStepper:
    """``x_next = x + (sigma_next - sigma) * v`` per stream, cast back to the stream's dtype (as diffusers)."""

    def __init__(self, sigmas: torch.Tensor, stream_sigmas: dict[str, torch.Tensor] | None = None):
        self.sigmas = sigmas.to(torch.float32)
        self.stream_sigmas = {s: v.to(torch.float32) for s, v in (stream_sigmas or {}).items()}

    def step(self, x: Streams, pred: Streams, i: int) -> StepResult:
        out = {}
        for s in x:
            sigmas = self.stream_sigmas.get(s, self.sigmas)
            out[s] = euler(x[s], pred[s], sigmas[i + 1] - sigmas[i]).to(x[s].dtype)
        return StepResult(out)


class SchedulerStepper:
    """A diffusers scheduler's own ``step``, one scheduler state per stream."""

    def __init__(self, scheduler: Any, timesteps: torch.Tensor, streams: Sequence[str]):
        self.schedulers = {s: scheduler if k == 0 else copy.deepcopy(scheduler) for k, s in enumerate(streams)}
        self.timesteps = timesteps

    def start_at(self, begin: int) -> None:
        for scheduler in self.schedulers.values():
            if hasattr(scheduler, "set_begin_index"):
                scheduler.set_begin_index(begin)

    def step(self, x: Streams, pred: Streams, i: int) -> StepResult:
        return StepResult({s: self.schedulers[s].step(pred[s], self.timesteps[i], x[s], return_dict=False)[0]
                           for s in x})


__all__ = ["EulerStepper", "SchedulerStepper", "StepResult", "Stepper", "euler"]
