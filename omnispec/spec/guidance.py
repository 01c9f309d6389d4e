"""Guidance plans: which extra denoiser passes run at a step and how their predictions combine.

Every term adds at most one pass. The linear terms share the delta form
``pred = cond + sum_i c_i * (cond - pass_i)``; APG and CFG-zero* replace the rule for their
``uncond`` pass; ``rescale`` is applied last. ``compile_plan`` (in ``plan.py``) turns a
``GuidanceSpec`` into per-step pass lists without touching torch.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, field_validator, model_validator

from .base import SpecModel, Unit


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


class _Term(SpecModel):
    name: str | None = Field(default=None, description="Pass name; defaults to the term's usual pass name.")
    window: Window | None = None


class CFG(_Term):
    """Classifier-free guidance: ``uncond + scale * (cond - uncond)`` (coefficient ``scale - 1``); with
    ``formulation: original``, ``cond + scale * (cond - uncond)`` (coefficient ``scale``, as diffusers'
    ``use_original_formulation`` and Z-Image's ``guidance_scale``)."""

    kind: Literal["cfg"]
    scale: StreamScale = 5.0
    formulation: Literal["standard", "original"] = "standard"


class TrueCFG(_Term):
    """CFG with a real negative-prompt pass on a guidance-distilled model (FLUX.1 ``true_cfg_scale``)."""

    kind: Literal["true_cfg"]
    scale: StreamScale = 4.0


class SkipLayer(_Term):
    """Skip-layer / spatio-temporal guidance: ``+ scale * (cond - cond_with_layers_skipped)``.

    ``skip: block`` drops whole blocks (SD3's ``skip_layers``); ``attention``, ``attention_scores``
    and ``ff`` skip that part of each listed block (diffusers' ``LayerSkipConfig``).
    """

    kind: Literal["skip_layer"]
    scale: StreamScale = 2.8
    layers: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    blocks: str | None = Field(default=None, description="Block list to index; the family's default if unset.")
    skip: Literal["block", "attention", "attention_scores", "ff"] = "block"

    @property
    def perturbs_attention(self) -> bool:
        return self.skip in ("attention", "attention_scores")


class Modality(_Term):
    """Modality-isolation guidance (LTX-2): ``+ (scale - 1) * (cond - cond_without_modality)``."""

    kind: Literal["modality"]
    scale: StreamScale = 3.0
    modality: str = Field(description="Modality whose cross-attention is disabled in the extra pass.")


class APG(_Term):
    """Adaptive projected guidance (Sadat et al., 2024, arXiv:2410.02416) on the ``uncond`` pass.

    ``diff = cond - uncond`` is (optionally) momentum-averaged and norm-clipped, split into parts
    parallel and orthogonal to ``cond``, and ``pred = cond + (scale - 1) * (orth + eta * parallel)``.
    """

    kind: Literal["apg"]
    scale: StreamScale = 5.0
    eta: float = 0.0
    norm_threshold: float = Field(default=0.0, ge=0.0)
    momentum: float = 0.0


class CFGZeroStar(_Term):
    """CFG-Zero* (Fan et al., 2025, arXiv:2503.18886): ``uncond`` is scaled by the optimal
    ``s* = <cond, uncond> / |uncond|^2`` before CFG, and the first ``zero_init_steps`` steps output zero."""

    kind: Literal["cfg_zero_star"]
    scale: StreamScale = 5.0
    zero_init_steps: int = Field(default=0, ge=0)


GuidanceTerm = Annotated[
    Union[CFG, TrueCFG, SkipLayer, Modality, APG, CFGZeroStar], Field(discriminator="kind")
]

# Terms whose extra pass runs the negative prompt; at most one per plan.
NEGATIVE_TERMS = ("cfg", "true_cfg", "apg", "cfg_zero_star")
DEFAULT_PASS_NAMES = {
    "cfg": "uncond",
    "true_cfg": "uncond",
    "apg": "uncond",
    "cfg_zero_star": "uncond",
    "skip_layer": "skip_layer",
    "modality": "modality",
}


class Renorm(SpecModel):
    """Rescale the guided prediction by the ``cond`` pass's L2 norm over its own: after the terms and ``rescale``,
    on steps where a term runs. ``over: token`` takes norms over the last dimension (each packed token's channels:
    Qwen-Image's true CFG), ``sample`` over all but the batch dimension. Without ``max_ratio`` the norm becomes the
    cond's; with ``max_ratio: k`` a norm above ``k`` times the cond's is scaled down to it (Z-Image's
    ``cfg_normalization``)."""

    over: Literal["token", "sample"]
    max_ratio: float | None = Field(default=None, gt=0)


class GuidanceSpec(SpecModel):
    """A phase's guidance plan."""

    embedded: Scale | None = Field(
        default=None, description="Distilled guidance fed to the denoiser as an input (FLUX.1-dev)."
    )
    terms: list[GuidanceTerm] = Field(default_factory=list)
    rescale: StreamScale = Field(default=0.0, description="CFG rescale phi (Lin et al., 2023); 0 disables it.")
    renorm: Renorm | None = None

    @model_validator(mode="after")
    def _one_negative_term_and_unique_passes(self) -> GuidanceSpec:
        negatives = [t.kind for t in self.terms if t.kind in NEGATIVE_TERMS]
        if len(negatives) > 1:
            raise ValueError(f"at most one of {', '.join(NEGATIVE_TERMS)} per plan, got {negatives}")
        names = [pass_name(t) for t in self.terms]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"pass names must be unique; give the terms distinct 'name's (repeated: {dupes})")
        if "cond" in names:
            raise ValueError("'cond' is the conditional pass and cannot name a term")
        return self

    @property
    def primary(self) -> str | None:
        """What a request's ``guidance_scale`` sets: ``embedded`` or the index of the negative term."""
        if self.embedded is not None:
            return "embedded"
        for i, term in enumerate(self.terms):
            if term.kind in NEGATIVE_TERMS:
                return str(i)
        return None

    def with_primary_scale(self, scale: float) -> GuidanceSpec:
        primary = self.primary
        if primary is None:
            return self
        if primary == "embedded":
            return self.model_copy(update={"embedded": scale})
        terms = list(self.terms)
        term = terms[int(primary)]
        if isinstance(term.scale, dict):  # per stream: the request's scale is the first stream's (as diffusers'
            first = next(iter(term.scale))  # guidance_scale sets LTX-2's video scale, not its audio one)
            new_scale: StreamScale = {**term.scale, first: scale}
        else:
            new_scale = scale
        terms[int(primary)] = term.model_copy(update={"scale": new_scale})
        return self.model_copy(update={"terms": terms})

    @property
    def streams(self) -> set[str]:
        """Streams named by per-stream scales (checked against the family's streams at build)."""
        named: set[str] = set()
        for scale in (self.rescale, *(t.scale for t in self.terms)):
            if isinstance(scale, dict):
                named |= set(scale)
        return named

    @property
    def perturbs_attention(self) -> bool:
        return any(isinstance(t, SkipLayer) and t.perturbs_attention for t in self.terms)


def pass_name(term: GuidanceTerm) -> str:
    if term.name:
        return term.name
    base = DEFAULT_PASS_NAMES[term.kind]
    return f"{base}.{term.modality}" if isinstance(term, Modality) else base
