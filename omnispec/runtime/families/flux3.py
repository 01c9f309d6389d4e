"""FLUX.3 [klein] (diffusers' ``Flux3ModularPipeline`` and ``Flux3DistilledModularPipeline``, modular only):
text-to-image and generation from reference images in one model.

A prompt goes through Qwen3-VL's chat template, is right-padded to a multiple of 80 tokens (at most
``max_sequence_length``) and encoded; the hidden states of layers 4, 8, ..., 32 are stacked along channels. The
padding is masked inside Qwen3-VL but the transformer attends to it, so a prompt's window is part of its encoding:
each prompt is encoded alone (as the blocks take one prompt per call), and ``predict`` runs each window length in a
forward of its own, cut back to that length. Noise is drawn as (C, H/16, W/16) latents (the VAE's packed 2x2
patches) in float32 and flattened into tokens with 4-D position ids; the schedule is ``flow_match`` at FLUX.3's
constant shift 6.93 over ``linspace(1, 1/N, N)``. Reference images are prepared by FLUX.3's image processor (one kept
whole, padded to the token grid, the output cropped back to it when no size was asked; several fitted under 1 MP and
cropped), VAE-encoded (the mode), batch-norm normalised and packed; their tokens enter every forward as the
transformer's ``image_cond_hidden_states``, told apart on the position ids' last axis.

``flux3`` is the base model: CFG against a negative prompt (the blocks' guider, 3.5 by default), 50 steps.
``flux3_distilled`` is the step-distilled flow map: one pass per step (no CFG), 16 steps, and its transformer also
takes the timestep each step lands on (``Family.flow_map``). Prompt preparation, noise, reference encoding and decode
are the blocks' own, run as pipelines of single blocks; diffusers' prompt upsampler (a Qwen3.5 model writing a
longer caption) is not run: the prompt is encoded as given, as with the blocks' ``prompt_upsampler`` step popped.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from diffusers.modular_pipelines import (
    Flux3AutoBlocks,
    Flux3DistilledAutoBlocks,
    Flux3DistilledModularPipeline,
    Flux3ModularPipeline,
    SequentialPipelineBlocks,
)
from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep
from PIL import Image

from ... import bridge
from ...spec import BUILTIN_FAMILIES, PipelineSpec, SpecError
from ...spec.guidance import term_of
from ...spec.request import Request
from ...targets import AttentionTarget, BlocksTarget, GuidanceTarget, ParallelTarget, Targets
from .base import Family
from .checks import Inputs, checkpoint_pipelines
from .text_padding import per_length
from .types import Conditioning, Decoded, Geometry, Perturbation, Streams

UNREGISTERED = ("diffusers 0.42 registers no FLUX.3 transformer block for its block hooks (they cannot find its "
                "hidden states)")
NO_GUIDANCE = ("the step-distilled FLUX.3 is a flow map sampled without CFG (diffusers' distilled blocks run no "
               "guider and encode no negative prompt)")


class Flux3Family(Family):
    name = "flux3"
    pipeline_class = Flux3ModularPipeline
    blocks_class: Any = Flux3AutoBlocks
    inputs = Inputs(max_images=10)  # the references FLUX.3 [klein] was trained on (the prompt upsampler's limit too)
    required = {"text_encoder": "encoder", "tokenizer": "tokenizer", "vae": "vae"}
    targets = Targets(
        attention=AttentionTarget({"mode": ("mode_blocks.*.attn", "txt_mode_blocks.*.attn"),
                                   "single": ("single_transformer_blocks.*.attn",)},
                                  categories={"mode": "self", "single": "self"}),
        blocks=BlocksTarget(("txt_mode_blocks", "single_transformer_blocks"),
                            shared_inputs=("pos_embed", "time_proj", "timestep_embedder")),
        parallel=ParallelTarget(sequence_refusal="FLUX.3's transformer has no diffusers context-parallel plan"),
        guidance=GuidanceTarget(skip_layer_refusal=UNREGISTERED),
        cache_limits={"first_block": UNREGISTERED, "magcache": UNREGISTERED},
    )

    # ---- checks before loading -------------------------------------------------------------------------

    @classmethod
    def index_problems(cls, spec: PipelineSpec, index) -> list[tuple[str, str]]:
        """A checkpoint whose index names another FLUX pipeline is refused naming the family that runs it."""
        problems = super().index_problems(spec, index)
        theirs = index.get("_class_name")
        if theirs and theirs not in checkpoint_pipelines(cls):
            runs = _families_running(str(theirs))
            problems.append(("model.family", f"the checkpoint's index names {theirs}, which family {cls.name!r} does "
                                             f"not run" + (f": run it with family {' or '.join(runs)}" if runs else "")))
        return problems

    def make_helper(self, components):
        """The modular pipeline with the loaded modules (``init_pipeline`` loads nothing; the scheduler, guider and
        image processor are the blocks' own), and pipelines of single blocks: noise (``latents_pipe``), reference
        images (``preprocess_pipe``: sizes; ``reference_pipe``: encoded and packed) and decode."""
        blocks = self.blocks_class()
        denoise = blocks.sub_blocks["denoise"].sub_blocks["image_conditioned"].sub_blocks
        self.text_step: Flux3TextEncoderStep = blocks.sub_blocks["text_encoder"]
        vae_encoder = blocks.sub_blocks["vae_encoder"].sub_blocks["image_conditioning"].sub_blocks
        single = {"latents_pipe": {"prepare": denoise["prepare_latents"]},
                  "preprocess_pipe": {"preprocess": vae_encoder["preprocess"]},
                  "reference_pipe": {**vae_encoder, "pack": denoise["prepare_image_cond_latents"]},
                  "decode_pipe": {"unpack": denoise["after_denoise"], "decode": blocks.sub_blocks["decode"]}}
        helper = blocks.init_pipeline()
        pipes = [helper]
        for attr, parts in single.items():
            pipe = SequentialPipelineBlocks.from_blocks_dict(parts).init_pipeline()
            setattr(self, attr, pipe)
            pipes.append(pipe)
        loaded = {n: components[n] for n in (*self.required, "transformer") if components.get(n) is not None}
        for pipe in pipes:
            pipe.update_components(**{n: m for n, m in loaded.items() if n in pipe.component_names})
            for name in ("transformer", "vae"):  # the pipeline's sizes read them (vae_scale_factor, channels)
                if name not in pipe.component_names:
                    setattr(pipe, name, loaded.get(name))
        self._check_transformer(components.get("transformer"))
        return helper

    def _check_transformer(self, transformer) -> None:
        if transformer is not None and bool(transformer.config.flow_map) != self.flow_map:
            runs = "flux3_distilled" if transformer.config.flow_map else "flux3"
            raise SpecError.single(f"the checkpoint's transformer is {'a' if transformer.config.flow_map else 'no'} "
                                   f"flow map (flow_map: {transformer.config.flow_map}): run it with family {runs}",
                                   "model.family")

    # ---- prompts ---------------------------------------------------------------------------------------

    def encode(self, prompts: list[str], request: Request) -> Conditioning:
        """Each prompt alone in its own window (module docstring), padded to the longest with zeros that ``predict``
        cuts off again; the window lengths stay on the host."""
        step = self.text_step
        tokenizer = self.helper.tokenizer
        tokenizer = tokenizer if hasattr(tokenizer, "tokenizer") else TextOnlyProcessor(tokenizer)
        embeds = [bridge.qwen3_vl_prompt_embeds(
            step, self.helper.text_encoder, tokenizer, prompt, device=self.device,
            max_sequence_length=request.max_sequence_length or self.spec.recipe.defaults.max_sequence_length or 8192,
            pad_multiple=step.pad_multiple, hidden_states_layers=_default(step, "text_encoder_out_layers"))
            for prompt in prompts]
        longest = max(e.shape[1] for e in embeds)
        padded = torch.cat([torch.nn.functional.pad(e, (0, 0, 0, longest - e.shape[1])) for e in embeds])
        lengths = torch.tensor([[e.shape[1]] for e in embeds])
        return Conditioning({"encoder_hidden_states": padded, "text_length": lengths},
                            ragged=frozenset({"encoder_hidden_states"}))

    # ---- reference images and sizes --------------------------------------------------------------------

    def _pil(self, request: Request) -> list[Image.Image]:
        out = []
        for condition in request.images:
            image = condition.image
            if isinstance(image, torch.Tensor):  # a checked (C, H, W) tensor in [0, 1]
                image = image.permute(1, 2, 0).float().cpu().numpy()
            if isinstance(image, np.ndarray):
                array = image if image.dtype == np.uint8 else (np.clip(image, 0, 1) * 255).round().astype(np.uint8)
                image = Image.fromarray(array)
            out.append(image)
        return out

    def geometry(self, request: Request, size_scale: float) -> Geometry:
        """The request's size; without one, the first reference's as the blocks prepare it (a single reference's
        padded canvas, whose decoded image is cropped back to the reference)."""
        if not request.images or (request.height and request.width):
            return super().geometry(request, size_scale)
        prepared = self.preprocess_pipe(image=self._pil(request), output=["condition_images", "reference_crop"])
        first = prepared["condition_images"][0]
        multiple = self.helper.vae_scale_factor * 2
        height = request.height or first.shape[-2] // multiple * multiple
        width = request.width or first.shape[-1] // multiple * multiple
        geometry = Geometry(round(height * size_scale), round(width * size_scale))
        if not request.height and not request.width and size_scale == 1:
            geometry.extra["reference_crop"] = prepared["reference_crop"]
        return geometry

    def encode_images(self, request: Request, geometry: Geometry, generators: list[torch.Generator]
                      ) -> Conditioning | None:
        """The references' packed latent tokens, one row per sample, and their position ids."""
        if not request.images:
            return None
        out = self.reference_pipe(image=self._pil(request), dtype=self.latent_dtype(None),
                                  output=["image_cond_hidden_states", "image_cond_ids"])
        tokens = out["image_cond_hidden_states"]
        return Conditioning({"image_cond_hidden_states": tokens.expand(len(generators), -1, -1)},
                            {"image_cond_ids": out["image_cond_ids"]})

    # ---- latents ----------------------------------------------------------------------------------------

    def tokens(self, geometry: Geometry) -> int:
        multiple = self.helper.vae_scale_factor * 2
        return (geometry.height // multiple) * (geometry.width // multiple)

    def latent_dtype(self, denoiser) -> torch.dtype:
        return self.components["transformer"].dtype  # the blocks keep latents in the transformer's dtype

    def initial_latents(self, geometry: Geometry, generators: list[torch.Generator]) -> Streams:
        out = self.latents_pipe(height=geometry.height, width=geometry.width, generator=generators,
                                batch_size=len(generators), dtype=self.latent_dtype(None),
                                output=["latents", "img_ids"])
        geometry.extra["img_ids"] = out["img_ids"].to(self.device)
        return {"latents": out["latents"].to(self.device)}

    def noise(self, latents: Streams, geometry: Geometry, generators: list[torch.Generator]) -> Streams:
        return self.initial_latents(geometry, generators)  # drawn on the grid, then flattened

    # ---- the forward ------------------------------------------------------------------------------------

    def predict(self, denoiser, latents: Streams, timestep, cond, geometry, *, embedded=None,
                perturbation: Perturbation | None = None, target: torch.Tensor | None = None) -> Streams:
        """One forward per prompt window length among the rows (module docstring), each at its own length."""
        x = latents["latents"].to(denoiser.dtype)

        def forward(index: torch.Tensor | None, length: int) -> torch.Tensor:
            rows = slice(None) if index is None else index
            return self._forward(denoiser, x[rows], timestep, target, cond, geometry, rows, int(length))

        return {"latents": per_length(cond.batched["text_length"][:, 0].tolist(), forward, x.device)}

    def _forward(self, denoiser, x, timestep, target, cond, geometry, index, length: int) -> torch.Tensor:
        b = x.shape[0]
        embeds = cond.batched["encoder_hidden_states"][index, :length].to(denoiser.dtype)
        reference = cond.batched.get("image_cond_hidden_states")
        kwargs: dict[str, Any] = {}
        if reference is not None:
            kwargs = {"image_cond_hidden_states": reference[index].to(x.dtype),
                      "image_cond_ids": cond.shared["image_cond_ids"]}
        if target is not None:
            kwargs["target_timestep"] = (target / 1000).expand(b).to(x.dtype)
        return denoiser(hidden_states=x, encoder_hidden_states=embeds,
                        timestep=(timestep / 1000).expand(b).to(x.dtype), img_ids=geometry.extra["img_ids"],
                        txt_ids=text_ids(length, x.device), return_dict=False, **kwargs)[0]

    # ---- decode -------------------------------------------------------------------------------------------

    def decode(self, latents: Streams, geometry: Geometry) -> Decoded:
        """The blocks' unpack and decode (batch-norm statistics undone, the VAE, a single reference's crop-back)."""
        images = self.decode_pipe(latents=latents["latents"], height=geometry.height, width=geometry.width,
                                  reference_crop=geometry.extra.get("reference_crop"), output_type="np",
                                  output="images")
        return Decoded(np.asarray(images, dtype=np.float32))


class Flux3DistilledFamily(Flux3Family):
    name = "flux3_distilled"
    pipeline_class = Flux3DistilledModularPipeline
    blocks_class = Flux3DistilledAutoBlocks
    flow_map = True

    @classmethod
    def check_spec(cls, spec: PipelineSpec) -> None:
        super().check_spec(spec)
        for i, phase in enumerate(spec.recipe.phases):
            if any(term_of(term).negative for term in phase.guidance.terms):
                raise SpecError.single(f"{NO_GUIDANCE}; phase {phase.name!r} has a negative-prompt term",
                                       f"recipe.phases.{i}.guidance.terms")


class TextOnlyProcessor:
    """A bare tokenizer in the processor's place (what ``AutoProcessor`` loads from the tokenizer folder without
    torchvision): the prompt path uses only the chat template and the tokenizer."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.apply_chat_template = tokenizer.apply_chat_template


def text_ids(length: int, device: torch.device) -> torch.Tensor:
    """Position ids (t, h, w, l) of ``length`` text tokens: the text advances along ``l`` only (the blocks'
    ``Flux3TextRoPEInputsStep``)."""
    ids = torch.zeros(length, 4, device=device)
    ids[:, 3] = torch.arange(length, device=device, dtype=torch.float32)
    return ids


def _default(block: Any, name: str) -> Any:
    """A block's default for one of its inputs."""
    return next(p.default for p in block.inputs if p.name == name)


def _families_running(pipeline: str) -> list[str]:
    from . import family_class  # the registry imports this module

    return [name for name in BUILTIN_FAMILIES if pipeline in checkpoint_pipelines(family_class(name))]
