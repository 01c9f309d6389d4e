"""Combine a step's pass predictions by its ``StepPlan`` (the executor side of the guidance plan).

Each term combines its pass by its own kind's rule (``Term.combine``: diffusers' own functions where they exist,
APG's projection, CFG-zero*'s optimal scale), then CFG rescale and renorm. Every stream combines on its own:
norms (APG, CFG-zero*, rescale) never mix streams, and a term scaled per stream guides only those it names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from diffusers.guiders.guider_utils import rescale_noise_cfg

from ..spec import GuidanceSpec, StepPlan
from ..spec.guidance import Renorm, term_of
from ..spec.plan import for_stream
from .families import Streams


@dataclass
class GuidanceState:
    """Per-request memory of stateful terms (APG's momentum), one dict per term index and stream."""

    memory: dict[tuple[int, str], dict] = field(default_factory=dict)


def combine(plan: StepPlan, preds: Mapping[str, Streams], guidance: GuidanceSpec, state: GuidanceState) -> Streams:
    """Per stream: ``cond + sum_i c_i * (cond - pass_i)`` with APG / CFG-zero* rules for their pass, then rescale
    and renorm."""
    return {stream: _combine_stream(plan, {name: p[stream] for name, p in preds.items()}, guidance, state, stream)
            for stream in preds["cond"]}


def _combine_stream(plan: StepPlan, preds: dict[str, torch.Tensor], guidance: GuidanceSpec, state: GuidanceState,
                    stream: str) -> torch.Tensor:
    cond = preds["cond"]
    pred = cond
    for planned in plan.terms:
        coefficient = for_stream(planned.coefficient, stream)
        if coefficient == 0.0:
            continue
        term = guidance.terms[planned.index]
        memory = state.memory.setdefault((planned.index, stream), {})
        pred = term_of(term).combine(pred, cond, preds[planned.pass_name], coefficient, term, memory)
    rescale = for_stream(plan.rescale, stream)
    if rescale:
        pred = rescale_noise_cfg(pred, cond, rescale)
    if plan.renorm is not None:
        pred = _renorm(pred, cond, plan.renorm)
    return pred


def _renorm(pred: torch.Tensor, cond: torch.Tensor, renorm: Renorm) -> torch.Tensor:
    """``pred`` scaled by ``|cond| / |pred|`` per token or per sample, or only where it exceeds ``max_ratio``."""
    dims = -1 if renorm.over == "token" else tuple(range(1, pred.ndim))
    target = torch.linalg.vector_norm(cond, dim=dims, keepdim=True)
    norm = torch.linalg.vector_norm(pred, dim=dims, keepdim=True)
    if renorm.max_ratio is None:
        return pred * (target / norm)
    cap = target * renorm.max_ratio
    return torch.where(norm > cap, pred * (cap / norm), pred)
