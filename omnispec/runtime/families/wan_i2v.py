"""Wan2.1 / Wan2.2 image-to-video (``WanImageToVideoPipeline``): the first frame enters by channel
concatenation (noise, a first-frame mask, the VAE latent of the image followed by grey frames: 36 channels);
Wan2.1 also cross-attends to the CLIP image encoder's penultimate hidden states."""

from __future__ import annotations

import torch
from diffusers import WanImageToVideoPipeline

from ...spec.request import Request
from .checks import Inputs
from .perturbations import layer_skip
from .types import Conditioning, Geometry, Perturbation, Streams
from .wan import WanFamily


class WanImageToVideoFamily(WanFamily):
    name = "wan_i2v"
    pipeline_class = WanImageToVideoPipeline
    inputs = Inputs(max_images=1)

    def make_helper(self, components):
        denoisers = [n for n, c in self.spec.model.components.items() if c.role == "denoiser"]
        return WanImageToVideoPipeline(
            tokenizer=components["tokenizer"], text_encoder=components["text_encoder"], vae=components["vae"],
            scheduler=components.get("scheduler"), image_processor=components.get("image_processor"),
            image_encoder=components.get("image_encoder"), transformer=components[denoisers[0]],
        )

    def encode_images(self, request: Request, geometry: Geometry, generators: list[torch.Generator]
                      ) -> Conditioning | None:
        """Per sample: the 20-channel condition (mask + normalised VAE mode of the image and F-1 grey frames, no
        generator draw) and, when the transformer takes image tokens (Wan2.1), the CLIP hidden states of the
        image as given (CLIP's processor resizes it itself)."""
        helper, image = self.helper, request.images[0].image
        b, frames = len(generators), geometry.frames or 1
        pixels = helper.video_processor.preprocess(image, height=geometry.height, width=geometry.width)
        placeholder = torch.empty(1, helper.vae.config.z_dim, *self.latent_shape(geometry), device=self.device)
        _, condition = helper.prepare_latents(
            pixels.to(self.device, torch.float32), 1, helper.vae.config.z_dim, geometry.height, geometry.width,
            frames, torch.float32, self.device, latents=placeholder)  # given latents: no noise is drawn
        batched = {"condition": condition.repeat(b, 1, 1, 1, 1)}
        if helper.transformer.config.image_dim is not None:
            if helper.image_encoder is None:
                raise ValueError(f"{type(helper.transformer).__name__} takes image tokens (image_dim is set) but "
                                 "the spec has no image_encoder component")
            batched["encoder_hidden_states_image"] = helper.encode_image(image, self.device).repeat(b, 1, 1)
        return Conditioning(batched)

    def predict(self, denoiser, latents: Streams, timestep, cond, geometry, *, embedded=None,
                perturbation: Perturbation | None = None) -> Streams:
        x = latents["latents"]
        image_tokens = cond.batched.get("encoder_hidden_states_image")
        with layer_skip(denoiser, perturbation, self.targets):
            return {"latents": denoiser(
                hidden_states=torch.cat([x, cond.batched["condition"]], dim=1).to(denoiser.dtype),
                timestep=timestep.expand(x.shape[0]),
                encoder_hidden_states=cond.batched["encoder_hidden_states"].to(denoiser.dtype),
                encoder_hidden_states_image=None if image_tokens is None else image_tokens.to(denoiser.dtype),
                return_dict=False,
            )[0]}
