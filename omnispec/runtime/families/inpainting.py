"""What inpainting families share: the request's mask as diffusers' inpainting pipelines read it, and the random
draws of a walk's start, which their conditioning needs again.

An inpainting pipeline draws, per sample, the image's VAE posterior, then the noise, then (FLUX Fill) the masked
image's posterior; the keep-unmasked blend of Qwen-Image inpaint re-noises the clean latents with the start's
noise at every step. Generation conditions a walk right after starting it, so those draws are at hand; replay
conditions a walk without starting it, so ``start_draws`` makes them again from the request's seeds (the same
generators the plan makes: one CPU generator per sample, ``manual_seed(seed)``), giving the same numbers.
"""

from __future__ import annotations

from typing import Any

import torch

from ...spec.request import Request
from .types import Geometry, Streams

# geometry.extra keys of a walk that started in this process: the image latents and the noise of its start.
START_IMAGE, START_NOISE = "inpaint_start_image", "inpaint_start_noise"


class InpaintMask:
    """Mixin, before a ``Family`` subclass, for families whose helper pipeline has diffusers' inpainting
    ``mask_processor`` (binarising at 0.5, greyscale, resized with the image) and whose ``image_latents`` keeps its
    draws under ``START_IMAGE`` (the mixin keeps the noise under ``START_NOISE``). Such a family declares
    ``inputs`` with ``inpaints=True``: it runs the task ``inpainting``, and only that one."""

    helper: Any
    device: torch.device

    def noise(self, latents: Streams, geometry: Geometry, generators: list[torch.Generator]) -> Streams:
        """The family's own noise, kept for the conditioning (``START_NOISE``)."""
        geometry.extra[START_NOISE] = noise = super().noise(latents, geometry, generators)  # type: ignore[misc]
        return noise

    def mask_pixels(self, request: Request, geometry: Geometry) -> torch.Tensor:
        """The mask at the output size, (1, 1, H, W) float32 of 0 (keep) and 1 (repaint): blurred first when the
        request says so (diffusers' ``VaeImageProcessor.blur``, the helper its inpainting docs apply by hand)."""
        assert request.mask is not None  # an inpainting recipe refuses a request without one
        mask = request.mask.image
        if request.mask_blur:
            mask = self.helper.mask_processor.blur(mask, blur_factor=request.mask_blur)
        return self.helper.mask_processor.preprocess(mask, height=geometry.height, width=geometry.width).to(
            self.device, torch.float32)

    def start_draws(self, request: Request, geometry: Geometry, generators: list[torch.Generator]
                    ) -> tuple[Streams, Streams, list[torch.Generator]]:
        """The start's image latents and noise, and the generators past those draws: kept from the start when the
        walk started here, else drawn again from the request's seeds (see the module's docstring)."""
        if START_IMAGE in geometry.extra and START_NOISE in geometry.extra:
            return geometry.extra[START_IMAGE], geometry.extra[START_NOISE], generators
        fresh = [torch.Generator("cpu").manual_seed(s) for s in request.seeds]
        image = self.image_latents(request, geometry, fresh)  # type: ignore[attr-defined]
        noise = self.noise(image, geometry, fresh)  # type: ignore[attr-defined]
        return image, noise, fresh

