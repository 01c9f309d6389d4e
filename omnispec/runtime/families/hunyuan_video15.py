"""HunyuanVideo-1.5 text-to-video (``HunyuanVideo15Pipeline``) and image-to-video
(``HunyuanVideo15ImageToVideoPipeline``).

Prompts are Qwen2.5-VL hidden states (1000 tokens, masked) plus ByT5 embeddings of the prompt's quoted text (256).
The transformer takes 65 channels: the noise, a condition latent and a mask (zeros for text-to-video; the image's VAE
mode on the first latent frame and a first-frame mask for image-to-video), and SigLIP image tokens (zeros for
text-to-video). Nothing is re-imposed after a step. The timestep is ``t`` itself, in the transformer's dtype. The VAE
decodes one sample at a time (its causal attention mask does not broadcast over a batch).

**Text without padding.** The prompt encodings come padded (1000 and 256 tokens; the text-to-video image tokens are
729 more, all padding), and the transformer masks the padding with an (all tokens x all tokens) boolean mask in every
block, which keeps attention off the flash-class kernels (BENCHMARKS.md, "HunyuanVideo-1.5"). Here each prompt's valid
tokens are kept in their order and the rest dropped (``ragged``: padded only to the call's longest, with their
counts on the host), text-to-video passes no image tokens, and the rows of a forward run as one forward per prompt
length (so a positive and a negative prompt of different lengths run apart, as the pipeline runs its passes), each
cut to its rows' valid tokens, so the joint attentions run without a mask (``UnmaskedJointAttention``). The padding
is masked out of every valid token's attention and the output keeps only the video tokens, so what the model
computes is the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from diffusers import HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0

from ... import bridge
from ...spec import PipelineSpec, SpecError
from ...spec.request import Request
from ...targets import AttentionTarget, BlocksTarget, GuidanceTarget, MlpTarget, ParallelTarget, Targets
from .base import Family
from .checks import Inputs
from .text_padding import per_length, valid_first
from .types import Conditioning, Decoded, Geometry, Perturbation, Streams

PROMPT_KEYS = frozenset({"encoder_hidden_states", "encoder_attention_mask", "encoder_hidden_states_2",
                         "encoder_attention_mask_2"})

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
        UnmaskedJointAttention.install(self.helper.transformer)

    def helper_components(self):
        return (*self.required, "scheduler", "transformer", "guider")  # no guider: the spec's guidance replaces it

    def encode(self, prompts: list[str], request: Request) -> Conditioning:
        embeds, mask, glyphs, glyph_mask = self.helper.encode_prompt(
            list(prompts), device=self.device, dtype=self.latent_dtype(None), batch_size=len(prompts))
        (embeds, mask, counts), (glyphs, glyph_mask, glyph_counts) = valid_first(embeds, mask), valid_first(glyphs,
                                                                                                      glyph_mask)
        return Conditioning({"encoder_hidden_states": embeds, "encoder_attention_mask": mask,
                             "encoder_hidden_states_2": glyphs, "encoder_attention_mask_2": glyph_mask,
                             "prompt_tokens": counts, "glyph_tokens": glyph_counts}, ragged=PROMPT_KEYS)

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
        """Text-to-video's empty conditioning: a zero condition latent and mask, and no image tokens (the pipeline
        passes zeros, which the transformer masks out as padding)."""
        helper, b, dtype = self.helper, len(generators), self.latent_dtype(None)
        shape = (b, helper.num_channels_latents + 1, *self.latent_shape(geometry))
        return Conditioning({"condition": torch.zeros(shape, dtype=dtype, device=self.device),
                             "image_embeds": torch.zeros(b, 0, helper.vision_states_dim, dtype=dtype,
                                                         device=self.device)})

    def predict(self, denoiser, latents: Streams, timestep, cond, geometry, *, embedded=None,
                perturbation: Perturbation | None = None) -> Streams:
        """One forward per prompt length among the rows (one in all for a single prompt, or a group of one prompt's
        samples), each with its prompts cut to their valid tokens, so no row is padded."""
        x = latents["latents"].to(self.latent_dtype(denoiser))
        lengths = list(zip(cond.batched["prompt_tokens"].tolist(), cond.batched["glyph_tokens"].tolist()))  # host

        def forward(index: torch.Tensor | None, length: tuple[int, int]) -> torch.Tensor:
            rows = (x, cond) if index is None else (x[index], cond.rows(index))
            return self._unpadded_forward(denoiser, *rows, *length, timestep)

        return {"latents": per_length(lengths, forward, x.device)}

    def _unpadded_forward(self, denoiser, x: torch.Tensor, cond: Conditioning, prompt: int, glyph: int,
                          timestep) -> torch.Tensor:
        """A forward of rows whose prompts have ``prompt`` valid tokens (and ``glyph`` ByT5 ones), cut to them: no row
        is padded, so the joint attentions run without a mask."""
        c, dtype = cond.batched, x.dtype
        with UnmaskedJointAttention.unmasked_here():
            return denoiser(
                hidden_states=torch.cat([x, c["condition"].to(dtype)], dim=1),
                image_embeds=c["image_embeds"], timestep=timestep.expand(x.shape[0]).to(dtype),
                encoder_hidden_states=c["encoder_hidden_states"][:, :prompt],
                encoder_attention_mask=c["encoder_attention_mask"][:, :prompt],
                encoder_hidden_states_2=c["encoder_hidden_states_2"][:, :glyph],
                encoder_attention_mask_2=c["encoder_attention_mask_2"][:, :glyph], return_dict=False,
            )[0]

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


class UnmaskedJointAttention(HunyuanVideo15AttnProcessor2_0):
    """diffusers' ``HunyuanVideo15AttnProcessor2_0``, without its mask inside the family's forwards, whose rows have no
    text padding (``unmasked_here``); elsewhere diffusers' own call. Written here, not wrapped: diffusers' processor
    always expands the text mask to a (tokens x tokens) one and hands it to the attention, which a mask of all ones
    would keep off the flash kernels too."""

    unmasked = False  # read by every joint attention; set only around the family's forwards

    @classmethod
    @contextmanager
    def unmasked_here(cls) -> Iterator[None]:
        previous, cls.unmasked = cls.unmasked, True
        try:
            yield
        finally:
            cls.unmasked = previous

    @classmethod
    def install(cls, denoiser: torch.nn.Module) -> None:
        """Put this processor on the joint attentions that run diffusers' (a processor set otherwise is kept). Other
        callers of the same modules (a diffusers pipeline sharing them) run diffusers' call: ``unmasked`` is off
        outside the family's forwards."""
        for block in getattr(denoiser, "transformer_blocks", ()):
            processor = block.attn.processor
            if type(processor) is HunyuanVideo15AttnProcessor2_0:
                replacement = cls()
                bridge.set_processor_settings(replacement, bridge.processor_settings(processor))
                block.attn.set_processor(replacement)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if not type(self).unmasked or encoder_hidden_states is None:
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        query, key, value = (proj(hidden_states).unflatten(2, (attn.heads, -1))
                             for proj in (attn.to_q, attn.to_k, attn.to_v))
        query, key = attn.norm_q(query), attn.norm_k(key)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        text_query, text_key, text_value = (proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
                                            for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
        if attn.norm_added_q is not None:
            text_query = attn.norm_added_q(text_query)
        if attn.norm_added_k is not None:
            text_key = attn.norm_added_k(text_key)
        backend, parallel_config = bridge.processor_settings(self)
        out = dispatch_attention_fn(torch.cat([query, text_query], dim=1), torch.cat([key, text_key], dim=1),
                                    torch.cat([value, text_value], dim=1), backend=backend,
                                    parallel_config=parallel_config)
        out = out.flatten(2, 3).to(query.dtype)
        video, text = out.split_with_sizes([hidden_states.shape[1], encoder_hidden_states.shape[1]], dim=1)
        video = attn.to_out[1](attn.to_out[0](video))
        return video, attn.to_add_out(text) if getattr(attn, "to_add_out", None) is not None else text
