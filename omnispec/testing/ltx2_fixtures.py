"""Tiny LTX-2 checkpoints (video and audio): the pipeline's modules at toy widths, with LTX-2.0's or LTX-2.3's
transformer, the latent upsampler, and a Gemma-3 text encoder with its tokenizer trained here."""

from __future__ import annotations

from pathlib import Path

from .fixtures import _seeded
from .tokenizers import gemma_tokenizer


def _gemma3(vocab_size: int):
    import transformers

    config = transformers.Gemma3Config(
        text_config={"vocab_size": vocab_size, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
                     "max_position_embeddings": 256, "sliding_window": 64, "query_pre_attn_scalar": 16},
        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": 28, "patch_size": 14},
        mm_tokens_per_image=4, boi_token_index=vocab_size - 3, eoi_token_index=vocab_size - 2,
        image_token_index=vocab_size - 1,
    )
    return transformers.Gemma3ForConditionalGeneration(config).eval()


def tiny_ltx2(root: str | Path, seed: int = 0, version: str = "2.3", bwe: bool = False) -> Path:
    """``LTX2Pipeline`` layout plus ``latent_upsampler/``. ``version`` "2.3" has LTX-2.3's gated attention,
    prompt AdaLN, per-modality connectors and the perturbable self-attention that makes STG act; "2.0" has
    LTX-2.0's (where diffusers' STG pass equals the plain one). The VAE compresses 2x in space and time, so
    32x32x5 frames are 3x16x16 latents; the scheduler is the real checkpoint's (dynamic shift, terminal 0.1).
    ``bwe`` gives the vocoder LTX-2.3's bandwidth extension to 48 kHz, as the ``ltx2.3-*`` specs name it."""
    from diffusers.pipelines.ltx2 import LTX2LatentUpsamplerModel, LTX2Pipeline

    pipe = LTX2Pipeline(**ltx2_components(seed, version, bwe))
    pipe.save_pretrained(root)
    _seeded(seed)
    LTX2LatentUpsamplerModel(in_channels=4, mid_channels=32, num_blocks_per_stage=1).save_pretrained(
        Path(root) / "latent_upsampler")
    return Path(root)


def ltx2_components(seed: int = 0, version: str = "2.3", bwe: bool = False) -> dict:
    """The tiny LTX-2 modules of ``tiny_ltx2``, in memory (benchmarks' smoke mode uses them too)."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder, LTX2VocoderWithBWE

    if version not in ("2.0", "2.3"):
        raise ValueError(f"version is '2.0' or '2.3', got {version!r}")
    v23 = version == "2.3"
    tokenizer = gemma_tokenizer()
    _seeded(seed)
    text_encoder = _gemma3(len(tokenizer))
    text = text_encoder.config.text_config
    _seeded(seed)
    transformer = LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2,
        audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2, qk_norm="rms_norm_across_heads",
        caption_channels=text.hidden_size, rope_double_precision=False, rope_type="split", perturbed_attn=v23,
        **({"gated_attn": True, "cross_attn_mod": True, "audio_gated_attn": True, "audio_cross_attn_mod": True,
            "use_prompt_embeddings": False} if v23 else {}),
    ).eval()
    _seeded(seed)
    heads = ({"per_modality_projections": True, "video_hidden_dim": 16, "audio_hidden_dim": 8, "proj_bias": True,
              "video_gated_attn": True, "audio_gated_attn": True, "video_connector_num_attention_heads": 2,
              "video_connector_attention_head_dim": 8, "audio_connector_num_attention_heads": 2,
              "audio_connector_attention_head_dim": 4} if v23 else
             {"video_connector_num_attention_heads": 4, "video_connector_attention_head_dim": 8,
              "audio_connector_num_attention_heads": 4, "audio_connector_attention_head_dim": 8})
    connectors = LTX2TextConnectors(
        caption_channels=text.hidden_size, text_proj_in_factor=text.num_hidden_layers + 1,
        video_connector_num_layers=1, video_connector_num_learnable_registers=None, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_theta=10000.0,
        rope_double_precision=False, causal_temporal_positioning=False, rope_type="split", **heads,
    ).eval()
    _seeded(seed)
    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,), decoder_block_out_channels=(8,),
        layers_per_block=(1,), decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,), decoder_inject_noise=(False, False), downsample_type=("spatial",),
        upsample_residual=(False,), upsample_factor=(1,), timestep_conditioning=False, patch_size=1, patch_size_t=1,
        encoder_causal=True, decoder_causal=False,
    ).eval()
    _seeded(seed)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8,
    ).eval()
    _seeded(seed)
    mel = audio_vae.config.output_channels * audio_vae.config.mel_bins
    small = dict(in_channels=mel, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4],
                 upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]])
    if bwe:  # the extension re-analyses the 16 kHz waveform into mels and upsamples 3x to 48 kHz
        vocoder = LTX2VocoderWithBWE(
            **small, bwe_in_channels=2 * 8, bwe_hidden_channels=16, bwe_out_channels=2,
            bwe_upsample_kernel_sizes=[12, 8], bwe_upsample_factors=[6, 4], bwe_resnet_kernel_sizes=[3],
            bwe_resnet_dilations=[[1, 3, 5]], filter_length=32, hop_length=8, window_length=32, num_mel_channels=8,
            input_sampling_rate=16000, output_sampling_rate=48000,
        ).eval()
    else:
        vocoder = LTX2Vocoder(**small, leaky_relu_negative_slope=0.1, output_sampling_rate=16000).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024, max_image_seq_len=4096,
        shift_terminal=0.1)
    return dict(scheduler=scheduler, vae=vae, audio_vae=audio_vae, text_encoder=text_encoder, tokenizer=tokenizer,
                connectors=connectors, transformer=transformer, vocoder=vocoder)
