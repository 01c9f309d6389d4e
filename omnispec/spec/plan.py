"""Compile a guidance spec to per-step pass lists and combine coefficients (pure Python, no torch)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .guidance import GuidanceSpec, Renorm, scale_at, stream_scale_at, term_of

# A value for every stream, or one per named stream (the others get 0: unguided by that term / no rescale).
PerStream = float | dict[str, float]


def for_stream(value: PerStream, stream: str) -> float:
    return value.get(stream, 0.0) if isinstance(value, dict) else value


@dataclass(frozen=True)
class PlannedTerm:
    kind: str
    pass_name: str
    coefficient: PerStream  # 0 means off (such a term is not planned)
    index: int  # position of the term in ``GuidanceSpec.terms``


@dataclass(frozen=True)
class StepPlan:
    """What one denoise step runs: ``passes[0]`` is ``cond`` unless the step is a zero-init step."""

    step: int
    fraction: float
    sigma: float | None
    passes: tuple[str, ...]
    terms: tuple[PlannedTerm, ...] = field(default=())
    embedded: float | None = None
    rescale: PerStream = 0.0
    renorm: Renorm | None = None
    zero: bool = False  # CFG-zero* zero-init: the step's prediction is 0 and no pass runs

    @property
    def coefficients(self) -> dict[str, PerStream]:
        return {t.pass_name: t.coefficient for t in self.terms}


def compile_plan(guidance: GuidanceSpec, steps: int, sigmas: Sequence[float] | None = None) -> list[StepPlan]:
    """Resolve windows and per-step scales into one ``StepPlan`` per step.

    ``sigmas`` (one per step, at least ``steps`` long) are needed only when a window or scale is keyed
    on sigma. A term whose coefficient is 0 at a step, or whose window excludes the step, adds no pass.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if sigmas is not None and len(sigmas) < steps:
        raise ValueError(f"need a sigma per step: got {len(sigmas)} for {steps} steps")
    plans = []
    for i in range(steps):
        fraction = i / steps
        sigma = float(sigmas[i]) if sigmas is not None else None
        terms: list[PlannedTerm] = []
        zero = False
        for index, term in enumerate(guidance.terms):
            if term.window is not None and not term.window.contains(fraction, sigma):
                continue
            behaviour = term_of(term)
            if behaviour.zero_at(term, i):
                zero = True
                continue
            value = stream_scale_at(term.scale, fraction, sigma)
            coefficient: PerStream
            if isinstance(value, dict):
                coefficient = {stream: c for stream, v in value.items() if (c := behaviour.coefficient(term, v)) != 0.0}
                if not coefficient:
                    continue
            else:
                coefficient = behaviour.coefficient(term, value)
                if coefficient == 0.0:
                    continue
            terms.append(PlannedTerm(term.kind, behaviour.pass_name(term), coefficient, index))
        embedded = None if guidance.embedded is None else scale_at(guidance.embedded, fraction, sigma)
        rescale = stream_scale_at(guidance.rescale, fraction, sigma)
        if zero:
            plans.append(StepPlan(i, fraction, sigma, (), (), embedded, 0.0, zero=True))
            continue
        passes = ("cond", *(t.pass_name for t in terms))
        plans.append(StepPlan(i, fraction, sigma, passes, tuple(terms), embedded, rescale if terms else 0.0,
                              guidance.renorm if terms else None))
    return plans


def compress_plan(plans: Sequence[StepPlan]) -> list[tuple[int, int, StepPlan]]:
    """Group consecutive steps with identical passes and coefficients: ``(first, last, plan)``."""
    runs: list[tuple[int, int, StepPlan]] = []
    for plan in plans:
        key = (plan.passes, plan.coefficients, plan.embedded, plan.rescale, plan.zero)
        if runs:
            first, _, prev = runs[-1]
            if (prev.passes, prev.coefficients, prev.embedded, prev.rescale, prev.zero) == key:
                runs[-1] = (first, plan.step, prev)
                continue
        runs.append((plan.step, plan.step, plan))
    return runs
