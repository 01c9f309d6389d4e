"""Turn a phase's schedule into concrete steps: timesteps, sigmas and the sampler that walks them."""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from ..spec import FlowMatchSchedule, SchedulerSchedule, flow_match_sigmas
from ..spec.schedule import dynamic_mu
from .samplers import EulerSampler, Sampler, SchedulerSampler


@dataclass
class Steps:
    """A walk over a schedule: ``timesteps[i]`` in the denoiser's units (sigma * T for flow matching)."""

    timesteps: torch.Tensor
    sigmas: list[float]  # one per step (the sigma the step starts from)
    num_train_timesteps: int
    sampler: Sampler
    scheduler: Any | None = None

    def __len__(self) -> int:
        return len(self.timesteps)

    @property
    def euler_sigmas(self) -> torch.Tensor:
        """The float32 sigmas (terminal included) an Euler walk steps through."""
        return self.sampler.sigmas

    def start_at(self, begin: int) -> None:
        if self.scheduler is not None and hasattr(self.scheduler, "set_begin_index"):
            self.scheduler.set_begin_index(begin)


def resolve_steps(
    schedule: FlowMatchSchedule | SchedulerSchedule,
    steps: int,
    seq_len: int,
    components: dict[str, Any],
    device: torch.device,
) -> Steps:
    if isinstance(schedule, FlowMatchSchedule):
        n = len(schedule.sigmas) if schedule.sigmas is not None else (schedule.steps or steps)
        sigmas = torch.tensor(flow_match_sigmas(schedule, n, seq_len), dtype=torch.float32, device=device)
        return Steps(sigmas[:-1] * 1000.0, sigmas[:-1].tolist(), 1000, EulerSampler(sigmas))
    return _scheduler_steps(schedule, schedule.steps or steps, seq_len, components, device)


def _scheduler_steps(
    schedule: SchedulerSchedule, steps: int, seq_len: int, components: dict[str, Any], device: torch.device
) -> Steps:
    """A fresh copy of the scheduler component per request: schedulers keep state between steps."""
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
    scheduler.set_timesteps(steps, device=device, **kwargs)
    timesteps = scheduler.timesteps
    if hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(0)
    T = int(config.get("num_train_timesteps", 1000))
    if getattr(scheduler, "sigmas", None) is not None and len(scheduler.sigmas) >= len(timesteps):
        sigmas = [float(s) for s in scheduler.sigmas[: len(timesteps)]]
    else:
        sigmas = [float(t) / T for t in timesteps]
    return Steps(timesteps, sigmas, T, SchedulerSampler(scheduler, timesteps), scheduler)
