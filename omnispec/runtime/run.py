"""``Run``: one request's execution, the one path that generate, rollout and replay share.

A ``Run`` executes a request's plan (``runtime/plan.py``: walks, steps, step plans, generators, the stochastic
window) with what every step needs (family, components, device, cache and parallel context, prompt encodings).
``execute`` runs the walks; ``prediction`` is the step body (passes, batched as the row limit allows, then the
guidance combine) that replay calls for single stored steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from ..kernels.sdpa import training_forwards
from ..spec import Phase
from ..spec.guidance import term_of
from ..spec.recipe import ImageInput, PreviousInput
from ..spec.request import Request
from .families import Conditioning, Geometry, Perturbation, Streams, batch_of, cat_streams
from .guidance import combine
from .parallel import broadcast_pass, check_sequence, gather_passes
from .phases import renoise, set_adapter, transform_latents
from .plan import Passes, PhaseRun, RequestPlan, Walk
from .samplers import StepResult, StochasticStepper

if TYPE_CHECKING:
    from .pipeline import Pipeline


@dataclass
class PhaseResult:
    latents: Streams
    geometry: Geometry


# Called after every step with (walk, step index, state before the step, the step's result).
StepObserver = Callable[[Walk, int, Streams, StepResult], None]


class Run:
    """Executes a request's plan (``plan.RequestPlan``): its walks' starting states, the denoise loop, the step
    body. ``plan`` may be given as a resolved ``Request``, which is then planned here."""

    def __init__(self, pipe: Pipeline, plan: RequestPlan | Request, *,
                 encodings: tuple[Conditioning, Conditioning | None] | None = None, trains: bool = False):
        self.pipe = pipe
        self.family, self.components, self.device = pipe.family, pipe.components, pipe.device
        self.targets = pipe.family.targets  # what the step policies read from the family (bound to its instance)
        self.policies, self.parallel = pipe.policies.steps, pipe.parallel
        self.plan = plan if isinstance(plan, RequestPlan) else pipe.plan(plan)
        self.spec, self.request = self.plan.spec, self.plan.request
        self.generators, self.walks = self.plan.generators, self.plan.walks
        self.positive, self.negative = encodings if encodings is not None else pipe.encode(self.request)
        # A rollout's or a replay's: its forwards run the kernels a backward may follow, with gradients or not
        # (``kernels.sdpa.training_forwards``), so a replay computes its rollout's forward.
        self.trains = trains
        self.scratch: dict[Any, Any] = {}  # what each step policy remembers for this request, keyed by the policy

    def condition(self, walk: Walk) -> None:
        """Encode the request's images for this walk's size and give every phase its pass inputs."""
        walk.images = self.family.encode_images(self.request, walk.geometry, self.generators)
        positive = self.positive.with_(walk.images)
        negative = self.negative.with_(walk.images) if self.negative is not None else None
        for run in walk.phases:
            run.passes = phase_passes(run.phase, positive, negative)

    # ---- execution ----------------------------------------------------------------------------------------

    def execute(self, observer: StepObserver | None = None) -> list[PhaseResult]:
        """Every phase's final latents, in phase order."""
        self.policies.begin(self.plan.steps_per_denoiser())
        results: list[PhaseResult] = []
        prev: PhaseResult | None = None
        for walk in self.walks:
            x = self._start(walk, prev)
            x = self._denoise(walk, x, observer)
            prev = PhaseResult(x, walk.geometry)
            results += [prev] * len(walk.phases)
        return results

    def _start(self, walk: Walk, prev: PhaseResult | None) -> Streams:
        """The walk's starting state (noise, the image re-noised, or the previous phase's latents transformed
        and re-noised), then its image conditioning."""
        phase, geometry = walk.first, walk.geometry
        if self.parallel is not None:
            check_sequence(self.parallel, self.family.tokens(geometry), f"phase {phase.name!r}'s image")
            check_sequence(self.parallel, self.request.max_sequence_length or 0, "the prompt (max_sequence_length)")
        if isinstance(phase.input, PreviousInput):
            assert prev is not None
            x = transform_latents(self.family, phase, prev.latents, prev.geometry, geometry, self.components)
            needs_noise = phase.input.renoise is not None
        elif isinstance(phase.input, ImageInput):
            x = self.family.image_latents(self.request, geometry, self.generators)
            needs_noise = True
        else:
            x = self.family.initial_latents(geometry, self.generators)
            needs_noise = False
        if needs_noise and walk.begin < len(walk.steps):
            x = renoise(self.family, x, walk.steps.step_sigmas[walk.begin], geometry, self.generators)
        self.condition(walk)
        sigma = walk.steps.step_sigmas[walk.begin] if walk.begin < len(walk.steps) else 0.0
        return self.family.start(x, walk.images, geometry, sigma)

    def _denoise(self, walk: Walk, x: Streams, observer: StepObserver | None) -> Streams:
        stepper = self.plan.stepper(walk, self.device)
        label = "+".join(run.phase.name for run in walk.phases)
        progress = self.spec.runtime.progress and (self.parallel is None or self.parallel.is_main)
        starts = {run.indices[0]: run for run in walk.phases if run.indices}
        sigmas = walk.steps.sigmas.tolist()
        last: Streams | None = None
        for i in tqdm(range(walk.begin, len(walk.steps)), desc=label, disable=not progress, leave=False):
            if i in starts:
                set_adapter(self.spec, starts[i].phase, self.components, self.pipe.adapters)
            # step_mask, or a stochastic stepper's cheaper steps outside its window: reuse the last prediction
            reuse = isinstance(stepper, StochasticStepper) and stepper.reuses(i)
            if (reuse or not self.policies.computes(i)) and last is not None:
                pred = last
            else:
                pred = self.prediction(walk, i, x)
            last = pred
            result = stepper.step(x, pred, i)
            if observer is not None:
                observer(walk, i, x, result)
            x = self.family.reimpose(result.next, walk.images, walk.geometry, sigmas[i + 1])
        return x

    # ---- the step body ------------------------------------------------------------------------------------

    def prediction(self, walk: Walk, i: int, x: Streams, rows: Sequence[int] | None = None) -> Streams:
        """The guided prediction at step ``i`` of ``walk`` for state ``x``, whose rows are the request's samples
        ``rows`` (all of them when None)."""
        run = walk.owner(i)
        plan = run.plans[i]
        if plan.zero:
            return {s: torch.zeros_like(v) for s, v in x.items()}
        with self.policies.step_context(self, walk, run, i), training_forwards() if self.trains else nullcontext():
            preds = self._passes(walk, run, i, x, rows)
        images = walk.images if rows is None or walk.images is None else _rows(walk.images, rows)
        if self.family.prediction_space == "velocity":
            guided = combine(plan, preds, run.phase.guidance, run.state)
            return self.family.constrain(guided, x, images, walk.geometry)
        sigma = {s: walk.steps.stream_sigmas.get(s, walk.steps.sigmas)[i] for s in x}
        x0 = {name: {s: x[s].float() - sigma[s] * v.float() for s, v in p.items()} for name, p in preds.items()}
        guided = self.family.constrain(combine(plan, x0, run.phase.guidance, run.state), x, images, walk.geometry)
        return {s: (x[s].float() - guided[s]) / sigma[s] for s in guided}

    def _passes(self, walk: Walk, run: PhaseRun, i: int, x: Streams, rows: Sequence[int] | None
                ) -> dict[str, Streams]:
        """Predictions for every pass of a step. Where a step policy asks for it (a hooked cache), one forward per
        (pass, sample); under CFG-parallel each rank computes its round-robin share and the shares are gathered."""
        names = list(run.plans[i].passes)
        if self.policies.separate_passes:
            return self._separate_passes(walk, run, i, x, rows)
        ctx = self.parallel
        if ctx is not None and ctx.cfg > 1:
            if len(names) == 1:
                mine = self._local_passes(walk, run, i, names, x, rows) if ctx.cfg_index == 0 else {}
                return {names[0]: broadcast_pass(ctx, mine.get(names[0]), x)}
            local = self._local_passes(walk, run, i, names[ctx.cfg_index::ctx.cfg], x, rows)
            return gather_passes(ctx, names, local, x)
        return self._local_passes(walk, run, i, names, x, rows)

    def _local_passes(self, walk: Walk, run: PhaseRun, i: int, names: list[str], x: Streams,
                      rows: Sequence[int] | None) -> dict[str, Streams]:
        """Unperturbed passes, and those whose perturbation the family applies per row, in one batched forward
        (at most ``max_rows`` rows each); other perturbed passes alone."""
        assert run.passes is not None
        passes = run.passes
        perturbation_of = passes.perturbations.get
        shared = [p for p in names if perturbation_of(p) is None or perturbation_of(p).kind in
                  self.family.row_perturbations]
        groups = [shared] if shared else []
        if len(shared) > 1 and self.family.ragged_passes_apart and _lengths_differ(
                [passes.conditions[n] for n in shared]):
            groups = [[p] for p in shared]
        groups += [[p] for p in names if p not in shared]
        plan, t = run.plans[i], walk.steps.timesteps[i]
        b = batch_of(x)
        preds: dict[str, Streams] = {}
        for group in groups:
            cond = Conditioning.cat([_rows(passes.conditions[n], rows) for n in group])
            per_row = [perturbation_of(n) for n in group for _ in range(b)]
            total = len(group) * b
            chunk = total if walk.max_rows is None else max(1, min(walk.max_rows, total))
            xs = cat_streams([x] * len(group))
            outs = []
            for start in range(0, total, chunk):
                sl = slice(start, min(total, start + chunk))
                mixed = per_row[sl]
                perturbation: Perturbation | list[Perturbation | None] | None = (
                    mixed[0] if all(p is mixed[0] for p in mixed) else mixed)
                outs.append(self.family.predict(run.denoiser, {s: v[sl] for s, v in xs.items()}, t, cond.rows(sl),
                                                walk.geometry, embedded=plan.embedded, perturbation=perturbation,
                                                **self._landing(walk, i)))
            out = cat_streams(outs)
            for k, name in enumerate(group):
                preds[name] = {s: v[k * b:(k + 1) * b] for s, v in out.items()}
        return preds

    def _separate_passes(self, walk: Walk, run: PhaseRun, i: int, x: Streams, rows: Sequence[int] | None
                         ) -> dict[str, Streams]:
        """One forward per (pass, sample), each under the step policies' ``pass_context`` named by the pass and the
        sample's index in the request: what a step cache sees for "uncond:1" never depends on which other passes or
        samples ran beside it."""
        assert run.passes is not None
        plan, t = run.plans[i], walk.steps.timesteps[i]
        samples = list(range(batch_of(x))) if rows is None else list(rows)
        preds: dict[str, Streams] = {}
        for name in plan.passes:
            cond = _rows(run.passes.conditions[name], rows)
            perturbation = run.passes.perturbations.get(name)
            outs = []
            for row, sample in enumerate(samples):
                where = {"step_index": plan.step, "num_inference_steps": len(run.plans), "timestep": t,
                         "sigma": plan.sigma}
                with self.policies.pass_context(run.denoiser, f"{name}:{sample}", **where):
                    outs.append(self.family.predict(
                        run.denoiser, {s: v[row:row + 1] for s, v in x.items()}, t, cond.rows(slice(row, row + 1)),
                        walk.geometry, embedded=plan.embedded, perturbation=perturbation, **self._landing(walk, i)))
            preds[name] = cat_streams(outs)
        return preds

    def _landing(self, walk: Walk, i: int) -> dict[str, torch.Tensor]:
        """What a flow-map family's ``predict`` takes besides the step's timestep: the one the step lands on."""
        return {"target": walk.steps.target(i)} if self.family.flow_map else {}



def _lengths_differ(conditions: Sequence[Conditioning]) -> bool:
    """Whether the conditionings' ragged entries (prompt encodings) have different lengths: batched, they would be
    padded to the longest with a mask."""
    keys = conditions[0].ragged & set(conditions[0].batched)
    return any(len({c.batched[k].shape[1] for c in conditions}) > 1 for k in keys)


def _rows(cond: Conditioning, rows: Sequence[int] | None) -> Conditioning:
    return cond if rows is None else cond.rows(torch.as_tensor(list(rows), dtype=torch.long))


def phase_passes(phase: Phase, positive: Conditioning, negative: Conditioning | None) -> Passes:
    """Each pass's conditioning (the negative prompt's for a negative-prompt term, else the positive one) and the
    perturbation its term runs it with."""
    conditions = {"cond": positive}
    perturbations: dict[str, Perturbation | None] = {"cond": None}
    for term in phase.guidance.terms:
        behaviour = term_of(term)
        name = behaviour.pass_name(term)
        if behaviour.negative:
            assert negative is not None, "encode() gives a negative encoding whenever a phase has a negative term"
        conditions[name] = negative if behaviour.negative else positive  # type: ignore[assignment]
        perturbations[name] = behaviour.perturbation(term)
    return Passes(conditions, perturbations)


__all__ = ["PhaseResult", "PhaseRun", "Run", "StepObserver", "Walk", "phase_passes"]
