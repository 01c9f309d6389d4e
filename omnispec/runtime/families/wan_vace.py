"""Wan VACE (``WanVACEPipeline``): Wan text-to-video with a control branch, run here for keyframes, a control
video with its masks, and reference images. Keyframes are images placed at frames of the video (first and last
frame, or any), built into the control video and mask as diffusers' VACE example builds them (each image resized to
the output size at its frame, grey frames elsewhere; the mask black at the images' frames, white where the model
generates). A request's video (video-to-video) is the control video itself, frame for frame (poses, depth, edges,
or a video to repaint); its mask, one image for every frame or one per frame, marks in white what is generated
(without one, every pixel is: the video only guides). Reference images (a subject, a style) are fitted onto white
canvases of the output size and prepended to the video as frames of their own: the noise has one more latent frame
per reference, which decoding drops.

The control video and mask go through the pipeline's own ``preprocess_conditions``, ``prepare_video_latents`` (VAE
latents of the kept and the generated parts, by their mode: no generator draw) and ``prepare_masks`` (the mask folded
8 x 8 into channels): 96 control channels, the same for every sample and both CFG passes. The transformer adds each
VACE block's hint after its main block, scaled by ``model.options.conditioning_scale`` (one number for every layer;
diffusers also takes one per layer, which a spec option, a scalar, cannot hold).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from diffusers import WanVACEPipeline
from PIL import Image

from ...spec import PipelineSpec, SpecError
from ...spec.request import Request
from ...spec.videos import VideoCondition
from ...targets import ParallelTarget
from .checks import Inputs
from .types import Conditioning, Decoded, Geometry, Streams
from .wan import WanFamily

GREY = (128, 128, 128)  # diffusers' example: 127.5 in the original code, which PIL cannot hold


class WanVACEFamily(WanFamily):
    name = "wan_vace"
    pipeline_class = WanVACEPipeline
    inputs = Inputs(max_images=16, max_references=4, takes_video=True)  # max_images: keyframes
    targets = replace(
        WanFamily.targets,
        parallel=ParallelTarget(
            sequence_refusal="WanVACETransformer3DModel has no context-parallel plan in diffusers 0.42",
            tensor_refusal="no tensor-parallel plan is written for the VACE blocks yet"),
        video_tokens=replace(WanFamily.targets.video_tokens, compiled_refusal=(
            "the VACE blocks' self-attention attends over the video's tokens at the main blocks' head size, and the "
            "compiled redirect cannot tell their calls from the main blocks' (eager, they stay dense)")),
        # the VACE hints are added between the main blocks, outside what the block hooks skip or reuse
        cache_limits={kind: "not checked against the VACE hints added between the blocks; use step_mask"
                      for kind in ("first_block", "magcache", "taylorseer")},
    )
    options = {"conditioning_scale": 1.0}

    @classmethod
    def check_spec(cls, spec: PipelineSpec) -> None:
        super().check_spec(spec)
        scale = {**cls.options, **spec.model.options}["conditioning_scale"]
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise SpecError.single(f"conditioning_scale is a number (every VACE layer's hint scale), got {scale!r}",
                                   "model.options.conditioning_scale")

    def make_helper(self, components):
        denoisers = [n for n, c in self.spec.model.components.items() if c.role == "denoiser"]
        return WanVACEPipeline(
            tokenizer=components["tokenizer"], text_encoder=components["text_encoder"], vae=components["vae"],
            scheduler=components.get("scheduler"), transformer=components.get(denoisers[0]),
        )

    def geometry(self, request: Request, size_scale: float) -> Geometry:
        geometry = super().geometry(request, size_scale)
        geometry.extra["vace_references"] = len(request.references)
        return geometry

    def latent_shape(self, geometry: Geometry) -> tuple[int, int, int]:
        """The video's latent frames after one frame per reference image (the pipeline's ``num_frames + R * 4``)."""
        frames, height, width = super().latent_shape(geometry)
        return frames + geometry.extra.get("vace_references", 0), height, width

    def keyframes(self, request: Request, geometry: Geometry) -> tuple[list, list]:
        """The control video and mask (lists of PIL frames) of the request's images at their frames."""
        frames = geometry.frames or 1
        size = (geometry.width, geometry.height)
        video = [Image.new("RGB", size, GREY) for _ in range(frames)]
        mask = [Image.new("L", size, 255) for _ in range(frames)]
        for k, condition in enumerate(request.images):
            at = condition.frame % frames
            image = self._pil(condition.image, f"request.conditions.{k}")
            video[at] = image.resize(size)  # as diffusers' example: PIL's default resampling
            mask[at] = Image.new("L", size, 0)
        return video, mask

    @staticmethod
    def control(request: Request) -> tuple[list | None, list | None]:
        """The request's video and its mask as frame lists (a mask image stands for every frame), or None."""
        if request.video is None:
            return None, None
        mask = request.mask
        if mask is not None:
            mask = mask.frames if isinstance(mask, VideoCondition) else [mask.image] * len(request.video.frames)
        return list(request.video.frames), mask

    def encode_images(self, request: Request, geometry: Geometry, generators: list[torch.Generator]
                      ) -> Conditioning | None:
        helper, device = self.helper, self.device
        video, mask = self.keyframes(request, geometry) if request.images else self.control(request)
        frames = geometry.frames or 1
        given = [self._pil(c.image, f"request.references.{k}") for k, c in enumerate(request.references)] or None
        video, mask, references = helper.preprocess_conditions(video, mask, given, 1, geometry.height,
                                                               geometry.width, frames, torch.float32, device)
        latents = helper.prepare_video_latents(video, mask, references, None, device)
        control = torch.cat([latents, helper.prepare_masks(mask, references, None)], dim=1)
        scale = [float(self.settings["conditioning_scale"])] * len(helper.transformer.config.vace_layers)
        dtype = helper.transformer.dtype
        return Conditioning({"control": control.to(dtype).repeat(len(generators), 1, 1, 1, 1)},
                            {"control_scale": torch.tensor(scale).to(device, dtype)})

    @staticmethod
    def _pil(image, where: str):
        if not (hasattr(image, "resize") and hasattr(image, "mode")):
            raise SpecError.single("family 'wan_vace' resizes its keyframes and reference images as PIL images: pass "
                                   "a PIL image or a path", where)
        return image

    def decode(self, latents: Streams, geometry: Geometry) -> Decoded:
        """The video without the reference images' leading latent frames."""
        skip = geometry.extra.get("vace_references", 0)
        return super().decode({"latents": latents["latents"][:, :, skip:]}, geometry)

    def model_inputs(self, cond: Conditioning) -> dict:
        return {"control_hidden_states": cond.batched["control"],
                "control_hidden_states_scale": cond.shared["control_scale"]}
