"""Kandinsky 6 text/image-to-video with audio (``Kandinsky6TI2VAPipeline``): one transformer denoises video and
audio together.

Two streams in the transformer's own layouts, in its dtype (as the pipeline keeps them): ``video`` (B, F, H, W, C)
and ``audio`` (B, L, C_a), L set by the clip's length at the frame rate. Prompts are Qwen2.5-VL hidden states
(after the pipeline's chat template, masked where padded) and a CLIP pooled embedding. The video input carries two
conditioning channels groups, a (always zero) condition latent and a mask; image-to-video appends the reference
image's VAE latents as one extra frame at temporal position 0, marked by the mask and token type 1, and drops it
from the prediction. The reference is a posterior *sample*, drawn before the noise from each sample's generator, as
the pipeline draws it.

The distilled release predicts ``n_grid`` PiFlow grid points per latent channel: only its ``PiflowScheduler``
(schedule kind ``scheduler``) steps them, each stream with its own copy as the pipeline's audio scheduler is; a
flow_match walk or a stochastic sampler needs an undistilled transformer (plain velocities).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from diffusers import Kandinsky6TI2VAPipeline

from ...spec import PipelineSpec, SpecError
from ...spec.request import Request
from ...targets import AttentionTarget, BlocksTarget, GuidanceTarget, ParallelTarget, Targets
from .base import Family
from .checks import Inputs
from .types import Conditioning, Decoded, Geometry, Perturbation, Streams

UNREGISTERED = ("diffusers' block hooks do not know Kandinsky 6's fused video/audio blocks (they are not in its "
                "TransformerBlockRegistry)")
# geometry.extra: the generators a walk started with, and the reference latents they drew first
FIRST_FRAME = "kandinsky6_first_frame"
IMAGE = "kandinsky6_image"  # geometry.extra: the request's reference image (its draw precedes the noise)
# The release's two pipelines, each with the family that runs it and a bundled spec of that family.
KANDINSKY6_PIPELINES = {"Kandinsky6TI2VAPipeline": ("kandinsky6", "kandinsky6-distill-t2v"),
                        "Kandinsky6SRPipeline": ("kandinsky6_sr", "kandinsky6-sr")}


def other_kandinsky6_pipeline(family: str, index) -> list[tuple[str, str]]:
    """A checkpoint of the release's other pipeline, named with the family and spec that run it."""
    pipeline = str(index.get("_class_name", ""))
    runs = KANDINSKY6_PIPELINES.get(pipeline)
    if runs is None or runs[0] == family:
        return []
    return [("model.family", f"the checkpoint is a {pipeline} checkpoint, which family {runs[0]!r} runs (the "
                             f"bundled spec {runs[1]!r}), not family {family!r}")]


def piflow_grid(config, spec: PipelineSpec) -> int:
    """PiFlow grid points a Kandinsky 6 transformer predicts per latent channel (1: plain velocities); a distilled
    one's only its PiflowScheduler steps, so every phase must take the scheduler's schedule."""
    grid = config.out_visual_dim // config.in_visual_dim
    if grid > 1:
        for i, phase in enumerate(spec.recipe.phases):
            if phase.schedule.walked(spec.recipe.schedules).scheduler_component is None:
                raise SpecError.single(
                    f"this distilled transformer predicts {grid} PiFlow grid points per latent channel, which only "
                    "its PiflowScheduler steps: use schedule kind scheduler (a flow_match walk needs an undistilled "
                    "checkpoint)", f"recipe.phases.{i}.schedule")
    return grid


class Kandinsky6Family(Family):
    name = "kandinsky6"
    pipeline_class = Kandinsky6TI2VAPipeline
    streams = ("video", "audio")
    spatial_streams = ("video",)
    inputs = Inputs(max_images=1)
    targets = Targets(
        attention=AttentionTarget(
            {"video_self": ("visual_transformer_blocks.*.video_dec_block.self_attention",),
             "audio_self": ("visual_transformer_blocks.*.audio_dec_block.self_attention",),
             "video_cross": ("visual_transformer_blocks.*.video_dec_block.cross_attention",),
             "audio_cross": ("visual_transformer_blocks.*.audio_dec_block.cross_attention",),
             "audio_to_video": ("visual_transformer_blocks.*.va_cross_attention",),
             "video_to_audio": ("visual_transformer_blocks.*.av_cross_attention",),
             "text": ("video_text_transformer_blocks.*.attn", "audio_text_transformer_blocks.*.attn")},
            categories={"video_self": "self", "audio_self": "self", "text": "self", "video_cross": "cross",
                        "audio_cross": "cross", "audio_to_video": "cross", "video_to_audio": "cross"},
            head_shape=lambda attn: (attn.num_heads, attn.to_query.out_features // attn.num_heads)),
        blocks=BlocksTarget(("visual_transformer_blocks",),
                            shared_inputs=("visual_rope_embeddings", "audio_rope_embeddings")),
        parallel=ParallelTarget(sequence_refusal="Kandinsky6Transformer3DModel has no diffusers context-parallel plan"),
        guidance=GuidanceTarget(skip_layer_refusal=UNREGISTERED),
        cache_limits={"first_block": UNREGISTERED, "magcache": UNREGISTERED,
                      "taylorseer": "diffusers' TaylorSeer cache hooks the attentions its patterns name "
                                    "(transformer_blocks.*attn and the like); Kandinsky 6's sit under "
                                    "visual_transformer_blocks, so it would cache nothing"},
    )
    required = {"text_encoder": "encoder", "tokenizer": "tokenizer", "text_encoder_2": "encoder",
                "tokenizer_2": "tokenizer", "vae": "vae", "audio_vae": "vae", "vocoder": "vae"}

    @classmethod
    def index_problems(cls, spec: PipelineSpec, index) -> list[tuple[str, str]]:
        return [*super().index_problems(spec, index), *other_kandinsky6_pipeline(cls.name, index)]

    def __init__(self, spec: PipelineSpec, components, device: torch.device):
        super().__init__(spec, components, device)
        config = self.helper.transformer.config
        if spec.recipe.task == "image-to-video" and not (config.visual_cond and
                                                         config.visual_token_type_num_embeddings >= 2):
            raise SpecError.single("image-to-video needs a transformer with visual_cond and two visual token types "
                                   "(the reference frame's); this checkpoint's lacks them, so it runs text-to-video "
                                   "only", "recipe.task")
        self.grid = piflow_grid(config, spec)

    def helper_components(self):
        return (*self.required, "scheduler", "transformer")

    def latent_dtype(self, denoiser) -> torch.dtype:
        return self.helper.transformer.dtype  # the pipeline keeps both streams in the transformer's dtype

    # ---- prompts ---------------------------------------------------------------------------------------

    def encode(self, prompts: list[str], request: Request) -> Conditioning:
        """Qwen2.5-VL tokens, CLIP pooled embeddings and the padding mask (all kept when nothing is padded)."""
        embeds, pooled, mask, *_ = self.helper.encode_prompt(
            list(prompts), do_classifier_free_guidance=False, max_sequence_length=request.max_sequence_length or 1024,
            device=self.device, dtype=self.latent_dtype(None))
        # the mask on the host: each forward asks whether anything is padded without waiting for the device
        mask = torch.ones(embeds.shape[:2], dtype=torch.bool) if mask is None else mask.cpu()
        return Conditioning({"encoder_hidden_states": embeds, "pooled_projections": pooled,
                             "encoder_attention_mask": mask})

    # ---- geometry and latents --------------------------------------------------------------------------

    def geometry(self, request: Request, size_scale: float) -> Geometry:
        geometry = super().geometry(request, size_scale)
        geometry.fps = request.fps or 24  # the pipeline's frame_rate default
        if request.images:
            geometry.extra[IMAGE] = request.images[0].image
        return geometry

    def latent_shape(self, geometry: Geometry) -> tuple[int, int, int]:
        helper = self.helper
        return ((geometry.frames or 1) - 1) // helper.vae_scale_factor_temporal + 1, \
            geometry.height // helper.vae_scale_factor_spatial, geometry.width // helper.vae_scale_factor_spatial

    def audio_frames(self, geometry: Geometry) -> int:
        """Audio latent frames covering the clip at its frame rate (the pipeline computes it inline in ``__call__``,
        with no helper to call)."""
        helper = self.helper
        samples = (self.latent_shape(geometry)[0] - 1) * helper.vae_scale_factor_temporal + 1
        return math.ceil(samples / geometry.fps * helper.audio_sample_rate / helper.audio_latent_hop_length)

    def tokens(self, geometry: Geometry) -> int:
        f, h, w = self.latent_shape(geometry)
        pt, ph, pw = self.helper.transformer_patch_size
        return (f + (IMAGE in geometry.extra)) // pt * (h // ph) * (w // pw)

    def initial_latents(self, geometry: Geometry, generators: list[torch.Generator]) -> Streams:
        """The reference image's posterior sample first (image-to-video), then the video noise, then the audio
        noise, per sample (the pipeline's order)."""
        helper, dtype, b = self.helper, self.latent_dtype(None), len(generators)
        if IMAGE in geometry.extra:
            geometry.extra[FIRST_FRAME] = generators, self._first_frame(geometry.extra[IMAGE], geometry, generators)
        video = helper.prepare_latents(b, helper.transformer.config.in_visual_dim, geometry.height, geometry.width,
                                       geometry.frames or 1, dtype, self.device, generators)
        audio = helper.prepare_audio_latents(b, helper.transformer.config.in_audio_dim, self.audio_frames(geometry),
                                             dtype, self.device, generators)
        return {"video": video, "audio": audio}

    def _first_frame(self, image, geometry: Geometry, generators: list[torch.Generator]) -> torch.Tensor:
        """(B, h, w, C): each sample's reference latents, sampled from the VAE posterior with its own generator
        (the pipeline encodes a batch's image once, drawing from its first generator only)."""
        helper, dtype = self.helper, self.latent_dtype(None)
        return torch.cat([helper.encode_image(image, geometry.height, geometry.width, self.device, dtype, 1, g)
                          for g in generators])

    def encode_images(self, request: Request, geometry: Geometry, generators: list[torch.Generator]
                      ) -> Conditioning | None:
        """The reference latents drawn at the start of the walk these generators started; otherwise (a replay,
        which starts no walk) drawn again from the request's seeds (the first draw of each sample's generator)."""
        if not request.images:
            return None
        drawn, first = geometry.extra.get(FIRST_FRAME, (None, None))
        if drawn is not generators:  # not this walk's start (a replay, or a check that drew with others)
            fresh = [torch.Generator("cpu").manual_seed(s) for s in request.seeds]
            first = self._first_frame(request.images[0].image, geometry, fresh)
        return Conditioning({"first_frame": first})

    # Phase transforms see VAE latents (B, C, F, H, W), un-scaled.
    def unpack(self, stream: str, latents: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        return latents.permute(0, 4, 1, 2, 3) / self.helper.vae.config.scaling_factor

    def pack(self, stream: str, spatial: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        return (spatial * self.helper.vae.config.scaling_factor).permute(0, 2, 3, 4, 1)

    # ---- the denoiser -------------------------------------------------------------------------------------

    def predict(self, denoiser, latents: Streams, timestep, cond, geometry, *, embedded=None,
                perturbation: Perturbation | None = None) -> Streams:
        dtype = self.latent_dtype(denoiser)
        video, audio = latents["video"].to(dtype), latents["audio"].to(dtype)
        b, frames = video.shape[0], video.shape[1]
        first = cond.batched.get("first_frame")
        if first is not None:
            video = torch.cat([video, first[:, None].to(dtype)], dim=1)
        if denoiser.config.visual_cond:  # [latent | condition latent (unused, zero) | mask]
            mask = torch.zeros((*video.shape[:-1], 1), dtype=dtype, device=video.device)
            if first is not None:
                mask[:, -1] = 1
            video = torch.cat([video, torch.zeros_like(video), mask], dim=-1)
        rope_pos, token_types = self._image_positions(geometry, b, video) if first is not None else (None, None)
        text_mask = cond.batched["encoder_attention_mask"]
        out_video, out_audio = denoiser(
            hidden_states=video, audio_hidden_states=audio, encoder_hidden_states=cond.batched["encoder_hidden_states"],
            pooled_projections=cond.batched["pooled_projections"], timestep=timestep.expand(b),
            visual_rope_pos=rope_pos,
            encoder_attention_mask=None if bool(text_mask.all()) else text_mask.to(video.device),
            visual_token_type_ids=token_types, return_dict=False)
        return {"video": out_video[:, :frames], "audio": out_audio}

    def _image_positions(self, geometry: Geometry, rows: int, video: torch.Tensor):
        """The appended reference frame's RoPE positions (temporal index 0 again) and token types (1), built once
        per walk as the pipeline builds them."""
        key = ("kandinsky6_positions", video.device)
        if key not in geometry.extra:
            f, h, w = self.latent_shape(geometry)
            pt, ph, pw = self.helper.transformer_patch_size
            zero = torch.zeros(1, dtype=torch.long, device=video.device)
            geometry.extra[key] = (torch.cat([torch.arange(f // pt, device=video.device), zero]),
                                   torch.arange(h // ph, device=video.device), torch.arange(w // pw, device=video.device))
        types = torch.zeros((rows, video.shape[1]), dtype=torch.long, device=video.device)
        types[:, -1] = 1
        return geometry.extra[key], types

    # ---- decode -----------------------------------------------------------------------------------------

    def decode(self, latents: Streams, geometry: Geometry) -> Decoded:
        """Video through HunyuanVideo's VAE (float32 frames in [0, 1]); audio latents through MMAudio's VAE to a
        mel spectrogram and its vocoder to a mono waveform (B, 1, samples) at the audio VAE's sample rate."""
        helper, vae, audio_vae = self.helper, self.helper.vae, self.helper.audio_vae
        video = latents["video"].permute(0, 4, 1, 2, 3).to(vae.dtype) / vae.config.scaling_factor
        frames = vae.decode(video, return_dict=False)[0]
        frames = helper.video_processor.postprocess_video(frames, output_type="np")
        audio = latents["audio"].permute(0, 2, 1).to(audio_vae.dtype) / audio_vae.config.scaling_factor
        mel = audio_vae.decode(audio, return_dict=False)[0]
        waveform = helper.vocoder(mel.to(helper.vocoder.dtype), return_dict=False)[0][:, :1].float()
        return Decoded(np.asarray(frames, dtype=np.float32), waveform.cpu().numpy(), int(helper.audio_sample_rate))
