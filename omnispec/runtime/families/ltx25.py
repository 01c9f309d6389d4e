"""LTX-2.5 (``Lightricks/LTX-2.5-Diffusers``; diffusers runs it as ``LTX25ModularPipeline``, ``LTX25AutoBlocks``):
LTX-2's joint video and audio denoising (the same transformer, connectors, guidance and conditioning, so the
``ltx2`` adapters are reused as they are) with a Gemma-4 text encoder and one difference in the blocks: the video
is decoded by the diffusion decoder (``LTX2VideoDiffusionDecoderModel``), which denoises pixels from noise it draws
from the request's generators after the latents' noise, as the modular pipeline passes it its ``generator``."""

from __future__ import annotations

import numpy as np
import torch

from ...spec import PipelineSpec, SpecError
from ...spec.recipe import InitialInput
from .ltx2 import LTX2ConditionFamily, LTX2Family
from .types import Decoded, Geometry, Streams

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
