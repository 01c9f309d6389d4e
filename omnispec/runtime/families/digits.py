"""The embedded digits model (``src_models/digits``): pixel-space flow matching, no VAE."""

from __future__ import annotations

import torch
from diffusers.utils.torch_utils import randn_tensor

from ...log import logger
from ...spec.request import Request
from ...targets import AttentionTarget, BlocksTarget, Targets
from .base import Family
from .perturbations import layer_skip
from .types import Conditioning, Decoded, Geometry, Perturbation, Streams


class DigitsFamily(Family):
    name = "digits"
    targets = Targets(attention=AttentionTarget({"self": ("blocks.*.attn",)}), blocks=BlocksTarget(("blocks",)))
    required = {"text_encoder": "encoder", "tokenizer": "tokenizer"}

    def encode(self, prompts: list[str], request: Request) -> Conditioning:
        tokenizer, encoder = self.components["tokenizer"], self.components["text_encoder"]
        length = request.max_sequence_length or 8
        for prompt in prompts:  # as diffusers' pipelines warn when their tokenizers cut a prompt
            count = len(tokenizer(prompt).input_ids)
            if count > length:
                logger.warning(f"prompt {prompt!r} has {count} tokens; only the first {length} are used "
                               f"(max_sequence_length {length})")
        enc = tokenizer(prompts, padding="max_length", max_length=length, truncation=True, return_tensors="pt")
        pooled = encoder(enc.input_ids.to(self.device), enc.attention_mask.to(self.device))
        return Conditioning({"text_embeds": pooled})

    def initial_latents(self, geometry: Geometry, generators: list[torch.Generator]) -> Streams:
        shape = (len(generators), 1, geometry.height, geometry.width)
        return {"latents": randn_tensor(shape, generator=generators, device=self.device, dtype=torch.float32)}

    def latent_dtype(self, denoiser) -> torch.dtype:
        return torch.float32

    def tokens(self, geometry: Geometry) -> int:
        return geometry.height * geometry.width // 64

    def predict(self, denoiser, latents: Streams, timestep, cond, geometry, *, embedded=None,
                perturbation: Perturbation | None = None) -> Streams:
        x = latents["latents"]
        with layer_skip(denoiser, perturbation, self.targets):
            return {"latents": denoiser(hidden_states=x.to(denoiser.dtype), timestep=timestep.expand(x.shape[0]),
                                        text_embeds=cond.batched["text_embeds"])[0].to(torch.float32)}

    def decode(self, latents: Streams, geometry: Geometry) -> Decoded:
        """Pixels in [-1, 1] -> float32 (B, H, W, 1) in [0, 1]: white ink on black, as in the data set."""
        x = latents["latents"]
        return Decoded(((x.float() + 1.0) / 2.0).clamp(0.0, 1.0).permute(0, 2, 3, 1).cpu().numpy())
