"""MiniMax-H3 (``MiniMaxH3ModularPipeline``, modular only): video with a stereo sound track from text.

One transformer forward denoises one packed sequence ``[text | audio | video]``: the prompt's Qwen3-VL hidden state
(read after layer 50), the stereo audio latents channel-major (left channel's latents, then the right's) and the
patchified video latents, each row with its own timestep, modality tag and ``(t, h, w)`` position. Two streams,
float32 rows: ``video`` (B, F*H*W/4, C*4) and ``audio`` (B, 2*L, C_a). The checkpoint is guidance-distilled: one
pass per step, no negative prompt.

The two streams walk two schedules over one base grid ``linspace(1, 0, N)``: video shifted by the ``scheduler``'s
shift (12), audio by the ``audio_scheduler``'s (3). The walk's sigmas are the video ones (a ``flow_match`` schedule
at the video shift: its ``linspace(1, 1/S, S)`` is that grid without its terminal 0, so S steps are diffusers'
``num_inference_steps = S + 1``); ``stream_sigmas`` gives the audio stream its own grid, which the steppers walk.
The model's velocity points toward the data (``x0 = x + sigma v``) and its timestep is ``1 - sigma``: ``predict``
hands it ``1 - sigma`` per stream and negates what it returns.

First/last frame (the blocks' fl2va workflow): a request image at frame 0 is the keyframe the video starts from,
one at the last frame (-1) the keyframe it ends on. The modular blocks put them on the canvas, present them to the
text encoder (a label and a vision block each, whose rows are tagged as video) and encode them (the VAE's posterior
sampled under the model's own fixed seed); each keyframe's latents, noised to ``t = 0.999`` with the sample's first
draws, are conditioning rows before the video rows, held there at ``max(t, 0.999)`` and never stepped.

References (the blocks' ref2va workflow, on the checkpoint's other partition ``transformer_ref``) are
``MiniMaxH3Ref2VAFamily``'s (``minimax_h3_ref2va``): the same loop, other conditioning rows and layout.

Prompt encoding, keyframe preparation, layout, timesteps, noise order (keyframe noise, then video drawn 5D and
patchified, then audio drawn in rows) and decode are the modular blocks' own, so they equal diffusers' by
construction.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3ModularPipeline
from diffusers.modular_pipelines.minimax_h3.before_denoise import (
    MiniMaxH3PrepareLayoutStep,
    MiniMaxH3SetTimestepsStep,
    patchify_video_latents,
)
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
    align_num_frames,
    audio_latent_num_frames,
    resolve_canvas_size,
    video_latent_num_frames,
)
from diffusers.utils.torch_utils import randn_tensor
from PIL import Image

from ...spec import PipelineSpec, SpecError
from ...spec.request import Request
from ...targets import AttentionTarget, BlocksTarget, ParallelTarget, Targets
from .base import Family
from .checks import CheckpointMatch, Inputs
from .types import Conditioning, Decoded, Geometry, Perturbation, Streams

PROMPT_KEYS = frozenset({"encoder_hidden_states", "text_tags"})
BLOCK_HOOKS = ("diffusers' block hooks do not know MiniMaxH3TransformerBlock (it is not in their registry of "
               "transformer blocks)")
NO_GUIDANCE = ("MiniMax-H3 is guidance-distilled: its one pass per step has no negative prompt or unconditional "
               "branch (diffusers' blocks run no guider)")


def shifted(base: torch.Tensor, shift: float) -> torch.Tensor:
    """The exponential shift ``s x / (1 + (s - 1) x)`` of the scheduler (MiniMaxH3Scheduler.set_timesteps)."""
    return shift * base / (1 + (shift - 1) * base)


def unshifted(sigma: torch.Tensor, shift: float) -> torch.Tensor:
    """The base grid point a shifted sigma came from (the inverse of ``shifted``)."""
    return sigma / (shift - (shift - 1) * sigma)


class MiniMaxH3Family(Family):
    name = "minimax_h3"
    pipeline_class = MiniMaxH3ModularPipeline
    streams = ("video", "audio")
    spatial_streams = ("video",)
    inputs = Inputs(max_images=2)  # the first and the last frame
    targets = Targets(
        attention=AttentionTarget({"joint": ("transformer_blocks.*.attn",), "text": ("token_refiner.*.attn",)},
                                  categories={"joint": "self", "text": "self"}),
        blocks=BlocksTarget(("transformer_blocks",)),
        parallel=ParallelTarget(sequence_refusal="MiniMax-H3's packed sequence is split inside the transformer by "
                                "its own context-parallel plan; omnispec's sequence split is not wired to it yet"),
        cache_limits={kind: BLOCK_HOOKS for kind in ("first_block", "magcache")},
    )
    required = {"text_encoder": "encoder", "tokenizer": "tokenizer", "processor": "processor", "vae": "vae",
                "audio_vae": "vae", "audio_scheduler": "scheduler"}

    checkpoints = CheckpointMatch(
        # The checkpoint's other partition, which the other workflow's family runs: ``omnispec init`` leaves it out.
        foreign_components={"transformer_ref": "the ref2va partition, which family minimax_h3_ref2va runs"},
        # Its sigmas are a flow_match schedule's at the config's shift (module docstring): omnispec init drafts one.
        flow_match_schedulers=("MiniMaxH3Scheduler",))

    @classmethod
    def check_spec(cls, spec: PipelineSpec) -> None:
        super().check_spec(spec)
        for k, phase in enumerate(spec.recipe.phases):
            if phase.guidance.terms:
                raise SpecError.single(f"{NO_GUIDANCE}; phase {phase.name!r} has guidance terms",
                                       "recipe.phases.guidance")
            if phase.denoiser in (foreign := cls.checkpoints.foreign_components):
                raise SpecError.single(f"{phase.denoiser!r} is {foreign[phase.denoiser]}; family "
                                       f"{cls.name!r} runs the other", f"recipe.phases.{k}.denoiser")

    @classmethod
    def check_request(cls, request: Request, spec: PipelineSpec) -> None:
        super().check_request(request, spec)
        frames = request.frames or 1
        anchors = [cls._anchor(c.frame, frames) for c in request.images]
        for k, anchor in enumerate(anchors):
            if anchor is None:
                raise SpecError.single("MiniMax-H3 starts from a keyframe at frame 0 or ends on one at the last frame "
                                       f"(-1), not at frame {request.images[k].frame}", f"request.conditions.{k}.frame")
        if len(set(anchors)) != len(anchors):
            raise SpecError.single("MiniMax-H3 takes one keyframe at the first frame and one at the last",
                                   "request.conditions")
        for k, condition in enumerate(request.images):
            if not isinstance(condition.image, (Image.Image, np.ndarray)):
                raise SpecError.single("MiniMax-H3 prepares its keyframes as PIL images: pass a PIL image, an (H, W, "
                                       "3) uint8 array or a path", f"request.conditions.{k}.image")

    @staticmethod
    def _anchor(frame: int, frames: int) -> str | None:
        return "first" if frame in (0, -frames) else "last" if frame in (-1, frames - 1) else None

    def make_helper(self, components):
        """The modular pipeline with the loaded modules (``init_pipeline`` loads nothing), and two pipelines of its
        blocks before the denoise: media preparation with text encoding (``prepare``), with keyframe encoding
        (``prepare_keyframes``)."""
        from diffusers.modular_pipelines import MiniMaxH3Blocks, SequentialPipelineBlocks

        blocks = MiniMaxH3Blocks()
        loaded = {n: components[n] for n in self.helper_components() if components.get(n) is not None}
        helper = blocks.init_pipeline()
        self.prepare, self.prepare_keyframes = (
            SequentialPipelineBlocks.from_blocks_dict({n: blocks.sub_blocks[n] for n in names}).init_pipeline()
            for names in (("before_encode", "text_encoder"), ("before_encode", "vae_encoder")))
        for pipeline in (helper, self.prepare, self.prepare_keyframes):
            pipeline.update_components(**{n: m for n, m in loaded.items() if n in pipeline.component_names})
        return helper

    def keyframes(self, request: Request) -> dict[str, Image.Image]:
        """The request's images as the blocks take them: ``image`` (first frame) and ``last_image``."""
        frames, out = request.frames or 1, {}
        for condition in request.images:
            image = condition.image
            image = image if isinstance(image, Image.Image) else Image.fromarray(np.asarray(image, dtype=np.uint8))
            out["image" if self._anchor(condition.frame, frames) == "first" else "last_image"] = image.convert("RGB")
        return out

    def helper_components(self):
        return (*self.required, "scheduler", "transformer")

    # ---- prompts ---------------------------------------------------------------------------------------

    def encode(self, prompts: list[str], request: Request) -> Conditioning:
        """Each prompt through the blocks' text encoding (with the keyframes, each labelled and shown to the
        Qwen3-VL conditioner): its hidden state and per-row modality tags, rows padded to the longest, with their
        lengths."""
        embeds, tags = [], []
        for prompt in prompts:
            out = self._encode_prompt(prompt, request)
            embeds.append(out["prompt_embeds"].to(self.device))
            tags.append(out["text_token_tags"][None])
        longest = max(e.shape[1] for e in embeds)
        padded = torch.cat([torch.nn.functional.pad(e, (0, 0, 0, longest - e.shape[1])) for e in embeds])
        tags = torch.cat([torch.nn.functional.pad(t, (0, longest - t.shape[1])) for t in tags])
        # Lengths and tags stay on the host: each forward builds the layout of its rows without a device sync.
        lengths = torch.tensor([[e.shape[1]] for e in embeds])
        return Conditioning({"encoder_hidden_states": padded, "text_tags": tags, "text_length": lengths},
                            ragged=PROMPT_KEYS)

    def _encode_prompt(self, prompt: str, request: Request) -> dict[str, torch.Tensor]:
        size = {"height": request.height, "width": request.width} if request.height and request.width else {}
        return self.prepare(prompt=prompt, **size, **self.keyframes(request), output=["prompt_embeds",
                                                                                        "text_token_tags"])

    # ---- geometry and latents --------------------------------------------------------------------------

    def geometry(self, request: Request, size_scale: float) -> Geometry:
        h = self.helper
        if request.images and not (request.height and request.width):  # the blocks' canvas of the first keyframe
            height, width = resolve_canvas_size(*next(iter(self.keyframes(request).values())).size,
                                                h.canvas_multiple, h.config.canvas_short_edge, h.config.canvas_max_pixels)
            request = request.model_copy(update={"height": height, "width": width})
        geometry = super().geometry(request, size_scale)
        geometry.extra["keyframe_anchors"] = tuple(a for a in ("first", "last") if a in {
            self._anchor(c.frame, request.frames or 1) for c in request.images})
        geometry.fps = h.fps
        frames = align_num_frames(geometry.frames or 1, h.vae_frames_per_chunk, h.vae_latents_per_chunk)
        if not h.min_duration <= frames / h.fps <= h.max_duration:
            raise SpecError.single(
                f"MiniMax-H3 generates {h.min_duration:g} to {h.max_duration:g} seconds at {h.fps} fps: frames "
                f"(of the form 17 n + 5) between {int(h.min_duration * h.fps)} and {int(h.max_duration * h.fps)}, "
                f"got {geometry.frames}", "request.frames")
        multiple = h.canvas_multiple
        if geometry.height % multiple or geometry.width % multiple:
            raise SpecError.single(f"MiniMax-H3's height and width are multiples of {multiple}, got "
                                   f"{geometry.height}x{geometry.width}", "request.height")
        geometry.frames = frames
        return geometry

    def latent_shape(self, geometry: Geometry) -> tuple[int, int, int]:
        h = self.helper
        ratio = h.vae_spatial_compression_ratio
        return (video_latent_num_frames(geometry.frames, h.vae_frames_per_chunk, h.vae_latents_per_chunk),
                geometry.height // ratio, geometry.width // ratio)

    def audio_latents(self, geometry: Geometry) -> int:
        return audio_latent_num_frames(geometry.frames, self.helper.fps)

    def tokens(self, geometry: Geometry) -> int:
        f, h, w = self.latent_shape(geometry)
        _, ph, pw = self.helper.patch_size
        return f * (h // ph) * (w // pw)

    def latent_dtype(self, denoiser) -> torch.dtype:
        return torch.float32  # the blocks step float32 rows; the transformer casts each input to its projection

    def initial_latents(self, geometry: Geometry, generators: list[torch.Generator]) -> Streams:
        """Per sample (one generator each, as the blocks draw from the request's one generator): past the keyframes'
        noise (its first draws, which ``encode_images`` makes again from the sample's seed), the video noise drawn 5D
        and patchified, then the audio noise drawn directly in rows."""
        helper = self.helper
        video, audio = [], []
        for generator in generators:
            self._condition_noise(geometry, generator)
            noise = randn_tensor((1, helper.vae_latent_channels, *self.latent_shape(geometry)), generator=generator,
                                 device=self.device, dtype=torch.float32)
            video.append(patchify_video_latents(noise, helper.patch_size))
            audio.append(randn_tensor((self.audio_latents(geometry) * helper.audio_channels,
                                       helper.audio_latent_channels), generator=generator, device=self.device,
                                      dtype=torch.float32))
        return {"video": torch.stack(video), "audio": torch.stack(audio)}

    def _condition_noise(self, geometry: Geometry, generator: torch.Generator) -> list[torch.Tensor]:
        """A sample's first draws: one per keyframe, shaped as its latents (one latent frame)."""
        _, h, w = self.latent_shape(geometry)
        return [randn_tensor((1, self.helper.vae_latent_channels, 1, h, w), generator=generator, device=self.device,
                             dtype=torch.float32) for _ in geometry.extra["keyframe_anchors"]]

    def encode_images(self, request: Request, geometry: Geometry, generators: list[torch.Generator]
                      ) -> Conditioning | None:
        """The keyframes as the blocks encode them, each noised to the model's ``t = 0.999`` with the sample's own
        first draws and patchified: ``condition_rows`` (B, keyframes * rows per frame, C * 4). Those draws come first
        from a generator seeded with the sample's seed, so they are drawn here from the request's seeds (the same
        numbers whether or not the walk started in this process: replay conditions a walk without starting it)."""
        if not request.images:
            return None
        helper = self.helper
        encoded = self.prepare_keyframes(height=geometry.height, width=geometry.width, **self.keyframes(request),
                                         output=["condition_latents", "keyframe_anchors"])
        assert tuple(encoded["keyframe_anchors"]) == geometry.extra["keyframe_anchors"]
        draws = [self._condition_noise(geometry, torch.Generator("cpu").manual_seed(s)) for s in request.seeds]
        rows = []
        for noises in draws:
            rows.append(torch.cat([
                patchify_video_latents(helper.scheduler.scale_noise(latents.to(self.device), helper.keyframe_noise_aug,
                                                                    noise), helper.patch_size)
                for latents, noise in zip(encoded["condition_latents"], noises)]))
        return Conditioning({"condition_rows": torch.stack(rows)})

    def noise(self, latents: Streams, geometry: Geometry, generators: list[torch.Generator]) -> Streams:
        return self.initial_latents(geometry, generators)

    def stream_sigmas(self, sigmas: torch.Tensor) -> dict[str, torch.Tensor]:
        """The audio stream's grid: the same base grid points as the video sigmas, at the audio shift."""
        video, audio = self.helper.scheduler.config.shift, self.helper.audio_scheduler.config.shift
        return {"audio": shifted(unshifted(sigmas.to(torch.float32), video), audio)}

    # ---- the denoiser -------------------------------------------------------------------------------------

    def _layout(self, geometry: Geometry, tags: tuple[int, ...]) -> dict[str, torch.Tensor]:
        """The packed layout's structural tensors for text rows tagged ``tags``, built once per walk."""
        key = ("minimax_h3_layout", tags)
        if key not in geometry.extra:
            position_ids, token_tags, video, audio, text = self._packed_sequence(geometry, tags)
            geometry.extra[key] = {"position_ids": position_ids.to(self.device), "token_tags": token_tags.to(self.device),
                                   "video_indices": video.to(self.device), "audio_indices": audio.to(self.device),
                                   "text_indices": text.to(self.device)}
        return geometry.extra[key]

    def _packed_sequence(self, geometry: Geometry, tags: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        """The blocks' layout ``[text | keyframes | audio | video]``: positions, tags and the rows of each part."""
        h = self.helper
        f, lh, lw = self.latent_shape(geometry)
        return MiniMaxH3PrepareLayoutStep.build_packed_sequence(
            torch.tensor(tags, dtype=torch.long), f, lh, lw, self.audio_latents(geometry), h.patch_size,
            h.audio_channels, h.audio_tag, h.video_tag, geometry.extra["keyframe_anchors"])[:5]

    def predict(self, denoiser, latents: Streams, timestep, cond, geometry, *, embedded=None,
                perturbation: Perturbation | None = None) -> Streams:
        helper = self.helper
        sigma = timestep.to(torch.float32).reshape(-1)[0] / 1000.0
        t, audio_t = float(1 - sigma), float(1 - self.stream_sigmas(sigma)["audio"])
        lengths = cond.batched["text_length"].reshape(-1).tolist()
        tags = [tuple(row[:n].tolist()) for row, n in zip(cond.batched["text_tags"], lengths)]
        # Conditioning rows ahead of the generated ones, never stepped: video held at max(t, 0.999), sound clean.
        conditions, sounds = cond.batched.get("condition_rows"), cond.batched.get("audio_condition_rows")
        held = 0 if conditions is None else conditions.shape[1]
        heard = 0 if sounds is None else sounds.shape[1]
        video_out, audio_out = [], []
        for text in dict.fromkeys(tags):  # rows with one text layout share one forward
            rows = [k for k, row in enumerate(tags) if row == text]
            layout = self._layout(geometry, text)
            unique, indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
                layout["video_indices"].cpu(), layout["audio_indices"].cpu(), held, heard, len(text), t, audio_t,
                max(t, helper.keyframe_noise_aug), 1.0)
            video, audio = latents["video"][rows], latents["audio"][rows]
            if held:
                video = torch.cat([conditions[rows].to(video), video], dim=1)
            if heard:
                audio = torch.cat([sounds[rows].to(audio), audio], dim=1)
            v, a = denoiser(
                hidden_states=video, audio_hidden_states=audio,
                encoder_hidden_states=cond.batched["encoder_hidden_states"][rows, :len(text)],
                timestep=unique.to(self.device), timestep_indices=indices.to(self.device), return_dict=False,
                **layout)
            video_out.append((rows, v[:, held:]))
            audio_out.append((rows, a[:, heard:]))
        return {"video": -self._gather(video_out, len(tags)), "audio": -self._gather(audio_out, len(tags))}

    @staticmethod
    def _gather(parts, batch: int) -> torch.Tensor:
        out = torch.empty((batch, *parts[0][1].shape[1:]), dtype=torch.float32, device=parts[0][1].device)
        for rows, x in parts:
            out[rows] = x.float()
        return out

    # ---- decode -----------------------------------------------------------------------------------------

    def unpack(self, stream: str, latents: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        """Video rows back to (B, C, F, H, W) latents (the after-denoise block's inverse patchify)."""
        f, h, w = self.latent_shape(geometry)
        pt, ph, pw = self.helper.patch_size
        c = self.helper.vae_latent_channels
        x = latents.reshape(latents.shape[0], f // pt, h // ph, w // pw, c, pt, ph, pw)
        return x.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(latents.shape[0], c, f, h, w).contiguous()

    def pack(self, stream: str, spatial: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        return torch.stack([patchify_video_latents(x[None], self.helper.patch_size) for x in spatial])

    def decode(self, latents: Streams, geometry: Geometry) -> Decoded:
        """Each sample as the decode blocks decode it: video de-normalised, through the video VAE, de-normalised
        from ImageNet's pixel statistics to [0, 1]; audio rows to (2 channels, latents) batch items of the mono audio
        VAE, giving a stereo waveform (B, 2, samples) at the audio VAE's sample rate."""
        helper = self.helper
        vae, audio_vae = helper.vae, helper.audio_vae
        mean = torch.tensor(vae.config.latents_mean, device=self.device).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std, device=self.device).view(1, -1, 1, 1, 1)
        pixel_mean = torch.tensor(helper.pixel_mean, device=self.device).view(1, -1, 1, 1, 1)
        pixel_std = torch.tensor(helper.pixel_std, device=self.device).view(1, -1, 1, 1, 1)
        audio_mean = torch.tensor(audio_vae.config.latents_mean, device=self.device).view(1, -1, 1)
        audio_std = torch.tensor(audio_vae.config.latents_std, device=self.device).view(1, -1, 1)
        videos, sounds = [], []
        n_audio = self.audio_latents(geometry)
        for video, audio in zip(self.unpack("video", latents["video"].float(), geometry), latents["audio"].float()):
            frames = vae.decode(video[None] * std + mean, return_dict=False)[0]
            frames = (frames.float() * pixel_std + pixel_mean).clamp(0, 1)
            videos.append(helper.video_processor.postprocess_video(frames, output_type="np"))
            rows = audio.reshape(helper.audio_channels, n_audio, audio.shape[-1]).permute(0, 2, 1)
            wave = audio_vae.decode(rows * audio_std + audio_mean, return_dict=False)[0]
            sounds.append(wave.float().permute(1, 0, 2))
        return Decoded(np.concatenate(videos).astype(np.float32), torch.cat(sounds).cpu().numpy(),
                       int(helper.audio_sampling_rate))
