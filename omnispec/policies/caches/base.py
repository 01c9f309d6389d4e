"""What a step cache kind does (one subclass per kind, one file each, registered with its spec class in
``spec.policies.CACHES``), and the mechanics the hooked ones share.

``first_block``, ``taylorseer`` and ``magcache`` are diffusers' caches, switched on and off through its public
``CacheMixin.enable_cache``/``disable_cache``; a denoiser without ``CacheMixin`` (the embedded digits DiT) gets the
same hooks through the ``apply_*`` function that ``enable_cache`` itself calls, and loses them by diffusers' hook
names (read through ``omnispec.bridge``). ``step_mask`` (a declared compute/reuse pattern, which diffusers lacks)
is read by the denoise loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from diffusers import CacheMixin

from ... import bridge


class Cache:
    """A cache kind's behaviour: what it puts on a built pipeline's denoisers, what it does at the start of each
    request, and which steps the loop computes."""

    active: ClassVar[bool] = True  # false for "none": the loop computes every step and nothing is put on the model
    # Whether forwards run one per (pass, sample), each under its own cache context: a hooked cache's decisions
    # then never depend on batch-mates or other passes.
    scoped: ClassVar[bool] = True

    def enable(self, policy: Any, denoiser: torch.nn.Module, steps: int) -> None:
        """Put the cache on ``denoiser`` for ``steps`` steps (the recipe's default count)."""

    def begin(self, policy: Any, denoisers: Mapping[str, torch.nn.Module], steps: Mapping[str, int],
              sized: dict[str, int]) -> None:
        """Start a request in which denoiser ``name`` runs ``steps[name]`` steps (``sized``: the count each
        denoiser's hooks were made for, kept across requests)."""

    def computes(self, policy: Any, step: int) -> bool:
        return True


class HookedCache(Cache):
    """A diffusers cache: its config, and the ``apply_*`` function ``CacheMixin.enable_cache`` calls."""

    apply_name: ClassVar[str]

    def config(self, policy: Any, steps: int) -> Any:
        raise NotImplementedError

    def enable(self, policy: Any, denoiser: torch.nn.Module, steps: int) -> None:
        config = self.config(policy, steps)
        if isinstance(denoiser, CacheMixin):
            denoiser.enable_cache(config)
            return
        import diffusers.hooks

        getattr(diffusers.hooks, self.apply_name)(denoiser, config)


def remove_cache_hooks(denoiser: torch.nn.Module) -> None:
    """An earlier build's cache on these modules ends here, so rebuilding never stacks caches: diffusers'
    ``CacheMixin.disable_cache`` (and the empty registries it leaves dropped, as ``bridge.remove_hook`` says why), or
    for a module without ``CacheMixin`` its hooks removed by diffusers' names."""
    if isinstance(denoiser, CacheMixin):
        if denoiser.is_cache_enabled:
            denoiser.disable_cache()
            for module in denoiser.modules():
                registry = bridge.hook_registry(module)
                if registry is not None and not registry.hooks:
                    bridge.remove_hook(module, "")
        return
    names = bridge.cache_hook_names()
    for module in denoiser.modules():
        for name in names:
            bridge.remove_hook(module, name)


def reset_state(denoisers: Mapping[str, torch.nn.Module]) -> None:
    """Every hook's state back to its start (each request begins clean)."""
    from diffusers.hooks import HookRegistry

    for module in denoisers.values():
        HookRegistry.check_if_exists_or_initialize(module).reset_stateful_hooks(recurse=True)


__all__ = ["Cache", "HookedCache", "remove_cache_hooks", "reset_state"]
