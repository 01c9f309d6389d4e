"""FLUX.2 [klein] (``Flux2KleinPipeline``): text-to-image and editing from reference images in one model.

Prompts are a Qwen3 causal LM's hidden states at three layers (stacked), padded to ``max_sequence_length``; noise is
drawn already in 2x2 channel patches and packed into tokens with 4-D position ids (time, row, column, layer);
reference images are VAE-encoded (the mode, no draw), batch-norm normalised with the VAE's running statistics,
packed, and appended after the noise tokens on every forward with their own time coordinate. The schedule is
``flow_match`` with FLUX.2's ``empirical`` shift (``mu`` from the noise tokens and the step count); CFG, when the
recipe asks for it (the base models), is two plain passes against the empty prompt.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers import Flux2KleinPipeline

from ... import bridge
from ...spec import SpecError
from ...spec.guidance import term_of
from ...spec.request import Request
from ...targets import AttentionTarget, BlocksTarget, ParallelTarget, Targets
from .base import Family
from .checks import Inputs
from .perturbations import layer_skip
from .types import Conditioning, Decoded, Geometry, Perturbation, Streams

MAX_REFERENCE_AREA = 1024 * 1024  # the pipeline resizes a larger reference image to this many pixels
MIN_REFERENCE_SIDE = 64  # Flux2ImageProcessor.check_image_input refuses smaller sides


class Flux2KleinFamily(Family):
    name = "flux2_klein"
    pipeline_class = Flux2KleinPipeline
    targets = Targets(
        attention=AttentionTarget({"joint": ("transformer_blocks.*.attn",),
                                   "single": ("single_transformer_blocks.*.attn",)}),
        blocks=BlocksTarget(("transformer_blocks", "single_transformer_blocks")),
        parallel=ParallelTarget(
            sequence_refusal="FLUX.2 [klein]'s context-parallel plan has not been checked against one process here"),
        # diffusers 0.42's first-block cache hook subtracts the single-stream block's output, a list here
        cache_limits={"first_block": "diffusers' first-block cache hook cannot read FLUX.2's single-stream block "
                                     "outputs (a TypeError inside the hook in 0.42); use taylorseer, magcache or "
                                     "step_mask"},
    )
    required = {"text_encoder": "encoder", "tokenizer": "tokenizer", "vae": "vae"}
    inputs = Inputs(max_images=10)

    @classmethod
    def index_problems(cls, spec, index) -> list[tuple[str, str]]:
        """A step-distilled checkpoint (``is_distilled``) never runs CFG in diffusers: a recipe with a negative
        pass on it is refused rather than run otherwise."""
        problems = super().index_problems(spec, index)
        if index.get("is_distilled"):
            for i, phase in enumerate(spec.recipe.phases):
                if any(term_of(term).negative for term in phase.guidance.terms):
                    problems.append((f"recipe.phases.{i}.guidance.terms", (
                        "the checkpoint is step-distilled (is_distilled: true in model_index.json), which diffusers "
                        "never runs with CFG; use a recipe without guidance (flux2-klein-4b) or a base checkpoint "
                        "(flux2-klein-base-4b)")))
        return problems

    def make_helper(self, components):
        denoisers = [n for n, c in self.spec.model.components.items() if c.role == "denoiser"]
        return Flux2KleinPipeline(scheduler=components.get("scheduler"), vae=components["vae"],
                                  text_encoder=components["text_encoder"], tokenizer=components["tokenizer"],
                                  transformer=components.get(denoisers[0]))

    def encode(self, prompts: list[str], request: Request) -> Conditioning:
        embeds, text_ids = self.helper.encode_prompt(prompt=list(prompts), device=self.device,
                                                     max_sequence_length=request.max_sequence_length or 512)
        return Conditioning({"encoder_hidden_states": embeds, "txt_ids": text_ids})

    # ---- sizes and reference images ---------------------------------------------------------------------

    def _reference(self, image) -> tuple[object, int, int]:
        """A reference image as the pipeline takes it: PIL, each side >= 64 and aspect <= 8 (its check), above 1 MP
        resized to 1 MP, then its size floored to the packed latent grid (16 px for the real VAE)."""
        from PIL import Image

        if not isinstance(image, Image.Image):  # a checked float array (H, W, C) or tensor (C, H, W) in [0, 1]
            processor = self.helper.image_processor
            array = processor.pt_to_numpy(image[None].float().cpu()) if isinstance(image, torch.Tensor) else \
                np.asarray(image, dtype=np.float32)[None]
            image = processor.numpy_to_pil(array)[0]
        try:
            self.helper.image_processor.check_image_input(image)
        except ValueError as exc:
            raise SpecError.single(f"FLUX.2 reference image: {exc}", "request.image") from None
        if image.width * image.height > MAX_REFERENCE_AREA:
            image = bridge.resize_to_target_area(self.helper.image_processor, image, MAX_REFERENCE_AREA)
        multiple = self.helper.vae_scale_factor * 2
        return image, image.height // multiple * multiple, image.width // multiple * multiple

    def image_size(self, image) -> tuple[int, int]:
        """Without a requested size, the output takes the first reference image's (fitted as above)."""
        _, height, width = self._reference(image)
        return height, width

    def tokens(self, geometry: Geometry) -> int:
        multiple = self.helper.vae_scale_factor * 2
        return (geometry.height // multiple) * (geometry.width // multiple)

    def latent_dtype(self, denoiser) -> torch.dtype:
        return self.helper.text_encoder.dtype  # the pipeline draws and steps its latents in the prompt's dtype

    def initial_latents(self, geometry: Geometry, generators: list[torch.Generator]) -> Streams:
        helper = self.helper
        latents, ids = helper.prepare_latents(len(generators), helper.transformer.config.in_channels // 4,
                                              geometry.height, geometry.width, self.latent_dtype(None), self.device,
                                              generators)
        geometry.extra["latent_ids"] = ids[:1]
        return {"latents": latents}

    def encode_images(self, request: Request, geometry: Geometry, generators: list[torch.Generator]
                      ) -> Conditioning | None:
        """The reference images' packed latents, one row per sample (the same images for every sample), their
        position ids kept per phase."""
        if not request.images:
            return None
        helper, pixels = self.helper, []
        for entry in request.images:
            image, height, width = self._reference(entry.image)
            pixels.append(helper.image_processor.preprocess(image, height=height, width=width, resize_mode="crop"))
        latents, ids = helper.prepare_image_latents(pixels, len(generators), generators[0], self.device,
                                                    helper.vae.dtype)
        geometry.extra["reference_ids"] = ids[:1]
        return Conditioning({"reference_latents": latents})

    # ---- the step ------------------------------------------------------------------------------------------

    def predict(self, denoiser, latents: Streams, timestep, cond, geometry, *, embedded=None,
                perturbation: Perturbation | None = None) -> Streams:
        x = latents["latents"]
        b, n = x.shape[:2]
        hidden, ids = x, geometry.extra["latent_ids"]
        reference = cond.batched.get("reference_latents")
        if reference is not None:
            hidden = torch.cat([x, reference.to(x.dtype)], dim=1)
            ids = torch.cat([ids, geometry.extra["reference_ids"]], dim=1)
        with layer_skip(denoiser, perturbation, self.targets):
            out = denoiser(hidden_states=hidden.to(denoiser.dtype), timestep=timestep.expand(b).to(x.dtype) / 1000,
                           guidance=self.guidance_input(denoiser, b, embedded, x.device), encoder_hidden_states=cond.batched["encoder_hidden_states"],
                           txt_ids=cond.batched["txt_ids"], img_ids=ids.expand(b, -1, -1), return_dict=False)[0]
        return {"latents": out[:, :n]}

    def guidance_input(self, denoiser, rows: int, embedded: float | None, device: torch.device
                       ) -> torch.Tensor | None:
        """The transformer's ``guidance`` input for ``rows`` rows: klein embeds none (FLUX.2 [dev] does)."""
        return None

    def latent_grid(self, x: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        """Packed tokens scattered back to their (C, H, W) grid by their position ids (the grid's size given, so no
        device sync)."""
        multiple = self.helper.vae_scale_factor * 2
        return bridge.unpack_latents_with_ids(self.helper, x, geometry.extra["latent_ids"].expand(x.shape[0], -1, -1),
                                              geometry.height // multiple, geometry.width // multiple)

    def decode(self, latents: Streams, geometry: Geometry) -> Decoded:
        helper, vae = self.helper, self.helper.vae
        grid = self.latent_grid(latents["latents"], geometry)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(grid.device, grid.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(grid.device, grid.dtype)
        spatial = bridge.unpatchify_latents(helper, grid * std + mean)
        image = vae.decode(spatial.to(vae.dtype), return_dict=False)[0]
        return Decoded(np.asarray(helper.image_processor.postprocess(image, output_type="np"), dtype=np.float32))

