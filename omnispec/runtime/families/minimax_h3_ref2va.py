"""MiniMax-H3 from references (the modular blocks' ``ref2va`` workflow): video with its stereo sound track showing
the subjects of up to 9 images, moving as up to 3 videos (with their own sound) and sounding like up to 3 sounds.

The request's references, in order (``spec.references``), are what diffusers' ``MiniMaxH3ImageReference``,
``MiniMaxH3VideoReference`` and ``MiniMaxH3AudioReference`` hold; the blocks normalise them (an image to its own
2048-pixel short edge, a video onto 24 fps and the canvas of its own aspect, truncated to the output's length, a
sound onto the audio VAE's rate), present them to the text encoder (a ``<Picture i>`` / ``<Video k>`` / ``<Audio
j>`` label each, vision blocks for images and sampled video frames) and encode them (images and videos through the
video VAE under the model's fixed seed, sounds through the audio VAE's posterior mean). The packed sequence is
``[text | one block per reference | audio | video]``: a reference's video rows are noised to ``t = 0.999`` with the
sample's first draws (one per image or video, in order) and held there, its sound rows held clean at ``t = 1``;
neither is ever stepped. The denoiser is the checkpoint's ``transformer_ref`` partition.

Everything else (the two streams, their schedules, noise order after the references' draws, decode) is
``MiniMaxH3Family``'s.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch
from diffusers.modular_pipelines import PipelineState
from diffusers.modular_pipelines.minimax_h3 import (
    MiniMaxH3AudioReference,
    MiniMaxH3ImageReference,
    MiniMaxH3VideoReference,
)
from diffusers.modular_pipelines.minimax_h3.before_denoise import (
    MiniMaxH3Ref2VAPrepareLayoutStep,
    patchify_video_latents,
)
from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3Ref2VASetupStep
from diffusers.modular_pipelines.minimax_h3.encoders import (
    MiniMaxH3Ref2VAReferenceEncoderStep,
    MiniMaxH3Ref2VATextEncoderStep,
)
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import align_num_frames, resolve_canvas_size
from diffusers.utils.torch_utils import randn_tensor
from PIL import Image

from ...spec import PipelineSpec, SpecError
from ...spec.audio import AudioCondition
from ...spec.references import reference_key, reference_kind
from ...spec.request import Request
from ...spec.videos import VideoCondition
from .checks import Inputs
from .minimax_h3 import MiniMaxH3Family
from .types import Conditioning, Geometry

# What the released checkpoint takes (the setup block's own limits).
LIMITS = {"image": 9, "video": 3, "audio": 3}
MAX_REFERENCES = 12
# A reference video is read at 2 fps in pairs of frames and encoded as 17 n + 5 frames: at least 22 at 24 fps.
MIN_VIDEO_FRAMES = 22
# The ref2va blocks before the denoise: normalising the references, encoding the prompt's presentation of them,
# encoding them.
SETUP, PRESENTATION, REFERENCE_ENCODER = (MiniMaxH3Ref2VASetupStep(), MiniMaxH3Ref2VATextEncoderStep(),
                                          MiniMaxH3Ref2VAReferenceEncoderStep())


class MiniMaxH3Ref2VAFamily(MiniMaxH3Family):
    name = "minimax_h3_ref2va"
    inputs = Inputs(max_references=MAX_REFERENCES, reference_kinds=("image", "video", "audio"))
    required = {**MiniMaxH3Family.required, "transformer_ref": "denoiser"}
    checkpoints = replace(MiniMaxH3Family.checkpoints, foreign_components={
        "transformer": "the t2va / fl2va partition, which family minimax_h3 runs"})
    # The blocks' configs: the canvas rule (the output's default, and a reference video's canvas) and the short
    # edge an image reference is encoded at.
    options = {"canvas_short_edge": 768, "canvas_max_pixels": 768 * 1344, "reference_image_short_edge": 2048}

    @classmethod
    def check_request(cls, request: Request, spec: PipelineSpec) -> None:
        super().check_request(request, spec)
        kinds = [reference_kind(r) for r in request.references]
        if not kinds:
            raise SpecError.single("MiniMax-H3's ref2va conditions on 1 to 12 references (--reference, "
                                   "--reference-video, --reference-audio; references= in Python); without any, "
                                   "minimax-h3-t2v generates from text", "request.references")
        for kind, limit in LIMITS.items():
            if kinds.count(kind) > limit:
                raise SpecError.single(f"MiniMax-H3 takes at most {limit} {kind} references, got {kinds.count(kind)}",
                                       "request.references")
        if set(kinds) == {"audio"}:
            raise SpecError.single("a sound reference goes with at least one image or video reference",
                                   "request.references")
        for k, reference in enumerate(request.references):
            if isinstance(reference, VideoCondition):
                cls._check_video(reference, f"request.references.{k}")
            elif not isinstance(reference, AudioCondition):
                cls._check_image(reference.image, f"request.references.{k}")

    @staticmethod
    def _check_video(video: VideoCondition, where: str) -> None:
        fps = video.fps or 24.0
        frames = len(video.frames) if fps == 24 else math.floor(len(video.frames) * 24 / fps + 0.5)
        if frames < MIN_VIDEO_FRAMES:
            raise SpecError.single(f"a reference video runs at least {MIN_VIDEO_FRAMES} frames at 24 fps "
                                   f"({MIN_VIDEO_FRAMES / 24:.2f} s); this one is {len(video.frames)} frames at {fps:g} "
                                   "fps", where)
        height, width = video.size
        if not 1 / 4 <= width / height <= 4:
            raise SpecError.single(f"a reference video's aspect is within 1:4 and 4:1, got {width}x{height}", where)

    @staticmethod
    def _check_image(image, where: str) -> None:
        shape = getattr(image, "shape", None)
        if shape is not None and (len(shape) != 3 or 3 not in (shape[0], shape[-1])):
            raise SpecError.single(f"an image reference is one RGB picture, got shape {tuple(shape)}", where)
        width, height = image.size if isinstance(image, Image.Image) else (shape[-2], shape[-3]) \
            if shape[-1] == 3 else (shape[-1], shape[-2])
        if not 1 / 4 <= width / height <= 4:
            raise SpecError.single(f"an image reference's aspect is within 1:4 and 4:1, got {width}x{height}", where)

    def make_helper(self, components):
        """The modular pipeline with every loaded module and the family's options as its configs; the ref2va blocks
        before the denoise run on it (``run_block``)."""
        helper = super().make_helper(components)
        helper.register_to_config(**self.settings)
        self._cache: dict[str, tuple] = {}
        return helper

    def run_block(self, block, output: str | list[str], **inputs):
        """One block of the ref2va workflow on the helper, which holds every module its steps read (the setup reads
        the VAEs' and the denoiser's geometry; a pipeline of the block alone would hold none of them)."""
        state = PipelineState()
        for param in block.inputs:
            if param.name is not None:
                state.set(param.name, inputs.get(param.name, param.default), param.kwargs_type)
        with torch.no_grad():
            _, state = block(self.helper, state)
        return state.get(output) if isinstance(output, str) else {name: state.get(name) for name in output}

    def helper_components(self):
        return (*self.required, "scheduler")

    # ---- references -----------------------------------------------------------------------------------------

    @staticmethod
    def diffusers_references(request: Request) -> list:
        """The request's references as the blocks take them."""
        out = []
        for reference in request.references:
            if isinstance(reference, VideoCondition):
                sound = reference.audio
                out.append(MiniMaxH3VideoReference(
                    frames=np.stack([np.asarray(frame) for frame in reference.frames]), fps=reference.fps,
                    audio=None if sound is None else torch.from_numpy(sound.waveform),
                    sample_rate=None if sound is None else sound.sample_rate))
            elif isinstance(reference, AudioCondition):
                out.append(MiniMaxH3AudioReference(audio=torch.from_numpy(reference.waveform),
                                                   sample_rate=reference.sample_rate))
            else:
                out.append(MiniMaxH3ImageReference(image=reference.image))
        return out

    def _frames(self, frames: int | None) -> int:
        h = self.helper
        return align_num_frames(frames or 1, h.vae_frames_per_chunk, h.vae_latents_per_chunk)

    def _cached(self, kind: str, key: tuple, make):
        """One entry per kind: the last request's normalised or encoded references."""
        held = self._cache.get(kind)
        if held is None or held[0] != key:
            self._cache[kind] = held = (key, make())
        return held[1]

    def normalized(self, request: Request) -> list:
        """The references as the setup block normalises them for the request's length."""
        frames = self._frames(request.frames)
        key = (tuple(reference_key(r) for r in request.references), frames)

        def make():
            try:
                return self.run_block(SETUP, "normalized_references", num_frames=frames,
                                      references=self.diffusers_references(request))
            except ImportError as exc:  # a sound at another rate, resampled with torchaudio
                raise SpecError.single(f"{exc} (pip install torchaudio)", "request.references") from None
        return self._cached("normalized", key, make)

    def _encoded(self, geometry: Geometry) -> dict:
        """The references' video latents (one per image or video) and sound rows (one per reference with sound),
        as the reference encoder block encodes them."""
        request = geometry.extra["minimax_h3_request"]
        key = (tuple(reference_key(r) for r in request.references), self._frames(request.frames))

        def make():
            normalized = self.normalized(request)
            out = self.run_block(REFERENCE_ENCODER, ["condition_latents", "audio_condition_latents"],
                                 normalized_references=normalized)
            return {"normalized": normalized, **out}
        return self._cached("encoded", key, make)

    # ---- prompts ----------------------------------------------------------------------------------------------

    def _encode_prompt(self, prompt: str, request: Request) -> dict[str, torch.Tensor]:
        return self.run_block(PRESENTATION, ["prompt_embeds", "text_token_tags"], prompt=prompt,
                              normalized_references=self.normalized(request))

    # ---- geometry and conditioning ----------------------------------------------------------------------------

    def geometry(self, request: Request, size_scale: float) -> Geometry:
        """The request's size, or the blocks' 16:9 canvas (references never set the output's size)."""
        if not (request.height and request.width):
            height, width = resolve_canvas_size(16, 9, self.helper.canvas_multiple, self.settings["canvas_short_edge"],
                                                self.settings["canvas_max_pixels"])
            request = request.model_copy(update={"height": height, "width": width})
        geometry = super().geometry(request, size_scale)
        geometry.extra["minimax_h3_request"] = request
        return geometry

    def _condition_noise(self, geometry: Geometry, generator: torch.Generator) -> list[torch.Tensor]:
        """A sample's first draws: one per image or video reference, shaped as its latents."""
        return [randn_tensor(tuple(latents.shape), generator=generator, device=self.device, dtype=torch.float32)
                for latents in self._encoded(geometry)["condition_latents"]]

    def encode_images(self, request: Request, geometry: Geometry, generators: list[torch.Generator]
                      ) -> Conditioning | None:
        """The references' rows ahead of the generated ones, per sample: ``condition_rows`` (the video latents of
        each image and video reference, noised to ``t = 0.999`` with the sample's first draws, drawn again from its
        seed as ``MiniMaxH3Family.encode_images`` does) and ``audio_condition_rows`` (the sounds, clean)."""
        helper, encoded = self.helper, self._encoded(geometry)
        out = {}
        if encoded["condition_latents"]:
            rows = []
            for seed in request.seeds:
                noises = self._condition_noise(geometry, torch.Generator("cpu").manual_seed(seed))
                rows.append(torch.cat([
                    patchify_video_latents(helper.scheduler.scale_noise(latents.to(self.device),
                                                                        helper.keyframe_noise_aug, noise),
                                           helper.patch_size)
                    for latents, noise in zip(encoded["condition_latents"], noises)]))
            out["condition_rows"] = torch.stack(rows)
        if encoded["audio_condition_latents"]:
            sound = torch.cat(encoded["audio_condition_latents"]).to(self.device)
            out["audio_condition_rows"] = sound[None].expand(len(request.seeds), -1, -1).contiguous()
        return Conditioning(out) if out else None

    def _packed_sequence(self, geometry: Geometry, tags: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        """The blocks' ref2va layout ``[text | references | audio | video]``."""
        h, encoded = self.helper, self._encoded(geometry)
        f, lh, lw = self.latent_shape(geometry)
        return MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence(
            torch.tensor(tags, dtype=torch.long), encoded["normalized"], encoded["condition_latents"],
            encoded["audio_condition_latents"], f, lh, lw, self.audio_latents(geometry), h.patch_size,
            h.audio_channels, h.audio_tag, h.video_tag)[:5]
