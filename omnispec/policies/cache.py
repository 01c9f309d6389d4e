"""Step caches. ``first_block``, ``taylorseer`` and ``magcache`` are diffusers' hooks on each denoiser;
``step_mask`` (a declared compute/reuse pattern, which diffusers lacks) is read by the denoise loop.

Scoping: while a cache is on, the loop runs every guidance pass of every sample in its own forward
under its own ``cache_context`` (named by pass and by the sample's index in the request: "uncond:1"), and
``begin`` clears all cache state at the start of each request, so neither batch-mates nor earlier requests
can reach an output.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers.hooks import HookRegistry

from ..spec import PipelineSpec
from .hooks import remove_hook


@dataclass
class CacheRuntime:
    """The cache of a built pipeline. ``begin`` starts each request: all cache state is reset, and caches that
    depend on the step count (MagCache's ratios and retention) are sized to the steps each denoiser runs."""

    policy: Any
    denoisers: dict[str, torch.nn.Module]
    sized: dict[str, int] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return self.policy.kind

    @property
    def step_mask(self) -> list[bool] | None:
        return list(self.policy.mask) if self.kind == "step_mask" else None

    @property
    def scoped(self) -> bool:
        """Whether forwards must be split per pass and sample, each under its own cache context."""
        return self.kind != "step_mask"

    def begin(self, steps: Mapping[str, int]) -> None:
        """Start a request in which denoiser ``name`` runs ``steps[name]`` steps."""
        if self.kind == "magcache":
            for name, count in steps.items():
                if count and self.sized.get(name) != count:
                    _remove_cache_hooks(self.denoisers[name])
                    _apply_hooks(self.policy, self.denoisers[name], count)
                    self.sized[name] = count
        for module in self.denoisers.values():
            registry = getattr(module, "_diffusers_hook", None)
            if isinstance(registry, HookRegistry):
                registry.reset_stateful_hooks(recurse=True)

    def computes(self, step: int) -> bool:
        mask = self.step_mask
        return mask is None or step >= len(mask) or mask[step]


@contextmanager
def cache_context(module: torch.nn.Module, name: str, **where: Any) -> Iterator[None]:
    """diffusers' ``CacheMixin.cache_context`` for any module (the digits DiT has no ``CacheMixin``);
    ``where`` carries step_index / num_inference_steps / timestep / sigma for the hooks that use them."""
    from diffusers.hooks.hooks import CacheContext, _set_cache_context

    _set_cache_context(module, CacheContext(name, **where))
    try:
        yield
    finally:
        _set_cache_context(module, None)


def _remove_cache_hooks(denoiser: torch.nn.Module) -> None:
    """An earlier build's cache hooks on these modules end here, so rebuilding never stacks caches."""
    from diffusers.hooks.first_block_cache import _FBC_BLOCK_HOOK, _FBC_LEADER_BLOCK_HOOK
    from diffusers.hooks.mag_cache import _MAG_CACHE_BLOCK_HOOK, _MAG_CACHE_LEADER_BLOCK_HOOK
    from diffusers.hooks.taylorseer_cache import _TAYLORSEER_CACHE_HOOK

    for module in denoiser.modules():
        for name in (_FBC_BLOCK_HOOK, _FBC_LEADER_BLOCK_HOOK, _MAG_CACHE_BLOCK_HOOK, _MAG_CACHE_LEADER_BLOCK_HOOK,
                     _TAYLORSEER_CACHE_HOOK):
            remove_hook(module, name)


def apply_cache(spec: PipelineSpec, components: dict[str, Any]) -> CacheRuntime | None:
    policy = spec.policies.cache
    denoisers = {n: components[n] for n, c in spec.model.components.items() if c.role == "denoiser"}
    for module in denoisers.values():
        _remove_cache_hooks(module)
    if policy.kind == "none":
        return None
    runtime = CacheRuntime(policy, denoisers)
    if policy.kind in ("first_block", "taylorseer"):  # magcache is sized per request, in begin()
        for module in denoisers.values():
            _apply_hooks(policy, module, spec.recipe.defaults.steps)
    return runtime


def _apply_hooks(policy: Any, module: torch.nn.Module, steps: int) -> None:
    from diffusers.hooks import (
        FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig, apply_first_block_cache, apply_mag_cache,
        apply_taylorseer_cache,
    )

    if policy.kind == "first_block":
        apply_first_block_cache(module, FirstBlockCacheConfig(threshold=policy.threshold))
    elif policy.kind == "taylorseer":
        apply_taylorseer_cache(module, TaylorSeerCacheConfig(
            cache_interval=policy.interval, max_order=policy.max_order,
            disable_cache_before_step=policy.warmup_steps, taylor_factors_dtype=torch.float32))
    else:
        apply_mag_cache(module, MagCacheConfig(
            threshold=policy.threshold, max_skip_steps=policy.max_skip_steps, retention_ratio=policy.retention_ratio,
            num_inference_steps=steps, mag_ratios=policy.mag_ratios, calibrate=policy.calibrate))
