"""Removing a diffusers hook so that the module is as it was before the hook came.

A live hook replaces a module's ``forward`` with a closure of its own, so under ``torch.compile`` dynamo
guards on that object per module and recompiles every block of a regionally compiled stack until its limit
(measured on FLUX.1-dev: a compile peer that still carried an omnispec build's attention hooks hit
``FailOnRecompileLimitHit``). Builds therefore remove the hooks an earlier build put on the same modules.
diffusers' ``HookRegistry.remove_hook`` leaves the original bound ``forward`` as an instance attribute and the
registry on the module; once the last hook is gone this removes both, so a module that had hooks is
indistinguishable from one that never had.
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
