"""LTX-2 / LTX-2.3 (``LTX2Pipeline``, ``LTX2ImageToVideoPipeline``): video and audio denoised together.

Two streams, both packed tokens in float32: ``video`` (B, F*H*W, C) and ``audio`` (B, L, C_a*M). Guidance
combines the passes' clean-sample estimates (``prediction_space = "x0"``, as diffusers does, since the rescale
is taken in x0 space); spatio-temporal guidance (a ``skip_layer`` term with ``skip: attention_scores``) and
modality isolation (a ``modality`` term on ``audio_video``) are the transformer's own forward arguments, not
hooks. Image-to-video fixes the first latent frame to the encoded image: its tokens get timestep 0, their x0
estimate is the state itself (so they never move), and the encoded image is put back after every step.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from diffusers.models.transformers.transformer_ltx2 import LTX2PerturbedAttnProcessor
from diffusers.pipelines.ltx2 import LTX2ConditionPipeline, LTX2ImageToVideoPipeline, LTX2Pipeline, LTX2VideoCondition
from diffusers.utils.torch_utils import randn_tensor

from ... import bridge
from ...spec import Modality, PipelineSpec, SkipLayer, SpecError
from ...spec.recipe import PreviousInput
from ...spec.request import Request
from ...spec.videos import import_pyav
from ...targets import (AttentionTarget, BlocksTarget, GuidanceTarget, MlpTarget, ParallelTarget, Targets, TensorPlan,
                        VideoTokensTarget)
from .base import Family
from .checks import Inputs
from .types import Conditioning, Decoded, Geometry, Perturbation, Streams

MODALITY = "audio_video"  # the pass that switches off the audio-to-video and video-to-audio cross-attention
APPENDED_COORDS = "appended_coords"  # Conditioning.shared: positions of the tokens appended after the video's
SELF_ATTENTION_MASK = "video_self_attention_mask"  # Conditioning.shared: (1, S, S) weights of the video tokens' pairs
MAX_MOTION_SPEED = 100.0


def ltx2_tensor_plan(denoiser: torch.nn.Module) -> TensorPlan:
    """Every attention of a block (video, audio, and the two cross-modal ones, each with its own head count)
    splits q/k/v and its per-head gate logits by column and its output by row; its processor reads
    ``attn.heads``, normalises q and k over all heads and rotates with tables spanning all heads, so the heads
    divide, the norms split and the tables are cut to each rank's heads. The two feed-forwards split as usual."""
    block = denoiser.transformer_blocks[0]
    linears: dict[str, str] = {}
    attentions = []
    for name, child in block.named_children():
        if hasattr(child, "to_q") and hasattr(child, "heads"):
            attentions.append(f"transformer_blocks.*.{name}")
            for proj in ("to_q", "to_k", "to_v", "to_gate_logits"):
                if getattr(child, proj, None) is not None:
                    linears[f"transformer_blocks.*.{name}.{proj}"] = "colwise"
            linears[f"transformer_blocks.*.{name}.to_out.0"] = "rowwise"
    for ff in ("ff", "audio_ff"):
        if hasattr(block, ff):
            linears[f"transformer_blocks.*.{ff}.net.0.proj"] = "colwise"
            linears[f"transformer_blocks.*.{ff}.net.2"] = "rowwise"
    return TensorPlan(linears, heads=tuple(attentions), norms=tuple(f"{a}.norm_[qk]" for a in attentions),
                      rope=tuple(attentions))


def ltx2_token_grid(denoiser: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[int, int, int]:
    """The (frames, height, width) of a call's video tokens, which the pipeline passes as latent sizes (patch 1)."""
    return kwargs["num_frames"], kwargs["height"], kwargs["width"]


class LTX2Family(Family):
    name = "ltx2"
    pipeline_class = LTX2Pipeline
    streams = ("video", "audio")
    spatial_streams = ("video",)
    prediction_space = "x0"
    row_perturbations = ("skip_layer",)  # STG takes a per-row mask: it shares the cond/uncond forward
    inputs = Inputs(max_images=1)
    targets = Targets(
        attention=AttentionTarget(
            {"video_self": ("transformer_blocks.*.attn1",), "audio_self": ("transformer_blocks.*.audio_attn1",),
             "video_cross": ("transformer_blocks.*.attn2",), "audio_cross": ("transformer_blocks.*.audio_attn2",),
             "audio_to_video": ("transformer_blocks.*.audio_to_video_attn",),
             "video_to_audio": ("transformer_blocks.*.video_to_audio_attn",)},
            categories={"video_self": "self", "audio_self": "self", "video_cross": "cross", "audio_cross": "cross",
                        "audio_to_video": "cross", "video_to_audio": "cross"}),
        blocks=BlocksTarget(("transformer_blocks",),
                            shared_inputs=("rope", "audio_rope", "cross_attn_rope", "cross_attn_audio_rope")),
        mlp=MlpTarget(),  # tanh-GELU feed-forwards (video and audio)
        video_tokens=VideoTokensTarget(("video_self",), ltx2_token_grid),
        parallel=ParallelTarget(
            sequence_refusal="diffusers' LTX-2 context-parallel plan splits the video tokens but not the 4-D "
                             "split-RoPE tables every LTX-2 checkpoint uses, so each rank would rotate its tokens with "
                             "the wrong positions",
            tensor_plan=ltx2_tensor_plan, tensor_refusal=None),
        guidance=GuidanceTarget(modalities=(MODALITY,)),
    )
    required = {
        "text_encoder": "encoder", "tokenizer": "tokenizer", "connectors": "encoder", "vae": "vae",
        "audio_vae": "vae", "vocoder": "vae",
    }

    # image_crf: the H.264 CRF the conditioning image is re-compressed with before encoding, as the model was
    # trained (None: the text encoder generation's default, 33 for Gemma 3; 0 skips it); use_cross_timestep:
    # the audio/video cross-attention modulation takes the other stream's timestep (LTX2Pipeline's default);
    # motion_speed: the video's positions are those of a video at fps / motion_speed (below 1, slower motion: 0.2 for
    # a 5x slow-motion LoRA), while the output keeps its fps and the audio its length.
    options = {"image_crf": None, "use_cross_timestep": True, "motion_speed": 1.0}

    def __init__(self, spec: PipelineSpec, components, device: torch.device):
        super().__init__(spec, components, device)
        BranchlessPerturbedAttention.install(self.helper.transformer)

    @classmethod
    def check_spec(cls, spec: PipelineSpec) -> None:
        super().check_spec(spec)
        speed = spec.model.options.get("motion_speed", 1.0)
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not 0 < speed <= MAX_MOTION_SPEED:
            raise SpecError.single(f"the motion speed is a number in (0, {MAX_MOTION_SPEED}] (the video's positions are "
                                   f"those of its frame rate over it: 0.2 plays motion 5x slower), got {speed!r}",
                                   "model.options.motion_speed")
        for i, phase in enumerate(spec.recipe.phases):
            for term in phase.guidance.terms:
                if isinstance(term, SkipLayer) and (term.skip != "attention_scores" or term.blocks not in
                                                    (None, "transformer_blocks")):
                    raise SpecError.single(
                        "LTX-2's spatio-temporal guidance replaces the self-attention of transformer_blocks by its "
                        "values: write skip: attention_scores (and no other block list)",
                        f"recipe.phases.{i}.guidance")

    @classmethod
    def check_request(cls, request: Request, spec: PipelineSpec) -> None:
        super().check_request(request, spec)
        crf = {**cls.options, **spec.model.options}["image_crf"]
        if request.images and crf != 0:
            import_pyav("LTX-2 re-compresses a conditioning image with H.264, as it was trained "
                        "(model.options.image_crf), which", "request.image",
                        otherwise=", or set model.options.image_crf=0 to skip it")

    def helper_components(self):
        return (*self.required, "scheduler", "transformer")

    @property
    def image_helper(self) -> LTX2ImageToVideoPipeline:
        return LTX2ImageToVideoPipeline(**{n: self.components.get(n) for n in self.helper_components()})

    # ---- prompts ---------------------------------------------------------------------------------------

    def encode(self, prompts: list[str], request: Request) -> Conditioning:
        """Gemma's stacked hidden states through the text connectors: video and audio text tokens and their
        mask (each row is encoded independently, so positive and negative prompts can be encoded apart)."""
        helper = self.helper
        embeds, mask, _, _ = helper.encode_prompt(prompts, do_classifier_free_guidance=False, device=self.device,
                                                  max_sequence_length=request.max_sequence_length or 1024)
        video, audio, mask = helper.connectors(embeds, mask, padding_side=helper.tokenizer.padding_side)
        # padding still marked, on the host: the connectors hand back ones, so no mask (a zero bias) goes in
        return Conditioning({"encoder_hidden_states": video, "audio_encoder_hidden_states": audio,
                             "encoder_attention_mask": mask, "text_padded": (mask == 0).any(dim=1).cpu()})

    # ---- geometry and latents --------------------------------------------------------------------------

    def geometry(self, request: Request, size_scale: float) -> Geometry:
        geometry = super().geometry(request, size_scale)
        geometry.fps = request.fps or 24
        return geometry

    def conditioning_fps(self, geometry: Geometry) -> float:
        """The frame rate the video's positions are taken at: the output's over ``model.options.motion_speed``, as
        diffusers' ``conditioning_frame_rate`` gives it."""
        from diffusers.pipelines.ltx2.utils import conditioning_frame_rate

        return conditioning_frame_rate(float(geometry.fps), float(self.settings["motion_speed"]))

    def latent_shape(self, geometry: Geometry) -> tuple[int, int, int]:
        h = self.helper
        return ((geometry.frames or 1) - 1) // h.vae_temporal_compression_ratio + 1, \
            geometry.height // h.vae_spatial_compression_ratio, geometry.width // h.vae_spatial_compression_ratio

    def audio_frames(self, geometry: Geometry) -> int:
        h = self.helper
        per_second = h.audio_sampling_rate / h.audio_hop_length / float(h.audio_vae_temporal_compression_ratio)
        return round((geometry.frames or 1) / geometry.fps * per_second)

    def tokens(self, geometry: Geometry) -> int:
        f, h, w = self.latent_shape(geometry)
        return f * h * w

    def latent_dtype(self, denoiser) -> torch.dtype:
        return self.helper.text_encoder.dtype  # LTX2Pipeline casts the model input to the prompt embeddings' dtype

    def initial_latents(self, geometry: Geometry, generators: list[torch.Generator]) -> Streams:
        """Video noise drawn 5D then packed, then audio noise drawn 4D then packed, per sample (diffusers' order)."""
        helper = self.helper
        b = len(generators)
        video = randn_tensor((b, helper.transformer.config.in_channels, *self.latent_shape(geometry)),
                             generator=generators, device=self.device, dtype=torch.float32)
        audio_vae = helper.audio_vae
        mel = audio_vae.config.mel_bins // helper.audio_vae_mel_compression_ratio
        audio = randn_tensor((b, audio_vae.config.latent_channels, self.audio_frames(geometry), mel),
                             generator=generators, device=self.device, dtype=torch.float32)
        return {"video": bridge.pack_latents(helper, video), "audio": bridge.pack_audio_latents(helper, audio)}

    # Phase transforms see the raw VAE latents (un-normalised, 5D), as the latent upsampler takes them.
    def unpack(self, stream: str, latents: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        helper, vae = self.helper, self.helper.vae
        spatial = bridge.unpack_latents(helper, latents, *self.latent_shape(geometry))
        return bridge.denormalize_latents(helper, spatial, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)

    def pack(self, stream: str, spatial: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        helper, vae = self.helper, self.helper.vae
        normalised = bridge.normalize_latents(helper, spatial, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        return bridge.pack_latents(helper, normalised)

    # ---- image-to-video ----------------------------------------------------------------------------------

    def encode_images(self, request: Request, geometry: Geometry, generators: list[torch.Generator]
                      ) -> Conditioning | None:
        """The first-frame image as LTX2ImageToVideoPipeline prepares it: re-compressed with H.264 at the model's
        CRF (PyAV), resized, encoded by the VAE's mode (no generator draw), normalised; one row per sample:
        ``clean`` (the image's latents on the first frame's tokens, 0 elsewhere) and the per-token
        ``conditioning_mask`` (1 where the image holds)."""
        if not request.images:
            return None
        helper = self.image_helper
        image = self._recompressed(request.images[0].image, "request.image")
        pixels = helper.video_processor.preprocess(image, height=geometry.height, width=geometry.width)
        pixels = pixels.to(self.device, self.latent_dtype(None))
        channels = helper.transformer.config.in_channels
        empty = [torch.Generator("cpu").manual_seed(0)]  # the VAE's mode draws nothing; noise comes separately
        image_latents, mask = helper.prepare_latents(pixels, 1, channels, geometry.height, geometry.width,
                                                     geometry.frames or 1, 0.0, torch.float32, self.device, empty)
        clean = image_latents * mask.unsqueeze(-1)  # outside the first frame: the throwaway noise, masked out
        b = len(generators)
        return Conditioning({"clean": clean.repeat(b, 1, 1), "conditioning_mask": mask.repeat(b, 1)})

    def _recompressed(self, image, where: str):
        """The image after the H.264 round trip the model was trained with (``model.options.image_crf``)."""
        from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf, resolve_default_image_crf
        from PIL import Image

        crf = self.settings["image_crf"]
        crf = resolve_default_image_crf(self.helper.text_encoder) if crf is None else int(crf)
        if not crf:
            return image
        if not isinstance(image, Image.Image):
            raise SpecError.single("LTX-2 re-compresses its conditioning image (model.options.image_crf); pass a PIL "
                                   "image or a path, or set image_crf: 0", where)
        return Image.fromarray(apply_image_conditioning_crf(np.array(image.convert("RGB")), crf))

    def start(self, latents: Streams, images: Conditioning | None, geometry: Geometry, sigma: float) -> Streams:
        """Noise where the mask is 0, the clean conditioning where it is 1, blended in between (a condition's
        strength): ``noise * (1 - mask) + clean * mask``, as both LTX-2 pipelines mix their first state."""
        if images is None:
            return latents
        mask = images.batched["conditioning_mask"].unsqueeze(-1).to(latents["video"])
        clean = images.batched["clean"].to(latents["video"])
        scaled = 1.0 - mask
        return {**latents, "video": latents["video"] * scaled + clean * (1 - scaled)}

    def constrain(self, guided: Streams, latents: Streams, images: Conditioning | None, geometry: Geometry) -> Streams:
        """The clean-sample estimate pulled to the conditioning by its mask (``x0 (1 - m) + clean m``): with
        strength 1 the conditioned tokens' velocity is 0 and they never move."""
        if images is None:
            return guided
        mask = images.batched["conditioning_mask"].unsqueeze(-1).to(guided["video"])
        clean = images.batched["clean"].to(guided["video"])
        return {**guided, "video": guided["video"] * (1 - mask) + clean * mask}

    # ---- the denoiser -------------------------------------------------------------------------------------

    def predict(self, denoiser, latents: Streams, timestep, cond, geometry, *, embedded=None,
                perturbation: Perturbation | None = None) -> Streams:
        dtype = self.latent_dtype(denoiser)
        video, audio = latents["video"].to(dtype), latents["audio"].to(dtype)
        b = video.shape[0]
        t = timestep.expand(b)
        mask = cond.batched.get("conditioning_mask")
        video_t = t if mask is None else t[:, None] * (1 - mask.to(t))
        video_coords, audio_coords = self._coords(denoiser, geometry, video.device)
        if APPENDED_COORDS in cond.shared:  # appended keyframe (and reference) tokens sit at their own positions
            video_coords = torch.cat([video_coords, cond.shared[APPENDED_COORDS].to(video_coords)], dim=2)
        f, h, w = self.latent_shape(geometry)
        stg_blocks, stg_mask = self._stg(perturbation, b, video)
        text_mask = cond.batched["encoder_attention_mask"] if bool(cond.batched["text_padded"].any()) else None
        attention_mask = cond.shared.get(SELF_ATTENTION_MASK)
        if attention_mask is not None:  # the reference tokens' attention weights (ltx25_ic), the same for every row
            attention_mask = attention_mask.to(video.device).expand(b, -1, -1)
        out_video, out_audio = denoiser(
            hidden_states=video, audio_hidden_states=audio,
            encoder_hidden_states=cond.batched["encoder_hidden_states"],
            audio_encoder_hidden_states=cond.batched["audio_encoder_hidden_states"],
            timestep=video_t, audio_timestep=t, sigma=t,
            encoder_attention_mask=text_mask, audio_encoder_attention_mask=text_mask,
            num_frames=f, height=h, width=w, fps=self.conditioning_fps(geometry),
            audio_num_frames=self.audio_frames(geometry), video_self_attention_mask=attention_mask,
            video_coords=video_coords.expand(b, *video_coords.shape[1:]),
            audio_coords=audio_coords.expand(b, *audio_coords.shape[1:]),
            isolate_modalities=isinstance(perturbation, Modality),
            spatio_temporal_guidance_blocks=stg_blocks, perturbation_mask=stg_mask,
            use_cross_timestep=bool(self.settings["use_cross_timestep"]), return_dict=False,
        )
        return {"video": out_video.float(), "audio": out_audio.float()}

    @staticmethod
    def _stg(perturbation, rows: int, like: torch.Tensor) -> tuple[list[int] | None, torch.Tensor | None]:
        """The transformer's STG arguments: the blocks, and a per-row mask (1 keeps a row's self-attention, 0
        replaces it by its values) when STG rows share the forward with plain ones."""
        if isinstance(perturbation, SkipLayer):
            return list(perturbation.layers), None  # every row perturbed
        if not isinstance(perturbation, list):
            return None, None
        skips = {tuple(p.layers) for p in perturbation if isinstance(p, SkipLayer)}
        if len(skips) != 1 or any(p is not None and not isinstance(p, SkipLayer) for p in perturbation):
            raise ValueError("one forward takes one set of STG blocks alongside unperturbed rows")
        mask = torch.tensor([0.0 if isinstance(p, SkipLayer) else 1.0 for p in perturbation], dtype=like.dtype,
                            device=like.device)
        return list(skips.pop()), mask

    def _coords(self, denoiser, geometry: Geometry, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE coordinates, built once per walk (they depend on the sizes and the frame rate only)."""
        key = ("ltx2_coords", device)
        if key not in geometry.extra:
            f, h, w = self.latent_shape(geometry)
            video = denoiser.rope.prepare_video_coords(1, f, h, w, device, fps=self.conditioning_fps(geometry))
            audio = denoiser.audio_rope.prepare_audio_coords(1, self.audio_frames(geometry), device)
            geometry.extra[key] = (video, audio)
        return geometry.extra[key]

    # ---- decode -----------------------------------------------------------------------------------------

    def decode(self, latents: Streams, geometry: Geometry) -> Decoded:
        """Video through the video VAE (float32 frames in [0, 1]); audio latents through the audio VAE to a
        mel spectrogram and the vocoder to a waveform (B, channels, samples) at the vocoder's sample rate."""
        helper, vae = self.helper, self.helper.vae
        video = self.unpack("video", latents["video"].to(self.latent_dtype(None)), geometry)
        timestep = None
        if vae.config.timestep_conditioning:  # decode_timestep 0: diffusers' default mixes in no decode noise
            timestep = torch.zeros(video.shape[0], device=video.device, dtype=video.dtype)
        frames = vae.decode(video.to(vae.dtype), timestep, return_dict=False)[0]
        frames = helper.video_processor.postprocess_video(frames, output_type="np")
        return Decoded(np.asarray(frames, dtype=np.float32), self.decode_audio(latents["audio"], geometry),
                       int(helper.vocoder.config.output_sampling_rate))

    def decode_audio(self, latents: torch.Tensor, geometry: Geometry) -> np.ndarray:
        """Packed audio latents through the audio VAE to a mel spectrogram, and the vocoder to a waveform."""
        helper, audio_vae = self.helper, self.helper.audio_vae
        audio = bridge.denormalize_audio_latents(helper, latents, audio_vae.latents_mean, audio_vae.latents_std)
        mel_bins = audio_vae.config.mel_bins // helper.audio_vae_mel_compression_ratio
        audio = bridge.unpack_audio_latents(helper, audio, self.audio_frames(geometry), num_mel_bins=mel_bins)
        mel = audio_vae.decode(audio.to(audio_vae.dtype), return_dict=False)[0]
        return helper.vocoder(mel).float().cpu().numpy()


class LTX2ConditionFamily(LTX2Family):
    """LTX-2 conditioned on images at frames (``LTX2ConditionPipeline``): an image at the first latent frame
    replaces its tokens; one at a later frame is appended as extra keyframe tokens with their own positions,
    dropped before decoding. A request frame is a frame of the output video; it lands on the latent frame that
    holds it (frame ``f > 0`` on latent ``(f - 1) // 8 + 1``). Noise is drawn in the packed layout, as that
    pipeline draws it (the same seed gives other noise than ``ltx2``'s)."""

    name = "ltx2_condition"
    pipeline_class = LTX2ConditionPipeline
    inputs = replace(LTX2Family.inputs, max_images=16)

    @classmethod
    def check_spec(cls, spec: PipelineSpec) -> None:
        super().check_spec(spec)
        for i, phase in enumerate(spec.recipe.phases):
            if isinstance(phase.input, PreviousInput):
                raise SpecError.single("keyframe tokens are not carried into a refining phase (nor are they in "
                                       "diffusers' chain); condition the first phase only",
                                       f"recipe.phases.{i}.input")

    def geometry(self, request: Request, size_scale: float) -> Geometry:
        geometry = super().geometry(request, size_scale)
        frames, (latent_frames, h, w) = geometry.frames or 1, self.latent_shape(geometry)
        indices = [self._latent_index(c.frame, frames, latent_frames) for c in request.images]
        geometry.extra["latent_indices"] = indices
        geometry.extra["keyframe_tokens"] = sum(h * w for idx in indices if idx != 0)
        return geometry

    def _latent_index(self, frame: int, frames: int, latent_frames: int) -> int:
        frame = frame % frames
        return 0 if frame == 0 else min((frame - 1) // self.helper.vae_temporal_compression_ratio + 1,
                                        latent_frames - 1)

    def tokens(self, geometry: Geometry) -> int:
        return super().tokens(geometry) + geometry.extra.get("keyframe_tokens", 0)

    def initial_latents(self, geometry: Geometry, generators: list[torch.Generator]) -> Streams:
        """Video noise drawn packed over the frames' and keyframes' tokens, then audio noise drawn packed."""
        helper = self.helper
        b = len(generators)
        video = randn_tensor((b, self.tokens(geometry), helper.transformer.config.in_channels),
                             generator=generators, device=self.device, dtype=torch.float32)
        audio_vae = helper.audio_vae
        mel = audio_vae.config.mel_bins // helper.audio_vae_mel_compression_ratio
        audio = randn_tensor((b, self.audio_frames(geometry), audio_vae.config.latent_channels * mel),
                             generator=generators, device=self.device, dtype=torch.float32)
        return {"video": video, "audio": audio}

    def encode_images(self, request: Request, geometry: Geometry, generators: list[torch.Generator]
                      ) -> Conditioning | None:
        """Each image prepared as LTX2ConditionPipeline prepares it (H.264 round trip, resized to cover and
        centre-cropped, encoded by the VAE's mode), placed by its latent frame: ``clean`` tokens, the per-token
        ``conditioning_mask`` and the keyframes' positions."""
        if not request.images:
            return None
        helper = self.helper
        conditions = [LTX2VideoCondition(frames=self._recompressed(c.image, f"request.conditions.{k}"), index=idx,
                                         crf=0) for k, (c, idx) in
                      enumerate(zip(request.images, geometry.extra["latent_indices"]))]
        throwaway = torch.Generator("cpu").manual_seed(0)  # the VAE's mode draws nothing; noise comes separately
        _, mask, clean, keyframe_coords = helper.prepare_latents(
            conditions, 1, helper.transformer.config.in_channels, geometry.height, geometry.width,
            geometry.frames or 1, self.conditioning_fps(geometry), 1.0, torch.float32, self.device, throwaway)
        b = len(generators)
        shared = {} if keyframe_coords is None else {APPENDED_COORDS: keyframe_coords}
        return Conditioning({"clean": clean.repeat(b, 1, 1), "conditioning_mask": mask.squeeze(-1).repeat(b, 1)},
                            shared)

    def unpack(self, stream: str, latents: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        return super().unpack(stream, latents[:, : super().tokens(geometry)], geometry)  # keyframes dropped


class BranchlessPerturbedAttention(LTX2PerturbedAttnProcessor):
    """diffusers' ``LTX2PerturbedAttnProcessor`` (LTX-2.3's and LTX-2.5's self-attentions) without its branch on whether
    every row of a spatio-temporal guidance block is perturbed. The transformer computes that on the device
    (``torch.all(mask == 0)``), so the branch waits for the device in eager runs and, inside a compiled block, is a
    data-dependent branch that ``fullgraph`` refuses, which would keep spatio-temporal guidance from ``compile:
    regional``. Here the rows' mask always blends (``lerp(value, attention, mask)``, its weight in the activations'
    dtype, as the family's own masks are), which is the values exactly where a row's mask is 0: the output is unchanged,
    at the cost of one block's self-attention in a forward whose rows are all perturbed."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, query_rotary_emb=None,
                 key_rotary_emb=None, perturbation_mask=None, all_perturbed=None):
        if isinstance(all_perturbed, torch.Tensor):
            all_perturbed = None if perturbation_mask is None else False
        if perturbation_mask is not None:
            # the device too: diffusers' transformer makes its default mask (every row perturbed) on the host, which
            # its own processor never reads (it takes the all-perturbed branch) and this one blends with
            perturbation_mask = perturbation_mask.to(hidden_states.device, hidden_states.dtype, non_blocking=True)
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb,
                                key_rotary_emb, perturbation_mask, all_perturbed)

    @classmethod
    def install(cls, denoiser: torch.nn.Module) -> None:
        """Put this processor where diffusers' runs (a processor set otherwise is kept). Every caller of the modules
        gets it, a diffusers pipeline sharing them too: their outputs are the same, and a compiled block needs it."""
        for block in getattr(denoiser, "transformer_blocks", ()):
            for attn in (getattr(block, "attn1", None), getattr(block, "audio_attn1", None)):
                if attn is not None and type(attn.processor) is LTX2PerturbedAttnProcessor:
                    replacement = cls()
                    bridge.set_processor_settings(replacement, bridge.processor_settings(attn.processor))
                    attn.set_processor(replacement)
