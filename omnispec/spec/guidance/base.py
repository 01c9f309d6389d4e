"""What every guidance term shares: scales (a number, a per-step schedule, or one per latent stream), windows, the
spec fields of a term, and ``Term``, the object a term kind's behaviour lives in (``GUIDANCE`` maps each kind to
its spec class and its ``Term``).

Every term adds at most one pass. The delta form ``pred = cond + sum_i c_i * (cond - pass_i)`` is ``Term``'s
default combine; a term with its own rule (APG, CFG-zero*) overrides ``combine`` for its pass. The behaviour is
torch-free here: tensors are combined through their own operators, and a term that uses a diffusers helper imports
it when it first combines, so ``import omnispec.spec`` stays pure.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Protocol, Union

from pydantic import Field, field_validator, model_validator

from ..base import SpecModel, Unit
from ..kinds import Kinds


class GuidanceFacts(Protocol):
    """What a term's refusal reads of a family's guidance target (``omnispec.targets.GuidanceTarget``)."""

    @property
    def modalities(self) -> tuple[str, ...]: ...

    @property
    def skip_layer_refusal(self) -> str | None: ...


class FamilyTargets(Protocol):
    """What a term's refusal reads of a family's targets: ``omnispec.targets.Targets``, described here because the
    spec layer imports nothing of ours (the family's name, its guidance target, and the two ways a refusal is
    worded)."""

    @property
    def family(self) -> str: ...

    @property
    def guidance(self) -> GuidanceFacts: ...

    def missing(self, technique: str) -> str: ...

    def refused(self, technique: str, why: str) -> str: ...


class ScaleSchedule(SpecModel):
    """A scale that varies over the run, piecewise-linear between points and held flat outside them.

    ``by: step`` keys points on the step fraction ``i / steps`` (0 = first step); ``by: sigma`` keys
    them on the step's sigma (1 = pure noise).
    """

    by: Literal["step", "sigma"]
    points: list[tuple[Unit, float]] = Field(min_length=1)

    @field_validator("points")
    @classmethod
    def _distinct_positions(cls, points: list[tuple[float, float]]) -> list[tuple[float, float]]:
        xs = [x for x, _ in points]
        if len(set(xs)) != len(xs):
            raise ValueError(f"point positions must be distinct, got {xs}")
        return points

    def at(self, fraction: float, sigma: float | None) -> float:
        x = fraction if self.by == "step" else sigma
        if x is None:
            raise ValueError("a sigma-keyed scale needs the schedule's sigmas")
        pts = sorted(self.points)
        if x <= pts[0][0]:
            return float(pts[0][1])
        if x >= pts[-1][0]:
            return float(pts[-1][1])
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if x0 <= x <= x1:
                return float(y0 + (y1 - y0) * (x - x0) / (x1 - x0))
        raise AssertionError("unreachable: x lies between the first and last point")


Scale = Union[float, ScaleSchedule]
# A scale for every latent stream alike, or one per stream (``{video: 3.0, audio: 7.0}``): a term given per
# stream guides only the streams it names.
StreamScale = Union[float, ScaleSchedule, dict[str, Scale]]


def scale_at(scale: Scale, fraction: float, sigma: float | None) -> float:
    return float(scale) if isinstance(scale, (int, float)) else scale.at(fraction, sigma)


def stream_scale_at(scale: StreamScale, fraction: float, sigma: float | None) -> float | dict[str, float]:
    """The value at one step: a float, or a float per named stream."""
    if isinstance(scale, dict):
        return {stream: scale_at(s, fraction, sigma) for stream, s in scale.items()}
    return scale_at(scale, fraction, sigma)


class Window(SpecModel):
    """Where a term is active: ``start <= i/steps < end`` (``by: step``) or ``start <= sigma <= end``."""

    by: Literal["step", "sigma"] = "step"
    start: Unit = 0.0
    end: Unit = 1.0

    @model_validator(mode="after")
    def _ordered(self) -> Window:
        if self.start > self.end:
            raise ValueError(f"window start {self.start} is after its end {self.end}")
        return self

    def contains(self, fraction: float, sigma: float | None) -> bool:
        if self.by == "step":
            return self.start <= fraction < self.end or (self.end == 1.0 and fraction >= 1.0)
        if sigma is None:
            raise ValueError("a sigma window needs the schedule's sigmas")
        return self.start <= sigma <= self.end


class TermSpec(SpecModel):
    """The fields every guidance term has; each kind adds ``kind: Literal[...]`` and its ``scale``."""

    name: str | None = Field(default=None, description="Pass name; defaults to the term's usual pass name.")
    window: Window | None = None


class Term:
    """What a guidance term kind does (one subclass per kind, registered with its spec class in ``GUIDANCE``):
    which pass it adds and on what it conditions, how its scale becomes the delta coefficient, how the pass is
    combined, what it refuses on a family, and how explain names it."""

    default_pass: ClassVar[str]
    negative: ClassVar[bool] = False  # the pass runs the negative prompt; else the positive one, perturbed by the term
    primary: ClassVar[bool] = False  # a request's guidance_scale sets this term's scale
    offset: ClassVar[float] = 1.0  # the delta coefficient is scale - offset (a coefficient of 0: the term is off)

    def pass_name(self, term: Any) -> str:
        return term.name or self.default_pass

    def coefficient(self, term: Any, value: float) -> float:
        return value - self.offset

    def zero_at(self, term: Any, step: int) -> bool:
        """Whether step ``step``'s prediction is zero (no pass runs): CFG-zero*'s first steps."""
        return False

    def combine(self, pred: Any, cond: Any, other: Any, coefficient: float, term: Any, state: dict) -> Any:
        """``pred`` with this term's pass ``other`` combined in (``state``: this term's per-request memory for one
        stream)."""
        return pred + coefficient * (cond - other)

    def perturbation(self, term: Any) -> Any:
        """What the pass perturbs the denoiser with (None: it only changes the conditioning)."""
        return None

    def perturbs_attention(self, term: Any) -> bool:
        return False

    def refusal(self, term: Any, targets: FamilyTargets) -> str | None:
        """Why a family with these targets cannot run this term, or None."""
        return None

    def replay_refusal(self, term: Any) -> str | None:
        """Why a single stored step of a rollout with this term cannot be replayed on its own, or None."""
        return None


GUIDANCE = Kinds("guidance term")


def term_of(spec: Any) -> Term:
    """The behaviour of a guidance term (a spec instance or class)."""
    return GUIDANCE.implementation(spec)


def pass_name(term: Any) -> str:
    return term_of(term).pass_name(term)


__all__ = ["GUIDANCE", "FamilyTargets", "GuidanceFacts", "Scale", "ScaleSchedule", "StreamScale", "Term", "TermSpec",
           "Window", "pass_name", "scale_at", "stream_scale_at", "term_of"]
