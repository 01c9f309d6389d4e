"""FLUX.1 Kontext: image editing by token concatenation. The reference image's packed latents follow the noise
tokens in every forward, with position ids whose first axis is 1; the prediction keeps the noise tokens."""

from __future__ import annotations

import torch
from diffusers import FluxKontextPipeline
from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

from ... import bridge
from ...log import logger
from ...spec.request import Request
from .flux import FluxFamily
from .types import Conditioning, Geometry, Perturbation, Streams


class FluxKontextFamily(FluxFamily):
    name = "flux_kontext"
    pipeline_class = FluxKontextPipeline
    # max_area: the output size is the request's aspect fitted to this many pixels (FluxKontextPipeline's
    # max_area); auto_resize: snap the reference image to the nearest resolution Kontext was trained on.
    options = {"max_area": 1024**2, "auto_resize": True}

    def geometry(self, request: Request, size_scale: float) -> Geometry:
        base = super().geometry(request, size_scale)
        area = self.settings["max_area"] * size_scale**2
        aspect = base.width / base.height if base.height and base.width else 1.0  # planning with no image: square
        multiple = self.helper.vae_scale_factor * 2
        width = round((area * aspect) ** 0.5) // multiple * multiple
        height = round((area / aspect) ** 0.5) // multiple * multiple
        return Geometry(height, width, base.frames, base.fps)

    def encode_images(self, request: Request, geometry: Geometry, generators: list[torch.Generator]
                      ) -> Conditioning | None:
        """The reference image at its own size (or the nearest preferred one), encoded by the VAE's mode (no
        generator draw), packed, one row per sample; its position ids live on axis 0 = 1.

        Without ``auto_resize`` a reference larger than ``max_area`` is fitted to it, keeping its aspect: its tokens
        join every forward, so a 4096x4096 reference would cost 64x the tokens of a 1024x1024 one on every step
        (diffusers takes it as it is)."""
        helper = self.helper
        image = request.images[0].image
        multiple = helper.vae_scale_factor * 2
        height, width = helper.image_processor.get_default_height_width(image)
        if self.settings["auto_resize"]:
            aspect = width / height
            _, width, height = min((abs(aspect - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
        elif width * height > self.settings["max_area"]:
            shrink = (self.settings["max_area"] / (width * height)) ** 0.5
            logger.warning("the reference image (%dx%d) is larger than max_area (%d pixels): encoded at %dx%d, its "
                           "aspect kept", width, height, self.settings["max_area"], int(width * shrink),
                           int(height * shrink))
            width, height = int(width * shrink), int(height * shrink)
        width, height = width // multiple * multiple, height // multiple * multiple
        image = helper.image_processor.resize(image, height, width)
        pixels = helper.image_processor.preprocess(image, height, width).to(self.device, self.latent_dtype(None))
        latents = bridge.encode_vae_image(helper, pixels, None)
        h, w = latents.shape[2:]
        packed = bridge.pack_latents(helper, latents, 1, latents.shape[1], h, w).repeat(len(generators), 1, 1)
        ids = bridge.prepare_latent_image_ids(helper, 1, h // 2, w // 2, self.device, packed.dtype)
        ids[..., 0] = 1
        return Conditioning({"image_latents": packed}, {"image_ids": ids})

    def predict(self, denoiser, latents: Streams, timestep, cond, geometry, *, embedded=None,
                perturbation: Perturbation | None = None) -> Streams:
        x = latents["latents"].to(self.latent_dtype(denoiser))
        tokens = x.shape[1]
        joined = torch.cat([x, cond.batched["image_latents"].to(x.dtype)], dim=1)
        out = self._forward(denoiser, joined, timestep, cond, geometry, embedded, perturbation,
                            extra_ids=cond.shared["image_ids"])
        return {"latents": out[:, :tokens]}
