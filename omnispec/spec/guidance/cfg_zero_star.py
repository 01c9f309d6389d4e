"""CFG-Zero*: CFG whose negative-prompt pass is scaled by its optimal projection, zero for the first steps."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from .base import GUIDANCE, StreamScale, TermSpec
from .cfg import NegativePromptTerm


class CFGZeroStar(TermSpec):
    """CFG-Zero* (Fan et al., 2025, arXiv:2503.18886): ``uncond`` is scaled by the optimal
    ``s* = <cond, uncond> / |uncond|^2`` before CFG, and the first ``zero_init_steps`` steps output zero."""

    kind: Literal["cfg_zero_star"]
    scale: StreamScale = 5.0
    zero_init_steps: int = Field(default=0, ge=0)


class CFGZeroStarTerm(NegativePromptTerm):
    """diffusers' ``cfg_zero_star_scale`` per sample."""

    def zero_at(self, term: Any, step: int) -> bool:
        return step < term.zero_init_steps

    def combine(self, pred: Any, cond: Any, other: Any, coefficient: float, term: Any, state: dict) -> Any:
        from diffusers.guiders.classifier_free_zero_star_guidance import cfg_zero_star_scale

        scale = cfg_zero_star_scale(cond.flatten(1), other.flatten(1)).view(-1, *[1] * (cond.ndim - 1))
        return pred + coefficient * (cond - other * scale)


GUIDANCE.register(CFGZeroStar, CFGZeroStarTerm())

__all__ = ["CFGZeroStar", "CFGZeroStarTerm"]
