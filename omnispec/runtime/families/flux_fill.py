"""FLUX.1 Fill (``FluxFillPipeline``): inpainting and outpainting by a transformer that sees the masked image.

Every forward takes, after the noise tokens' channels, the packed VAE latents of the image with the repainted
region blacked out and the mask folded from pixels into channels (VAE scale x VAE scale values per latent pixel):
64 + 64 + 256 = 384 input channels at the real size. There is no keep-unmasked blend: the model itself keeps what
the mask keeps. The start is diffusers' image-to-image start (the image's posterior, then the noise, re-noised to
``strength``; at the default strength 1 the start is the noise), then the masked image's posterior is drawn, each
per sample from its own generator.
"""

from __future__ import annotations

import torch
from diffusers import FluxFillPipeline

from ... import bridge
from ...spec.request import Request
from .checks import Inputs
from .flux import FluxFamily
from .inpainting import START_IMAGE, InpaintMask
from .types import Conditioning, Geometry, Perturbation, Streams


class FluxFillFamily(InpaintMask, FluxFamily):
    name = "flux_fill"
    pipeline_class = FluxFillPipeline
    inputs = Inputs(max_images=1, inpaints=True)

    def _pixels(self, request: Request, geometry: Geometry) -> torch.Tensor:
        """The image stretched to the output size, in [-1, 1] (the pipeline's ``init_image``)."""
        return self.helper.image_processor.preprocess(request.images[0].image, height=geometry.height,
                                                      width=geometry.width).to(self.device, torch.float32)

    def image_latents(self, request: Request, geometry: Geometry, generators: list[torch.Generator]) -> Streams:
        vae = self.helper.vae
        pixels = self._pixels(request, geometry).to(vae.dtype)
        spatial = torch.cat([bridge.encode_vae_image(self.helper, pixels, g) for g in generators])
        latents = {"latents": self.pack("latents", spatial.to(self.latent_dtype(None)), geometry)}
        geometry.extra[START_IMAGE] = latents
        return latents

    def encode_images(self, request: Request, geometry: Geometry, generators: list[torch.Generator]
                      ) -> Conditioning | None:
        """Per sample, the masked image's posterior (drawn after the start's draws) and the folded mask, packed
        and joined on the channel axis as the pipeline's ``masked_image_latents``."""
        helper, vae = self.helper, self.helper.vae
        _, _, generators = self.start_draws(request, geometry, generators)
        pixels = self._pixels(request, geometry)
        mask = self.mask_pixels(request, geometry)
        masked = (pixels * (1 - mask)).to(vae.dtype)
        dtype = self.latent_dtype(None)
        rows = []
        for g in generators:
            packed_mask, packed_image = helper.prepare_mask_latents(
                mask, masked, 1, vae.config.latent_channels, 1, geometry.height, geometry.width, dtype, self.device, g)
            rows.append(torch.cat([packed_image, packed_mask], dim=-1))
        return Conditioning({"fill_latents": torch.cat(rows)})

    def predict(self, denoiser, latents: Streams, timestep, cond, geometry, *, embedded=None,
                perturbation: Perturbation | None = None) -> Streams:
        x = latents["latents"].to(self.latent_dtype(denoiser))
        hidden = torch.cat([x, cond.batched["fill_latents"].to(x)], dim=2)
        return {"latents": self._forward(denoiser, hidden, timestep, cond, geometry, embedded, perturbation)}
