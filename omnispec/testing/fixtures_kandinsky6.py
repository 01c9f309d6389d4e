"""Tiny Kandinsky 6 checkpoints (``Kandinsky6TI2VAPipeline``: video and audio denoised by one transformer).

The pipeline's modules at toy widths: a Qwen2.5-VL text encoder (with its vision tower, as the real checkpoint
ships it) and a CLIP text encoder, tokenizers trained here; HunyuanVideo's VAE compressing 8x in space and 4x in
time; MMAudio's audio VAE and vocoder at a toy sample rate; the transformer with the released checkpoints'
architecture flags (padded text, cross-modal RoPE and gates, fixed modulation, two token types for the reference
frame). ``distilled`` gives the distilled release's layout: a ``PiflowScheduler`` and a transformer whose output
holds ``n_grid`` predictions per latent channel; otherwise a flow-matching Euler scheduler and plain velocities.

The ``tokenizer/`` folder holds the Qwen tokenizer files only, with ``model_index.json`` naming the real
``Qwen2_5_VLProcessor``: transformers builds that processor only with torchvision installed, and the pipeline calls
it with text alone, which the tokenizer answers the same (load it with ``transformers.AutoProcessor``).
"""

from __future__ import annotations

import json
from pathlib import Path

from .fixtures import _clip, _seeded
from .tokenizers import clip_tokenizer, qwen_tokenizer
from .vl_encoders import qwen25_vl_encoder

N_GRID = 2  # the distilled scheduler's predictions per channel (the real checkpoint's is its own config's)
LATENT_CHANNELS = 4
AUDIO_CHANNELS = 4


def kandinsky6_components(seed: int = 0, distilled: bool = True) -> dict:
    """Tiny ``Kandinsky6TI2VAPipeline`` modules."""
    from diffusers import (
        AutoencoderKLHunyuanVideo,
        FlowMatchEulerDiscreteScheduler,
        Kandinsky6Transformer3DModel,
        MMAudioVAE,
        MMAudioVocoder,
        PiflowScheduler,
    )

    grid = N_GRID if distilled else 1
    _seeded(seed)
    transformer = Kandinsky6Transformer3DModel(
        in_visual_dim=LATENT_CHANNELS, out_visual_dim=LATENT_CHANNELS * grid, in_text_dim=16, in_text_dim2=32,
        time_dim=16, patch_size=(1, 2, 2), model_dim=16, ff_dim=32, num_text_blocks=1, num_visual_blocks=2,
        axes_dims=(2, 2, 4), visual_cond=True, in_audio_dim=AUDIO_CHANNELS, out_audio_dim=AUDIO_CHANNELS * grid,
        text_token_padding=True, ca_rope=True, cross_gates=True, fix_modulation=True,
        visual_token_type_num_embeddings=2).eval()
    _seeded(seed)
    vae = AutoencoderKLHunyuanVideo(
        in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS,
        down_block_types=("HunyuanVideoDownBlock3D",) * 4, up_block_types=("HunyuanVideoUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4, scaling_factor=0.476986,
        spatial_compression_ratio=8, temporal_compression_ratio=4, mid_block_add_attention=True).eval()
    _seeded(seed)
    # hop 4 = the vocoder's upsampling (2 x 2); one audio latent frame is 8 samples at 160 Hz
    audio_vae = MMAudioVAE(mel_bins=8, latent_channels=AUDIO_CHANNELS, hidden_channels=8, channel_multipliers=(1, 2),
                           layers_per_block=1, sample_rate=160, n_fft=16, hop_length=4).eval()
    _seeded(seed)
    vocoder = MMAudioVocoder(num_mels=8, upsample_initial_channel=8, upsample_rates=(2, 2),
                             upsample_kernel_sizes=(4, 4), resblock_kernel_sizes=(3,),
                             resblock_dilation_sizes=((1,),)).eval()
    tokenizer = qwen_tokenizer()
    ids = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
                                           "<|video_pad|>", "<|endoftext|>"])
    _seeded(seed)
    text_encoder = qwen25_vl_encoder(ids, vision_depth=1)
    _seeded(seed)
    clip = _clip()
    scheduler = PiflowScheduler(shift=5.0, n_grid=N_GRID) if distilled else FlowMatchEulerDiscreteScheduler(shift=5.0)
    return dict(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                text_encoder_2=clip, tokenizer_2=clip_tokenizer(), scheduler=scheduler, audio_vae=audio_vae,
                vocoder=vocoder)


def tiny_kandinsky6(root: str | Path, seed: int = 0, distilled: bool = True) -> Path:
    """``Kandinsky6TI2VAPipeline`` layout (see the module's docstring for ``tokenizer/``)."""
    from diffusers import Kandinsky6TI2VAPipeline

    Kandinsky6TI2VAPipeline(**kandinsky6_components(seed, distilled)).save_pretrained(root)
    index = Path(root) / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()),
                                 "tokenizer": ["transformers", "Qwen2_5_VLProcessor"]}, indent=2))
    return Path(root)


def kandinsky6_tokenizer(root: str | Path):
    """The fixture's ``tokenizer/`` as omnispec's spec loads it (``AutoProcessor``: the Qwen tokenizer here)."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(Path(root) / "tokenizer")


__all__ = ["kandinsky6_components", "kandinsky6_tokenizer", "tiny_kandinsky6"]
