"""Removing a diffusers hook so that the module is as it was before the hook came.

diffusers' ``HookRegistry.remove_hook`` puts the original forward back as an instance attribute, and the
registry stays on the module. Under ``torch.compile`` that instance ``forward`` is a distinct object per
module, so dynamo's guards fail on every block of a regionally compiled stack: it recompiles block after
block until its recompile limit, then runs the rest eager. Measured on FLUX.1-dev: a rebuild with compile
over modules an earlier build had hooked (attention ``auto``) hit the limit. Once a module's last hook is
gone, this removes the instance ``forward`` and the registry as well.
"""

from __future__ import annotations

import torch
from diffusers.hooks import HookRegistry


def remove_hook(module: torch.nn.Module, name: str) -> None:
    """Remove hook ``name`` from ``module`` (not its children), if present, restoring the plain module when
    it was the last one."""
    registry = getattr(module, "_diffusers_hook", None)
    if not isinstance(registry, HookRegistry):
        return
    if registry.get_hook(name) is not None:
        registry.remove_hook(name, recurse=False)
    if not registry.hooks:
        bound = module.__dict__.get("forward")
        if getattr(bound, "__func__", None) is type(module).forward and getattr(bound, "__self__", None) is module:
            del module.__dict__["forward"]
        del module._diffusers_hook
