"""Perturbations a guidance pass runs its forward with, applied the same way for every family that takes them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ... import bridge
from ...spec import SkipLayer, SpecError
from ...targets import Targets
from .types import Perturbation


@contextlib.contextmanager
def layer_skip(denoiser: torch.nn.Module, skip: Perturbation | None, targets: Targets) -> Iterator[None]:
    """Apply a skip-layer perturbation with diffusers' layer-skip hooks for one forward (on ``skip.blocks``, else the
    family's first block list), then remove it."""
    if skip is None:
        yield
        return
    if not isinstance(skip, SkipLayer):
        raise SpecError.single(f"family {targets.family!r} cannot run a {skip.kind} perturbation", "guidance")
    from diffusers.hooks import LayerSkipConfig

    config = LayerSkipConfig(
        indices=list(skip.layers),
        fqn=skip.blocks or targets.blocks.lists[0],
        skip_attention=skip.skip in ("block", "attention"),
        skip_attention_scores=skip.skip == "attention_scores",
        skip_ff=skip.skip in ("block", "ff"),
    )
    hook_name = "omnispec_layer_skip"
    bridge.apply_layer_skip_hook(denoiser, config, hook_name)
    try:
        yield
    finally:
        blocks = denoiser.get_submodule(config.fqn)
        for i in config.indices:
            for module in blocks[i].modules():
                bridge.remove_hook(module, hook_name)
