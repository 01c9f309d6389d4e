"""HunyuanVideo-1.5 text-to-video (``HunyuanVideo15Pipeline``) and image-to-video
(``HunyuanVideo15ImageToVideoPipeline``).

Prompts are Qwen2.5-VL hidden states (1000 tokens, masked) plus ByT5 embeddings of the prompt's quoted text (256).
The transformer takes 65 channels: the noise, a condition latent and a mask (zeros for text-to-video; the image's VAE
mode on the first latent frame and a first-frame mask for image-to-video), and SigLIP image tokens (zeros for
text-to-video). Nothing is re-imposed after a step. The timestep is ``t`` itself, in the transformer's dtype. The VAE
decodes one sample at a time (its causal attention mask does not broadcast over a batch).
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers import HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline

from ...spec import PipelineSpec, SpecError
from ...spec.request import Request
from ...targets import AttentionTarget, BlocksTarget, GuidanceTarget, MlpTarget, ParallelTarget, Targets
from .base import Family
from .checks import Inputs
from .types import Conditioning, Decoded, Geometry, Perturbation, Streams

UNREGISTERED = ("diffusers' block hooks do not know HunyuanVideo15's transformer blocks (they are not in its "
                "TransformerBlockRegistry)")


class HunyuanVideo15Family(Family):
    name = "hunyuan_video15"
    pipeline_class = HunyuanVideo15Pipeline
    targets = Targets(
        attention=AttentionTarget({"joint": ("transformer_blocks.*.attn",),
                                   "text": ("context_embedder.token_refiner.refiner_blocks.*.attn",)}),
        blocks=BlocksTarget(("transformer_blocks",), shared_inputs=("rope",)),
        mlp=MlpTarget(),  # tanh-GELU feed-forwards in the blocks (the token refiner's are SiLU)
        parallel=ParallelTarget(sequence_refusal="HunyuanVideo15Transformer3DModel has no diffusers context-parallel "
                                                 "plan"),
        guidance=GuidanceTarget(skip_layer_refusal=UNREGISTERED),
        cache_limits={"first_block": UNREGISTERED, "magcache": UNREGISTERED},
    )
    required = {"text_encoder": "encoder", "tokenizer": "tokenizer", "text_encoder_2": "encoder",
                "tokenizer_2": "tokenizer", "vae": "vae"}

    def __init__(self, spec: PipelineSpec, components, device: torch.device):
        super().__init__(spec, components, device)
        if self.helper.transformer.config.get("use_meanflow"):
            raise SpecError.single("step-distilled (use_meanflow) checkpoints take the next step's timestep in every "
                                   "forward, which the family's predict is not given", "model.source")

    def helper_components(self):
        return (*self.required, "scheduler", "transformer", "guider")  # no guider: the spec's guidance replaces it

    def encode(self, prompts: list[str], request: Request) -> Conditioning:
        embeds, mask, glyphs, glyph_mask = self.helper.encode_prompt(
            list(prompts), device=self.device, dtype=self.latent_dtype(None), batch_size=len(prompts))
        return Conditioning({"encoder_hidden_states": embeds, "encoder_attention_mask": mask,
                             "encoder_hidden_states_2": glyphs, "encoder_attention_mask_2": glyph_mask})

    def latent_dtype(self, denoiser) -> torch.dtype:
        return self.helper.transformer.dtype  # the pipelines keep latents in the transformer's dtype

    def geometry(self, request: Request, size_scale: float) -> Geometry:
        if request.height and request.width:
            return super().geometry(request, size_scale)
        helper = self.helper  # HunyuanVideo15Pipeline's default: the 16:9 bucket at the transformer's target size
        height, width = helper.video_processor.calculate_default_height_width(9, 16, helper.target_size)
        return Geometry(int(height * size_scale), int(width * size_scale), request.frames, request.fps)

    def latent_shape(self, geometry: Geometry) -> tuple[int, int, int]:
        helper = self.helper
        return ((geometry.frames or 1) - 1) // helper.vae_scale_factor_temporal + 1, \
            geometry.height // helper.vae_scale_factor_spatial, geometry.width // helper.vae_scale_factor_spatial

    def tokens(self, geometry: Geometry) -> int:
        config = self.helper.transformer.config
        f, h, w = self.latent_shape(geometry)
        return f // config.patch_size_t * (h // config.patch_size) * (w // config.patch_size)

    def initial_latents(self, geometry: Geometry, generators: list[torch.Generator]) -> Streams:
        helper = self.helper
        return {"latents": helper.prepare_latents(len(generators), helper.num_channels_latents, geometry.height,
                                                  geometry.width, geometry.frames or 1, self.latent_dtype(None),
                                                  self.device, generators)}

    def encode_images(self, request: Request, geometry: Geometry, generators: list[torch.Generator]
                      ) -> Conditioning | None:
        """Text-to-video's empty conditioning: a zero condition latent and mask, and zero image tokens."""
        helper, b, dtype = self.helper, len(generators), self.latent_dtype(None)
        shape = (b, helper.num_channels_latents + 1, *self.latent_shape(geometry))
        return Conditioning({"condition": torch.zeros(shape, dtype=dtype, device=self.device),
                             "image_embeds": torch.zeros(b, helper.vision_num_semantic_tokens, helper.vision_states_dim,
                                                         dtype=dtype, device=self.device)})

    def predict(self, denoiser, latents: Streams, timestep, cond, geometry, *, embedded=None,
                perturbation: Perturbation | None = None) -> Streams:
        dtype = self.latent_dtype(denoiser)
        x = latents["latents"].to(dtype)
        out = denoiser(
            hidden_states=torch.cat([x, cond.batched["condition"].to(dtype)], dim=1),
            image_embeds=cond.batched["image_embeds"], timestep=timestep.expand(x.shape[0]).to(dtype),
            encoder_hidden_states=cond.batched["encoder_hidden_states"],
            encoder_attention_mask=cond.batched["encoder_attention_mask"],
            encoder_hidden_states_2=cond.batched["encoder_hidden_states_2"],
            encoder_attention_mask_2=cond.batched["encoder_attention_mask_2"], return_dict=False,
        )[0]
        return {"latents": out}

    def decode(self, latents: Streams, geometry: Geometry) -> Decoded:
        helper, vae = self.helper, self.helper.vae
        x = latents["latents"].to(vae.dtype) / vae.config.scaling_factor
        video = torch.cat([vae.decode(x[i:i + 1], return_dict=False)[0] for i in range(x.shape[0])])
        return Decoded(np.asarray(helper.video_processor.postprocess_video(video, output_type="np"), dtype=np.float32))


class HunyuanVideo15ImageToVideoFamily(HunyuanVideo15Family):
    """The output takes the size bucket nearest the image's aspect at the transformer's target size; the image is
    cropped to it, VAE-encoded by its mode onto the first latent frame, and given to SigLIP for image tokens."""

    name = "hunyuan_video15_i2v"
    pipeline_class = HunyuanVideo15ImageToVideoPipeline
    required = {**HunyuanVideo15Family.required, "image_encoder": "encoder", "feature_extractor": "processor"}
    inputs = Inputs(max_images=1)

    def image(self, request: Request):
        image = request.images[0].image
        if not (hasattr(image, "size") and hasattr(image, "convert")):
            raise SpecError.single("HunyuanVideo-1.5 buckets its image as a PIL image: pass a PIL image or a path",
                                   "request.image")
        return image

    def geometry(self, request: Request, size_scale: float) -> Geometry:
        if not request.images:  # planning without an image (explain): the 16:9 bucket
            return super().geometry(request, size_scale)
        image = self.image(request)
        height, width = self.helper.video_processor.calculate_default_height_width(
            height=image.size[1], width=image.size[0], target_size=self.helper.target_size)
        return Geometry(int(height * size_scale), int(width * size_scale), request.frames, request.fps)

    def encode_images(self, request: Request, geometry: Geometry, generators: list[torch.Generator]
                      ) -> Conditioning | None:
        helper, b, dtype = self.helper, len(generators), self.latent_dtype(None)
        image = helper.video_processor.resize(self.image(request), height=geometry.height, width=geometry.width,
                                              resize_mode="crop")
        placeholder = torch.empty(b, helper.num_channels_latents, *self.latent_shape(geometry), device=self.device)
        condition, mask = helper.prepare_cond_latents_and_mask(placeholder, image, b, geometry.height, geometry.width,
                                                               dtype, self.device)
        return Conditioning({"condition": torch.cat([condition, mask], dim=1),
                             "image_embeds": helper.encode_image(image, b, self.device, dtype)})
