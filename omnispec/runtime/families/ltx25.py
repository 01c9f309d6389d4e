"""LTX-2.5 (``Lightricks/LTX-2.5-Diffusers``; diffusers runs it as ``LTX25ModularPipeline``, ``LTX25AutoBlocks``):
LTX-2's joint video and audio denoising (the same transformer, connectors, guidance and conditioning, so the
``ltx2`` adapters are reused as they are) with a Gemma-4 text encoder and one difference in the blocks: the video
is decoded by the diffusion decoder (``LTX2VideoDiffusionDecoderModel``), which denoises pixels from noise it draws
from the request's generators after the latents' noise, as the modular pipeline passes it its ``generator``."""

from __future__ import annotations

import functools

import numpy as np
import torch
from diffusers.pipelines.ltx2 import LTX2InContextPipeline, LTX2ReferenceCondition
from diffusers.video_processor import VideoProcessor

from ...spec import PipelineSpec, SpecError
from ...spec.base import MAX_REFERENCES
from ...spec.recipe import InitialInput
from ...spec.references import reference_key
from ...spec.request import Request
from .ltx2 import APPENDED_COORDS, LTX2ConditionFamily, LTX2Family
from .types import Conditioning, Decoded, Geometry, Streams

_GENERATORS = "ltx25_generators"  # geometry.extra: the request's generators, for the decoder's noise
DECODER = ("diffusers", "LTX2VideoDiffusionDecoderModel")


class LTX25Family(LTX2Family):
    """Text-to-video and image-to-video with audio (the modular blocks' ``text2video`` and ``image2video``): LTX-2's
    adapter with the ``diffusion_decoder`` component and the decode through it."""

    name = "ltx25"
    required = {**LTX2Family.required, "diffusion_decoder": "vae"}
    # LTX-2.5's model_index.json names LTX2Pipeline as LTX-2's does; its diffusion decoder tells it apart.
    model_index_values = {"diffusion_decoder": (list(DECODER),)}

    @classmethod
    def check_spec(cls, spec: PipelineSpec) -> None:
        super().check_spec(spec)
        for i, phase in enumerate(spec.recipe.phases):
            if not isinstance(phase.input, InitialInput):
                raise SpecError.single(
                    "the diffusion decoder draws its noise from the request's generators right after the first "
                    "noise, as diffusers' LTX-2.5 blocks do; LTX-2.5 runs recipes whose phases start from noise",
                    f"recipe.phases.{i}.input")

    def helper_components(self):
        return tuple(n for n in super().helper_components() if n != "diffusion_decoder")  # LTX2Pipeline has none

    def initial_latents(self, geometry: Geometry, generators: list[torch.Generator]) -> Streams:
        latents = super().initial_latents(geometry, generators)
        geometry.extra[_GENERATORS] = generators
        return latents

    def decode(self, latents: Streams, geometry: Geometry) -> Decoded:
        """Video: the denormalised latents through the diffusion decoder, which draws its starting noise from the
        generators (float32 frames in [0, 1]); audio as LTX-2's, through the audio VAE and the vocoder."""
        decoder, helper = self.components["diffusion_decoder"], self.helper
        video = self.unpack("video", latents["video"].to(self.latent_dtype(None)), geometry)
        frames = decoder.decode(video.to(decoder.dtype), generator=geometry.extra[_GENERATORS], return_dict=False)[0]
        frames = helper.video_processor.postprocess_video(frames, output_type="np")
        return Decoded(np.asarray(frames, dtype=np.float32), self.decode_audio(latents["audio"], geometry),
                       int(helper.vocoder.config.output_sampling_rate))


class LTX25ConditionFamily(LTX25Family, LTX2ConditionFamily):
    """Images at frames of the video, e.g. first and last frame (the modular blocks' ``condition`` workflow): LTX-2's
    condition adapter (its helper, noise and keyframe tokens, dropped before decoding) with LTX-2.5's decode."""

    name = "ltx25_condition"


@functools.cache
def reference_processor() -> VideoProcessor:
    """The video processor the blocks' reference encoder declares (``LTX2ReferenceEncoderStep``): bilinear, sizes
    in multiples of 32 whatever the VAE's scale."""
    from diffusers.modular_pipelines.ltx2.encoders import LTX2ReferenceEncoderStep

    spec = next(c for c in LTX2ReferenceEncoderStep().expected_components if c.name == "video_processor")
    return spec.create()


class LTX25InContextFamily(LTX25ConditionFamily):
    """In-context generation with an IC-LoRA (the modular blocks' ``in_context`` workflow): each reference video
    (``spec.references``) is resized and centre-cropped to the output's size divided by
    ``model.options.reference_downscale_factor``, cut to the output's length, encoded by the VAE's mode and appended
    after the keyframe tokens as clean tokens (timestep 0, never moved) whose positions are their own grid's, scaled
    in space by the factor into the output's coordinates; the factor must be the one the LoRA was trained with. The
    IC-LoRA itself is a LoRA slot (``--lora``). Images at frames work as in ``ltx25_condition``; a reference's frame
    rate and sound are not read (its frames take the output's rate). Noise is drawn over every token, as the blocks
    draw it."""

    name = "ltx25_ic"
    max_references = MAX_REFERENCES
    reference_kinds = ("video",)
    options = {**LTX25ConditionFamily.options, "reference_downscale_factor": 1}
    _held_references: tuple | None = None  # the last request's encoded references, under their key

    @classmethod
    def check_spec(cls, spec: PipelineSpec) -> None:
        super().check_spec(spec)
        cls.downscale_factor(spec)

    @classmethod
    def downscale_factor(cls, spec: PipelineSpec) -> int:
        """``model.options.reference_downscale_factor``, an integer from 1 to 16."""
        factor = spec.model.options.get("reference_downscale_factor", cls.options["reference_downscale_factor"])
        if isinstance(factor, bool) or not isinstance(factor, int) or not 1 <= factor <= 16:
            raise SpecError.single(f"the reference downscale factor is an integer from 1 to 16 (the one the IC-LoRA "
                                   f"was trained with), got {factor!r}", "model.options.reference_downscale_factor")
        return factor

    @classmethod
    def check_request(cls, request: Request, spec: PipelineSpec) -> None:
        """At least one reference video, each encodable at the output's size and length: the size divided by the
        factor in whole multiples of the reference processor's 32, and the frames it gives (at most the output's)
        on the VAE's temporal grid (the recipe's ``frames_multiple_of`` and ``frames_offset``)."""
        super().check_request(request, spec)
        if not request.references:
            raise SpecError.single("ltx25_ic conditions on reference videos (--reference-video; references= in "
                                   "Python); without one, ltx2.5-keyframes or ltx2.5-t2v with --lora runs the LoRA",
                                   "request.references")
        factor = cls.downscale_factor(spec)
        step = reference_processor().config.vae_scale_factor
        for name, size in (("height", request.height), ("width", request.width)):
            if size is not None and (size % (factor * step) or size < factor * step):
                raise SpecError.single(
                    f"{name} {size}: the reference videos are encoded at the output's size over the reference "
                    f"downscale factor {factor}, in multiples of {step}; use a multiple of {factor * step}",
                    f"request.{name}")
        constraints = spec.recipe.constraints
        for k, reference in enumerate(request.references):
            used = min(len(reference.frames), request.frames or len(reference.frames))
            if constraints.frames_problems(used):
                grid = f"k*{constraints.frames_multiple_of}+{constraints.frames_offset}"
                raise SpecError.single(
                    f"a reference video of {len(reference.frames)} frames gives {used} frames to encode, and the VAE "
                    f"encodes {grid} frames: trim it to such a length, or give at least the output's {request.frames}",
                    f"request.references.{k}")

    @property
    def reference_helper(self) -> LTX2InContextPipeline:
        """LTX2InContextPipeline over the loaded modules, with the blocks' reference video processor."""
        helper = LTX2InContextPipeline(**{n: self.components.get(n) for n in self.helper_components()})
        helper.video_processor = reference_processor()
        return helper

    def geometry(self, request: Request, size_scale: float) -> Geometry:
        geometry = super().geometry(request, size_scale)
        tokens, coords = self._references(request, geometry)
        geometry.extra["reference_tokens"], geometry.extra["reference_coords"] = tokens, coords
        return geometry

    def _references(self, request: Request, geometry: Geometry) -> tuple[torch.Tensor, torch.Tensor]:
        """The references' packed clean tokens (1, N, C) and their positions (1, 3, N, 2), as the blocks' reference
        encoder makes them (the VAE's mode: no generator draw); the last request's are kept. A request
        without references (``explain --estimate`` plans one; a run refuses it) has none: N is 0."""
        if not request.references:
            channels = self.helper.transformer.config.in_channels
            return torch.zeros(1, 0, channels, device=self.device), torch.zeros(1, 3, 0, 2, device=self.device)
        factor = int(self.settings["reference_downscale_factor"])
        key = (tuple(reference_key(r) for r in request.references), geometry.height, geometry.width, geometry.frames,
               geometry.fps, factor, self.device)
        held = self._held_references
        if held is None or held[0] != key:
            conditions = [LTX2ReferenceCondition(frames=list(r.frames)) for r in request.references]
            latents, coords, _, _ = self.reference_helper.prepare_reference_latents(
                conditions, geometry.height, geometry.width, geometry.frames or 1, reference_downscale_factor=factor,
                frame_rate=float(geometry.fps), dtype=torch.float32, device=self.device,
                generator=torch.Generator("cpu").manual_seed(0))
            self._held_references = held = (key, (latents, coords))
        return held[1]

    def tokens(self, geometry: Geometry) -> int:
        return super().tokens(geometry) + geometry.extra["reference_tokens"].shape[1]

    def encode_images(self, request: Request, geometry: Geometry, generators: list[torch.Generator]
                      ) -> Conditioning:
        """The keyframe conditioning (``ltx25_condition``'s, or none) with the reference tokens appended: clean,
        conditioning mask 1, their positions after the keyframes'."""
        b = len(generators)
        frames = super().encode_images(request, geometry, generators)
        if frames is None:
            base = LTX2Family.tokens(self, geometry)  # the video's own tokens
            channels = self.helper.transformer.config.in_channels
            frames = Conditioning({"clean": torch.zeros(b, base, channels, device=self.device),
                                   "conditioning_mask": torch.zeros(b, base, device=self.device)})
        tokens, coords = geometry.extra["reference_tokens"], geometry.extra["reference_coords"]
        clean = torch.cat([frames.batched["clean"], tokens.to(frames.batched["clean"]).expand(b, -1, -1)], dim=1)
        mask = torch.cat([frames.batched["conditioning_mask"],
                          torch.ones(b, tokens.shape[1]).to(frames.batched["conditioning_mask"])], dim=1)
        appended = frames.shared.get(APPENDED_COORDS)
        coords = coords if appended is None else torch.cat([appended, coords.to(appended)], dim=2)
        return Conditioning({"clean": clean, "conditioning_mask": mask}, {**frames.shared, APPENDED_COORDS: coords})
