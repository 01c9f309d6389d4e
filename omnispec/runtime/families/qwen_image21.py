"""Qwen-Image-2.1 (``QwenImage21Pipeline``) and its Turbo (diffusers' ``QwenImage21TurboModularPipeline``: the same
modules and model, its checkpoint's own sigma grid and no guidance), text-to-image and image-conditioned.

One single-stream transformer reads one sequence: the Qwen3-VL prompt encoding, with every condition image's latent
tokens dropped into the vision slots the encoder reserved for it (a slot stands for 2x2 latent tokens), then the
target's tokens; the prediction is the sequence's last tokens. Latents are the 16x VAE's, unpatched and flattened,
in the prompt embeddings' dtype. A condition image is resized once to ``output_resolution``-squared pixels of its
aspect and serves both the text encoder (as vision context) and the VAE (its mode: no generator draw).

The position of every token, padding included, moves its rotary phase, so a prompt's padding changes its output:
true-CFG passes run apart at their own lengths, as diffusers runs them. diffusers caches the prompt's keys and
values after the first step (its ``use_kv_cache``); every forward here recomputes them, which gives the same
numbers in float32 (the prompt tokens are modulated at t=0 and never see the target's).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from diffusers import QwenImage21Pipeline
from diffusers.pipelines.qwenimage21 import pipeline_qwenimage21
from PIL import Image

from ... import bridge
from ...spec import PipelineSpec, SpecError
from ...spec.request import Request
from ...targets import AttentionTarget, BlocksTarget, GuidanceTarget, ParallelTarget, Targets
from .base import Family
from .checks import Inputs
from .latents import decode_images
from .parallel_plans import model_tensor_plan
from .types import Conditioning, Decoded, Geometry, Perturbation, Streams

PROMPT_KEYS = frozenset({"encoder_hidden_states", "encoder_hidden_states_mask", "image_pad_mask"})
UNREGISTERED = ("diffusers 0.42 registers no QwenImage21TransformerBlock for its block hooks (they cannot find its "
                "hidden states)")
SLOT_TOKENS = 4  # latent tokens per vision slot of the prompt (2x2)


class QwenImage21Family(Family):
    name = "qwen_image21"
    pipeline_class = QwenImage21Pipeline
    ragged_passes_apart = True  # padding shifts the rotary positions: each pass's prompt at its own length
    inputs = Inputs(max_images=16)  # diffusers sets no limit; each image adds a block of tokens to every forward
    options = {"output_resolution": 1024}  # the pipeline's: default side, and the reference images' area
    targets = Targets(
        attention=AttentionTarget({"joint": ("transformer_blocks.*.attn",)}),
        blocks=BlocksTarget(("transformer_blocks",), shared_inputs=("pos_embed", "time_text_embed", "modulation")),
        parallel=ParallelTarget(sequence_refusal="QwenImage21Transformer2DModel has no diffusers context-parallel "
                                                 "plan (its block-causal attention splits the sequence in segments)",
                                tensor_plan=model_tensor_plan, tensor_refusal=None),
        guidance=GuidanceTarget(skip_layer_refusal=UNREGISTERED),
        cache_limits={"first_block": UNREGISTERED, "magcache": UNREGISTERED},
    )
    required = {"text_encoder": "encoder", "processor": "processor", "vae": "vae"}

    def helper_components(self):
        return (*self.required, "scheduler", "transformer")

    # ---- checks before loading -------------------------------------------------------------------------

    @classmethod
    def index_problems(cls, spec: PipelineSpec, index) -> list[tuple[str, str]]:
        """A checkpoint whose model_index.json sets ``sample_sigmas`` (the Turbo's) is sampled on them by diffusers:
        the spec's first phase must walk the same sigmas."""
        problems = super().index_problems(spec, index)
        theirs = index.get("sample_sigmas")
        if theirs is None:
            return problems
        if not isinstance(theirs, list) or not all(isinstance(s, (int, float)) and not isinstance(s, bool)
                                                   for s in theirs):
            problems.append(("model.source", f"the checkpoint's model_index.json sets sample_sigmas {theirs!r:.80}, "
                                             "not a list of numbers"))
            return problems
        ours = getattr(spec.recipe.phases[0].schedule, "sigmas", None)
        if ours is None or len(ours) != len(theirs) or not np.allclose(ours, theirs, rtol=0, atol=1e-6):
            problems.append(("recipe.phases.0.schedule.sigmas", (
                f"the checkpoint's model_index.json sets sample_sigmas {list(theirs)}, which diffusers samples on, "
                f"and the spec's schedule walks {'its step count' if ours is None else list(ours)}: set "
                "recipe.phases.0.schedule.sigmas to the checkpoint's (the bundled qwen-image-2.1-turbo spec does)")))
        return problems

    # ---- prompt and images --------------------------------------------------------------------------------

    def condition_images(self, request: Request) -> list[tuple[Any, torch.Tensor, tuple[int, int]]]:
        """Each request image as the pipeline takes it: RGBA, resized to ``output_resolution``-squared pixels of its
        aspect (multiples of 32); (the resized image for the text encoder, its VAE pixels (1, 4, 1, H, W),
        (width, height))."""
        helper, area = self.helper, self.settings["output_resolution"] ** 2
        out = []
        for image in self._pil_images(request):
            image = image if image.mode == "RGBA" else image.convert("RGBA")
            width, height, _ = pipeline_qwenimage21.calculate_dimensions(area, image.size[0] / image.size[1])
            resized = helper.image_processor.resize(image, width=width, height=height)
            pixels = helper.image_processor.preprocess(image, width=width, height=height).unsqueeze(2)
            out.append((resized, pixels, (width, height)))
        return out

    def _pil_images(self, request: Request) -> list[Image.Image]:
        images = []
        for condition in request.images:
            image = condition.image
            if isinstance(image, np.ndarray):
                image = Image.fromarray(image)
            if not isinstance(image, Image.Image):
                raise SpecError.single(f"family {self.name!r} shows its condition images to the text encoder as PIL "
                                       "images: pass a PIL image, a uint8 array or a path", "request.image")
            images.append(image)
        return images

    def encode(self, prompts: list[str], request: Request) -> Conditioning:
        images = [resized for resized, _, _ in self.condition_images(request)] or None
        embeds, mask, image_pad = self.helper.encode_prompt(list(prompts), image=images, device=self.device)
        mask = torch.ones(embeds.shape[:2], dtype=torch.long) if mask is None else mask.cpu()
        # masks on the host: each forward asks whether anything is padded without waiting for the device
        return Conditioning({"encoder_hidden_states": embeds, "encoder_hidden_states_mask": mask,
                             "image_pad_mask": image_pad.cpu()}, ragged=PROMPT_KEYS)

    def encode_images(self, request: Request, geometry: Geometry, generators: list[torch.Generator]
                      ) -> Conditioning | None:
        """The condition images' normalised VAE latents (their mode), flattened and joined in order, one row per
        sample; their latent shapes lead the target's in the rotary layout."""
        helper, vae = self.helper, self.helper.vae
        f = helper.vae_scale_factor
        packed, shapes = [], []
        for _, pixels, (width, height) in self.condition_images(request):
            latents = bridge.encode_vae_image(helper, pixels.to(self.device, self.latent_dtype(None)), None)
            c, h, w = latents.shape[1], latents.shape[3], latents.shape[4]
            packed.append(bridge.pack_latents(helper, latents, 1, c, h, w).to(self.latent_dtype(None)))
            shapes.append((1, height // f, width // f))
        geometry.extra["qwen21_condition_shapes"] = shapes
        if not packed:
            return None
        return Conditioning({"image_latents": torch.cat(packed, dim=1).repeat(len(generators), 1, 1)})

    # ---- geometry and latents -------------------------------------------------------------------------

    def geometry(self, request: Request, size_scale: float) -> Geometry:
        """The request's size, else the last image's aspect at ``output_resolution``-squared pixels, else
        ``output_resolution`` square; floored to a multiple of 32."""
        side = self.settings["output_resolution"]
        height = width = side
        if request.images:
            image = self._pil_images(request)[-1]
            width, height, _ = pipeline_qwenimage21.calculate_dimensions(side * side, image.size[0] / image.size[1])
        multiple = self.helper.vae_scale_factor * 2
        height = int((request.height or height) * size_scale) // multiple * multiple
        width = int((request.width or width) * size_scale) // multiple * multiple
        return Geometry(height, width, request.frames, request.fps)

    def _latent_hw(self, geometry: Geometry) -> tuple[int, int]:
        f = self.helper.vae_scale_factor
        return 2 * (geometry.height // (f * 2)), 2 * (geometry.width // (f * 2))

    def tokens(self, geometry: Geometry) -> int:
        h, w = self._latent_hw(geometry)
        return h * w

    def latent_dtype(self, denoiser) -> torch.dtype:
        return self.helper.text_encoder.dtype  # the pipeline keeps latents in the prompt embeddings' dtype

    def initial_latents(self, geometry: Geometry, generators: list[torch.Generator]) -> Streams:
        helper = self.helper
        latents, _ = helper.prepare_latents(None, len(generators), helper.transformer.config.in_channels,
                                            geometry.height, geometry.width, self.latent_dtype(None), self.device,
                                            generators)
        return {"latents": latents}

    def noise(self, latents: Streams, geometry: Geometry, generators: list[torch.Generator]) -> Streams:
        return self.initial_latents(geometry, generators)  # drawn unflattened, then flattened

    def pack(self, stream: str, spatial: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        b, c, h, w = spatial.shape
        return bridge.pack_latents(QwenImage21Pipeline, spatial.contiguous(), b, c, h, w)

    def unpack(self, stream: str, latents: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        return self._spatial(latents, geometry).squeeze(2)

    def _spatial(self, latents: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        return bridge.unpack_latents(QwenImage21Pipeline, latents, geometry.height, geometry.width,
                                     self.helper.vae_scale_factor)

    # ---- the forward ------------------------------------------------------------------------------------

    def predict(self, denoiser, latents: Streams, timestep, cond, geometry, *, embedded=None,
                perturbation: Perturbation | None = None) -> Streams:
        x = latents["latents"].to(self.latent_dtype(denoiser))
        b, tokens = x.shape[:2]
        reference = cond.batched.get("image_latents")
        hidden = x if reference is None else torch.cat([reference.to(x.dtype), x], dim=1)  # references first
        embeds = cond.batched["encoder_hidden_states"]
        mask = cond.batched["encoder_hidden_states_mask"]
        image_pad = cond.batched["image_pad_mask"].to(torch.bool)
        # the target's slots follow the prompt's: one per 2x2 latent tokens
        img_mask = torch.cat([image_pad, image_pad.new_ones(image_pad.shape[0], tokens // SLOT_TOKENS)], dim=1)
        h, w = self._latent_hw(geometry)
        shapes = [*geometry.extra.get("qwen21_condition_shapes", []), (1, h, w)]
        out = denoiser(
            hidden_states=hidden, timestep=timestep.expand(b).to(x.dtype) / 1000,
            encoder_hidden_states=embeds,
            encoder_hidden_states_mask=None if bool(mask.all()) else mask.to(embeds.device),
            img_shapes=[shapes] * b, img_mask=img_mask.to(embeds.device), attention_kwargs={}, return_dict=False,
        )[0]
        return {"latents": out[:, -tokens:]}

    def decode(self, latents: Streams, geometry: Geometry) -> Decoded:
        """Un-normalised and decoded to RGBA (the VAE reconstructs four channels)."""
        helper, vae = self.helper, self.helper.vae
        x = self._spatial(latents["latents"], geometry).to(vae.dtype)
        z = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(x)
        std = torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(x)
        image = vae.decode(x * std + mean, return_dict=False)[0][:, :, 0]
        return Decoded(decode_images(helper, image))
