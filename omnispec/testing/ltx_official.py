"""LTX-2 against Lightricks' own implementation (``ltx-core`` / ``ltx-pipelines``, the ``ltx-official`` extra).

Both sides hold the same random weights:

- ``official_checkpoint`` builds tiny LTX-2.0 / LTX-2.3 modules with ltx-core's own configurators and writes them
  as one safetensors file in the official single-file layout (``model.diffusion_model.*``, ``vae.*``,
  ``audio_vae.*``, ``vocoder.*``, ``text_embedding_projection.*``; the config in the file's metadata).
- ``load_official`` loads that file back through ltx-core's loader (``ModelLedger``).
- ``ltx_converted.diffusers_components`` converts the same tensors with diffusers' single-file converters (plus the key
  renames those lack: LTX-2.3's prompt AdaLN and fourth decoder stage, the text connectors and the vocoder) and
  loads them, strictly, into the diffusers classes omnispec's ``ltx2`` family uses.
- ``official_one_stage`` runs ltx-pipelines' one-stage loop, i.e. ``TI2VidOneStagePipeline.__call__`` with its
  float32 building blocks and without its bfloat16 cast and CUDA synchronisation.

The tiny modules keep every shape the pipelines hard-code (128 video latent channels, 8x32x32 compression, 8 x 16
audio latents, 64 mel bins, 128 connector registers) and shrink every width. Gemma is the tiny one of
``omnispec.testing.ltx2_components``: 32 wide with 2 layers, so 3 stacked hidden states.
"""

from __future__ import annotations

import importlib
import json
import math
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

TEXT_HIDDEN = 32  # the tiny Gemma's hidden size
TEXT_STATES = 3  # its embeddings plus 2 layers
SEQUENCE = 128  # connector registers: prompts are padded to a multiple of 128 tokens
VERSIONS = ("2.0", "2.3")
CPU = torch.device("cpu")


# ---- importing ltx-core ---------------------------------------------------------------------------------


def import_ltx() -> None:
    """Import ltx-core's audio package even where ``torchaudio`` cannot load.

    ``ltx_core.model.audio_vae.ops`` imports torchaudio at module level for ``AudioProcessor`` (waveform to mel,
    the audio encoder's input), which nothing here uses; torchaudio's wheels are built for one torch release, so
    beside another torch it fails to load. A stand-in module is in ``sys.modules`` only while that package
    imports, so other libraries' availability checks still see no torchaudio."""
    if "ltx_core.model.audio_vae" in sys.modules:
        return
    try:
        importlib.import_module("torchaudio")
    except Exception:  # noqa: BLE001 - missing, or built for another torch
        stand_in = types.ModuleType("torchaudio")
        sys.modules["torchaudio"] = stand_in
        try:
            importlib.import_module("ltx_core.model.audio_vae")
        finally:
            if sys.modules.get("torchaudio") is stand_in:
                del sys.modules["torchaudio"]


# ---- the tiny official config ----------------------------------------------------------------------------

# Values ltx-core's LTXModelConfigurator insists on (it raises on any other).
_FIXED_TRANSFORMER = {
    "dropout": 0.0, "attention_bias": True, "num_vector_embeds": None, "activation_fn": "gelu-approximate",
    "num_embeds_ada_norm": 1000, "use_linear_projection": False, "only_cross_attention": False,
    "cross_attention_norm": True, "double_self_attention": False, "upcast_attention": False,
    "standardization_norm": "rms_norm", "norm_elementwise_affine": False, "qk_norm": "rms_norm",
    "positional_embedding_type": "rope", "use_audio_video_cross_attention": True, "share_ff": False,
    "av_cross_ada_norm": True, "use_middle_indices_grid": True,
}
VIDEO_HEADS, VIDEO_HEAD_DIM, AUDIO_HEADS, AUDIO_HEAD_DIM, LAYERS = 2, 8, 2, 4, 2
VAE_BASE = 4  # decoder width: 8 * VAE_BASE channels after conv_in, VAE_BASE before conv_out


def official_config(version: str) -> dict[str, Any]:
    """The ``config`` metadata of a tiny official checkpoint, in the keys ltx-core's configurators read."""
    if version not in VERSIONS:
        raise ValueError(f"version is one of {VERSIONS}, got {version!r}")
    v23 = version == "2.3"
    video_dim, audio_dim = VIDEO_HEADS * VIDEO_HEAD_DIM, AUDIO_HEADS * AUDIO_HEAD_DIM
    transformer = {
        **_FIXED_TRANSFORMER,
        "num_attention_heads": VIDEO_HEADS, "attention_head_dim": VIDEO_HEAD_DIM, "in_channels": 128,
        "out_channels": 128, "num_layers": LAYERS, "cross_attention_dim": video_dim,
        "audio_num_attention_heads": AUDIO_HEADS, "audio_attention_head_dim": AUDIO_HEAD_DIM,
        "audio_in_channels": 128, "audio_out_channels": 128, "audio_cross_attention_dim": audio_dim,
        "positional_embedding_theta": 10000.0, "positional_embedding_max_pos": [20, 2048, 2048],
        "audio_positional_embedding_max_pos": [20], "timestep_scale_multiplier": 1000,
        "av_ca_timestep_scale_multiplier": 1000, "rope_type": "split", "frequencies_precision": "float64",
        "caption_channels": TEXT_HIDDEN, "connector_num_layers": 1, "connector_positional_embedding_max_pos": [4096],
    }
    if v23:  # gated attention, cross-attention AdaLN, the caption projection moved into the text side
        transformer.update({
            "apply_gated_attention": True, "cross_attention_adaln": True, "caption_proj_before_connector": True,
            "caption_projection_first_linear": False, "caption_proj_input_norm": False,
            "caption_projection_second_linear": False, "connector_apply_gated_attention": True,
            "connector_num_attention_heads": VIDEO_HEADS, "connector_attention_head_dim": VIDEO_HEAD_DIM,
            "audio_connector_num_attention_heads": AUDIO_HEADS, "audio_connector_attention_head_dim": AUDIO_HEAD_DIM,
        })
    else:  # both connectors as wide as Gemma
        transformer.update({"connector_num_attention_heads": 4, "connector_attention_head_dim": TEXT_HIDDEN // 4})
    return {"transformer": transformer, "vae": _vae_config(v23), "audio_vae": _audio_vae_config(),
            "vocoder": _vocoder_config(v23)}


def _vae_config(v23: bool) -> dict[str, Any]:
    res = ["res_x", {"num_layers": 1}]
    if v23:  # LTX-2.3's decoder: four stages, the last two temporal-only and spatial-only, no residual upsamplers
        blocks = [res, ["compress_space", {"multiplier": 2}], res, ["compress_time", {"multiplier": 2}], res,
                  ["compress_all", {"multiplier": 1}], res, ["compress_all", {"multiplier": 2}], res]
    else:
        up = ["compress_all", {"residual": True, "multiplier": 2}]
        blocks = [res, up, res, up, res, up, res]
    return {"dims": 3, "in_channels": 3, "out_channels": 3, "latent_channels": 128, "patch_size": 4,
            "norm_layer": "pixel_norm", "causal_decoder": False, "timestep_conditioning": False,
            "spatial_padding_mode": "zeros" if v23 else "reflect", "decoder_base_channels": VAE_BASE,
            "decoder_blocks": blocks}


def _audio_vae_config() -> dict[str, Any]:
    # 128 base channels: ltx-core (and diffusers) size the latent statistics by them, and the packed audio
    # latent is 8 channels x 16 mel bins = 128.
    ddconfig = {"ch": 128, "out_ch": 2, "ch_mult": [1, 1, 1], "num_res_blocks": 1, "attn_resolutions": [],
                "resolution": 256, "z_channels": 8, "norm_type": "pixel", "causality_axis": "height", "dropout": 0.0,
                "mid_block_add_attention": False, "mel_bins": 64}
    return {"model": {"params": {"sampling_rate": 16000, "ddconfig": ddconfig}},
            "preprocessing": {"stft": {"hop_length": 160, "causal": True}}}


BWE = {"n_fft": 32, "hop_length": 8, "num_mels": 64, "input_sampling_rate": 16000, "output_sampling_rate": 48000}


def _vocoder_config(v23: bool) -> dict[str, Any]:
    small = {"resblock_kernel_sizes": [3], "resblock_dilation_sizes": [[1, 3, 5]], "upsample_initial_channel": 16,
             "stereo": True}
    if not v23:
        return {**small, "resblock": "1", "upsample_rates": [2, 2], "upsample_kernel_sizes": [4, 4],
                "output_sampling_rate": 16000}
    amp = {**small, "resblock": "AMP1", "activation": "snakebeta", "use_tanh_at_final": False,
           "use_bias_at_final": False}
    # The BWE generator upsamples one mel frame (hop_length samples at 16 kHz) to hop_length * 3 samples at 48 kHz.
    return {"vocoder": {**amp, "upsample_rates": [2, 2], "upsample_kernel_sizes": [4, 4]},
            "bwe": {**amp, "upsample_rates": [6, 4], "upsample_kernel_sizes": [12, 8], **BWE}}


# ---- building the official checkpoint ---------------------------------------------------------------------


def _ltx_modules(config: dict[str, Any]) -> dict[str, torch.nn.Module]:
    """ltx-core's modules for ``config``, keyed by their prefix in the official single-file layout."""
    import_ltx()
    from ltx_core.model.audio_vae import AudioDecoderConfigurator, VocoderConfigurator
    from ltx_core.model.transformer import LTXModelConfigurator
    from ltx_core.model.video_vae import VideoDecoderConfigurator

    return {"model.diffusion_model.": LTXModelConfigurator.from_config(config),
            "text": TextProcessorConfigurator.from_config(config),
            "vae.": VideoDecoderConfigurator.from_config(config),
            "audio_vae.": AudioDecoderConfigurator.from_config(config),
            "vocoder.": VocoderConfigurator.from_config(config)}


def _official_key(prefix: str, key: str) -> str:
    """A module's own state-dict key -> its key in the official checkpoint (the inverse of ltx-core's SDOps)."""
    if prefix == "text":
        for own, official in (("feature_extractor.", "text_embedding_projection."),
                              ("video_connector.", "model.diffusion_model.video_embeddings_connector."),
                              ("audio_connector.", "model.diffusion_model.audio_embeddings_connector.")):
            if key.startswith(own):
                return official + key[len(own):]
        raise KeyError(key)
    if prefix in ("vae.", "audio_vae.") and not key.startswith("per_channel_statistics."):
        return f"{prefix}decoder.{key}"
    return prefix + key


def _random_tensor(key: str, like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Weights that keep activations O(1) through the tiny stacks."""
    shape = tuple(like.shape)
    if key.endswith("learnable_registers"):
        return torch.rand(shape, generator=generator) * 2 - 1
    if key.endswith(("alpha", "beta")):  # snake activations, log-scale
        return torch.randn(shape, generator=generator) * 0.1
    if "scale_shift_table" in key:
        return torch.randn(shape, generator=generator) / math.sqrt(shape[-1])
    if len(shape) <= 1:  # biases and norm gains
        owner = key.rpartition(".")[0].rpartition(".")[2]
        base = 1.0 if "norm" in owner else 0.0
        return base + torch.randn(shape, generator=generator) * 0.05
    fan_in = math.prod(shape[1:])
    return torch.randn(shape, generator=generator) / math.sqrt(fan_in)


def _fixed_buffer(key: str, like: torch.Tensor, generator: torch.Generator) -> torch.Tensor | None:
    """Buffers a checkpoint carries (ltx-core leaves them empty until loading): latent statistics and the BWE's
    STFT bases and mel filterbank. Every other buffer keeps the value the module computed."""
    if key.endswith("mean-of-means"):
        return torch.randn(like.shape, generator=generator) * 0.5
    if key.endswith("std-of-means"):
        return 0.5 + torch.rand(like.shape, generator=generator)
    if key.endswith(("stft_fn.forward_basis", "stft_fn.inverse_basis")):
        return _dft_basis(like.shape[-1])
    if key.endswith("mel_basis"):
        return torch.rand(like.shape, generator=generator) * 2 / like.shape[-1]
    return None


def _dft_basis(n_fft: int) -> torch.Tensor:
    """Real and imaginary DFT rows times a Hann window, (2 * (n_fft // 2 + 1), 1, n_fft)."""
    n = np.arange(n_fft)
    k = np.arange(n_fft // 2 + 1)[:, None]
    window = np.hanning(n_fft + 1)[:-1]
    angle = 2 * np.pi * k * n / n_fft
    basis = np.concatenate([np.cos(angle), -np.sin(angle)]) * window
    return torch.tensor(basis[:, None, :], dtype=torch.float32)


def official_checkpoint(path: str | Path, version: str = "2.3", seed: int = 0) -> dict[str, torch.Tensor]:
    """Write a tiny random checkpoint in the official single-file layout to ``path``; return its tensors."""
    from safetensors.torch import save_file

    config = official_config(version)
    generator = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for prefix, module in _ltx_modules(config).items():
        params = {name for name, _ in module.named_parameters()}
        for key, tensor in sorted(module.state_dict().items()):
            value = _random_tensor(key, tensor, generator) if key in params else (
                _fixed_buffer(key, tensor, generator))
            if value is None:
                if tensor.is_meta:
                    raise ValueError(f"{prefix}{key}: an uninitialised buffer with no rule to fill it")
                value = tensor
            state[_official_key(prefix, key)] = value.to(torch.float32).contiguous()
    save_file(state, str(path), metadata={"config": json.dumps(config), "model_version": version})
    return state


class TextProcessorConfigurator:
    """ltx-core's ``EmbeddingsProcessor`` (feature extractor, video and audio connectors) sized for the tiny Gemma.

    ltx-core's own ``EmbeddingsProcessorConfigurator`` takes the feature extractor's input width from its
    built-in Gemma-3-12B config (3840 x 49); the connectors come from ltx-core's configurators as usual."""

    @classmethod
    def from_config(cls, config: dict) -> torch.nn.Module:
        from ltx_core.text_encoders.gemma import EmbeddingsProcessor
        from ltx_core.text_encoders.gemma.embeddings_connector import (
            AudioEmbeddings1DConnectorConfigurator,
            Embeddings1DConnectorConfigurator,
        )
        from ltx_core.text_encoders.gemma.feature_extractor import FeatureExtractorV1, FeatureExtractorV2

        transformer = config["transformer"]
        flat = TEXT_HIDDEN * TEXT_STATES
        if transformer.get("caption_proj_before_connector"):
            video = transformer["num_attention_heads"] * transformer["attention_head_dim"]
            audio = transformer["audio_num_attention_heads"] * transformer["audio_attention_head_dim"]
            extractor = FeatureExtractorV2(torch.nn.Linear(flat, video), TEXT_HIDDEN, torch.nn.Linear(flat, audio))
        else:
            extractor = FeatureExtractorV1(torch.nn.Linear(flat, TEXT_HIDDEN, bias=False), is_av=True)
        return EmbeddingsProcessor(feature_extractor=extractor,
                                   video_connector=Embeddings1DConnectorConfigurator.from_config(config),
                                   audio_connector=AudioEmbeddings1DConnectorConfigurator.from_config(config))


# ---- loading it with ltx-core ------------------------------------------------------------------------------


@dataclass
class OfficialModels:
    """ltx-core's modules as ltx-pipelines' ``ModelLedger`` builds them, plus the prompt encoder."""
    transformer: torch.nn.Module  # X0Model
    video_decoder: torch.nn.Module
    audio_decoder: torch.nn.Module
    vocoder: torch.nn.Module
    text_encoder: torch.nn.Module  # GemmaTextEncoder
    text_processor: torch.nn.Module  # EmbeddingsProcessor

    def encode(self, prompt: str):
        """Gemma's hidden states through the feature extractor and connectors (ltx-pipelines' ``encode_prompts``
        for one prompt)."""
        hidden_states, mask = self.text_encoder.encode(prompt)
        return self.text_processor.process_hidden_states(hidden_states, mask)


def load_official(checkpoint: str | Path, gemma: torch.nn.Module, tokenizer_dir: str | Path) -> OfficialModels:
    """Load ``checkpoint`` with ltx-core's loader (float32, CPU); ``gemma`` and the tokenizer in
    ``tokenizer_dir`` make the text encoder, with prompts padded to ``SEQUENCE`` tokens."""
    import_ltx()
    from ltx_core.loader.single_gpu_model_builder import SingleGPUModelBuilder
    from ltx_core.text_encoders.gemma import EMBEDDINGS_PROCESSOR_KEY_OPS, GemmaTextEncoder
    from ltx_core.text_encoders.gemma.tokenizer import LTXVGemmaTokenizer
    from ltx_pipelines.utils.model_ledger import ModelLedger

    ledger = ModelLedger(dtype=torch.float32, device=CPU, checkpoint_path=str(checkpoint))
    processor = SingleGPUModelBuilder(model_class_configurator=TextProcessorConfigurator, model_path=str(checkpoint),
                                      model_sd_ops=EMBEDDINGS_PROCESSOR_KEY_OPS).build(device=CPU, dtype=torch.float32)
    models = OfficialModels(
        transformer=ledger.transformer(), video_decoder=ledger.video_decoder(), audio_decoder=ledger.audio_decoder(),
        vocoder=ledger.vocoder(),
        text_encoder=GemmaTextEncoder(model=gemma, tokenizer=LTXVGemmaTokenizer(str(tokenizer_dir), SEQUENCE),
                                      dtype=torch.float32).eval(),
        text_processor=processor.eval())
    for name in ("transformer", "video_decoder", "audio_decoder", "vocoder", "text_processor"):
        unloaded = [k for k, v in getattr(models, name).state_dict().items() if v.is_meta]
        if unloaded:  # ltx-core's builder only logs a warning and hands back a meta model
            raise ValueError(f"ltx-core left {name} weights unloaded: {unloaded[:5]}")
    return models


# ---- the official one-stage loop ----------------------------------------------------------------------------


def latent_sizes(height: int, width: int, frames: int, fps: float) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Video (1, 128, F, H, W) and audio (1, 8, L, 16) latent shapes, as ltx-pipelines computes them."""
    import_ltx()
    from ltx_core.types import AudioLatentShape, VideoLatentShape, VideoPixelShape

    pixels = VideoPixelShape(batch=1, frames=frames, height=height, width=width, fps=fps)
    return (tuple(VideoLatentShape.from_pixel_shape(pixels).to_torch_shape()),
            tuple(AudioLatentShape.from_video_pixel_shape(pixels).to_torch_shape()))


class PresetNoise:
    """An ltx-core ``Noiser`` that uses given noise (one tensor per call, packed) with ``GaussianNoiser``'s blend."""

    def __init__(self, noise: list[torch.Tensor]):
        self.noise = list(noise)

    def __call__(self, latent_state, noise_scale: float = 1.0):
        from dataclasses import replace

        noise = self.noise.pop(0).to(latent_state.latent)
        if noise.shape != latent_state.latent.shape:
            raise ValueError(f"preset noise {tuple(noise.shape)} for a latent of {tuple(latent_state.latent.shape)}")
        mask = latent_state.denoise_mask * noise_scale
        return replace(latent_state, latent=noise * mask + latent_state.latent * (1 - mask))


@dataclass
class OfficialRun:
    frames: np.ndarray  # (F, H, W, 3) uint8, as ltx-core's decode_video yields them
    audio: np.ndarray  # (channels, samples) float32
    sample_rate: int
    video_latent: torch.Tensor  # (1, 128, F, H, W), normalised
    audio_latent: torch.Tensor  # (1, 8, L, 16), normalised
    sigmas: torch.Tensor


def official_one_stage(models: OfficialModels, prompt: str, negative_prompt: str, *, height: int, width: int,
                       frames: int, fps: float, steps: int, video_guidance, audio_guidance, seed: int = 0,
                       noise: list[torch.Tensor] | None = None) -> OfficialRun:
    """ltx-pipelines' ``TI2VidOneStagePipeline.__call__`` for text-to-video, in float32 on the CPU: encode both
    prompts, ``LTX2Scheduler().execute(steps)`` sigmas, the multi-modal guider loop, Euler steps, decode.
    ``noise`` replaces its ``GaussianNoiser(torch.Generator(device).manual_seed(seed))``."""
    import_ltx()
    from ltx_core.components.diffusion_steps import EulerDiffusionStep
    from ltx_core.components.guiders import create_multimodal_guider_factory
    from ltx_core.components.noisers import GaussianNoiser
    from ltx_core.components.schedulers import LTX2Scheduler
    from ltx_core.model.audio_vae import decode_audio
    from ltx_core.model.video_vae import decode_video
    from ltx_core.types import VideoPixelShape
    from ltx_pipelines.utils.helpers import denoise_audio_video, multi_modal_guider_factory_denoising_func
    from ltx_pipelines.utils.samplers import euler_denoising_loop
    from ltx_pipelines.utils.types import PipelineComponents

    generator = torch.Generator(device=CPU).manual_seed(seed)
    noiser = GaussianNoiser(generator=generator) if noise is None else PresetNoise(noise)
    with torch.inference_mode():
        positive, negative = models.encode(prompt), models.encode(negative_prompt)
        sigmas = LTX2Scheduler().execute(steps=steps).to(dtype=torch.float32, device=CPU)
        video_factory = create_multimodal_guider_factory(params=video_guidance,
                                                         negative_context=negative.video_encoding)
        audio_factory = create_multimodal_guider_factory(params=audio_guidance,
                                                         negative_context=negative.audio_encoding)

        def loop(sigmas, video_state, audio_state, stepper):
            return euler_denoising_loop(
                sigmas=sigmas, video_state=video_state, audio_state=audio_state, stepper=stepper,
                denoise_fn=multi_modal_guider_factory_denoising_func(
                    video_guider_factory=video_factory, audio_guider_factory=audio_factory,
                    v_context=positive.video_encoding, a_context=positive.audio_encoding,
                    transformer=models.transformer))

        video, audio = denoise_audio_video(
            output_shape=VideoPixelShape(batch=1, frames=frames, width=width, height=height, fps=fps),
            conditionings=[], noiser=noiser, sigmas=sigmas, stepper=EulerDiffusionStep(), denoising_loop_fn=loop,
            components=PipelineComponents(dtype=torch.float32, device=CPU), dtype=torch.float32, device=CPU)
        decoded = torch.cat(list(decode_video(video.latent, models.video_decoder, generator=generator)))
        sound = decode_audio(audio.latent, models.audio_decoder, models.vocoder)
    return OfficialRun(decoded.numpy(), sound.waveform.numpy(), int(sound.sampling_rate), video.latent,
                       audio.latent, sigmas)


# ---- one transformer forward on both sides ------------------------------------------------------------------

PASSES = ("plain", "stg", "modality")  # the three kinds of forward the guided loops make


def official_forward(models: OfficialModels, video: torch.Tensor, audio: torch.Tensor, context, sigma: float, *,
                     height: int, width: int, frames: int, fps: float, kind: str = "plain",
                     stg_blocks: tuple[int, ...] = (1,)) -> tuple[torch.Tensor, torch.Tensor]:
    """ltx-core's velocity for packed ``video`` (1, T, 128) and ``audio`` (1, L, 128) at ``sigma``, with the
    positions ltx-core's latent tools give and the perturbations ltx-pipelines' guided loop passes for ``kind``
    (``stg``: both self-attentions skipped on ``stg_blocks``; ``modality``: both cross-modal attentions off)."""
    import_ltx()
    from ltx_core.guidance.perturbations import (
        BatchedPerturbationConfig,
        Perturbation,
        PerturbationConfig,
        PerturbationType,
    )
    from ltx_core.model.transformer import Modality
    from ltx_core.types import VideoPixelShape
    from ltx_pipelines.utils.helpers import noise_audio_state, noise_video_state
    from ltx_pipelines.utils.types import PipelineComponents

    pixels = VideoPixelShape(batch=1, frames=frames, height=height, width=width, fps=fps)
    components = PipelineComponents(dtype=torch.float32, device=CPU)
    keep = PresetNoise([torch.zeros_like(video), torch.zeros_like(audio)])  # states only, for their positions
    video_state, _ = noise_video_state(pixels, keep, [], components, torch.float32, CPU, noise_scale=0.0)
    audio_state, _ = noise_audio_state(pixels, keep, [], components, torch.float32, CPU, noise_scale=0.0)
    perturbations = {
        "plain": None,
        "stg": [Perturbation(PerturbationType.SKIP_VIDEO_SELF_ATTN, list(stg_blocks)),
                Perturbation(PerturbationType.SKIP_AUDIO_SELF_ATTN, list(stg_blocks))],
        "modality": [Perturbation(PerturbationType.SKIP_A2V_CROSS_ATTN, None),
                     Perturbation(PerturbationType.SKIP_V2A_CROSS_ATTN, None)],
    }[kind]
    batched = None if perturbations is None else BatchedPerturbationConfig([PerturbationConfig(perturbations)])
    s = torch.tensor([sigma], dtype=torch.float32)

    def modality(state, latent, context):
        return Modality(latent=latent, sigma=s, timesteps=state.denoise_mask * s, positions=state.positions,
                        context=context)

    with torch.inference_mode():
        return models.transformer.velocity_model(modality(video_state, video, context.video_encoding),
                                                 modality(audio_state, audio, context.audio_encoding), batched)
