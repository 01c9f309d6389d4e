"""Wan2.2 TI2V-5B: one model for text-to-video and image-to-video (diffusers' Wan pipelines with
``expand_timesteps``). The timestep is given per token; with an image, the image's latent is the first latent
frame, whose tokens get timestep 0, blended into the model's input every step by a first-frame mask and into the
result before decoding (no channel concatenation, no image encoder). The Wan2.2 VAE packs 2x2 pixels per channel
group (48 latent channels, 16x spatial)."""

from __future__ import annotations

import torch
from diffusers import WanImageToVideoPipeline

from ...spec.request import Request
from .checks import CheckpointMatch, Inputs
from .perturbations import layer_skip
from .types import Conditioning, Decoded, Geometry, Perturbation, Streams
from .wan import WanFamily


class WanTI2VFamily(WanFamily):
    name = "wan_ti2v"
    # The I2V pipeline's helpers serve both tasks (its prompt encoding is WanPipeline's); the checkpoint's
    # model_index names WanPipeline with expand_timesteps set.
    pipeline_class = WanImageToVideoPipeline
    inputs = Inputs(max_images=1)
    checkpoints = CheckpointMatch(pipelines=("WanPipeline", "WanImageToVideoPipeline"),
                                  model_index_values={"expand_timesteps": (True,)})

    def make_helper(self, components):
        denoisers = [n for n, c in self.spec.model.components.items() if c.role == "denoiser"]
        return WanImageToVideoPipeline(
            tokenizer=components["tokenizer"], text_encoder=components["text_encoder"], vae=components["vae"],
            scheduler=components.get("scheduler"), transformer=components[denoisers[0]], expand_timesteps=True,
        )

    def encode_images(self, request: Request, geometry: Geometry, generators: list[torch.Generator]
                      ) -> Conditioning | None:
        """Per sample: the image's normalised VAE mode as the first latent frame (no generator draw) and the
        first-frame mask (0 on frame 0, 1 elsewhere), as diffusers' ``prepare_latents`` makes them."""
        if not request.images:
            return None
        helper, image = self.helper, request.images[0].image
        b, frames = len(generators), geometry.frames or 1
        pixels = helper.video_processor.preprocess(image, height=geometry.height, width=geometry.width)
        placeholder = torch.empty(1, helper.vae.config.z_dim, *self.latent_shape(geometry), device=self.device)
        _, condition, mask = helper.prepare_latents(
            pixels.to(self.device, torch.float32), 1, helper.vae.config.z_dim, geometry.height, geometry.width,
            frames, torch.float32, self.device, latents=placeholder)  # given latents: no noise is drawn
        geometry.extra["first_frame"] = (condition, mask)  # for decode
        return Conditioning({"condition": condition.repeat(b, 1, 1, 1, 1), "first_frame_mask": mask.repeat(b, 1, 1, 1, 1)})

    def decode(self, latents: Streams, geometry: Geometry) -> Decoded:
        """With an image, frame 0 is the image's latent, put in place once before decoding (diffusers blends it
        into the model's input every step and into the result once; the state itself keeps its sampled frame 0,
        so a rollout's stored states are the samples its log-probs score)."""
        first = geometry.extra.get("first_frame")
        if first is not None:
            condition, mask = first
            latents = {"latents": (1 - mask) * condition + mask * latents["latents"]}
        return super().decode(latents, geometry)

    def predict(self, denoiser, latents: Streams, timestep, cond, geometry, *, embedded=None,
                perturbation: Perturbation | None = None) -> Streams:
        x = latents["latents"]
        b = x.shape[0]
        mask = cond.batched.get("first_frame_mask")
        if mask is not None:
            x = (1 - mask) * cond.batched["condition"] + mask * x
        else:
            mask = torch.ones(1, 1, *x.shape[2:], device=x.device, dtype=x.dtype)
        _, ph, pw = denoiser.config.patch_size
        per_token = (mask[:1, 0, :, ::ph, ::pw] * timestep).flatten(1).expand(b, -1)  # 0 on the image's tokens
        with layer_skip(denoiser, perturbation, self.targets):
            return {"latents": denoiser(
                hidden_states=x.to(denoiser.dtype), timestep=per_token,
                encoder_hidden_states=cond.batched["encoder_hidden_states"].to(denoiser.dtype), return_dict=False,
            )[0]}
