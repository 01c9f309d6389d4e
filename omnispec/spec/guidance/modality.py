"""Modality-isolation guidance (LTX-2): a pass with one modality's cross-attention switched off."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from .base import GUIDANCE, FamilyTargets, StreamScale, Term, TermSpec


class Modality(TermSpec):
    """Modality-isolation guidance (LTX-2): ``+ (scale - 1) * (cond - cond_without_modality)``."""

    kind: Literal["modality"]
    scale: StreamScale = 3.0
    modality: str = Field(description="Modality whose cross-attention is disabled in the extra pass.")


class ModalityTerm(Term):
    default_pass = "modality"

    def pass_name(self, term: Any) -> str:
        return term.name or f"{self.default_pass}.{term.modality}"

    def perturbation(self, term: Any) -> Any:
        return term

    def refusal(self, term: Any, targets: FamilyTargets) -> str | None:
        modalities = targets.guidance.modalities
        if term.modality in modalities:
            return None
        have = ", ".join(modalities) or "none"
        return targets.missing(f"modality {term.modality!r} to isolate") + f" (modalities: {have})"


GUIDANCE.register(Modality, ModalityTerm())

__all__ = ["Modality", "ModalityTerm"]
