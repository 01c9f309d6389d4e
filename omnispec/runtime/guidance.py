"""Combine a step's pass predictions by its ``StepPlan`` (the executor side of the guidance plan).

The rules are diffusers' own functions where they exist (APG's projection, CFG-zero*'s optimal scale,
CFG rescale), so a plan here means what the same guider means there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from diffusers.guiders.adaptive_projected_guidance import MomentumBuffer, normalized_guidance
from diffusers.guiders.classifier_free_zero_star_guidance import cfg_zero_star_scale
from diffusers.guiders.guider_utils import rescale_noise_cfg

from ..spec import APG, GuidanceSpec, StepPlan


@dataclass
class GuidanceState:
    """Per-request state of stateful terms (APG momentum), keyed by term index."""

    momentum: dict[int, MomentumBuffer] = field(default_factory=dict)


def combine(
    plan: StepPlan, preds: dict[str, torch.Tensor], guidance: GuidanceSpec, state: GuidanceState, like: torch.Tensor
) -> torch.Tensor:
    """``cond + sum_i c_i * (cond - pass_i)`` with APG / CFG-zero* rules for their pass, then rescale."""
    if plan.zero:
        return torch.zeros_like(like)
    cond = preds["cond"]
    pred = cond
    for term in plan.terms:
        other = preds[term.pass_name]
        if term.rule == "delta":
            pred = pred + term.coefficient * (cond - other)
        elif term.rule == "cfg_zero_star":
            scale = cfg_zero_star_scale(cond.flatten(1), other.flatten(1)).view(-1, *[1] * (cond.ndim - 1))
            pred = pred + term.coefficient * (cond - other * scale)
        else:  # apg: the paper's form cond + (w - 1) * (orthogonal + eta * parallel)
            spec = guidance.terms[term.index]
            assert isinstance(spec, APG)
            buffer = None
            if spec.momentum:
                buffer = state.momentum.setdefault(term.index, MomentumBuffer(spec.momentum))
            guided = normalized_guidance(
                cond, other, term.coefficient, buffer, spec.eta, spec.norm_threshold, use_original_formulation=True
            )
            pred = pred + (guided - cond)
    if plan.rescale:
        pred = rescale_noise_cfg(pred, cond, plan.rescale)
    return pred
