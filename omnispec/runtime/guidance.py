"""Combine a step's pass predictions by its ``StepPlan`` (the executor side of the guidance plan).

The rules are diffusers' own functions where they exist (APG's projection, CFG-zero*'s optimal scale,
CFG rescale), so a plan here means what the same guider means there. Every stream combines on its own:
norms (APG, CFG-zero*, rescale) never mix streams, and a term scaled per stream guides only those it names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from diffusers.guiders.adaptive_projected_guidance import MomentumBuffer, normalized_guidance
from diffusers.guiders.classifier_free_zero_star_guidance import cfg_zero_star_scale
from diffusers.guiders.guider_utils import rescale_noise_cfg

from ..spec import APG, GuidanceSpec, StepPlan
from ..spec.guidance import Renorm
from ..spec.plan import for_stream
from .families import Streams


@dataclass
class GuidanceState:
    """Per-request state of stateful terms (APG momentum), keyed by term index and stream."""

    momentum: dict[tuple[int, str], MomentumBuffer] = field(default_factory=dict)


def combine(plan: StepPlan, preds: Mapping[str, Streams], guidance: GuidanceSpec, state: GuidanceState) -> Streams:
    """Per stream: ``cond + sum_i c_i * (cond - pass_i)`` with APG / CFG-zero* rules for their pass, then rescale
    and renorm."""
    return {stream: _combine_stream(plan, {name: p[stream] for name, p in preds.items()}, guidance, state, stream)
            for stream in preds["cond"]}


def _combine_stream(plan: StepPlan, preds: dict[str, torch.Tensor], guidance: GuidanceSpec, state: GuidanceState,
                    stream: str) -> torch.Tensor:
    cond = preds["cond"]
    pred = cond
    for term in plan.terms:
        coefficient = for_stream(term.coefficient, stream)
        if coefficient == 0.0:
            continue
        other = preds[term.pass_name]
        if term.rule == "delta":
            pred = pred + coefficient * (cond - other)
        elif term.rule == "cfg_zero_star":
            scale = cfg_zero_star_scale(cond.flatten(1), other.flatten(1)).view(-1, *[1] * (cond.ndim - 1))
            pred = pred + coefficient * (cond - other * scale)
        else:  # apg: the paper's form cond + (w - 1) * (orthogonal + eta * parallel)
            spec = guidance.terms[term.index]
            assert isinstance(spec, APG)
            buffer = None
            if spec.momentum:
                buffer = state.momentum.setdefault((term.index, stream), MomentumBuffer(spec.momentum))
            guided = normalized_guidance(
                cond, other, coefficient, buffer, spec.eta, spec.norm_threshold, use_original_formulation=True
            )
            pred = pred + (guided - cond)
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
