"""A phase's guidance plan: its terms (any registered kind), distilled guidance fed to the denoiser, rescale and
renorm. ``compile_plan`` (``spec/plan.py``) turns it into per-step pass lists without touching torch."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from ..base import SpecModel
from .base import GUIDANCE, Scale, StreamScale, TermSpec, term_of


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
    terms: list[Annotated[TermSpec, GUIDANCE]] = Field(default_factory=list)
    rescale: StreamScale = Field(default=0.0, description="CFG rescale phi (Lin et al., 2023); 0 disables it.")
    renorm: Renorm | None = None

    @model_validator(mode="after")
    def _one_negative_term_and_unique_passes(self) -> GuidanceSpec:
        negatives = [t.kind for t in self.terms if term_of(t).negative]
        if len(negatives) > 1:
            have = ", ".join(k for k, cls in GUIDANCE.classes.items() if term_of(cls).negative)
            raise ValueError(f"at most one negative-prompt term ({have}) per plan, got {negatives}")
        names = [term_of(t).pass_name(t) for t in self.terms]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"pass names must be unique; give the terms distinct 'name's (repeated: {dupes})")
        if "cond" in names:
            raise ValueError("'cond' is the conditional pass and cannot name a term")
        return self

    @property
    def primary(self) -> str | None:
        """What a request's ``guidance_scale`` sets: ``embedded`` or the index of the first primary term."""
        if self.embedded is not None:
            return "embedded"
        for i, term in enumerate(self.terms):
            if term_of(term).primary:
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
    def negative(self) -> bool:
        """Whether a pass of this plan runs the negative prompt."""
        return any(term_of(t).negative for t in self.terms)

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
        return any(term_of(t).perturbs_attention(t) for t in self.terms)


GUIDANCE.held_by(GuidanceSpec)

__all__ = ["GuidanceSpec", "Renorm"]
