"""Helpers several family adapters share: packed 2x2 latent patches, and decoded pixels to the host."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .types import Geometry


class PackedLatents:
    """Mixin for families that pack 2x2 latent patches into tokens (FLUX, Qwen-Image, Z-Image): the latent grid
    (even on both sides, as their pipelines round it) and the token count the schedule's shift reads."""

    helper: Any

    def _latent_hw(self, geometry: Geometry) -> tuple[int, int]:
        f = self.helper.vae_scale_factor
        return 2 * (geometry.height // (f * 2)), 2 * (geometry.width // (f * 2))

    def tokens(self, geometry: Geometry) -> int:
        h, w = self._latent_hw(geometry)
        return (h // 2) * (w // 2)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU: a CUDA tensor copied into page-locked memory, anything else as ``t.cpu()`` does. A copy
    into ordinary host memory goes through the driver's staging buffer and faults in every new page, which costs a
    rollout's images and states more than its copy (BENCHMARKS.md, "RL rollouts on the H200"). Page-locked blocks
    come from torch's caching host
    allocator, which keeps each for the next result of its size once the last array over it is gone (until then
    it stays reserved, rounded up to a power of two)."""
    if t.device.type != "cuda":
        return t.cpu()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t)  # synchronous: the values are there on return, as with .cpu()
    return out


def decode_images(helper: Any, decoded: torch.Tensor) -> np.ndarray:
    """VAE output in [-1, 1] (B, C, H, W) -> float32 (B, H, W, C) in [0, 1]: diffusers' postprocess denormalizes
    (``output_type="pt"``, on the tensor's device), then the layout and float32 conversion its ``"np"`` output would
    make on the host run where the tensor is (the same values: a widening cast is exact), so the host only copies."""
    images = helper.image_processor.postprocess(decoded, output_type="pt")
    return to_host(images.permute(0, 2, 3, 1).float()).numpy()
