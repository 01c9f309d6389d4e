"""The diffusers side of the LTX-2 accuracy check: the tiny official checkpoint of ``ltx_official`` converted
with diffusers' single-file converters and loaded strictly into the classes omnispec's ``ltx2`` family uses, the
initial noise an ``LTX2Pipeline`` run draws, and one transformer forward called as the family calls it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .ltx_official import (
    AUDIO_HEAD_DIM,
    AUDIO_HEADS,
    BWE,
    CPU,
    LAYERS,
    SEQUENCE,
    TEXT_HIDDEN,
    TEXT_STATES,
    VAE_BASE,
    VIDEO_HEAD_DIM,
    VIDEO_HEADS,
    latent_sizes,
)

# ---- converting it to diffusers ----------------------------------------------------------------------------

# Renames diffusers' single-file converters (diffusers 0.42) lack for LTX-2.3 checkpoints; the converter script
# in diffusers' repository (scripts/convert_ltx2_to_diffusers.py) has them.
_TRANSFORMER_23 = (("audio_prompt_adaln_single.", "audio_prompt_adaln."), ("prompt_adaln_single.", "prompt_adaln."))
_VAE_23 = (("up_blocks.7.", "up_blocks.3.upsamplers.0."), ("up_blocks.8.", "up_blocks.3."))
# No single-file converter exists for these two.
_CONNECTORS = (("model.diffusion_model.video_embeddings_connector.", "video_connector."),
               ("model.diffusion_model.audio_embeddings_connector.", "audio_connector."),
               ("text_embedding_projection.aggregate_embed.", "text_proj_in."),
               ("text_embedding_projection.video_aggregate_embed.", "video_text_proj_in."),
               ("text_embedding_projection.audio_aggregate_embed.", "audio_text_proj_in."),
               (".transformer_1d_blocks.", ".transformer_blocks."), (".q_norm.", ".norm_q."), (".k_norm.", ".norm_k."))
_VOCODER = (("conv_pre.", "conv_in."), ("conv_post.", "conv_out."), ("act_post.", "act_out."),
            ("resblocks.", "resnets."), ("ups.", "upsamplers."), ("downsample.lowpass.", "downsample."))
_CONNECTOR_PREFIXES = ("model.diffusion_model.video_embeddings_connector.",
                       "model.diffusion_model.audio_embeddings_connector.", "text_embedding_projection.")


def _renamed(state: dict[str, torch.Tensor], renames, strip: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        key = key.removeprefix(strip)
        for old, new in renames:
            key = key.replace(old, new)
        out[key] = value
    return out


def _with_prefix(state: dict[str, torch.Tensor], prefix: str, exclude: tuple[str, ...] = ()) -> dict:
    return {k: v.clone() for k, v in state.items() if k.startswith(prefix) and not k.startswith(exclude)}


def diffusers_configs(version: str) -> dict[str, dict[str, Any]]:
    """The diffusers configs the tiny official checkpoint converts into (as diffusers' converter script writes
    them for the real checkpoints, at the tiny widths)."""
    v23 = version == "2.3"
    video_dim, audio_dim = VIDEO_HEADS * VIDEO_HEAD_DIM, AUDIO_HEADS * AUDIO_HEAD_DIM
    transformer = dict(
        in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=VIDEO_HEADS,
        attention_head_dim=VIDEO_HEAD_DIM, cross_attention_dim=video_dim, vae_scale_factors=(8, 32, 32),
        pos_embed_max_pos=20, base_height=2048, base_width=2048, audio_in_channels=128, audio_out_channels=128,
        audio_num_attention_heads=AUDIO_HEADS, audio_attention_head_dim=AUDIO_HEAD_DIM,
        audio_cross_attention_dim=audio_dim, num_layers=LAYERS, caption_channels=TEXT_HIDDEN,
        rope_double_precision=True, cross_attn_timestep_scale_multiplier=1000, rope_type="split",
        gated_attn=v23, cross_attn_mod=v23, audio_gated_attn=v23, audio_cross_attn_mod=v23,
        use_prompt_embeddings=not v23, perturbed_attn=v23)
    connectors = dict(
        caption_channels=TEXT_HIDDEN, text_proj_in_factor=TEXT_STATES, video_connector_num_layers=1,
        audio_connector_num_layers=1, video_connector_num_learnable_registers=SEQUENCE,
        audio_connector_num_learnable_registers=SEQUENCE, connector_rope_base_seq_len=4096, rope_theta=10000.0,
        rope_double_precision=True, causal_temporal_positioning=False, rope_type="split")
    if v23:
        connectors.update(per_modality_projections=True, video_hidden_dim=video_dim, audio_hidden_dim=audio_dim,
                          proj_bias=True, video_gated_attn=True, audio_gated_attn=True,
                          video_connector_num_attention_heads=VIDEO_HEADS,
                          video_connector_attention_head_dim=VIDEO_HEAD_DIM,
                          audio_connector_num_attention_heads=AUDIO_HEADS,
                          audio_connector_attention_head_dim=AUDIO_HEAD_DIM)
    else:
        connectors.update(video_connector_num_attention_heads=4, video_connector_attention_head_dim=TEXT_HIDDEN // 4,
                          audio_connector_num_attention_heads=4, audio_connector_attention_head_dim=TEXT_HIDDEN // 4)
    b = VAE_BASE
    vae = dict(  # the encoder is not in the checkpoint (text-to-video never encodes): small and random
        in_channels=3, out_channels=3, latent_channels=128, block_out_channels=(8, 16, 32, 64),
        layers_per_block=(1, 1, 1, 1, 1), spatio_temporal_scaling=(True,) * 4,
        downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
        timestep_conditioning=False, patch_size=4, patch_size_t=1, resnet_norm_eps=1e-6, encoder_causal=True,
        decoder_causal=False, encoder_spatial_padding_mode="zeros", spatial_compression_ratio=32,
        temporal_compression_ratio=8)
    if v23:
        vae.update(decoder_block_out_channels=(2 * b, 4 * b, 4 * b, 8 * b), decoder_layers_per_block=(1,) * 5,
                   decoder_spatio_temporal_scaling=(True,) * 4, decoder_inject_noise=(False,) * 5,
                   upsample_type=("spatiotemporal", "spatiotemporal", "temporal", "spatial"),
                   upsample_residual=(False,) * 4, upsample_factor=(2, 2, 1, 2), decoder_spatial_padding_mode="zeros")
    else:
        vae.update(decoder_block_out_channels=(2 * b, 4 * b, 8 * b), decoder_layers_per_block=(1,) * 4,
                   decoder_spatio_temporal_scaling=(True,) * 3, decoder_inject_noise=(False,) * 4,
                   upsample_type=("spatiotemporal",) * 3, upsample_residual=(True,) * 3, upsample_factor=(2, 2, 2),
                   decoder_spatial_padding_mode="reflect")
    audio_vae = dict(base_channels=128, output_channels=2, ch_mult=(1, 1, 1), num_res_blocks=1, attn_resolutions=None,
                     in_channels=2, resolution=256, latent_channels=8, norm_type="pixel", causality_axis="height",
                     dropout=0.0, mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True,
                     mel_bins=64, double_z=True)
    small = dict(in_channels=128, hidden_channels=16, out_channels=2, upsample_kernel_sizes=[4, 4],
                 upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]])
    if v23:  # final_act_fn None, as diffusers' converter writes it for LTX-2.3
        vocoder = dict(**small, act_fn="snakebeta", antialias=True, antialias_ratio=2, antialias_kernel_size=12,
                       final_act_fn=None, final_bias=False, bwe_in_channels=128, bwe_hidden_channels=16,
                       bwe_out_channels=2, bwe_upsample_kernel_sizes=[12, 8], bwe_upsample_factors=[6, 4],
                       bwe_resnet_kernel_sizes=[3], bwe_resnet_dilations=[[1, 3, 5]], bwe_act_fn="snakebeta",
                       bwe_antialias=True, bwe_antialias_ratio=2, bwe_antialias_kernel_size=12, bwe_final_act_fn=None,
                       bwe_final_bias=False, filter_length=BWE["n_fft"], hop_length=BWE["hop_length"],
                       window_length=BWE["n_fft"], num_mel_channels=BWE["num_mels"],
                       input_sampling_rate=BWE["input_sampling_rate"], output_sampling_rate=BWE["output_sampling_rate"])
    else:
        vocoder = dict(**small, act_fn="leaky_relu", leaky_relu_negative_slope=0.1, antialias=False,
                       final_act_fn="tanh", final_bias=True, output_sampling_rate=16000)
    return {"transformer": transformer, "connectors": connectors, "vae": vae, "audio_vae": audio_vae,
            "vocoder": vocoder}


def diffusers_components(state: dict[str, torch.Tensor], version: str) -> dict[str, torch.nn.Module]:
    """The official tensors converted and loaded into diffusers' LTX-2 classes (strictly: every converted key
    lands and every diffusers key is covered, except the video VAE's encoder, which the checkpoint lacks)."""
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2VideoTransformer3DModel
    from diffusers.loaders.single_file_utils import (
        convert_ltx2_audio_vae_to_diffusers,
        convert_ltx2_transformer_to_diffusers,
        convert_ltx2_vae_to_diffusers,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors, LTX2Vocoder, LTX2VocoderWithBWE

    v23 = version == "2.3"
    configs = diffusers_configs(version)
    transformer = convert_ltx2_transformer_to_diffusers(
        _with_prefix(state, "model.diffusion_model.", exclude=_CONNECTOR_PREFIXES))
    vae = convert_ltx2_vae_to_diffusers(_with_prefix(state, "vae."))
    if v23:
        transformer, vae = _renamed(transformer, _TRANSFORMER_23), _renamed(vae, _VAE_23)
    converted = {
        "transformer": (LTX2VideoTransformer3DModel, transformer),
        "connectors": (LTX2TextConnectors, _renamed(
            {k: v.clone() for k, v in state.items() if k.startswith(_CONNECTOR_PREFIXES)}, _CONNECTORS)),
        "vae": (AutoencoderKLLTX2Video, vae),
        "audio_vae": (AutoencoderKLLTX2Audio, convert_ltx2_audio_vae_to_diffusers(_with_prefix(state, "audio_vae."))),
        "vocoder": (LTX2VocoderWithBWE if v23 else LTX2Vocoder, _renamed(_with_prefix(state, "vocoder."), _VOCODER, strip="vocoder.")),
    }
    modules = {}
    for name, (cls, weights) in converted.items():
        module = cls(**configs[name]).eval()
        missing, unexpected = module.load_state_dict(weights, strict=False)
        missing = [k for k in missing if not k.startswith("encoder.")]
        if missing or unexpected:
            raise ValueError(f"{name}: converted keys do not fit diffusers' {cls.__name__}: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
        modules[name] = module
    return modules


def save_diffusers_checkpoint(root: str | Path, modules: dict[str, torch.nn.Module], text_encoder, tokenizer) -> Path:
    """An ``LTX2Pipeline`` directory (what ``omnispec.build(source=...)`` loads) with the converted modules, the
    given Gemma and tokenizer, and the non-distilled checkpoints' scheduler config."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.ltx2 import LTX2Pipeline

    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024, max_image_seq_len=4096,
        shift_terminal=0.1)
    LTX2Pipeline(scheduler=scheduler, text_encoder=text_encoder, tokenizer=tokenizer, **modules).save_pretrained(root)
    return Path(root)


def diffusers_noise(seed: int, video_shape, audio_shape) -> list[torch.Tensor]:
    """The initial noise of an ``LTX2Pipeline`` (and omnispec) run with ``seed``, packed to tokens: video drawn
    5D, then audio drawn 4D, from one CPU generator."""
    from diffusers.utils.torch_utils import randn_tensor

    generator = [torch.Generator("cpu").manual_seed(seed)]
    video = randn_tensor(tuple(video_shape), generator=generator, dtype=torch.float32)
    audio = randn_tensor(tuple(audio_shape), generator=generator, dtype=torch.float32)
    return [video.flatten(2).transpose(1, 2), audio.transpose(1, 2).flatten(2)]


def diffusers_forward(transformer: torch.nn.Module, video: torch.Tensor, audio: torch.Tensor, context,
                      sigma: float, *, height: int, width: int, frames: int, fps: float, kind: str = "plain",
                      stg_blocks: tuple[int, ...] = (1,)) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' ``LTX2VideoTransformer3DModel`` called as omnispec's ``ltx2`` family calls it (timestep in
    1000ths, coordinates from the transformer's own RoPE modules, ``use_cross_timestep``)."""
    (_, _, f, h, w), (_, _, length, _) = latent_sizes(height, width, frames, fps)
    t = torch.tensor([sigma * 1000.0], dtype=torch.float32)
    mask = torch.ones(context.video_encoding.shape[:2], dtype=torch.long)
    with torch.inference_mode():
        return transformer(
            hidden_states=video, audio_hidden_states=audio, encoder_hidden_states=context.video_encoding,
            audio_encoder_hidden_states=context.audio_encoding, timestep=t, audio_timestep=t, sigma=t,
            encoder_attention_mask=mask, audio_encoder_attention_mask=mask, num_frames=f, height=h, width=w, fps=fps,
            audio_num_frames=length, video_coords=transformer.rope.prepare_video_coords(1, f, h, w, CPU, fps=fps),
            audio_coords=transformer.audio_rope.prepare_audio_coords(1, length, CPU),
            isolate_modalities=kind == "modality", spatio_temporal_guidance_blocks=list(stg_blocks) if kind == "stg"
            else None, use_cross_timestep=True, return_dict=False)
