"""Classifier-free guidance, and true CFG (FLUX.1's ``true_cfg_scale``): a negative-prompt pass."""

from __future__ import annotations

from typing import Any, Literal

from .base import GUIDANCE, StreamScale, Term, TermSpec


class CFG(TermSpec):
    """Classifier-free guidance: ``uncond + scale * (cond - uncond)`` (coefficient ``scale - 1``); with
    ``formulation: original``, ``cond + scale * (cond - uncond)`` (coefficient ``scale``, as diffusers'
    ``use_original_formulation`` and Z-Image's ``guidance_scale``)."""

    kind: Literal["cfg"]
    scale: StreamScale = 5.0
    formulation: Literal["standard", "original"] = "standard"


class TrueCFG(TermSpec):
    """CFG with a real negative-prompt pass on a guidance-distilled model (FLUX.1 ``true_cfg_scale``)."""

    kind: Literal["true_cfg"]
    scale: StreamScale = 4.0


class NegativePromptTerm(Term):
    """A pass on the negative prompt, combined in the delta form; a request's guidance_scale sets its scale."""

    default_pass = "uncond"
    negative = True
    primary = True

    def coefficient(self, term: Any, value: float) -> float:
        return value if getattr(term, "formulation", "standard") == "original" else value - self.offset


GUIDANCE.register(CFG, NegativePromptTerm())
GUIDANCE.register(TrueCFG, NegativePromptTerm())

__all__ = ["CFG", "NegativePromptTerm", "TrueCFG"]
