"""diffusers' first-block cache: the rest of the network is reused while the first block's output changes less than
``threshold``."""

from typing import Any

from .base import HookedCache


class FirstBlock(HookedCache):
    apply_name = "apply_first_block_cache"

    def config(self, policy: Any, steps: int) -> Any:
        from diffusers.hooks import FirstBlockCacheConfig

        return FirstBlockCacheConfig(threshold=policy.threshold)


FIRST_BLOCK = FirstBlock()
