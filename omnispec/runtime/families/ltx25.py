"""LTX-2.5 (``Lightricks/LTX-2.5-Diffusers``; diffusers runs it as ``LTX25ModularPipeline``, ``LTX25AutoBlocks``):
LTX-2's joint video and audio denoising (the same transformer, connectors, guidance and conditioning, so the
``ltx2`` adapters are reused as they are) with a Gemma-4 text encoder and one difference in the blocks: the video
is decoded by the diffusion decoder (``LTX2VideoDiffusionDecoderModel``), which denoises pixels from noise it draws
from the request's generators after the latents' noise, as the modular pipeline passes it its ``generator``."""

from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import torch
from diffusers.pipelines.ltx2 import LTX2InContextPipeline, LTX2ReferenceCondition
from diffusers.video_processor import VideoProcessor

from ... import bridge
from ...spec import PipelineSpec, SpecError
from ...spec.base import MAX_REFERENCES
from ...spec.recipe import InitialInput
from ...spec.references import reference_key
from ...spec.request import Request
from ...spec.videos import VideoCondition
from .checks import CheckpointMatch
from .ltx2 import APPENDED_COORDS, SELF_ATTENTION_MASK, LTX2ConditionFamily, LTX2Family
from .types import Conditioning, Decoded, Geometry, Streams

_GENERATORS = "ltx25_generators"  # geometry.extra: the request's generators, for the decoder's noise
DECODER = ("diffusers", "LTX2VideoDiffusionDecoderModel")


class LTX25Family(LTX2Family):
    """Text-to-video and image-to-video with audio (the modular blocks' ``text2video`` and ``image2video``): LTX-2's
    adapter with the ``diffusion_decoder`` component and the decode through it."""

    name = "ltx25"
    required = {**LTX2Family.required, "diffusion_decoder": "vae"}
    # LTX-2.5's model_index.json names LTX2Pipeline as LTX-2's does; its diffusion decoder tells it apart.
    checkpoints = CheckpointMatch(model_index_values={"diffusion_decoder": (list(DECODER),)})

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
    draw it. How much the video's tokens and each reference's attend to each other is
    ``model.options.conditioning_attention_strength`` times the request's mask (its grey values over the
    reference's pixels, white 1), which the blocks give as a video self-attention mask; at strength 1 without a
    mask attention is left unmasked, as the blocks leave it."""

    name = "ltx25_ic"
    inputs = replace(LTX25ConditionFamily.inputs, max_references=MAX_REFERENCES, reference_kinds=("video",),
                     masks_references=True)
    options = {**LTX25ConditionFamily.options, "reference_downscale_factor": 1, "conditioning_attention_strength": 1.0}
    _held_references: tuple | None = None  # the last request's encoded references, under their key

    @classmethod
    def check_spec(cls, spec: PipelineSpec) -> None:
        super().check_spec(spec)
        cls.downscale_factor(spec)
        cls.attention_strength(spec)

    @classmethod
    def attention_strength(cls, spec: PipelineSpec) -> float:
        """``model.options.conditioning_attention_strength``, a number from 0 to 1."""
        value = spec.model.options.get("conditioning_attention_strength",
                                       cls.options["conditioning_attention_strength"])
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise SpecError.single(f"the conditioning attention strength is a number from 0 (the video and the "
                                   f"references ignore each other) to 1 (unmasked attention), got {value!r}",
                                   "model.options.conditioning_attention_strength")
        return float(value)

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
        mask_frames = len(request.mask.frames) if isinstance(request.mask, VideoCondition) else 1
        for k, reference in enumerate(request.references):
            used = min(len(reference.frames), request.frames or len(reference.frames))
            if constraints.frames_problems(used):
                grid = f"k*{constraints.frames_multiple_of}+{constraints.frames_offset}"
                raise SpecError.single(
                    f"a reference video of {len(reference.frames)} frames gives {used} frames to encode, and the VAE "
                    f"encodes {grid} frames: trim it to such a length, or give at least the output's {request.frames}",
                    f"request.references.{k}")
            latent = (used - 1) // constraints.frames_multiple_of + 1
            if mask_frames > 1 and latent > 1 and (mask_frames - 1) % (latent - 1):
                raise SpecError.single(
                    f"a mask of {mask_frames} frames over reference {k}, whose {used} frames encode to {latent} latent "
                    f"frames: the mask's first frame weighs the first latent frame and each later one the mean of an "
                    f"equal share of the rest, so give one image (for every frame) or 1 + n*{latent - 1} frames, "
                    f"e.g. {used}", "request.mask")

    @property
    def reference_helper(self) -> LTX2InContextPipeline:
        """LTX2InContextPipeline over the loaded modules, with the blocks' reference video processor."""
        helper = LTX2InContextPipeline(**{n: self.components.get(n) for n in self.helper_components()})
        helper.video_processor = reference_processor()
        return helper

    def geometry(self, request: Request, size_scale: float) -> Geometry:
        geometry = super().geometry(request, size_scale)
        tokens, coords, cross = self._references(request, geometry)
        geometry.extra["reference_tokens"], geometry.extra["reference_coords"] = tokens, coords
        geometry.extra["reference_cross"] = cross
        return geometry

    def _references(self, request: Request, geometry: Geometry) -> tuple[torch.Tensor, torch.Tensor, list | None]:
        """The references' packed clean tokens (1, N, C), their positions (1, 3, N, 2) and, where attention is
        weighted, each reference's per-token weights (1, N_k), as the blocks' reference encoder makes them (the VAE's
        mode: no generator draw); the last request's are kept. A request without references (``explain
        --estimate`` plans one; a run refuses it) has none: N is 0."""
        if not request.references:
            channels = self.helper.transformer.config.in_channels
            return torch.zeros(1, 0, channels, device=self.device), torch.zeros(1, 3, 0, 2, device=self.device), None
        factor, strength = int(self.settings["reference_downscale_factor"]), self.attention_strength(self.spec)
        mask = request.mask.digest if request.mask is not None else None
        key = (tuple(reference_key(r) for r in request.references), geometry.height, geometry.width, geometry.frames,
               self.conditioning_fps(geometry), factor, strength, mask, self.device)
        held = self._held_references
        if held is None or held[0] != key:
            self._held_references = held = (key, self._encoded_references(request, geometry, factor, strength))
        return held[1]

    def _encoded_references(self, request: Request, geometry: Geometry, factor: int, strength: float
                            ) -> tuple[torch.Tensor, torch.Tensor, list | None]:
        """Each reference through ``LTX2InContextPipeline.prepare_reference_latents`` (which encodes references one
        by one), with the request's mask over its frames: a mask image stands for every frame."""
        helper, frames = self.reference_helper, geometry.frames or 1
        parts = []
        for reference in request.references:
            used = min(len(reference.frames), frames)  # the frames the encoder keeps
            parts.append(helper.prepare_reference_latents(
                [LTX2ReferenceCondition(frames=list(reference.frames))], geometry.height, geometry.width, frames,
                reference_downscale_factor=factor, frame_rate=self.conditioning_fps(geometry),
                conditioning_attention_strength=strength,
                conditioning_attention_mask=self._attention_mask(request, used), dtype=torch.float32,
                device=self.device, generator=torch.Generator("cpu").manual_seed(0)))
        cross = None if parts[0][3] is None else [p[3] for p in parts]
        return torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=2), cross

    def _attention_mask(self, request: Request, count: int) -> torch.Tensor | None:
        """The request's mask as the blocks take it, (1, 1, F, H, W) values in [0, 1]: its frames' grey values
        (8-bit over 255, floats as given), one image repeated over the reference's ``count`` frames."""
        if request.mask is None:
            return None
        frames = request.mask.frames if isinstance(request.mask, VideoCondition) else [request.mask.image]
        planes = []
        for frame in frames:
            if isinstance(frame, torch.Tensor):
                planes.append(frame.detach().float().cpu().reshape(frame.shape[-2:]))
            else:
                array = np.asarray(frame)
                plane = torch.from_numpy(array.reshape(array.shape[:2]).astype(np.float32))
                planes.append(plane / 255.0 if array.dtype == np.uint8 else plane)
        if len(planes) == 1:
            planes = planes * count
        return torch.stack(planes)[None, None].to(self.device)

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
        shared = {**frames.shared, APPENDED_COORDS: coords}
        cross = geometry.extra["reference_cross"]
        if cross is not None:  # weighted attention: the blocks' mask over [video | keyframes | references]
            shared[SELF_ATTENTION_MASK] = bridge.ltx2_video_self_attention_mask(
                LTX2InContextPipeline, LTX2Family.tokens(self, geometry), frames.batched["clean"].shape[1], cross,
                self.device)
        return Conditioning({"clean": clean, "conditioning_mask": mask}, shared)
