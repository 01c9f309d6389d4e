"""One request's plan: what runs, decided once, and read by every use of the request.

``plan_request`` takes a resolved request to the spec as it sets it (guidance scale, sigmas), one generator per
sample, the walks (phases grouped by the schedule they step, each phase's steps and compiled step plans, rows per
forward), and the stochastic part of a rollout (its sampler, which steps are stochastic for which sample, the
noise seeds). Generate, rollout and replay execute a plan through ``Run``; explain reads its sigmas and estimate
its passes and rows; none of them plans again.

A walk is a group of phases stepping one schedule: one phase, or the consecutive segments of a shared schedule
(Wan2.2's two experts). Steps are counted per walk; ``Walk.offset`` places them in the request's whole sequence
(RL windows count over it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..spec import Phase, PipelineSpec, SpecError, StepPlan, compile_plan
from ..spec.request import Request, with_request_sigmas
from ..spec.schedule import SHARED_SCHEDULES
from .families import Conditioning, Family, Geometry
from .guidance import GuidanceState
from .phases import first_step, group_steps, phase_groups
from .samplers import StochasticStepper, sde_generators, stochastic_stepper, window_mask
from .schedule import Steps


@dataclass
class Passes:
    """What each pass name runs: which conditioning, and which perturbation (None = plain forward)."""

    conditions: dict[str, Conditioning]
    perturbations: dict[str, Any]


@dataclass
class PhaseRun:
    """One phase's share of a walk: its step indices, its compiled plan per step, and its pass inputs."""

    phase: Phase
    denoiser: torch.nn.Module
    indices: list[int]
    plans: dict[int, StepPlan]
    passes: Passes | None = None  # set once the walk's image conditioning is known
    state: GuidanceState = field(default_factory=GuidanceState)


@dataclass
class Walk:
    phases: list[PhaseRun]
    steps: Steps
    geometry: Geometry
    begin: int
    offset: int
    max_rows: int | None
    images: Conditioning | None = None

    @property
    def phase_starts(self) -> list[int]:
        """The first step each phase of the walk runs."""
        return [run.indices[0] for run in self.phases if run.indices]

    def owner(self, i: int) -> PhaseRun:
        return next(run for run in self.phases if i in run.plans)

    @property
    def first(self) -> Phase:
        return self.phases[0].phase

    def holds(self, g: int) -> bool:
        """Whether request step ``g`` (counted over every walk) is one this walk runs."""
        return self.offset + self.begin <= g < self.offset + len(self.steps)


@dataclass
class Stochastic:
    """A rollout's stochastic steps: its sampler, ``mask[b, g]`` for sample ``b`` at request step ``g``, the walk
    they lie in, and each sample's SDE noise seed."""

    sampler: Any
    mask: torch.Tensor
    walk: Walk
    noise_seeds: list[int]

    def local_mask(self) -> torch.Tensor:
        """The mask over the walk's own steps."""
        return self.mask[:, self.walk.offset:self.walk.offset + len(self.walk.steps)]


@dataclass
class RequestPlan:
    spec: PipelineSpec  # as the request sets it
    request: Request  # the samples this process runs (under data parallelism, its data group's share)
    generators: list[torch.Generator]  # one per sample, on the CPU: seed S means manual_seed(S), as diffusers
    walks: list[Walk]
    streams: tuple[str, ...]  # the family's latent streams
    stochastic: Stochastic | None = None
    share: range | None = None  # which of the whole request's samples ``request`` holds (None: all of them)

    @property
    def total_steps(self) -> int:
        return self.walks[-1].offset + len(self.walks[-1].steps)

    def walk_of(self, g: int) -> Walk:
        """The walk that runs request step ``g``."""
        return next(w for w in self.walks if w.offset <= g < w.offset + len(w.steps))

    def steps_per_denoiser(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for walk in self.walks:
            for run in walk.phases:
                counts[run.phase.denoiser] = counts.get(run.phase.denoiser, 0) + len(run.indices)
        return counts

    def sigmas(self) -> dict[str, list[float]]:
        """Per phase, the sigmas it steps from (what explain prints as run here)."""
        return {run.phase.name: [walk.steps.step_sigmas[i] for i in run.indices]
                for walk in self.walks for run in walk.phases}

    def stepper(self, walk: Walk, device: torch.device):
        """A walk's stepper: a rollout's stochastic stepper on its window's walk, a phase's own stochastic sampler
        (generation with ``recipe.phases[].sampler``), else the schedule's deterministic one."""
        if self.stochastic is not None and walk is self.stochastic.walk:
            return self._stochastic(walk, self.stochastic.sampler, self.stochastic.local_mask(),
                                    self.stochastic.noise_seeds, device, "sampler")
        sampler = walk.first.sampler
        if not sampler.stochastic:
            return walk.steps.stepper(self.streams, walk.begin)
        where = f"recipe.phases.{self.spec.recipe.phases.index(walk.first)}.sampler"
        if sampler.outside_window.compress != 1:
            raise SpecError.single("compress shortens the walk after a rollout's window (Pipeline.rollout, whose "
                                   "replays score the steps up to it); generation takes every step of the "
                                   "schedule: use compress: 1 here, or roll out", f"{where}.outside_window.compress")
        seeds = list(self.request.seeds)
        mask = window_mask(sampler, len(walk.steps), torch.arange(len(seeds)), seeds[0], start=walk.begin)
        return self._stochastic(walk, sampler, mask, seeds, device, where)

    def _stochastic(self, walk: Walk, sampler: Any, mask: torch.Tensor, seeds: Sequence[int], device: torch.device,
                    where: str) -> StochasticStepper:
        return stochastic_stepper(sampler, walk.steps, mask, sde_generators(list(seeds), device), where=where,
                                  begin=walk.begin, phase_starts=walk.phase_starts)

    def scorer(self, walk: Walk, sampler: Any) -> StochasticStepper:
        """The stepper that scores stored transitions of ``walk`` (replay): the same step arithmetic, no draw."""
        return StochasticStepper(sampler, walk.steps.sigmas, torch.zeros(0, 0, dtype=torch.bool), [],
                                 stream_sigmas=walk.steps.stream_sigmas)


def request_spec(spec: PipelineSpec, request: Request) -> PipelineSpec:
    """The spec with the request's ``guidance_scale`` applied to every phase's primary scale and its ``sigmas`` to
    the schedules that take the request's steps."""
    spec = spec if request.sigmas is None else with_request_sigmas(spec, request.sigmas)
    if request.guidance_scale is None:
        return spec
    phases = [p.model_copy(update={"guidance": p.guidance.with_primary_scale(request.guidance_scale)})
              for p in spec.recipe.phases]
    return spec.model_copy(update={"recipe": spec.recipe.model_copy(update={"phases": phases})})


def plan_request(spec: PipelineSpec, family: Family, components: dict[str, Any], device: torch.device,
                 request: Request, *, rollout: dict[str, Any] | None = None, share: range | None = None) -> RequestPlan:
    """The plan of ``request`` on a pipeline's spec, family, components and device. ``rollout`` (``sampler``,
    ``ids``: group or sample ids for random windows, ``seed``, ``noise_seeds``) adds a rollout's stochastic window,
    which must lie within one walk. ``share``: the samples this process runs (a data group's), each with the
    generator of its own seed, so a sample's numbers never depend on how the request is split."""
    spec = request_spec(spec, request)
    walks = _walks(spec, family, components, device, request)
    if share is not None:
        request = request.model_copy(update={"prompts": [request.prompts[i] for i in share],
                                             "seeds": [request.seeds[i] for i in share]})
    plan = RequestPlan(spec, request, [torch.Generator("cpu").manual_seed(s) for s in request.seeds], walks,
                       family.streams, share=share)
    if rollout is not None:
        spans = [(w.offset + w.begin, w.offset + len(w.steps)) for w in walks]
        mask = window_mask(rollout["sampler"], plan.total_steps, rollout["ids"], rollout["seed"], walks=spans)
        plan.walks, mask, walk = _compress_after_window(spec, family, request.steps, walks, _window_walk(walks, mask),
                                                        mask, rollout["sampler"], device)
        plan.stochastic = Stochastic(rollout["sampler"], mask, walk, rollout["noise_seeds"])
    return plan


def _walks(spec: PipelineSpec, family: Family, components: dict[str, Any], device: torch.device,
           request: Request) -> list[Walk]:
    walks, offset = [], 0
    for group in phase_groups(spec):
        first = spec.recipe.phases[group[0]]
        geometry = family.geometry(request, first.size_scale)
        tokens = family.tokens(geometry)
        steps, owned = group_steps(spec, group, request.steps, tokens, components, device)
        steps.stream_sigmas = family.stream_sigmas(steps.sigmas)
        steps.check_own_sigmas(f"recipe.phases.{group[0]}.schedule")
        begin = first_step(first, steps, request.strength)
        runs = []
        for k, idx in enumerate(group):
            phase = spec.recipe.phases[idx]
            mine = [i for i in owned[k] if i >= begin]
            plans = compile_plan(phase.guidance, len(mine), [steps.step_sigmas[i] for i in mine]) if mine else []
            runs.append(PhaseRun(phase, components.get(phase.denoiser), mine, dict(zip(mine, plans))))
        walks.append(Walk(runs, steps, geometry, begin, offset, max_rows(spec, tokens)))
        offset += len(steps)
    return walks


def max_rows(spec: PipelineSpec, tokens: int) -> int | None:
    """Rows (passes x samples) per denoiser forward: ``runtime.max_batch`` and ``max_tokens_per_forward``."""
    runtime = spec.runtime
    limits = [runtime.max_batch] if runtime.max_batch else []
    if runtime.max_tokens_per_forward:
        limits.append(max(1, runtime.max_tokens_per_forward // max(1, tokens)))
    return min(limits) if limits else None


def _compress_after_window(spec: PipelineSpec, family: Family, request_steps: int, walks: list[Walk], walk: Walk,
                           mask: torch.Tensor, sampler: Any, device: torch.device
                           ) -> tuple[list[Walk], torch.Tensor, Walk]:
    """The walks, the mask over their steps and the window's walk, with that walk's steps after the window's last
    step taken on ``sampler.outside_window.compress``'s fewer points of the schedule's own time warp (MixGRPO-Flash);
    the walks after it move up. The window's steps and all before them keep their sigmas, timesteps and step plans,
    so a replay, which plans the request without the window, scores them as the rollout stepped them."""
    last = int(torch.nonzero(mask[:, walk.offset:walk.offset + len(walk.steps)].any(0)).flatten()[-1])
    points = len(walk.steps) - last  # the sigmas after the last window step, the terminal 0 included
    count = sampler.outside_window.points_after(points)
    if count == points:
        return walks, mask, walk
    if len(walk.phases) > 1:
        raise SpecError.single(f"the window's walk runs phases {', '.join(r.phase.name for r in walk.phases)} on "
                               "segments of one shared schedule, whose bounds a compressed walk would move: use "
                               "compress: 1", "sampler.outside_window.compress")
    schedule = walk.first.schedule.walked(spec.recipe.schedules)
    steps = SHARED_SCHEDULES.implementation(schedule).compressed(schedule, request_steps, family.tokens(walk.geometry),
                                                                 last + 1, count, device)
    steps.stream_sigmas = family.stream_sigmas(steps.sigmas)
    run = walk.phases[0]
    indices = [i for i in run.indices if i <= last] + list(range(last + 1, len(steps)))
    compiled = compile_plan(run.phase.guidance, len(indices), [steps.step_sigmas[i] for i in indices])
    plans = {i: run.plans[i] if i <= last else plan for i, plan in zip(indices, compiled)}
    shorter = replace(walk, phases=[replace(run, indices=indices, plans=plans)], steps=steps)
    removed = len(walk.steps) - len(steps)
    moved = [shorter if w is walk else replace(w, offset=w.offset - removed) if w.offset > walk.offset else w
             for w in walks]
    cut = walk.offset + last + 1  # the removed steps select no sample: the window ends before them
    return moved, torch.cat([mask[:, :cut], mask[:, cut + removed:]], dim=1), shorter


def _window_walk(walks: list[Walk], mask: torch.Tensor) -> Walk:
    """The one walk every sample's window lies in (states are stored as consecutive transitions)."""
    used = torch.nonzero(mask.any(0)).flatten().tolist()
    if not used:
        raise SpecError.single("the window selects no step", "sampler.window")
    holding = {id(w): w for w in walks for g in used if w.holds(g)}
    if len(holding) != 1 or any(not w.holds(g) for w in holding.values() for g in used):
        spans = ", ".join(f"{w.first.name}: steps {w.offset + w.begin}-{w.offset + len(w.steps) - 1}" for w in walks)
        raise SpecError.single(f"the window (steps {used[0]}-{used[-1]}) must lie within the steps one walk runs "
                               f"({spans})", "sampler.window")
    return next(iter(holding.values()))


__all__ = ["Passes", "PhaseRun", "RequestPlan", "Stochastic", "Walk", "max_rows", "plan_request", "request_spec"]
