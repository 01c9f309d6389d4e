"""Tensor-parallel plans a family's parallel target may name (``ParallelTarget.tensor_plan``) when it is no family's
own: the model class's diffusers plan."""

from __future__ import annotations

import torch

from ... import bridge
from ...targets import TensorPlan


def model_tensor_plan(denoiser: torch.nn.Module) -> TensorPlan | None:
    """The model class's own diffusers tensor-parallel plan, for models whose processors take the head count from
    the split tensors (FLUX, Qwen-Image)."""
    own = bridge.model_tensor_plan(denoiser)
    return TensorPlan(own) if own else None
