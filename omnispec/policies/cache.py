"""Step caches. ``first_block``, ``taylorseer`` and ``magcache`` are diffusers' caches, switched on and off through
its public ``CacheMixin.enable_cache``/``disable_cache`` and scoped by ``cache_context``; ``step_mask`` (a declared
compute/reuse pattern, which diffusers lacks) is read by the denoise loop. A denoiser without ``CacheMixin`` (the
embedded digits DiT) gets the same hooks through the functions ``enable_cache`` calls: the only place private
diffusers names are kept here.

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
from diffusers import CacheMixin

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
            HookRegistry.check_if_exists_or_initialize(module).reset_stateful_hooks(recurse=True)

    def computes(self, step: int) -> bool:
        mask = self.step_mask
        return mask is None or step >= len(mask) or mask[step]


@contextmanager
def cache_context(module: torch.nn.Module, name: str, **where: Any) -> Iterator[None]:
    """The cache context one forward runs under (``where``: step_index / num_inference_steps / timestep / sigma, for
    the hooks that read them): diffusers' ``CacheMixin.cache_context`` on a diffusers model. Kept here for a module
    without ``CacheMixin`` (the digits DiT): the same context set through diffusers' hook registry."""
    if isinstance(module, CacheMixin):
        with module.cache_context(name, **where):
            yield
        return
    from diffusers.hooks.hooks import CacheContext, _set_cache_context

    _set_cache_context(module, CacheContext(name, **where))
    try:
        yield
    finally:
        _set_cache_context(module, None)


def _remove_cache_hooks(denoiser: torch.nn.Module) -> None:
    """An earlier build's cache on these modules ends here, so rebuilding never stacks caches: diffusers'
    ``CacheMixin.disable_cache``. Kept here for a module without ``CacheMixin`` (the digits DiT), whose hooks are
    removed by diffusers' hook names."""
    if isinstance(denoiser, CacheMixin):
        if denoiser.is_cache_enabled:
            denoiser.disable_cache()
            for module in denoiser.modules():  # disable_cache leaves empty registries: drop them (hooks.py says why)
                registry = getattr(module, "_diffusers_hook", None)
                if isinstance(registry, HookRegistry) and not registry.hooks:
                    remove_hook(module, "")
        return
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


def _config(policy: Any, steps: int) -> Any:
    """diffusers' config for a hooked cache kind (``step_mask`` is the loop's own, no hooks)."""
    from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

    if policy.kind == "first_block":
        return FirstBlockCacheConfig(threshold=policy.threshold)
    if policy.kind == "taylorseer":
        return TaylorSeerCacheConfig(cache_interval=policy.interval, max_order=policy.max_order,
                                     disable_cache_before_step=policy.warmup_steps, taylor_factors_dtype=torch.float32)
    return MagCacheConfig(threshold=policy.threshold, max_skip_steps=policy.max_skip_steps,
                          retention_ratio=policy.retention_ratio, num_inference_steps=steps,
                          mag_ratios=policy.mag_ratios, calibrate=policy.calibrate)


def _apply_hooks(policy: Any, module: torch.nn.Module, steps: int) -> None:
    """diffusers' ``CacheMixin.enable_cache``; for a module without it (the digits DiT), the ``apply_*`` function
    that ``enable_cache`` itself calls."""
    config = _config(policy, steps)
    if isinstance(module, CacheMixin):
        module.enable_cache(config)
        return
    from diffusers.hooks import apply_first_block_cache, apply_mag_cache, apply_taylorseer_cache

    apply = {"first_block": apply_first_block_cache, "taylorseer": apply_taylorseer_cache,
             "magcache": apply_mag_cache}[policy.kind]
    apply(module, config)
