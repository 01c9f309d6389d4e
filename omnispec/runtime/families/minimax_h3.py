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

Layout, timesteps, noise order (video drawn 5D then patchified, then audio drawn in rows) and decode are the modular
blocks' own helpers, so they equal diffusers' by construction.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3ModularPipeline
from diffusers.modular_pipelines.minimax_h3.before_denoise import (MiniMaxH3PrepareLayoutStep,
                                                                   MiniMaxH3SetTimestepsStep, patchify_video_latents)
from diffusers.modular_pipelines.minimax_h3.encoders import get_qwen3vl_prompt_embeds
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (align_num_frames, audio_latent_num_frames,
                                                                     video_latent_num_frames)
from diffusers.utils.torch_utils import randn_tensor

from ...spec import PipelineSpec, SpecError
from ...spec.request import Request
from ...targets import AttentionTarget, BlocksTarget, ParallelTarget, Targets
from .base import Family
from .types import Conditioning, Decoded, Geometry, Perturbation, Streams

PROMPT_KEYS = frozenset({"encoder_hidden_states"})
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
    targets = Targets(
        attention=AttentionTarget({"joint": ("transformer_blocks.*.attn",), "text": ("token_refiner.*.attn",)},
                                  categories={"joint": "self", "text": "self"}),
        blocks=BlocksTarget(("transformer_blocks",)),
        parallel=ParallelTarget(sequence_refusal="MiniMax-H3's packed sequence is split inside the transformer by "
                                "its own context-parallel plan; omnispec's sequence split is not wired to it yet"),
        cache_limits={kind: BLOCK_HOOKS for kind in ("first_block", "magcache")},
    )
    # Its sigmas are a flow_match schedule's at the config's shift (module docstring): omnispec init drafts one.
    flow_match_schedulers = ("MiniMaxH3Scheduler",)
    required = {"text_encoder": "encoder", "tokenizer": "tokenizer", "processor": "processor", "vae": "vae",
                "audio_vae": "vae", "audio_scheduler": "scheduler"}

    @classmethod
    def check_spec(cls, spec: PipelineSpec) -> None:
        super().check_spec(spec)
        for phase in spec.recipe.phases:
            if phase.guidance.terms:
                raise SpecError.single(f"{NO_GUIDANCE}; phase {phase.name!r} has guidance terms",
                                       "recipe.phases.guidance")

    def make_helper(self, components):
        """The modular pipeline with the loaded modules (``init_pipeline`` loads nothing)."""
        from diffusers.modular_pipelines import MiniMaxH3Blocks

        helper = MiniMaxH3Blocks().init_pipeline()
        helper.update_components(**{n: components[n] for n in self.helper_components() if components.get(n) is not None})
        return helper

    def helper_components(self):
        return (*self.required, "scheduler", "transformer")

    # ---- prompts ---------------------------------------------------------------------------------------

    def encode(self, prompts: list[str], request: Request) -> Conditioning:
        """Each prompt verbatim (no template, no special tokens) through the Qwen3-VL conditioner, as the t2va text
        block encodes its one prompt; rows padded to the longest, with their lengths."""
        helper = self.helper
        embeds = []
        for prompt in prompts:
            ids = helper.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            embeds.append(get_qwen3vl_prompt_embeds(helper.text_encoder, helper.processor, ids, {},
                                                    text_encoder_layer=helper.text_encoder_layer, device=self.device,
                                                    dtype=helper.text_encoder.dtype))
        longest = max(e.shape[1] for e in embeds)
        padded = torch.cat([torch.nn.functional.pad(e, (0, 0, 0, longest - e.shape[1])) for e in embeds])
        # Lengths stay on the host: each forward builds the layout of its rows' text length without a device sync.
        lengths = torch.tensor([[e.shape[1]] for e in embeds])
        return Conditioning({"encoder_hidden_states": padded, "text_length": lengths}, ragged=PROMPT_KEYS)

    # ---- geometry and latents --------------------------------------------------------------------------

    def geometry(self, request: Request, size_scale: float) -> Geometry:
        geometry = super().geometry(request, size_scale)
        h = self.helper
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
        """Per sample (one generator each, as the blocks draw from the request's one generator): the video noise
        drawn 5D and patchified, then the audio noise drawn directly in rows."""
        helper = self.helper
        video, audio = [], []
        for generator in generators:
            noise = randn_tensor((1, helper.vae_latent_channels, *self.latent_shape(geometry)), generator=generator,
                                 device=self.device, dtype=torch.float32)
            video.append(patchify_video_latents(noise, helper.patch_size))
            audio.append(randn_tensor((self.audio_latents(geometry) * helper.audio_channels,
                                       helper.audio_latent_channels), generator=generator, device=self.device,
                                      dtype=torch.float32))
        return {"video": torch.stack(video), "audio": torch.stack(audio)}

    def noise(self, latents: Streams, geometry: Geometry, generators: list[torch.Generator]) -> Streams:
        return self.initial_latents(geometry, generators)

    def stream_sigmas(self, sigmas: torch.Tensor) -> dict[str, torch.Tensor]:
        """The audio stream's grid: the same base grid points as the video sigmas, at the audio shift."""
        video, audio = self.helper.scheduler.config.shift, self.helper.audio_scheduler.config.shift
        return {"audio": shifted(unshifted(sigmas.to(torch.float32), video), audio)}

    # ---- the denoiser -------------------------------------------------------------------------------------

    def _layout(self, geometry: Geometry, text_length: int) -> dict[str, torch.Tensor]:
        """The packed layout's structural tensors for a prompt of ``text_length`` tokens, built once per walk."""
        key = ("minimax_h3_layout", text_length)
        if key not in geometry.extra:
            h = self.helper
            f, lh, lw = self.latent_shape(geometry)
            tags = torch.full((text_length,), h.text_tag, dtype=torch.long)
            position_ids, token_tags, video, audio, text, _, _ = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
                tags, f, lh, lw, self.audio_latents(geometry), h.patch_size, h.audio_channels, h.audio_tag,
                h.video_tag)
            geometry.extra[key] = {"position_ids": position_ids.to(self.device), "token_tags": token_tags.to(self.device),
                                   "video_indices": video.to(self.device), "audio_indices": audio.to(self.device),
                                   "text_indices": text.to(self.device)}
        return geometry.extra[key]

    def predict(self, denoiser, latents: Streams, timestep, cond, geometry, *, embedded=None,
                perturbation: Perturbation | None = None) -> Streams:
        sigma = timestep.to(torch.float32).reshape(-1)[0] / 1000.0
        audio_sigma = self.stream_sigmas(sigma)["audio"]
        lengths = cond.batched["text_length"].reshape(-1).tolist()
        video_out, audio_out = [], []
        for length in sorted(set(lengths)):  # rows with one text length share one layout and one forward
            rows = [k for k, n in enumerate(lengths) if n == length]
            layout = self._layout(geometry, length)
            unique, indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
                layout["video_indices"].cpu(), layout["audio_indices"].cpu(), 0, 0, length, float(1 - sigma),
                float(1 - audio_sigma), 1.0, 1.0)
            v, a = denoiser(
                hidden_states=latents["video"][rows], audio_hidden_states=latents["audio"][rows],
                encoder_hidden_states=cond.batched["encoder_hidden_states"][rows, :length],
                timestep=unique.to(self.device), timestep_indices=indices.to(self.device), return_dict=False,
                **layout)
            video_out.append((rows, v))
            audio_out.append((rows, a))
        return {"video": -self._gather(video_out, len(lengths)), "audio": -self._gather(audio_out, len(lengths))}

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
