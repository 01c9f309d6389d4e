"""Qwen-Image text-to-image (``QwenImagePipeline``), editing (``QwenImageEditPipeline``,
``QwenImageEditPlusPipeline``) and inpainting (``QwenImageInpaintPipeline``).

Latents are packed 2x2 patches in the prompt embeddings' dtype. Prompts are Qwen2.5-VL hidden states after a fixed
template, padded only to their own call's longest prompt, so they are ``ragged`` with a mask (passed as None when
nothing is padded, as diffusers does). True CFG rescales the guided prediction to the cond pass's norm per token
(``renorm: {over: token}``). Editing feeds the image to the text encoder with the prompt, appends the image's packed
VAE latents (its mode: no generator draw) to the noise tokens of every forward, and keeps the noise tokens of the
prediction; Edit-Plus does so for each of several images. Inpainting runs the text-to-image model from the image
re-noised and sets the kept region back after every step.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline, QwenImageInpaintPipeline, QwenImagePipeline
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus
from diffusers.utils.torch_utils import randn_tensor

from ... import bridge
from ...spec import PipelineSpec, SpecError
from ...spec.request import Request
from ...targets import AttentionTarget, BlocksTarget, MlpTarget, ModulationTarget, ParallelTarget, Targets
from .base import Family
from .checks import Inputs
from .inpainting import START_IMAGE, InpaintMask
from .latents import PackedLatents, decode_images
from .parallel_plans import model_tensor_plan
from .perturbations import layer_skip
from .types import Conditioning, Decoded, Geometry, Perturbation, Streams

PROMPT_KEYS = frozenset({"encoder_hidden_states", "encoder_hidden_states_mask"})
IMAGE_AREA = 1024 * 1024  # the editing pipelines size the reference image (and the default output) to this area


class QwenImageFamily(PackedLatents, Family):
    name = "qwen_image"
    pipeline_class = QwenImagePipeline
    ragged_passes_apart = True  # QwenImagePipeline's true CFG: two forwards, each prompt at its own length
    targets = Targets(
        attention=AttentionTarget({"joint": ("transformer_blocks.*.attn",)}),
        blocks=BlocksTarget(("transformer_blocks",), shared_inputs=("pos_embed", "time_text_embed")),
        mlp=MlpTarget(),  # tanh-GELU feed-forwards
        modulation=ModulationTarget("time_text_embed", ("transformer_blocks.*.img_mod.1",
                                                        "transformer_blocks.*.txt_mod.1", "norm_out.linear")),
        parallel=ParallelTarget(sequence_refusal=None, tensor_plan=model_tensor_plan, tensor_refusal=None),
    )
    required = {"text_encoder": "encoder", "tokenizer": "tokenizer", "vae": "vae"}

    @classmethod
    def check_spec(cls, spec: PipelineSpec) -> None:
        super().check_spec(spec)
        if spec.policies.parallel.ring > 1:
            raise SpecError.single("ring attention runs diffusers' _native_flash kernel, which takes no attention mask, "
                                   "and Qwen-Image masks its padded prompt tokens (use ulysses)", "policies.parallel.ring")

    def helper_components(self):
        return (*self.required, "scheduler", "transformer")

    def encode(self, prompts: list[str], request: Request) -> Conditioning:
        embeds, mask = self.helper.encode_prompt(list(prompts), device=self.device,
                                                 max_sequence_length=request.max_sequence_length or 512)
        return _prompt_conditioning(embeds, mask)

    def latent_dtype(self, denoiser) -> torch.dtype:
        return self.helper.text_encoder.dtype  # QwenImagePipeline keeps latents in the prompt embeddings' dtype

    def initial_latents(self, geometry: Geometry, generators: list[torch.Generator]) -> Streams:
        helper = self.helper
        return {"latents": helper.prepare_latents(len(generators), helper.transformer.config.in_channels // 4,
                                                  geometry.height, geometry.width, self.latent_dtype(None),
                                                  self.device, generators)}

    def noise(self, latents: Streams, geometry: Geometry, generators: list[torch.Generator]) -> Streams:
        return self.initial_latents(geometry, generators)  # drawn unpacked, then packed

    def pack(self, stream: str, spatial: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        b, c, h, w = spatial.shape
        return bridge.pack_latents(QwenImagePipeline, spatial, b, c, h, w)

    def unpack(self, stream: str, latents: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        spatial = bridge.unpack_latents(QwenImagePipeline, latents, geometry.height, geometry.width,
                                                    self.helper.vae_scale_factor)
        return spatial.squeeze(2)

    def image_shapes(self, geometry: Geometry) -> list[tuple[int, int, int]]:
        """RoPE shapes of the noise tokens, then of each reference image's tokens (``encode_images``)."""
        h, w = self._latent_hw(geometry)
        return [(1, h // 2, w // 2), *geometry.extra.get("qwen_reference_shapes", [])]

    def predict(self, denoiser, latents: Streams, timestep, cond, geometry, *, embedded=None,
                perturbation: Perturbation | None = None) -> Streams:
        x = latents["latents"].to(self.latent_dtype(denoiser))
        tokens = x.shape[1]
        reference = cond.batched.get("image_latents")
        hidden = x if reference is None else torch.cat([x, reference.to(x.dtype)], dim=1)
        embeds, mask = self._sequence_padded(cond.batched["encoder_hidden_states"],
                                             cond.batched["encoder_hidden_states_mask"])
        b = x.shape[0]
        with layer_skip(denoiser, perturbation, self.targets):
            out = denoiser(
                hidden_states=hidden, timestep=timestep.expand(b).to(x.dtype) / 1000, guidance=None,
                encoder_hidden_states=embeds,
                encoder_hidden_states_mask=None if bool(mask.all()) else mask.to(embeds.device),
                img_shapes=[self.image_shapes(geometry)] * b, attention_kwargs={}, return_dict=False,
            )[0]
        return {"latents": out[:, :tokens]}

    def modulation_embeddings(self, denoiser, timesteps, embedded, cond):
        """``time_text_embed`` of every step's timestep through ``predict``'s and the model's conversions (the
        embedding reads no prompt: every row of a step is alike); a model with ``zero_cond_t`` (its reference
        images' tokens modulated at timestep 0) also embeds timestep 0."""
        rows, latent_dtype, model_dtype = cond.batch_size, self.latent_dtype(denoiser), denoiser.dtype
        device = cond.batched["encoder_hidden_states"].device
        t = torch.cat([timestep.expand(rows).to(latent_dtype) / 1000 for timestep in timesteps]).to(model_dtype)
        if getattr(denoiser.config, "zero_cond_t", False):
            t = torch.cat([t, t * 0])
        return denoiser.time_text_embed(t.to(device), torch.empty(0, dtype=model_dtype, device=device))

    def _sequence_padded(self, embeds: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Under ulysses the text splits over the sequence ranks: pad it (masked) to a multiple of their count."""
        parallel = self.spec.policies.parallel
        extra = -embeds.shape[1] % (parallel.ulysses * parallel.ring)
        if not extra:
            return embeds, mask
        return (torch.nn.functional.pad(embeds, (0, 0, 0, extra)), torch.nn.functional.pad(mask, (0, extra)))

    def decode(self, latents: Streams, geometry: Geometry) -> Decoded:
        helper, vae = self.helper, self.helper.vae
        x = bridge.unpack_latents(QwenImagePipeline, latents["latents"], geometry.height, geometry.width,
                                              helper.vae_scale_factor).to(vae.dtype)
        z = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(x)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(x)
        image = vae.decode(x / inv_std + mean, return_dict=False)[0][:, :, 0]
        return Decoded(decode_images(helper, image))


class QwenImageEditFamily(QwenImageFamily):
    name = "qwen_image_edit"
    pipeline_class = QwenImageEditPipeline
    required = {**QwenImageFamily.required, "processor": "processor"}
    inputs = Inputs(max_images=1)
    # The reference image's size for the text encoder (the editing pipeline uses the VAE's size for both).
    condition_area = IMAGE_AREA
    sizing = staticmethod(pipeline_qwenimage_edit.calculate_dimensions)  # the pipeline's own sizing rule

    def helper_components(self):
        return (*self.required, "scheduler", "transformer")

    def fitted(self, image, area: int) -> tuple[int, int]:
        """(width, height) of ``image``'s aspect at ``area`` pixels, in multiples of 32."""
        width, height = self.sizing(area, image.size[0] / image.size[1])[:2]
        return int(width), int(height)

    def images(self, request: Request) -> list:
        images = [c.image for c in request.images]
        if not all(hasattr(image, "size") and hasattr(image, "convert") for image in images):
            raise SpecError.single(f"family {self.name!r} sizes its reference images as PIL images: pass a PIL image "
                                   "or a path", "request.image")
        return images

    def geometry(self, request: Request, size_scale: float) -> Geometry:
        """The request's size, or the last image's aspect at 1024x1024 pixels (1024x1024 with no image, when
        planning), floored to a multiple of 16."""
        width, height = self.fitted(self.images(request)[-1], IMAGE_AREA) if request.images else (1024, 1024)
        multiple = self.helper.vae_scale_factor * 2
        height = int((request.height or height) * size_scale) // multiple * multiple
        width = int((request.width or width) * size_scale) // multiple * multiple
        return Geometry(height, width, request.frames, request.fps)

    def initial_latents(self, geometry: Geometry, generators: list[torch.Generator]) -> Streams:
        helper = self.helper  # with no image, the editing pipelines' prepare_latents draws the noise alone
        latents, _ = helper.prepare_latents(None, len(generators), helper.transformer.config.in_channels // 4,
                                            geometry.height, geometry.width, self.latent_dtype(None), self.device,
                                            generators)
        return {"latents": latents}

    def prompt_images(self, request: Request) -> list:
        """The images the text encoder sees, resized to ``condition_area``."""
        out = []
        for image in self.images(request):
            width, height = self.fitted(image, self.condition_area)
            out.append(self.helper.image_processor.resize(image, height, width))
        return out

    def encode(self, prompts: list[str], request: Request) -> Conditioning:
        """One prompt at a time (the processor pairs the images with one prompt's vision tokens), joined padded."""
        images = self.prompt_images(request)
        image = images if self.inputs.max_images > 1 else images[0]
        return Conditioning.cat([_prompt_conditioning(*self.helper.encode_prompt([p], image=image, device=self.device))
                                 for p in prompts])

    def encode_images(self, request: Request, geometry: Geometry, generators: list[torch.Generator]
                      ) -> Conditioning | None:
        """Each image at 1024x1024 pixels' worth of its aspect, VAE-encoded by its mode (no generator draw),
        normalised and packed; the images' tokens follow each other, one row per sample."""
        helper, vae = self.helper, self.helper.vae
        f = helper.vae_scale_factor
        packed, shapes = [], []
        for image in self.images(request):
            width, height = self.fitted(image, IMAGE_AREA)
            pixels = helper.image_processor.preprocess(image, height, width).unsqueeze(2)
            latents = bridge.encode_vae_image(helper, pixels.to(self.device, vae.dtype), None)
            c, h, w = latents.shape[1], latents.shape[3], latents.shape[4]
            packed.append(bridge.pack_latents(helper, latents, 1, c, h, w).to(self.latent_dtype(None)))
            shapes.append((1, height // f // 2, width // f // 2))
        geometry.extra["qwen_reference_shapes"] = shapes
        tokens = self.tokens(geometry) + sum(s[1] * s[2] for s in shapes)
        parallel = self.spec.policies.parallel
        if tokens % (parallel.ulysses * parallel.ring):
            raise SpecError.single(f"{tokens} image tokens (output and references) do not split over "
                                   f"{parallel.ulysses * parallel.ring} sequence-parallel ranks", "request")
        return Conditioning({"image_latents": torch.cat(packed, dim=1).repeat(len(generators), 1, 1)})


class QwenImageEditPlusFamily(QwenImageEditFamily):
    """Several reference images (``conditions=[...]``), each named to the text encoder as "Picture i" and seen there
    at 384x384 pixels' worth of its aspect; the output's default size follows the last image."""

    name = "qwen_image_edit_plus"
    pipeline_class = QwenImageEditPlusPipeline
    inputs = replace(QwenImageEditFamily.inputs, max_images=3)  # the model card's 1 to 3 input images
    condition_area = pipeline_qwenimage_edit_plus.CONDITION_IMAGE_SIZE
    sizing = staticmethod(pipeline_qwenimage_edit_plus.calculate_dimensions)


def _prompt_conditioning(embeds: torch.Tensor, mask: torch.Tensor | None) -> Conditioning:
    """Prompt embeddings and their 0/1 mask (diffusers returns None when nothing is padded). The mask is kept on the
    host: each forward asks whether anything is padded, which read from a device tensor would make the host wait
    for the GPU every step."""
    mask = torch.ones(embeds.shape[:2], dtype=torch.long) if mask is None else mask.cpu()
    return Conditioning({"encoder_hidden_states": embeds, "encoder_hidden_states_mask": mask}, ragged=PROMPT_KEYS)


class QwenImageInpaintFamily(InpaintMask, QwenImageFamily):
    """Qwen-Image inpainting (``QwenImageInpaintPipeline``): the text-to-image model started from the image
    re-noised to ``strength``; after every step the kept region (mask 0) is set back to the clean image latents
    re-noised to the new state's sigma with the start's own noise, and to the clean latents at the end."""

    name = "qwen_image_inpaint"
    pipeline_class = QwenImageInpaintPipeline
    inputs = Inputs(max_images=1, inpaints=True)

    def image_latents(self, request: Request, geometry: Geometry, generators: list[torch.Generator]) -> Streams:
        """Each sample's VAE posterior of the image stretched to the output size, normalised and packed."""
        helper = self.helper
        dtype = self.latent_dtype(None)
        pixels = helper.image_processor.preprocess(request.images[0].image, height=geometry.height,
                                                   width=geometry.width).to(self.device, torch.float32)
        pixels = pixels.unsqueeze(2).to(helper.vae.dtype)
        spatial = torch.cat([bridge.encode_vae_image(helper, pixels, g) for g in generators]).to(dtype)
        b, c, _, h, w = spatial.shape
        latents = {"latents": bridge.pack_latents(helper, spatial.transpose(1, 2), b, c, h, w)}
        geometry.extra[START_IMAGE] = latents
        return latents

    def initial_latents(self, geometry: Geometry, generators: list[torch.Generator]) -> Streams:
        """Noise drawn (B, 1, C, h, w) and packed, as the inpainting pipeline draws it."""
        h, w = self._latent_hw(geometry)
        c, b = self.helper.transformer.config.in_channels // 4, len(generators)
        noise = randn_tensor((b, 1, c, h, w), generator=generators, device=self.device, dtype=self.latent_dtype(None))
        return {"latents": bridge.pack_latents(self.helper, noise, b, c, h, w)}

    def encode_images(self, request: Request, geometry: Geometry, generators: list[torch.Generator]
                      ) -> Conditioning | None:
        """The packed mask (the binarised mask at the latent size, nearest, on every channel) with the start's clean
        latents and noise, one row per sample. The pipeline also encodes the masked image, which this 16-channel
        model never reads (no later draw depends on it either), so it is not computed here."""
        clean, noise, _ = self.start_draws(request, geometry, generators)
        helper = self.helper
        h, w = self._latent_hw(geometry)
        mask = torch.nn.functional.interpolate(self.mask_pixels(request, geometry), size=(h, w))
        c = helper.transformer.config.in_channels // 4
        packed = bridge.pack_latents(helper, mask.to(self.latent_dtype(None)).repeat(1, c, 1, 1), 1, c, h, w)
        b = len(request.seeds)
        return Conditioning({"inpaint_mask": packed.repeat(b, 1, 1), "inpaint_clean": clean["latents"],
                             "inpaint_noise": noise["latents"]})

    def reimpose(self, latents: Streams, images: Conditioning | None, geometry: Geometry, sigma: float) -> Streams:
        """Also the walk's start (Family.start): a first walk's start is the image re-noised everywhere, which this
        leaves as it is; a later walk's start (from the previous walk's latents) gets its kept region here, so
        generation and replay (which reimposes every stored state) see the same first state."""
        assert images is not None
        mask, clean, noise = (images.batched[k] for k in ("inpaint_mask", "inpaint_clean", "inpaint_noise"))
        x = latents["latents"]
        kept = clean if sigma == 0 else sigma * noise + (1.0 - sigma) * clean  # diffusers' scale_noise
        return {"latents": ((1 - mask) * kept + mask * x).to(x.dtype)}
