"""Run a recipe's phases: group segments of a shared schedule, transform and re-noise between phases,
switch adapter slots, and keep every phase's final latents for the output phase."""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.utils.torch_utils import randn_tensor

from ..policies import CacheRuntime
from ..spec import Phase, PipelineSpec, SegmentSchedule, compile_plan
from ..spec.recipe import LatentUpsample, PreviousInput, Resize
from ..spec.request import Request
from .distributed import check_sequence
from .families import Family, Geometry
from .loop import Passes, PhaseRun, StepHook, denoise
from .schedule import Steps, resolve_steps


@dataclass
class PhaseResult:
    latents: torch.Tensor
    geometry: Geometry


def phase_groups(spec: PipelineSpec) -> list[list[int]]:
    """Consecutive segments of one shared schedule form one group (one walk, one scheduler state)."""
    groups: list[list[int]] = []
    prev_of: str | None = None
    for i, phase in enumerate(spec.recipe.phases):
        of = phase.schedule.of if isinstance(phase.schedule, SegmentSchedule) else None
        if of is not None and of == prev_of:
            groups[-1].append(i)
        else:
            groups.append([i])
        prev_of = of
    return groups


def group_steps(
    spec: PipelineSpec, group: list[int], request: Request, seq_len: int, components: dict[str, Any], device: torch.device
) -> tuple[Steps, list[list[int]]]:
    """The walk of a group and, per phase of the group, the step indices it owns."""
    phases = [spec.recipe.phases[i] for i in group]
    first = phases[0].schedule
    schedule = spec.recipe.schedules[first.of] if isinstance(first, SegmentSchedule) else first
    steps = resolve_steps(schedule, request.steps, seq_len, components, device)
    if not isinstance(first, SegmentSchedule):
        return steps, [list(range(len(steps)))]
    owned: list[list[int]] = [[] for _ in phases]
    T = steps.num_train_timesteps
    for i, t in enumerate(steps.timesteps.tolist()):
        for k, phase in enumerate(phases):
            seg = phase.schedule
            assert isinstance(seg, SegmentSchedule)
            if t >= seg.low * T and (t < seg.high * T or seg.high == 1.0):
                owned[k].append(i)
                break
        else:
            raise ValueError(f"step {i} (t={t:g}) lies in no segment of {first.of!r}")
    return steps, owned


def planned_steps(
    spec: PipelineSpec, family: Family, group: list[int], request: Request, components: dict[str, Any],
    device: torch.device,
) -> tuple[Steps, list[list[int]]]:
    """A group's walk as a request would take it, without running it (explain, RL replay): the sequence
    length for a dynamic shift comes from a probe of the group's initial latents."""
    geometry = family.geometry(request, spec.recipe.phases[group[0]].size_scale)
    probe = family.initial_latents(geometry, [torch.Generator("cpu").manual_seed(0)])
    return group_steps(spec, group, request, family.seq_len(probe, geometry), components, device)


def transform_latents(
    family: Family, phase: Phase, latents: torch.Tensor, prev: Geometry, new: Geometry, components: dict[str, Any]
) -> torch.Tensor:
    assert isinstance(phase.input, PreviousInput)
    transform = phase.input.transform
    if transform is None:
        return latents
    spatial = family.unpack(latents, prev)
    ratio_h, ratio_w = new.height / prev.height, new.width / prev.width
    size = (*spatial.shape[2:-2], round(spatial.shape[-2] * ratio_h), round(spatial.shape[-1] * ratio_w))
    if isinstance(transform, LatentUpsample) and transform.upsampler is not None:
        upsampler = components[transform.upsampler]
        out = upsampler(spatial.to(upsampler.dtype)).to(spatial.dtype)
    else:
        assert isinstance(transform, (LatentUpsample, Resize))
        mode = transform.mode
        if spatial.ndim == 5 and mode in ("bilinear", "bicubic"):
            mode = "trilinear"
        kwargs = {} if mode == "nearest" else {"align_corners": False}
        out = F.interpolate(spatial.float(), size=size, mode=mode, **kwargs).to(spatial.dtype)
    if tuple(out.shape[2:]) != tuple(size):
        raise ValueError(f"phase {phase.name!r}: transform gave latents {tuple(out.shape[2:])}, expected {size}")
    return family.pack(out, new)


def renoise(latents: torch.Tensor, sigma: float, generators: list[torch.Generator]) -> torch.Tensor:
    """Flow-matching forward process to ``sigma``: ``(1 - sigma) * x + sigma * noise``, per-sample noise."""
    noise = randn_tensor(tuple(latents.shape), generator=generators, device=latents.device, dtype=torch.float32)
    return ((1.0 - sigma) * latents.float() + sigma * noise).to(latents.dtype)


def set_adapter(spec: PipelineSpec, phase: Phase, components: dict[str, Any]) -> None:
    """Switch on the phase's adapter slot on its target and every other slot off."""
    if not spec.model.adapters:
        return
    from .components import adapter_target

    by_target: dict[str, list[str]] = {}
    for slot in spec.model.adapters:
        by_target.setdefault(adapter_target(spec, slot), []).append(slot)
    for target, slots in by_target.items():
        module = components[target]
        if phase.adapter in slots:
            module.enable_adapters()
            module.set_adapters([phase.adapter], weights=[spec.model.adapters[phase.adapter].scale])
        else:
            module.disable_adapters()


def run_phases(
    spec: PipelineSpec,
    family: Family,
    components: dict[str, Any],
    request: Request,
    passes_for: Callable[[Phase], Passes],
    generators: list[torch.Generator],
    *,
    device: torch.device,
    on_step: StepHook | None = None,
    cache: CacheRuntime | None = None,
    sampler_factory: Callable[[Steps], Any] | None = None,
    parallel: Any = None,
) -> list[PhaseResult]:
    """Every phase's final latents, in phase order. ``sampler_factory`` replaces a walk's sampler (RL
    rollouts use it to step stochastically and collect log-probs)."""
    results: list[PhaseResult] = []
    prev: PhaseResult | None = None
    for group in phase_groups(spec):
        first = spec.recipe.phases[group[0]]
        geometry = family.geometry(request, first.size_scale)
        if isinstance(first.input, PreviousInput):
            assert prev is not None
            x = transform_latents(family, first, prev.latents, prev.geometry, geometry, components)
        else:
            x = family.initial_latents(geometry, generators)
        if parallel is not None:
            check_sequence(parallel, family.seq_len(x, geometry), f"phase {first.name!r}'s image")
            check_sequence(parallel, request.max_sequence_length or 0, "the prompt (max_sequence_length)")
        steps, owned = group_steps(spec, group, request, family.seq_len(x, geometry), components, device)
        if sampler_factory is not None:
            steps.sampler = sampler_factory(steps)
        elif first.sampler.kind != "ode":
            steps.sampler = stochastic_sampler(first.sampler, steps, generators, device)
        begin = 0
        if isinstance(first.input, PreviousInput) and first.input.renoise is not None:
            target = first.input.renoise
            if target != "first":
                begin = next((i for i, s in enumerate(steps.sigmas) if s <= target + 1e-9), len(steps))
            if begin < len(steps):
                x = renoise(x, steps.sigmas[begin], generators)
        runs = []
        for k, idx in enumerate(group):
            phase = spec.recipe.phases[idx]
            mine = [i for i in owned[k] if i >= begin]
            sigmas = [steps.sigmas[i] for i in mine]
            plans = compile_plan(phase.guidance, len(mine), sigmas) if mine else []
            runs.append(PhaseRun(phase, components[phase.denoiser], mine, plans, passes_for(phase)))
        x = _walk(spec, family, runs, steps, x, geometry, begin, on_step, components, cache, parallel)
        for idx in group:
            results.append(PhaseResult(x, geometry))
        prev = results[-1]
    return results


def stochastic_sampler(sampler: Any, steps: Steps, generators: list[torch.Generator], device: torch.device) -> Any:
    """A declared SDE sampler on an ordinary call: stochastic on its window, each sample with its own noise
    (seeded from its request seed, offset so it never repeats the initial noise)."""
    from .samplers import EulerSampler, StochasticSampler, sde_generators, window_mask

    if not isinstance(steps.sampler, EulerSampler):
        raise ValueError(f"{sampler.kind} needs a flow_match schedule")
    seeds = [g.initial_seed() for g in generators]
    mask = window_mask(sampler, len(steps), torch.arange(len(seeds)), seeds[0])
    return StochasticSampler(sampler, steps.euler_sigmas, mask, sde_generators(seeds, device))


def max_rows(spec: PipelineSpec, family: Family, x: torch.Tensor, geometry: Geometry) -> int | None:
    """Rows per denoiser forward allowed by ``runtime.max_batch`` and ``runtime.max_tokens_per_forward``."""
    limits = [spec.runtime.max_batch] if spec.runtime.max_batch else []
    if spec.runtime.max_tokens_per_forward:
        limits.append(max(1, spec.runtime.max_tokens_per_forward // max(1, family.seq_len(x, geometry))))
    return min(limits) if limits else None


def _walk(spec, family, runs, steps, x, geometry, begin, on_step, components, cache, parallel) -> torch.Tensor:
    """Walk a group, switching adapter slots on each phase's first step."""
    starts = {run.indices[0]: run for run in runs if run.indices}

    def hook(i, run, x_in, result):
        nxt = starts.get(i + 1)
        if nxt is not None:
            set_adapter(spec, nxt.phase, components)
        if on_step is not None:
            on_step(i, run, x_in, result)

    first = starts.get(begin)
    if first is not None:
        set_adapter(spec, first.phase, components)
    progress = spec.runtime.progress and (parallel is None or parallel.is_main)
    return denoise(family, runs, steps, x, geometry, begin=begin,
                   max_rows=max_rows(spec, family, x, geometry), progress=progress, on_step=hook,
                   cache=cache, parallel=parallel)


__all__ = ["PhaseResult", "Passes", "run_phases"]
