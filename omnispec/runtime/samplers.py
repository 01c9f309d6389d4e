"""Steppers: turn (state, prediction, step index) into the next state, for every latent stream.

One stepper per walk. ``EulerStepper`` is omnispec's flow-matching ODE step; ``SchedulerStepper`` defers to
a diffusers scheduler's ``step`` (one copy per stream: multistep schedulers keep per-stream history);
``StochasticStepper`` runs a spec's SDE on the steps of its window and scores them. A stepper returns a
``StepResult`` so that stochastic steps can add their log-probability, mean and std.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..spec import SpecError
from .families import Streams


@dataclass
class StepResult:
    next: Streams
    log_prob: torch.Tensor | None = None  # (B,) float32: the sum of the streams' log-probs
    stream_log_probs: dict[str, torch.Tensor] | None = None  # (B,) per stream
    mean: Streams | None = None  # float32
    std: dict[str, torch.Tensor] | None = None  # (B,) per stream


class Stepper(Protocol):
    def step(self, x: Streams, pred: Streams, i: int) -> StepResult: ...


def euler(x: torch.Tensor, pred: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
    """``x + dt * v`` in float32 (diffusers' FlowMatchEulerDiscreteScheduler arithmetic)."""
    return x.to(torch.float32) + dt * pred.to(torch.float32)


class EulerStepper:
    """``x_next = x + (sigma_next - sigma) * v`` per stream, cast back to the stream's dtype (as diffusers)."""

    def __init__(self, sigmas: torch.Tensor):
        self.sigmas = sigmas.to(torch.float32)

    def step(self, x: Streams, pred: Streams, i: int) -> StepResult:
        dt = self.sigmas[i + 1] - self.sigmas[i]
        return StepResult({s: euler(x[s], pred[s], dt).to(x[s].dtype) for s in x})


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One SDE step of one stream in float32: ``(sample, log_prob, mean, std)``. The mean and std of ``x_next``
    follow from the prediction; then either a draw (``noise``) or the log-prob of a given ``sample`` (replay).
    ``sigma``/``sigma_next`` are per-row tensors shaped to broadcast; ``sigma_guard`` replaces sigma = 1 in
    Flow-GRPO's ``1 - sigma``.

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
    return sample, gaussian_log_prob(sample, mean, std), mean, std.flatten()


# A sample's SDE noise comes from its seed plus this offset, so it never repeats its initial noise.
SDE_SEED_OFFSET = 1 << 31


def sde_generators(seeds: list[int], device: torch.device | str) -> list[torch.Generator]:
    """One SDE-noise generator per sample, on the device the latents live on: drawing on the host was the
    largest host-side cost of a GPU rollout (8.4 M normals per step at 128 x 512²). Streams therefore differ
    between devices; replay never redraws noise, so log-prob ratios don't depend on it."""
    return [torch.Generator(device).manual_seed(s + SDE_SEED_OFFSET) for s in seeds]


class StochasticStepper:
    """Euler steps, except where ``mask[b, i]`` marks a stochastic step of sample ``b``: there the spec's SDE
    runs with that sample's own generator (drawing each stream's noise in stream order), and the result
    carries log-probs, means and stds. States stay float32, whatever the latents' dtype: a log-prob scores
    exactly the sample that is stored and stepped on."""

    def __init__(self, sampler: Any, sigmas: torch.Tensor, mask: torch.Tensor, generators: list[torch.Generator]):
        self.spec, self.sigmas, self.mask, self.generators = sampler, sigmas.to(torch.float32), mask, generators
        self.guard = self.sigmas[1] if len(self.sigmas) > 2 else self.sigmas[0]

    def step(self, x: Streams, pred: Streams, i: int) -> StepResult:
        dt = self.sigmas[i + 1] - self.sigmas[i]
        ode = {s: euler(x[s], pred[s], dt) for s in x}
        rows = self.mask[:, i]
        if not bool(rows.any()):
            return StepResult(ode)
        # Only samples in their window draw noise, each from its own generator: a sample's stream never
        # depends on its batch-mates' windows. Draws happen where the generators live (see sde_generators).
        picked = torch.nonzero(rows).flatten().tolist()
        noise = {s: torch.zeros(x[s].shape, dtype=torch.float32, device=self.generators[0].device) for s in x}
        for b in picked:
            for s in x:
                noise[s][b] = torch.randn(x[s].shape[1:], generator=self.generators[b], device=noise[s].device,
                                          dtype=torch.float32)
        sde = self._sde(x, pred, i, noise=noise)
        for s in x:
            keep = rows.to(x[s].device).reshape(-1, *[1] * (x[s].ndim - 1))
            sde.next[s] = torch.where(keep, sde.next[s], ode[s])
        return sde

    def score(self, x: Streams, pred: Streams, i: int, sample: Streams) -> StepResult:
        """The log-prob of given next states (replay): the same arithmetic as ``step``, no draw."""
        return self._sde(x, pred, i, sample=sample)

    def _sde(self, x: Streams, pred: Streams, i: int, *, noise: Mapping[str, torch.Tensor] | None = None,
             sample: Streams | None = None) -> StepResult:
        result = StepResult({}, stream_log_probs={}, mean={}, std={})
        for s in x:
            shape = (-1, *[1] * (x[s].ndim - 1))
            device = x[s].device
            sigma = self.sigmas[i].to(device).expand(x[s].shape[0]).reshape(shape)
            sigma_next = self.sigmas[i + 1].to(device).expand(x[s].shape[0]).reshape(shape)
            out, lp, mean, std = stochastic_step(
                self.spec, x[s], pred[s], sigma, sigma_next, self.guard.to(device),
                noise=None if noise is None else noise[s].to(device),
                sample=None if sample is None else sample[s].to(device))
            result.next[s] = out
            result.stream_log_probs[s], result.mean[s], result.std[s] = lp, mean, std  # type: ignore[index]
        result.log_prob = sum(result.stream_log_probs.values())  # type: ignore[union-attr, assignment]
        return result


def window_mask(sampler: Any, steps: int, group_ids: torch.Tensor, seed: int, start: int = 0) -> torch.Tensor:
    """(B, steps) bool: which steps are stochastic for each sample. Steps before ``start`` never run (a walk
    that begins late: re-noising, image strength), so no window may use them."""
    b = len(group_ids)
    last = steps - 1 if sampler.kind == "cps" else steps  # CPS's final step has std 0: it stays deterministic
    window = sampler.window
    mask = torch.zeros(b, steps, dtype=torch.bool)
    if window.kind == "all":
        mask[:, start:last] = True
        return mask
    if window.length > last - start:
        raise SpecError.single(f"window length {window.length} exceeds the {last - start} usable steps", "sampler.window")
    if window.kind == "fixed":
        if window.start < start:
            raise SpecError.single(f"window starts at step {window.start}, before step {start}, the first that runs",
                                   "sampler.window")
        if window.start + window.length > last:
            raise SpecError.single(f"window {window.start}+{window.length} runs past step {last - 1}", "sampler.window")
        mask[:, window.start:window.start + window.length] = True
        return mask
    low, high = max(window.low, start), min(window.high, last - window.length)
    if low > high:
        raise SpecError.single(f"no room for a {window.length}-step window in [{window.low}, {window.high}]",
                               "sampler.window")
    gen = torch.Generator().manual_seed(window.seed * 1_000_003 + seed)
    # ``group_ids`` are global ids (sample ids for scope "sample"), so a shard of a batch draws the same
    # windows its samples get in the whole batch: draws are a prefix-consistent sequence.
    draws = 1 if window.scope == "batch" else int(group_ids.max()) + 1
    starts = torch.randint(low, high + 1, (draws,), generator=gen)
    for row in range(b):
        first = int(starts[0 if window.scope == "batch" else int(group_ids[row])])
        mask[row, first:first + window.length] = True
    return mask
