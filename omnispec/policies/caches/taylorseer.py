"""diffusers' TaylorSeer cache: features forecast by a Taylor expansion between computed steps."""

from typing import Any

import torch

from .base import HookedCache


class TaylorSeer(HookedCache):
    apply_name = "apply_taylorseer_cache"

    def config(self, policy: Any, steps: int) -> Any:
        from diffusers.hooks import TaylorSeerCacheConfig

        return TaylorSeerCacheConfig(cache_interval=policy.interval, max_order=policy.max_order,
                                     disable_cache_before_step=policy.warmup_steps, taylor_factors_dtype=torch.float32)


TAYLORSEER = TaylorSeer()
