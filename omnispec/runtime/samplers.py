"""Samplers: turn (x, prediction, step) into the next x. One object per phase run.

``EulerSampler`` is omnispec's flow-matching ODE step; ``SchedulerSampler`` defers to a diffusers
scheduler's ``step`` (Wan's UniPC, or any scheduler a spec names). A sampler returns a ``StepResult``
so that stochastic samplers can add the step's log-probability, mean and std.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..spec import SpecError


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


# ---- stochastic steps (RL rollouts) --------------------------------------------------------------------

def gaussian_log_prob(sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """log N(sample; mean, std^2) per element, averaged over every non-batch dimension (float32)."""
    std = std.to(torch.float32)
    lp = -((sample.detach().float() - mean.float()) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    return lp.mean(dim=tuple(range(1, lp.ndim)))


def stochastic_step(
    sampler: Any,
    x: torch.Tensor,
    pred: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    sigma_guard: torch.Tensor,
    noise: torch.Tensor | None = None,
    sample: torch.Tensor | None = None,
) -> StepResult:
    """One SDE step in float32: the mean and std of ``x_next`` given the prediction, then either a draw
    (``noise``) or the log-prob of a given ``sample`` (replay). ``sigma``/``sigma_next`` are per-row
    tensors shaped to broadcast; ``sigma_guard`` replaces sigma = 1 in Flow-GRPO's ``1 - sigma``.

    - ``sde`` (Flow-GRPO): ``std_t = eta * sqrt(sigma / (1 - sigma))``, ``dt = sigma_next - sigma``,
      ``mean = x (1 + std_t^2 dt / (2 sigma)) + v (1 + std_t^2 (1 - sigma) / (2 sigma)) dt``,
      ``std = std_t sqrt(-dt)``.
    - ``cps``: ``x0 = x - sigma v``, ``x1 = x + (1 - sigma) v``, ``std = sigma_next sin(eta pi / 2)``,
      ``mean = (1 - sigma_next) x0 + sqrt(sigma_next^2 - std^2) x1``.
    - ``dance_sde``: ``std = eta sqrt(sigma - sigma_next)``, ``mean = x + v dt - eta^2 / 2 * score * dt``
      with ``score = -(x - (1 - sigma) x0) / sigma^2``.
    """
    x32, v = x.to(torch.float32), pred.to(torch.float32)
    dt = sigma_next - sigma
    if sampler.kind == "sde":
        std_t = torch.sqrt(sigma / (1 - torch.where(sigma >= 1, sigma_guard, sigma))) * sampler.noise_level
        mean = x32 * (1 + std_t**2 / (2 * sigma) * dt) + v * (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * dt
        std = std_t * torch.sqrt(-dt)
    elif sampler.kind == "cps":
        std = sigma_next * math.sin(sampler.noise_level * math.pi / 2)
        x0, x1 = x32 - sigma * v, x32 + (1 - sigma) * v
        mean = x0 * (1 - sigma_next) + x1 * torch.sqrt(sigma_next**2 - std**2)
    elif sampler.kind == "dance_sde":
        std = sampler.eta * torch.sqrt(-dt)
        x0 = x32 - sigma * v
        score = -(x32 - x0 * (1 - sigma)) / sigma**2
        mean = x32 + dt * v - 0.5 * sampler.eta**2 * score * dt
    else:
        raise ValueError(f"not a stochastic sampler: {sampler.kind!r}")
    std = torch.as_tensor(std, dtype=torch.float32, device=mean.device).expand(mean.shape[0], *[1] * (mean.ndim - 1))
    if sample is None:
        assert noise is not None
        sample = mean + std * noise.to(torch.float32)
    return StepResult(sample.to(x.dtype) if noise is not None else sample, gaussian_log_prob(sample, mean, std),
                      mean, std.flatten())


# A sample's SDE noise comes from its seed plus this offset, so it never repeats its initial noise.
SDE_SEED_OFFSET = 1 << 31


def sde_generators(seeds: list[int], device: torch.device | str) -> list[torch.Generator]:
    """One SDE-noise generator per sample, on the device the latents live on: drawing on the host was the
    largest host-side cost of a GPU rollout (8.4 M normals per step at 128 x 512²). Streams therefore differ
    between devices; replay never redraws noise, so log-prob ratios don't depend on it."""
    return [torch.Generator(device).manual_seed(s + SDE_SEED_OFFSET) for s in seeds]


class StochasticSampler:
    """Euler steps, except where ``mask[b, i]`` marks a stochastic step of sample ``b``: there the spec's
    SDE runs with that sample's own generator, and the result carries log-prob, mean and std."""

    def __init__(self, sampler: Any, sigmas: torch.Tensor, mask: torch.Tensor, generators: list[torch.Generator]):
        self.spec, self.sigmas, self.mask, self.generators = sampler, sigmas.to(torch.float32), mask, generators
        self.euler = EulerSampler(sigmas)
        self.guard = self.sigmas[1] if len(self.sigmas) > 2 else self.sigmas[0]

    def step(self, x: torch.Tensor, pred: torch.Tensor, i: int) -> StepResult:
        ode = self.euler.step(x, pred, i)
        rows = self.mask[:, i]
        if not bool(rows.any()):
            return ode
        # Only samples in their window draw noise, each from its own generator: a sample's stream never
        # depends on its batch-mates' windows. Draws happen where the generators live (see sde_generators).
        noise = torch.zeros(x.shape, dtype=torch.float32, device=self.generators[0].device)
        for b in torch.nonzero(rows).flatten().tolist():
            noise[b] = torch.randn(x.shape[1:], generator=self.generators[b], device=noise.device, dtype=torch.float32)
        noise = noise.to(x.device)
        shape = (-1, *[1] * (x.ndim - 1))
        sigma = self.sigmas[i].expand(x.shape[0]).reshape(shape)
        sigma_next = self.sigmas[i + 1].expand(x.shape[0]).reshape(shape)
        sde = stochastic_step(self.spec, x, pred, sigma, sigma_next, self.guard, noise=noise)
        keep = rows.to(x.device).reshape(shape)
        return StepResult(torch.where(keep, sde.next, ode.next), sde.log_prob, sde.mean, sde.std)


def window_mask(sampler: Any, steps: int, group_ids: torch.Tensor, seed: int) -> torch.Tensor:
    """(B, steps) bool: which steps are stochastic for each sample."""
    b = len(group_ids)
    last = steps - 1 if sampler.kind == "cps" else steps  # CPS's final step has std 0: it stays deterministic
    window = sampler.window
    mask = torch.zeros(b, steps, dtype=torch.bool)
    if window.kind == "all":
        mask[:, :last] = True
        return mask
    if window.length > last:
        raise SpecError.single(f"window length {window.length} exceeds the {last} usable steps", "sampler.window")
    if window.kind == "fixed":
        if window.start + window.length > last:
            raise SpecError.single(f"window {window.start}+{window.length} runs past step {last - 1}", "sampler.window")
        mask[:, window.start:window.start + window.length] = True
        return mask
    high = min(window.high, last - window.length)
    if window.low > high:
        raise SpecError.single(f"no room for a {window.length}-step window in [{window.low}, {window.high}]",
                               "sampler.window")
    gen = torch.Generator().manual_seed(window.seed * 1_000_003 + seed)
    # ``group_ids`` are global ids (sample ids for scope "sample"), so a shard of a batch draws the same
    # windows its samples get in the whole batch: draws are a prefix-consistent sequence.
    draws = 1 if window.scope == "batch" else int(group_ids.max()) + 1
    starts = torch.randint(window.low, high + 1, (draws,), generator=gen)
    for row in range(b):
        start = int(starts[0 if window.scope == "batch" else int(group_ids[row])])
        mask[row, start:start + window.length] = True
    return mask


