"""diffusers' MagCache: steps skipped by the accumulated residual-magnitude ratio. Its ratios and retention depend on
the step count, so its hooks are sized to the steps each denoiser runs, per request (made again when that count
changes)."""

from collections.abc import Mapping
from typing import Any

import torch

from .base import HookedCache, remove_cache_hooks


class Mag(HookedCache):
    apply_name = "apply_mag_cache"

    def config(self, policy: Any, steps: int) -> Any:
        from diffusers.hooks import MagCacheConfig

        return MagCacheConfig(threshold=policy.threshold, max_skip_steps=policy.max_skip_steps,
                              retention_ratio=policy.retention_ratio, num_inference_steps=steps,
                              mag_ratios=policy.mag_ratios, calibrate=policy.calibrate)

    def enable(self, policy: Any, denoiser: torch.nn.Module, steps: int) -> None:
        """Nothing at build: the hooks are made in ``begin``, for the request's step count."""

    def begin(self, policy: Any, denoisers: Mapping[str, torch.nn.Module], steps: Mapping[str, int],
              sized: dict[str, int]) -> None:
        for name, count in steps.items():
            if count and sized.get(name) != count:
                remove_cache_hooks(denoisers[name])
                super().enable(policy, denoisers[name], count)
                sized[name] = count


MAGCACHE = Mag()
