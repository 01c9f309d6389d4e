"""Stochastic steps (RL rollouts): the window of steps that draw noise, the stepper that runs a sampler kind's SDE
there and scores it, and the Gaussian log-probs. Each sampler kind's transition is in its own file (``sde.py``,
``cps.py``, ``dance_sde.py``), looked up through ``spec.recipe.SAMPLERS``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...spec import SpecError
from ...spec.recipe import SAMPLERS
from ..families import Streams
from .steppers import StepResult, euler

# log N(x; mu, s^2) = -(x - mu)^2 / (2 s^2) - log s - HALF_LOG_2PI (the float32 value of log sqrt(2 pi))
HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


@dataclass
class Transition:
    """One stochastic step of one stream, all float32 and ``(B,)`` for the per-row values.

    ``std`` is the std of the transition ``x -> sample``; ``std_t`` is the coefficient Flow-GRPO returns as
    ``std_dev_t`` and divides its KL term by: for ``sde`` the noise scale before the ``sqrt(sigma -
    sigma_next)`` factor, ``noise_level * sqrt(sigma / (1 - sigma))``; for ``dance_sde`` likewise, ``eta``;
    for ``cps``, which has no such factor, the transition std itself."""

    sample: torch.Tensor
    log_prob: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    std_t: torch.Tensor


def gaussian_log_prob(sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """log N(sample; mean, std^2) per element, averaged over every non-batch dimension (float32)."""
    std = std.to(torch.float32)
    lp = -((sample.detach().float() - mean.float()) ** 2) / (2 * std**2) - torch.log(std) - HALF_LOG_2PI
    return row_means(lp)


def squared_error_log_prob(sample: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """``-(sample - mean)^2`` averaged over every non-batch dimension: the Gaussian log-density with every
    constant removed, as Flow-GRPO and Flow-CPS score CPS steps (finite where the std is 0)."""
    lp = -((sample.detach().float() - mean.float()) ** 2)
    return row_means(lp)


def row_means(values: torch.Tensor) -> torch.Tensor:
    """Each row's mean over its non-batch elements, every row reduced on its own: a CUDA reduction over a batch
    splits its work by the batch's size, so a row's last bit depended on how many rows were scored with it, and a
    replay in another micro-batch than its rollout's read log-probs one float32 ulp off (BENCHMARKS.md, "Replay
    exactness"). A row
    alone, copied to a fresh buffer (its layout and alignment, so its vectorized loads, no longer depend on its place
    in the batch, nor on whether the sample is a slice of a stored rollout or a fresh draw), is reduced the same way
    in a rollout and in any replay; the batch is one micro-batch, so the launches per row cost little beside the
    denoiser."""
    flat = values.reshape(values.shape[0], -1)
    if not len(flat):
        return flat.mean(dim=1)
    return torch.stack([row.clone().mean() for row in flat])


def stochastic_step(
    sampler: Any,
    x: torch.Tensor,
    pred: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    sigma_guard: torch.Tensor,
    noise: torch.Tensor | None = None,
    sample: torch.Tensor | None = None,
) -> Transition:
    """One stochastic step of one stream in float32: the sampler kind's transition (mean and std from the
    prediction ``v``, its file says the formulas), then either a draw (``noise``) or the log-prob of a given
    ``sample`` (replay). ``sigma`` and ``sigma_next`` are per-row tensors shaped to broadcast; ``sigma_guard``
    replaces sigma = 1 in ``1 - sigma`` (Flow-GRPO takes the schedule's second sigma: 0 for a one-step schedule).
    Log-probs are averaged over every non-batch element, as the official trainers do."""
    kind = SAMPLERS.implementation(sampler)
    if not kind.stochastic:
        raise ValueError(f"not a stochastic sampler: {sampler.kind!r}")
    mean, std, std_t = kind.transition(sampler, x.to(torch.float32), pred.to(torch.float32), sigma, sigma_next,
                                       sigma_guard)
    rows = (mean.shape[0], *[1] * (mean.ndim - 1))
    std = torch.as_tensor(std, dtype=torch.float32, device=mean.device).expand(rows)
    std_t = torch.as_tensor(std_t, dtype=torch.float32, device=mean.device).expand(rows)
    if sample is None:
        if noise is None:
            raise ValueError("stochastic_step needs the noise to draw with, or the sample to score")
        sample = mean + std * noise.to(torch.float32)
    return Transition(sample, kind.log_prob(sampler, sample, mean, std), mean, std.flatten(), std_t.flatten())


# A sample's SDE noise comes from its seed plus this offset, so it never repeats its initial noise.
SDE_SEED_OFFSET = 1 << 31


def sde_generators(seeds: list[int], device: torch.device | str) -> list[torch.Generator]:
    """One SDE-noise generator per sample, on the device the latents live on (a draw on the host per step
    and sample costs more than the step on a GPU). Streams therefore differ between devices; replay never
    redraws noise, so log-prob ratios don't depend on it."""
    return [torch.Generator(device).manual_seed(s + SDE_SEED_OFFSET) for s in seeds]


def reused_steps(sampler: Any, window: torch.Tensor, begin: int = 0, phase_starts: Sequence[int] = ()) -> set[int]:
    """The steps outside the window (``window[i]``: some sample is stochastic at step ``i``) that reuse the last
    computed prediction under ``sampler.outside_window.compute_every = k``: in each run of outside steps (a run
    restarts after a window step, at ``begin`` and at every phase start), the first step and every k-th after
    it compute; the others reuse."""
    k = sampler.outside_window.compute_every
    reused: set[int] = set()
    if k == 1:
        return reused
    position = 0
    for i in range(begin, len(window)):
        fresh = i == begin or i in phase_starts or bool(window[i]) or bool(window[i - 1])
        position = 0 if fresh else position + 1
        if not bool(window[i]) and position % k:
            reused.add(i)
    return reused


class StochasticStepper:
    """Euler steps, except where ``mask[b, i]`` marks a stochastic step of sample ``b``: there the spec's SDE
    runs with that sample's own generator (drawing each stream's noise in stream order), and the result
    carries log-probs, means and stds. States stay float32, whatever the latents' dtype: a log-prob scores
    exactly the sample that is stored and stepped on.

    ``reuses(i)`` tells the loop which steps outside the window may reuse the last prediction (the sampler's
    ``outside_window``); on the walk's last step the result carries the clean-sample estimate ``x0`` when the
    sampler decodes it."""

    def __init__(self, sampler: Any, sigmas: torch.Tensor, mask: torch.Tensor, generators: list[torch.Generator],
                 *, begin: int = 0, phase_starts: Sequence[int] = (),
                 stream_sigmas: Mapping[str, torch.Tensor] | None = None):
        self.spec, self.sigmas, self.mask, self.generators = sampler, sigmas.to(torch.float32), mask, generators
        # Streams on sigmas of their own (``Family.stream_sigmas``), each with its own guard.
        self.stream_sigmas = {s: v.to(torch.float32) for s, v in (stream_sigmas or {}).items()}
        # Flow-GRPO's guard for sigma = 1: the schedule's second sigma (the terminal 0 for a one-step schedule).
        self.guard = self.sigmas[1]
        window = mask.any(0) if mask.numel() else torch.zeros(len(self.sigmas) - 1, dtype=torch.bool)
        self.reused = reused_steps(sampler, window, begin, phase_starts)
        self.x0_at = len(self.sigmas) - 2 if sampler.decode == "x0" else None
        # MixGRPO-Flash: DPM-Solver++ after the last window step, on the clean-sample estimates of every step
        self.solver = sampler.outside_window.solver
        stochastic = torch.nonzero(window).flatten()
        self.after = int(stochastic[-1]) if len(stochastic) else len(window)
        self.history: list[Streams] = []

    def reuses(self, i: int) -> bool:
        """Whether step ``i`` (outside the window) may reuse the last computed prediction."""
        return i in self.reused

    def sigmas_of(self, stream: str) -> torch.Tensor:
        return self.stream_sigmas.get(stream, self.sigmas)

    def step(self, x: Streams, pred: Streams, i: int) -> StepResult:
        x0 = {s: x[s].float() - self.sigmas_of(s)[i].to(x[s].device) * pred[s].float() for s in x} \
            if i == self.x0_at else None
        if self.solver == "dpmsolver++":
            self.history = [*self.history[-1:], {s: x[s].float() - self.sigmas_of(s)[i].to(x[s].device)
                                                 * pred[s].float() for s in x}]
            if i > self.after:
                final = i == len(self.sigmas) - 2
                return StepResult({s: dpm_solver_pp(x[s], [h[s] for h in self.history], self.sigmas_of(s), i,
                                                    self.spec.outside_window.solver_type, first_order=final)
                                   for s in x}, x0=x0)
        ode = {s: euler(x[s], pred[s], self.sigmas_of(s)[i + 1] - self.sigmas_of(s)[i]) for s in x}
        rows = self.mask[:, i]
        if not bool(rows.any()):
            return StepResult(ode, x0=x0)
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
        sde.x0 = x0
        return sde

    def score(self, x: Streams, pred: Streams, i: int, sample: Streams) -> StepResult:
        """The log-prob of given next states (replay): the same arithmetic as ``step``, no draw."""
        return self._sde(x, pred, i, sample=sample)

    def _sde(self, x: Streams, pred: Streams, i: int, *, noise: Mapping[str, torch.Tensor] | None = None,
             sample: Streams | None = None) -> StepResult:
        result = StepResult({}, stream_log_probs={}, mean={}, std={}, std_t={})
        for s in x:
            shape = (-1, *[1] * (x[s].ndim - 1))
            device = x[s].device
            sigmas = self.sigmas_of(s)
            sigma = sigmas[i].to(device).expand(x[s].shape[0]).reshape(shape)
            sigma_next = sigmas[i + 1].to(device).expand(x[s].shape[0]).reshape(shape)
            t = stochastic_step(self.spec, x[s], pred[s], sigma, sigma_next, sigmas[1].to(device),
                                noise=None if noise is None else noise[s].to(device),
                                sample=None if sample is None else sample[s].to(device))
            result.next[s] = t.sample
            result.stream_log_probs[s], result.mean[s] = t.log_prob, t.mean  # type: ignore[index]
            result.std[s], result.std_t[s] = t.std, t.std_t  # type: ignore[index]
        result.log_prob = sum(result.stream_log_probs.values())  # type: ignore[union-attr, assignment]
        return result


def dpm_solver_pp(x: torch.Tensor, x0s: Sequence[torch.Tensor], sigmas: torch.Tensor, i: int, solver_type: str,
                  first_order: bool = False) -> torch.Tensor:
    """One multistep DPM-Solver++ step (Lu et al., 2022, arXiv:2211.01095) of a flow model from ``sigmas[i]`` to
    ``sigmas[i + 1]`` in float32: ``alpha = 1 - sigma``, ``lambda = log(alpha / sigma)``, ``h`` the step in
    lambda; first order (DDIM) with one clean-sample estimate ``x0s[-1]`` or ``first_order``, second order with the
    previous one too (``heun`` or ``midpoint`` correction). diffusers' DPMSolverMultistepScheduler computes the
    same update but keeps its history and step index inside a scheduler walked from its first step; here it runs
    after a window whose steps another stepper took, so the update is written out."""
    x = x.float()
    sigma_t, sigma_s0 = sigmas[i + 1].to(x.device), sigmas[i].to(x.device)
    alpha_t, alpha_s0 = 1 - sigma_t, 1 - sigma_s0
    lambda_t = torch.log(alpha_t) - torch.log(sigma_t)
    lambda_s0 = torch.log(alpha_s0) - torch.log(sigma_s0)
    h = lambda_t - lambda_s0
    d0 = x0s[-1].float()
    out = (sigma_t / sigma_s0) * x - (alpha_t * (torch.exp(-h) - 1.0)) * d0
    if first_order or len(x0s) < 2:
        return out
    sigma_s1 = sigmas[i - 1].to(x.device)
    lambda_s1 = torch.log(1 - sigma_s1) - torch.log(sigma_s1)
    d1 = (1.0 / ((lambda_s0 - lambda_s1) / h)) * (d0 - x0s[-2].float())
    if solver_type == "midpoint":
        return out - 0.5 * (alpha_t * (torch.exp(-h) - 1.0)) * d1
    return out + (alpha_t * ((torch.exp(-h) - 1.0) / h + 1.0)) * d1


def stochastic_stepper(sampler: Any, steps: Any, mask: torch.Tensor, generators: list[torch.Generator], *,
                       where: str, begin: int = 0, phase_starts: Sequence[int] = ()) -> StochasticStepper:
    """The stochastic stepper of a walk over ``steps`` (a ``schedule.Steps``). A multistep solver's schedule is
    refused unless the sampler asks for Euler steps on it (``multistep: euler``); a scheduler whose model output is
    no velocity is refused either way."""
    steps.check_velocity(where)
    if sampler.multistep == "refuse":
        try:
            steps.check_stochastic(where)
        except SpecError as exc:
            raise SpecError.single(f"{exc.problems[0].message}; or set multistep: euler to take Euler and SDE steps "
                                   "on its sigmas, as Flow-GRPO's Wan pipeline does", where) from None
    return StochasticStepper(sampler, steps.sigmas, mask, generators, begin=begin, phase_starts=phase_starts,
                             stream_sigmas=steps.stream_sigmas)


def window_mask(sampler: Any, steps: int, group_ids: torch.Tensor, seed: int, start: int = 0,
                walks: Sequence[tuple[int, int]] | None = None) -> torch.Tensor:
    """(B, steps) bool: which steps are stochastic for each sample. ``walks`` are the ``[first, end)`` step
    ranges the request's walks run (default: ``[start, steps)``; steps before a walk's first never run:
    re-noising, image strength). A window lies in one walk, and a walk's last step is left out unless the
    sampler's ``include_last`` is set (both official trainers leave it out)."""
    spans = list(walks) if walks is not None else [(start, steps)]
    cut = 0 if sampler.include_last else 1
    usable = torch.zeros(steps, dtype=torch.bool)
    for first, end in spans:
        usable[first:max(first, end - cut)] = True
    if not bool(usable.any()):
        raise SpecError.single(
            "no step is left for the window: " + ", ".join(f"steps {a}-{b - 1}" for a, b in spans) + " run, and a "
            "walk's last step is deterministic unless the sampler sets include_last: true", "sampler.window")
    fill = _WINDOW_FILLS.get(sampler.window.kind)
    if fill is None:  # a window kind added to the spec without its mask here
        raise SpecError.single(f"window kind {sampler.window.kind!r} has no mask in this runtime", "sampler.window")
    mask = torch.zeros(len(group_ids), steps, dtype=torch.bool)
    fill(mask, sampler.window, usable, spans, group_ids, seed)
    return mask


def _fits(window: Any, first: int, usable: torch.Tensor, spans: Sequence[tuple[int, int]]) -> bool:
    """Whether ``window.length`` steps from ``first`` are all usable and lie in one walk."""
    end = first + window.length
    return end <= len(usable) and bool(usable[first:end].all()) and any(a <= first and end <= z for a, z in spans)


def _fill_all(mask: torch.Tensor, window: Any, usable: torch.Tensor, spans: Sequence[tuple[int, int]],
              group_ids: torch.Tensor, seed: int) -> None:
    mask[:, usable] = True


def _fill_fixed(mask: torch.Tensor, window: Any, usable: torch.Tensor, spans: Sequence[tuple[int, int]],
                group_ids: torch.Tensor, seed: int) -> None:
    if not _fits(window, window.start, usable, spans):
        raise SpecError.single(
            f"window {window.start}+{window.length} (steps {window.start}-{window.start + window.length - 1}) "
            f"does not fit the usable steps {_ranges(usable)} of one walk (a walk's last step is usable only "
            "with include_last: true)", "sampler.window")
    mask[:, window.start:window.start + window.length] = True


def _fill_random(mask: torch.Tensor, window: Any, usable: torch.Tensor, spans: Sequence[tuple[int, int]],
                 group_ids: torch.Tensor, seed: int) -> None:
    candidates = [s for s in range(window.low, window.high + 1) if _fits(window, s, usable, spans)]
    if not candidates:
        raise SpecError.single(f"no room for a {window.length}-step window starting in [{window.low}, {window.high}] "
                               f"within the usable steps {_ranges(usable)} of one walk", "sampler.window")
    gen = torch.Generator().manual_seed((window.seed * 1_000_003 + seed) % (1 << 64))  # as torch wraps negatives
    # ``group_ids`` are global ids (sample ids for scope "sample"), so a shard of a batch draws the same
    # windows its samples get in the whole batch: draws are a prefix-consistent sequence.
    draws = 1 if window.scope == "batch" else int(group_ids.max()) + 1
    picks = torch.randint(0, len(candidates), (draws,), generator=gen)
    for row in range(len(group_ids)):
        first = candidates[int(picks[0 if window.scope == "batch" else int(group_ids[row])])]
        mask[row, first:first + window.length] = True


def _fill_sliding(mask: torch.Tensor, window: Any, usable: torch.Tensor, spans: Sequence[tuple[int, int]],
                  group_ids: torch.Tensor, seed: int) -> None:
    starts = [s for s in range(window.start, len(usable)) if _fits(window, s, usable, spans)]
    if not starts:
        raise SpecError.single(f"no room for a {window.length}-step window starting at or after {window.start} "
                               f"within the usable steps {_ranges(usable)} of one walk", "sampler.window")
    first = window.first_step(starts[-1])
    if not _fits(window, first, usable, spans):
        raise SpecError.single(f"at iteration {window.iteration} the window starts at step {first}, where "
                               f"{window.length} steps do not fit the usable steps {_ranges(usable)} of one walk",
                               "sampler.window")
    mask[:, first:first + window.length] = True


# One mask per window kind of ``omnispec.spec.recipe``; tests/test_architecture.py checks none is missing.
_WINDOW_FILLS = {"all": _fill_all, "fixed": _fill_fixed, "random": _fill_random, "sliding": _fill_sliding}


def _ranges(usable: torch.Tensor) -> str:
    """``usable``'s true runs as "a-b, c-d"."""
    out, i, n = [], 0, len(usable)
    while i < n:
        if bool(usable[i]):
            j = i
            while j + 1 < n and bool(usable[j + 1]):
                j += 1
            out.append(f"{i}-{j}")
            i = j + 1
        else:
            i += 1
    return ", ".join(out) or "none"
