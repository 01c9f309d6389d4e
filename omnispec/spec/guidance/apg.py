"""Adaptive projected guidance on the negative-prompt pass."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from .base import GUIDANCE, StreamScale, TermSpec
from .cfg import NegativePromptTerm


class APG(TermSpec):
    """Adaptive projected guidance (Sadat et al., 2024, arXiv:2410.02416) on the ``uncond`` pass.

    ``diff = cond - uncond`` is (optionally) momentum-averaged and norm-clipped, split into parts
    parallel and orthogonal to ``cond``, and ``pred = cond + (scale - 1) * (orth + eta * parallel)``.
    """

    kind: Literal["apg"]
    scale: StreamScale = 5.0
    eta: float = 0.0
    norm_threshold: float = Field(default=0.0, ge=0.0)
    momentum: float = 0.0


class APGTerm(NegativePromptTerm):
    """diffusers' own APG projection (``normalized_guidance``) in the paper's form, with its momentum buffer kept per
    request and stream."""

    def combine(self, pred: Any, cond: Any, other: Any, coefficient: float, term: Any, state: dict) -> Any:
        from diffusers.guiders.adaptive_projected_guidance import MomentumBuffer, normalized_guidance

        buffer = None
        if term.momentum:
            buffer = state.setdefault("momentum", MomentumBuffer(term.momentum))
        guided = normalized_guidance(cond, other, coefficient, buffer, term.eta, term.norm_threshold,
                                     use_original_formulation=True)
        return pred + (guided - cond)

    def replay_refusal(self, term: Any) -> str | None:
        return "APG momentum carries state across steps, so single steps can't be replayed" if term.momentum else None


GUIDANCE.register(APG, APGTerm())

__all__ = ["APG", "APGTerm"]
