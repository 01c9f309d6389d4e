"""Wan2.1 / Wan2.2 text-to-video: UMT5 prompts, float32 latents, one or two expert transformers."""

from __future__ import annotations

import numpy as np
import torch
from diffusers import WanPipeline
from diffusers.utils.torch_utils import randn_tensor

from ...spec.request import Request
from ...targets import (AttentionTarget, BlocksTarget, MlpTarget, ParallelTarget, Targets, TensorPlan,
                        VideoTokensTarget)
from .base import Family
from .checks import CheckpointMatch
from .perturbations import layer_skip
from .types import Conditioning, Decoded, Geometry, Perturbation, Streams


def wan_tensor_plan(denoiser: torch.nn.Module) -> TensorPlan:
    """Wan's processor reads ``attn.heads`` and normalises q and k over all heads before splitting them, so
    besides the split linears the heads divide and the q/k norms become split norms; I2V's image keys and
    values (``add_k_proj``/``add_v_proj``, ``norm_added_k``) split like the text ones."""
    linears: dict[str, str] = {}
    for attn in ("attn1", "attn2"):
        for proj in ("to_q", "to_k", "to_v"):
            linears[f"blocks.*.{attn}.{proj}"] = "colwise"
        linears[f"blocks.*.{attn}.to_out.0"] = "rowwise"
    if getattr(denoiser.blocks[0].attn2, "add_k_proj", None) is not None:
        linears["blocks.*.attn2.add_k_proj"] = linears["blocks.*.attn2.add_v_proj"] = "colwise"
    linears["blocks.*.ffn.net.0.proj"] = "colwise"
    linears["blocks.*.ffn.net.2"] = "rowwise"
    return TensorPlan(linears, heads=("blocks.*.attn1", "blocks.*.attn2"),
                      norms=("blocks.*.attn1.norm_[qk]", "blocks.*.attn2.norm_[qk]", "blocks.*.attn2.norm_added_k"))


def wan_token_grid(denoiser: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[int, int, int]:
    """The (frames, height, width) of a call's video tokens: the latents' grid over the transformer's patch."""
    latents = args[0] if args else kwargs["hidden_states"]
    patch = denoiser.config.patch_size
    return tuple(n // p for n, p in zip(latents.shape[2:], patch))  # type: ignore[return-value]


class WanFamily(Family):
    name = "wan"
    pipeline_class = WanPipeline
    targets = Targets(
        attention=AttentionTarget({"self": ("blocks.*.attn1",), "cross": ("blocks.*.attn2",)}),
        blocks=BlocksTarget(("blocks",), shared_inputs=("rope", "condition_embedder")),
        mlp=MlpTarget(),  # tanh-GELU feed-forwards
        video_tokens=VideoTokensTarget(("self",), wan_token_grid),
        parallel=ParallelTarget(sequence_refusal=None, tensor_plan=wan_tensor_plan, tensor_refusal=None),
    )
    required = {"text_encoder": "encoder", "tokenizer": "tokenizer", "vae": "vae"}
    # one timestep per sample (TI2V: family wan_ti2v)
    checkpoints = CheckpointMatch(model_index_values={"expand_timesteps": (None, False)})


    def make_helper(self, components):
        denoisers = [n for n, c in self.spec.model.components.items() if c.role == "denoiser"]
        return WanPipeline(
            tokenizer=components["tokenizer"], text_encoder=components["text_encoder"], vae=components["vae"],
            scheduler=components.get("scheduler"), transformer=components.get(denoisers[0]),
        )

    def encode(self, prompts: list[str], request: Request) -> Conditioning:
        embeds, _ = self.helper.encode_prompt(
            prompt=prompts, do_classifier_free_guidance=False, device=self.device,
            max_sequence_length=request.max_sequence_length or 512,
        )
        return Conditioning({"encoder_hidden_states": embeds})

    def latent_shape(self, geometry: Geometry) -> tuple[int, int, int]:
        h = self.helper
        frames = geometry.frames or 1
        return ((frames - 1) // h.vae_scale_factor_temporal + 1, geometry.height // h.vae_scale_factor_spatial,
                geometry.width // h.vae_scale_factor_spatial)

    def initial_latents(self, geometry: Geometry, generators: list[torch.Generator]) -> Streams:
        channels = self.helper.vae.config.z_dim
        shape = (len(generators), channels, *self.latent_shape(geometry))
        return {"latents": randn_tensor(shape, generator=generators, device=self.device, dtype=torch.float32)}

    def latent_dtype(self, denoiser) -> torch.dtype:
        return torch.float32  # WanPipeline steps float32 latents and casts only the model input

    def tokens(self, geometry: Geometry) -> int:
        p = self.helper.transformer.config.patch_size
        f, h, w = self.latent_shape(geometry)
        return f // p[0] * (h // p[1]) * (w // p[2])

    def predict(self, denoiser, latents: Streams, timestep, cond, geometry, *, embedded=None,
                perturbation: Perturbation | None = None) -> Streams:
        x = latents["latents"]
        with layer_skip(denoiser, perturbation, self.targets):
            return {"latents": denoiser(
                hidden_states=x.to(denoiser.dtype), timestep=timestep.expand(x.shape[0]),
                encoder_hidden_states=cond.batched["encoder_hidden_states"].to(denoiser.dtype), return_dict=False,
                **self.model_inputs(cond),
            )[0]}

    def model_inputs(self, cond: Conditioning) -> dict:
        """Further keyword inputs of the transformer call (VACE's control branch); none for Wan itself."""
        return {}

    def decode(self, latents: Streams, geometry: Geometry) -> Decoded:
        vae = self.helper.vae
        x = latents["latents"]
        z = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(x.device, vae.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(x.device, vae.dtype)
        video = vae.decode(x.to(vae.dtype) / inv_std + mean, return_dict=False)[0]
        frames = self.helper.video_processor.postprocess_video(video, output_type="np")
        return Decoded(np.asarray(frames, dtype=np.float32))
