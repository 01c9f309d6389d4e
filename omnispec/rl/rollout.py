"""Rollouts with per-step log-probs, and their replay with gradients, through the interpreter's own loop.

Rollout and replay share every piece of numerics: the same pass batching (``run_passes``), the same
guidance combine and the same ``stochastic_step``; so with unchanged weights ``exp(new - old) == 1``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from pydantic import TypeAdapter

from ..runtime.families import Conditioning
from ..runtime.guidance import combine
from ..runtime.loop import PhaseRun, run_passes
from ..runtime.phases import phase_groups, planned_steps, run_phases
from ..runtime.pipeline import phase_passes
from ..runtime.samplers import StepResult, StochasticSampler, sde_generators, stochastic_step, window_mask
from ..spec import APG, SpecError, compile_plan
from ..spec.recipe import STOCHASTIC_SAMPLERS, Phase, Sampler
from ..spec.request import Request, resolve_request
from ..spec.schedule import FlowMatchSchedule

if TYPE_CHECKING:
    from ..runtime.pipeline import Pipeline

_SAMPLER = TypeAdapter(Sampler)


@dataclass
class Rollout:
    """One rollout batch: B = prompts x group_size samples, W stochastic steps each."""

    prompts: list[str]
    group_ids: torch.Tensor  # (B,)
    seeds: list[int]  # (B,) initial-noise seeds; SDE noise uses seed + SDE_SEED_OFFSET
    latents: torch.Tensor  # (B, W + 1, ...) float32: the state before each stochastic step, then after the last
    log_probs: torch.Tensor  # (B, W) float32
    sigmas: torch.Tensor  # (B, W)
    timesteps: torch.Tensor  # (B, W)
    step_indices: torch.Tensor  # (B, W) long: which step of the phase each stored step is
    positive: Conditioning
    negative: Conditioning | None
    array: np.ndarray  # decoded outputs, (B, H, W, C) or (B, F, H, W, C)
    request: Request
    sampler: Any
    phase: str
    weight_version: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def window(self) -> int:
        return self.log_probs.shape[1]

    def select(self, rows: Sequence[int] | torch.Tensor) -> Rollout:
        """The rollout restricted to some samples (for micro-batched or split policy updates)."""
        index = torch.as_tensor(rows, dtype=torch.long)
        pick = index.tolist()
        return Rollout(
            prompts=[self.prompts[i] for i in pick], group_ids=self.group_ids[index], seeds=[self.seeds[i] for i in pick],
            latents=self.latents[index], log_probs=self.log_probs[index], sigmas=self.sigmas[index],
            timesteps=self.timesteps[index], step_indices=self.step_indices[index],
            positive=self.positive.rows(index.to(next(iter(self.positive.batched.values())).device)),
            negative=self.negative.rows(index) if self.negative is not None else None, array=self.array[pick],
            request=self.request.model_copy(update={"prompts": [self.prompts[i] for i in pick],
                                                    "seeds": [self.seeds[i] for i in pick]}),
            sampler=self.sampler, phase=self.phase, weight_version=self.weight_version, extra=dict(self.extra),
        )


@dataclass
class Replay:
    log_probs: torch.Tensor  # (B, K)
    means: torch.Tensor  # (B, K, ...) float32
    stds: torch.Tensor  # (B, K)


def _rl_phase(pipe: Pipeline, sampler: Any) -> Phase:
    phases = pipe.spec.recipe.phases
    if len(phase_groups(pipe.spec)) != 1 or len(phases) != 1:
        raise SpecError.single("rollouts support single-phase recipes in this version", "recipe.phases")
    phase = phases[0]
    if not isinstance(phase.schedule, FlowMatchSchedule):
        raise SpecError.single("SDE rollouts need a flow_match schedule", "recipe.phases.0.schedule")
    if sampler.kind not in STOCHASTIC_SAMPLERS:
        raise SpecError.single(f"rollouts need a stochastic sampler (one of {STOCHASTIC_SAMPLERS}), got "
                               f"{sampler.kind!r}; set recipe.phases.0.sampler or pass sampler=", "sampler")
    if any(isinstance(t, APG) and t.momentum for t in phase.guidance.terms):
        raise SpecError.single("APG momentum carries state across steps, so single steps can't be replayed",
                               "recipe.phases.0.guidance")
    return phase


def resolve_sampler(pipe: Pipeline, sampler: Any | None) -> Any:
    if sampler is None:
        return pipe.spec.recipe.phases[0].sampler
    if isinstance(sampler, Mapping):
        try:
            return _SAMPLER.validate_python(dict(sampler))
        except Exception as exc:  # noqa: BLE001 - pydantic's ValidationError, reported as a spec error
            raise SpecError.single(f"bad sampler: {exc}".splitlines()[0], "sampler") from None
    return sampler


def rollout(
    pipe: Pipeline,
    prompts: str | Sequence[str],
    group_size: int = 1,
    seed: int = 0,
    sampler: Any | None = None,
    shared_noise: bool = False,
    sample_offset: int = 0,
    **request: Any,
) -> Rollout:
    """Roll out ``prompts x group_size`` samples. Sample ``b`` (counting from ``sample_offset``, the position
    of this batch in a larger sharded one) starts from seed ``seed + b`` (``seed + group`` with
    ``shared_noise``) and draws its SDE noise on the pipeline's device from seed ``seed + b + 2**31``."""
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    if sample_offset % group_size:
        raise ValueError("sample_offset must be a multiple of group_size")
    sampler = resolve_sampler(pipe, sampler)
    phase = _rl_phase(pipe, sampler)
    expanded = [p for p in prompts for _ in range(group_size)]
    first_group = sample_offset // group_size
    group_ids = torch.arange(first_group, first_group + len(prompts)).repeat_interleave(group_size)
    seeds = [seed + (int(g) if shared_noise else sample_offset + b) for b, g in enumerate(group_ids)]
    req = resolve_request(pipe.spec, expanded, seeds, **request)
    spec = pipe.spec_for(req)
    phase = spec.recipe.phases[0].model_copy(update={"sampler": sampler})
    spec = spec.model_copy(update={"recipe": spec.recipe.model_copy(update={"phases": [phase]})})

    positive, negative = pipe.encode(req)
    init_generators = [torch.Generator("cpu").manual_seed(s) for s in seeds]
    noise_generators = sde_generators([seed + sample_offset + b for b in range(len(expanded))], pipe.device)
    record: dict[str, Any] = {}

    def make_sampler(steps):
        ids = torch.arange(sample_offset, sample_offset + len(expanded)) if sampler.window.kind == "random" and \
            sampler.window.scope == "sample" else group_ids
        mask = window_mask(sampler, len(steps), ids, seed)
        record["mask"], record["steps"] = mask, steps
        return StochasticSampler(sampler, steps.euler_sigmas, mask, noise_generators)

    states: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def on_step(i: int, run: PhaseRun, x_in: torch.Tensor, result: StepResult) -> None:
        rows = record["mask"][:, i]
        if rows.any():
            states.append((i, x_in.detach().to(torch.float32).clone(), result.next.detach().to(torch.float32).clone(),
                           result.log_prob.detach()))

    with torch.no_grad():
        results = run_phases(spec, pipe.family, pipe.components, req,
                             lambda ph: phase_passes(ph, positive, negative), init_generators, device=pipe.device,
                             on_step=on_step, cache=pipe.policies.cache, sampler_factory=make_sampler)
        out = results[-1]
        array = pipe.family.decode(out.latents, out.geometry)

    mask, steps = record["mask"], record["steps"]
    w = int(mask[0].sum())
    b = len(expanded)
    dev = states[0][1].device
    # Gathered on the device and copied to the host once: per-sample host copies were a visible share of
    # a GPU rollout's time.
    latents = torch.empty((b, w + 1, *states[0][1].shape[1:]), dtype=torch.float32, device=dev)
    lp = torch.empty((b, w), dtype=torch.float32, device=dev)
    idx = torch.empty((b, w), dtype=torch.long)
    position = mask.long().cumsum(1) - 1
    for i, x_in, x_out, step_lp in states:
        rows = torch.nonzero(mask[:, i]).flatten()
        k = position[rows, i]
        rows_d, k_d = rows.to(dev), k.to(dev)
        latents[rows_d, k_d] = x_in[rows_d]
        latents[rows_d, k_d + 1] = x_out[rows_d]
        lp[rows_d, k_d] = step_lp[rows_d]
        idx[rows, k] = i
    latents, lp = latents.cpu(), lp.cpu()
    sig = torch.tensor(steps.sigmas, dtype=torch.float32)
    return Rollout(
        prompts=expanded, group_ids=group_ids - first_group, seeds=seeds, latents=latents, log_probs=lp, sigmas=sig[idx],
        timesteps=steps.timesteps.cpu().to(torch.float32)[idx], step_indices=idx, positive=positive, negative=negative,
        array=array, request=req, sampler=sampler, phase=phase.name, weight_version=pipe.weight_version,
    )


def log_prob(
    pipe: Pipeline,
    ro: Rollout,
    steps: Sequence[int] | None = None,
    grad: bool = True,
    micro_batch: int | None = None,
) -> Replay:
    """Recompute the log-prob of each stored transition ``latents[:, k] -> latents[:, k + 1]``.

    ``steps`` are positions in the window (default: all). Samples are replayed grouped by the phase step
    they were at, ``micro_batch`` samples per forward.
    """
    spec = pipe.spec_for(ro.request)
    phase = spec.recipe.phases[0]
    _rl_phase(pipe, ro.sampler)
    ks = list(range(ro.window)) if steps is None else list(steps)
    walk, _ = planned_steps(spec, pipe.family, [0], ro.request, pipe.components, pipe.device)
    sigmas, timesteps = [*walk.sigmas, 0.0], walk.timesteps.tolist()
    plans = compile_plan(phase.guidance, len(sigmas) - 1, sigmas[:-1])
    guard = torch.tensor(sigmas[1] if len(sigmas) > 2 else sigmas[0])
    dtype = pipe.family.latent_dtype(pipe.components[phase.denoiser])
    geometry = pipe.family.geometry(ro.request, phase.size_scale)
    b = len(ro.prompts)
    out_lp = torch.empty((b, len(ks)), dtype=torch.float32, device=pipe.device)
    out_std = torch.empty((b, len(ks)), dtype=torch.float32, device=pipe.device)
    means: list[list[torch.Tensor | None]] = [[None] * len(ks) for _ in range(b)]
    context = torch.enable_grad() if grad else torch.no_grad()
    with context:
        for col, k in enumerate(ks):
            by_step: dict[int, list[int]] = {}
            for row in range(b):
                by_step.setdefault(int(ro.step_indices[row, k]), []).append(row)
            for i, rows in by_step.items():
                chunk = micro_batch or len(rows)
                for start in range(0, len(rows), chunk):
                    sel = rows[start:start + chunk]
                    index = torch.tensor(sel)
                    x = ro.latents[index, k].to(pipe.device, dtype)
                    passes = phase_passes(phase, ro.positive.rows(index), ro.negative.rows(index) if ro.negative else None)
                    run = PhaseRun(phase, pipe.components[phase.denoiser], [i], [plans[i]], passes)
                    t = torch.tensor(timesteps[i], dtype=torch.float32, device=pipe.device)
                    preds = run_passes(pipe.family, run, plans[i], x, t, geometry, None, pipe.policies.cache)
                    pred = combine(plans[i], preds, phase.guidance, run.state, x)
                    shape = (-1, *[1] * (x.ndim - 1))
                    sigma = torch.full((len(sel),), sigmas[i], dtype=torch.float32, device=pipe.device).reshape(shape)
                    sigma_next = torch.full((len(sel),), sigmas[i + 1], dtype=torch.float32,
                                            device=pipe.device).reshape(shape)
                    result = stochastic_step(ro.sampler, x, pred, sigma, sigma_next, guard.to(pipe.device),
                                             sample=ro.latents[index, k + 1].to(pipe.device))
                    out_lp[index, col] = result.log_prob
                    out_std[index, col] = result.std
                    for j, row in enumerate(sel):
                        means[row][col] = result.mean[j]
    stacked = torch.stack([torch.stack(m) for m in means])  # type: ignore[arg-type]
    return Replay(out_lp, stacked, out_std)
