"""The one denoise loop every family shares.

A step looks up its phase (a segment of a shared schedule picks by timestep), runs the plan's passes
(unperturbed passes batched into one forward, bounded by ``max_batch``; each perturbed pass its own
forward), combines them and hands the result to the sampler.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ..policies import CacheRuntime
from ..policies.cache import cache_context
from ..spec import Phase, SkipLayer, StepPlan
from .distributed import ParallelContext, broadcast_pass, gather_passes
from .families import Conditioning, Family, Geometry
from .guidance import GuidanceState, combine
from .samplers import StepResult
from .schedule import Steps


@dataclass
class Passes:
    """What each pass name runs: which prompts, and which perturbation (None = plain forward)."""

    conditions: dict[str, Conditioning]
    perturbations: dict[str, SkipLayer | None]


@dataclass
class PhaseRun:
    """One phase's share of a walk: its step indices (into ``Steps``), compiled plan and pass inputs."""

    phase: Phase
    denoiser: torch.nn.Module
    indices: list[int]
    plans: list[StepPlan]
    passes: Passes
    state: GuidanceState = field(default_factory=GuidanceState)


StepHook = Callable[[int, PhaseRun, torch.Tensor, StepResult], None]


def run_passes(
    family: Family,
    run: PhaseRun,
    plan: StepPlan,
    x: torch.Tensor,
    t: torch.Tensor,
    geometry: Geometry,
    max_rows: int | None,
    cache: CacheRuntime | None = None,
    parallel: ParallelContext | None = None,
) -> dict[str, torch.Tensor]:
    """Predictions for every pass of a step, keyed by pass name; at most ``max_rows`` rows per forward.
    Under CFG-parallel each rank computes its round-robin share of the passes and the shares are gathered."""
    if cache is not None and cache.scoped:
        return _scoped_passes(family, run, plan, x, t, geometry)
    if parallel is not None and parallel.cfg > 1:
        names = list(plan.passes)
        if len(names) == 1:
            mine = _local_passes(family, run, plan, names, x, t, geometry, max_rows) if parallel.cfg_index == 0 else {}
            return {names[0]: broadcast_pass(parallel, mine.get(names[0]), x)}
        local = _local_passes(family, run, plan, names[parallel.cfg_index::parallel.cfg], x, t, geometry, max_rows)
        return gather_passes(parallel, names, local, x)
    return _local_passes(family, run, plan, list(plan.passes), x, t, geometry, max_rows)


def _local_passes(family, run, plan, names_wanted, x, t, geometry, max_rows) -> dict[str, torch.Tensor]:
    passes = run.passes
    plain = [p for p in names_wanted if passes.perturbations.get(p) is None]
    groups: list[tuple[list[str], SkipLayer | None]] = [(plain, None)] if plain else []
    groups += [([p], passes.perturbations[p]) for p in names_wanted if passes.perturbations.get(p) is not None]
    preds: dict[str, torch.Tensor] = {}
    b = x.shape[0]
    for names, skip in groups:
        cond = Conditioning.cat([passes.conditions[n] for n in names])
        rows = len(names) * b
        chunk = rows if max_rows is None else max(1, min(max_rows, rows))
        xs = x.repeat(len(names), *[1] * (x.ndim - 1)) if len(names) > 1 else x
        outs = []
        for start in range(0, rows, chunk):
            sl = slice(start, min(rows, start + chunk))
            outs.append(family.predict(
                run.denoiser, xs[sl], t, cond.rows(sl), geometry,
                embedded=plan.embedded, skip=skip,
            ))
        out = torch.cat(outs) if len(outs) > 1 else outs[0]
        for k, name in enumerate(names):
            preds[name] = out[k * b:(k + 1) * b]
    return preds


def _scoped_passes(family, run, plan, x, t, geometry) -> dict[str, torch.Tensor]:
    """One forward per (pass, sample), each under its own cache context: what a step cache sees for
    "uncond:1" never depends on which other passes or samples ran beside it."""
    preds = {}
    for name in plan.passes:
        cond, skip = run.passes.conditions[name], run.passes.perturbations.get(name)
        rows = []
        for row in range(x.shape[0]):
            where = {"step_index": plan.step, "num_inference_steps": len(run.plans), "timestep": t, "sigma": plan.sigma}
            with cache_context(run.denoiser, f"{name}:{row}", **where):
                rows.append(family.predict(run.denoiser, x[row:row + 1], t, cond.rows(slice(row, row + 1)), geometry,
                                           embedded=plan.embedded, skip=skip))
        preds[name] = torch.cat(rows)
    return preds


def denoise(
    family: Family,
    runs: Sequence[PhaseRun],
    steps: Steps,
    x: torch.Tensor,
    geometry: Geometry,
    *,
    begin: int = 0,
    max_rows: int | None = None,
    progress: bool = True,
    on_step: StepHook | None = None,
    cache: CacheRuntime | None = None,
    parallel: ParallelContext | None = None,
) -> torch.Tensor:
    owner = {i: (run, k) for run in runs for k, i in enumerate(run.indices)}
    label = "+".join(r.phase.name for r in runs)
    steps.start_at(begin)
    last: torch.Tensor | None = None
    for i in tqdm(range(begin, len(steps)), desc=label, disable=not progress, leave=False):
        run, k = owner[i]
        plan = run.plans[k]
        t = steps.timesteps[i]
        if plan.zero:
            pred = torch.zeros_like(x)
        elif cache is not None and not cache.computes(i) and last is not None:
            pred = last  # step_mask: reuse the previous step's combined prediction
        else:
            preds = run_passes(family, run, plan, x, t, geometry, max_rows, cache, parallel)
            pred = combine(plan, preds, run.phase.guidance, run.state, x)
        last = pred
        result = steps.sampler.step(x, pred, i)
        if on_step is not None:
            on_step(i, run, x, result)
        x = result.next
    return x
