"""Stable Diffusion 3 / 3.5 (MMDiT): three text encoders, CFG, skip-layer guidance via ``skip_layers``."""

from __future__ import annotations

import torch
from diffusers import StableDiffusion3Pipeline
from diffusers.utils.torch_utils import randn_tensor

from ...spec import SkipLayer
from ...spec.request import Request
from ...targets import AttentionTarget, BlocksTarget, MlpTarget, Targets
from .base import Family
from .latents import decode_images
from .perturbations import layer_skip
from .types import Conditioning, Decoded, Geometry, Perturbation, Streams


class SD3Family(Family):
    name = "sd3"
    pipeline_class = StableDiffusion3Pipeline
    targets = Targets(
        attention=AttentionTarget({"joint": ("transformer_blocks.*.attn",), "self": ("transformer_blocks.*.attn2",)}),
        blocks=BlocksTarget(("transformer_blocks",)),
        mlp=MlpTarget(),  # tanh-GELU feed-forwards
        cache_limits={"first_block": "SD3's last joint block returns no text stream, which diffusers' "
                                     "first-block cache subtracts (use taylorseer, magcache or step_mask)"},
    )
    required = {
        "text_encoder": "encoder", "tokenizer": "tokenizer", "text_encoder_2": "encoder", "tokenizer_2": "tokenizer",
        "text_encoder_3": "encoder", "tokenizer_3": "tokenizer", "vae": "vae",
    }

    def helper_components(self):
        return (*self.required, "scheduler", "transformer")

    def encode(self, prompts: list[str], request: Request) -> Conditioning:
        embeds, _, pooled, _ = self.helper.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=self.device, do_classifier_free_guidance=False,
            max_sequence_length=request.max_sequence_length or 256,
        )
        return Conditioning({"encoder_hidden_states": embeds, "pooled_projections": pooled})

    def initial_latents(self, geometry: Geometry, generators: list[torch.Generator]) -> Streams:
        f = self.helper.vae_scale_factor
        shape = (len(generators), self.helper.vae.config.latent_channels, geometry.height // f, geometry.width // f)
        return {"latents": randn_tensor(shape, generator=generators, device=self.device, dtype=self.latent_dtype(None))}

    def latent_dtype(self, denoiser) -> torch.dtype:
        # StableDiffusion3Pipeline keeps latents in the prompt embeddings' dtype.
        enc = self.helper.text_encoder_3 or self.helper.text_encoder
        return enc.dtype

    def tokens(self, geometry: Geometry) -> int:
        f, p = self.helper.vae_scale_factor, self.helper.patch_size
        return (geometry.height // f // p) * (geometry.width // f // p)

    def predict(self, denoiser, latents: Streams, timestep, cond, geometry, *, embedded=None,
                perturbation: Perturbation | None = None) -> Streams:
        x = latents["latents"].to(self.latent_dtype(denoiser))
        kwargs = {}
        skip = perturbation
        if isinstance(skip, SkipLayer) and skip.skip == "block" and skip.blocks in (None, "transformer_blocks"):
            kwargs["skip_layers"] = list(skip.layers)  # the model's own block skipping, as diffusers' SLG uses
            skip = None
        with layer_skip(denoiser, skip, self.targets):
            return {"latents": denoiser(
                hidden_states=x, timestep=timestep.expand(x.shape[0]),
                encoder_hidden_states=cond.batched["encoder_hidden_states"],
                pooled_projections=cond.batched["pooled_projections"], return_dict=False, **kwargs,
            )[0]}

    def decode(self, latents: Streams, geometry: Geometry) -> Decoded:
        vae = self.helper.vae
        spatial = latents["latents"] / vae.config.scaling_factor + vae.config.shift_factor
        return Decoded(decode_images(self.helper, vae.decode(spatial.to(vae.dtype), return_dict=False)[0]))
