"""Skip-layer / spatio-temporal guidance: a pass on the positive prompt with some layers skipped."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from .base import GUIDANCE, FamilyTargets, StreamScale, Term, TermSpec


class SkipLayer(TermSpec):
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


class SkipLayerTerm(Term):
    default_pass = "skip_layer"
    offset = 0.0

    def perturbation(self, term: Any) -> Any:
        return term

    def perturbs_attention(self, term: Any) -> bool:
        return term.perturbs_attention

    def refusal(self, term: Any, targets: FamilyTargets) -> str | None:
        why = targets.guidance.skip_layer_refusal
        return targets.refused("skip_layer guidance", why) if why else None


GUIDANCE.register(SkipLayer, SkipLayerTerm())

__all__ = ["SkipLayer", "SkipLayerTerm"]
