"""Step caches: each kind's behaviour in its own file (``base.Cache``), looked up through ``spec.policies.CACHES``;
``CacheRuntime`` holds a built pipeline's cache and scopes it per request.

Scoping: while a scoped cache is on, the loop runs every guidance pass of every sample in its own forward under its
own ``cache_context`` (named by pass and by the sample's index in the request: "uncond:1"), and ``begin`` clears
all cache state at the start of each request, so neither batch-mates nor earlier requests can reach an output.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers import CacheMixin

from ... import bridge
from ...spec import PipelineSpec
from ...spec.policies import CACHES
from ..steps import StepPolicy
from .base import Cache, remove_cache_hooks, reset_state


@dataclass
class CacheRuntime(StepPolicy):
    """The cache of a built pipeline: its policy, the kind's behaviour and the denoisers it is on; the loop consults
    it as a ``StepPolicy``."""

    policy: Any
    denoisers: dict[str, torch.nn.Module]
    sized: dict[str, int] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return self.policy.kind

    @property
    def behaviour(self) -> Cache:
        return CACHES.implementation(self.policy)

    @property
    def separate_passes(self) -> bool:  # type: ignore[override]
        """Whether forwards must be split per pass and sample, each under its own cache context."""
        return self.behaviour.scoped

    def begin(self, steps: Mapping[str, int]) -> None:
        """Start a request in which denoiser ``name`` runs ``steps[name]`` steps: all cache state reset, caches that
        depend on the step count sized to it."""
        self.behaviour.begin(self.policy, self.denoisers, steps, self.sized)
        reset_state(self.denoisers)

    def computes(self, step: int) -> bool:
        return self.behaviour.computes(self.policy, step)

    def pass_context(self, denoiser: torch.nn.Module, name: str, **where: Any) -> AbstractContextManager:
        return cache_context(denoiser, name, **where)


@contextmanager
def cache_context(module: torch.nn.Module, name: str, **where: Any) -> Iterator[None]:
    """The cache context one forward runs under (``where``: step_index / num_inference_steps / timestep / sigma, for
    the hooks that read them): diffusers' ``CacheMixin.cache_context``, or for a module without it (the digits DiT)
    the same context set through diffusers' hook registry (``bridge.set_cache_context``)."""
    if isinstance(module, CacheMixin):
        with module.cache_context(name, **where):
            yield
        return
    bridge.set_cache_context(module, name, **where)
    try:
        yield
    finally:
        bridge.set_cache_context(module, None)


def apply_cache(spec: PipelineSpec, components: dict[str, Any]) -> CacheRuntime | None:
    """The spec's cache on its denoisers (any cache an earlier build left on them removed first); None for none."""
    policy = spec.policies.cache
    denoisers = {n: components[n] for n, c in spec.model.components.items() if c.role == "denoiser"}
    for module in denoisers.values():
        remove_cache_hooks(module)
    behaviour = CACHES.implementation(policy)
    if not behaviour.active:
        return None
    for module in denoisers.values():
        behaviour.enable(policy, module, spec.recipe.defaults.steps)
    return CacheRuntime(policy, denoisers)


__all__ = ["Cache", "CacheRuntime", "apply_cache", "cache_context"]
