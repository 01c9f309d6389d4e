"""Tiny random checkpoints in diffusers layout, one builder per family, saved with ``save_pretrained``.

Each builder writes ``model_index.json`` and one folder per component through the diffusers
pipeline's own ``save_pretrained``, so both ``omnispec.build`` and the diffusers pipeline load the very
same files. Sizes are the smallest that keep every code path (packing, multi-encoder prompts,
temporal VAE) alive; weights are random with a fixed seed.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .tokenizers import clip_tokenizer, t5_tokenizer

TEXT_DIM = 32


def _seeded(seed: int) -> None:
    torch.manual_seed(seed)


def _clip(cls_name: str = "CLIPTextModel", hidden: int = TEXT_DIM, projection: int = TEXT_DIM):
    import transformers

    config = transformers.CLIPTextConfig(
        hidden_size=hidden, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2, vocab_size=400,
        projection_dim=projection, max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )
    return getattr(transformers, cls_name)(config).eval()


def _t5(cls_name: str = "T5EncoderModel", d_model: int = TEXT_DIM):
    import transformers

    config_cls = transformers.UMT5Config if cls_name.startswith("UMT5") else transformers.T5Config
    config = config_cls(d_model=d_model, d_kv=8, d_ff=37, num_layers=2, num_heads=4, vocab_size=256,
                        relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return getattr(transformers, cls_name)(config).eval()


def _image_vae(latent_channels: int, **extra):
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 8), layers_per_block=1,
        latent_channels=latent_channels, norm_num_groups=4, sample_size=32, **extra,
    ).eval()


def tiny_flux(root: str | Path, seed: int = 0, guidance_embeds: bool = True) -> Path:
    """FLUX.1-dev layout (``guidance_embeds=False`` gives schnell's); VAE scale 2, so 32 px -> 64 tokens."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    _seeded(seed)
    pipe = FluxPipeline(
        transformer=FluxTransformer2DModel(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=TEXT_DIM, pooled_projection_dim=TEXT_DIM,
            axes_dims_rope=(4, 4, 8), guidance_embeds=guidance_embeds,
        ).eval(),
        text_encoder=_clip(), tokenizer=clip_tokenizer(), text_encoder_2=_t5(), tokenizer_2=t5_tokenizer(),
        vae=_image_vae(4, shift_factor=0.0609, scaling_factor=1.5035, use_quant_conv=False, use_post_quant_conv=False),
        scheduler=FlowMatchEulerDiscreteScheduler(
            shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
            base_image_seq_len=256, max_image_seq_len=4096,
        ),
    )
    pipe.save_pretrained(root)
    return Path(root)


def tiny_sd3(root: str | Path, seed: int = 0) -> Path:
    """SD3.5 layout with three text encoders; 4 joint blocks so skip-layer guidance has layers to skip."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    _seeded(seed)
    pipe = StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel(
            sample_size=16, patch_size=1, in_channels=4, num_layers=4, attention_head_dim=8, num_attention_heads=4,
            caption_projection_dim=32, joint_attention_dim=TEXT_DIM, pooled_projection_dim=2 * 16, out_channels=4,
        ).eval(),
        text_encoder=_clip("CLIPTextModelWithProjection", hidden=16, projection=16), tokenizer=clip_tokenizer(),
        text_encoder_2=_clip("CLIPTextModelWithProjection", hidden=16, projection=16), tokenizer_2=clip_tokenizer(),
        text_encoder_3=_t5(), tokenizer_3=t5_tokenizer(),
        vae=_image_vae(4, shift_factor=0.0609, scaling_factor=1.5305),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )
    pipe.save_pretrained(root)
    return Path(root)


def _wan_transformer(in_channels: int = 16, **extra):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=in_channels, out_channels=16,
        text_dim=TEXT_DIM, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32, **extra,
    ).eval()


def _wan_vae():
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True]).eval()


def _unipc():
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                   num_train_timesteps=1000)


def tiny_wan(root: str | Path, seed: int = 0, two_experts: bool = False) -> Path:
    """Wan2.1 T2V layout with the UniPC flow scheduler real checkpoints use; ``two_experts`` adds
    ``transformer_2`` and ``boundary_ratio`` 0.875 (Wan2.2 A14B)."""
    from diffusers import WanPipeline

    _seeded(seed)
    pipe = WanPipeline(
        tokenizer=t5_tokenizer(), text_encoder=_t5("UMT5EncoderModel"), vae=_wan_vae(), scheduler=_unipc(),
        transformer=_wan_transformer(),
        transformer_2=_wan_transformer() if two_experts else None,
        boundary_ratio=0.875 if two_experts else None,
    )
    pipe.save_pretrained(root)
    return Path(root)


def tiny_wan_i2v(root: str | Path, seed: int = 0, two_experts: bool = False) -> Path:
    """``WanImageToVideoPipeline`` layout with 36-channel transformers. One expert (Wan2.1 I2V): a CLIP vision
    encoder and processor, and image cross-attention with its own key/value projections (``added_kv_proj_dim``,
    which splits image from text tokens assuming 512 text tokens, as the real model: run it with
    ``max_sequence_length`` 512). ``two_experts`` (Wan2.2 I2V A14B): no image encoder, ``boundary_ratio`` 0.9."""
    import transformers
    from diffusers import WanImageToVideoPipeline

    _seeded(seed)
    encoder = processor = None
    extra: dict = {}
    if not two_experts:
        encoder = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(
            hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, image_size=32,
            patch_size=4, projection_dim=8)).eval()
        processor = transformers.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
        extra = {"image_dim": 8, "added_kv_proj_dim": 24}
    pipe = WanImageToVideoPipeline(
        tokenizer=t5_tokenizer(), text_encoder=_t5("UMT5EncoderModel"), vae=_wan_vae(), scheduler=_unipc(),
        image_processor=processor, image_encoder=encoder, transformer=_wan_transformer(36, **extra),
        transformer_2=_wan_transformer(36) if two_experts else None, boundary_ratio=0.9 if two_experts else None,
    )
    pipe.save_pretrained(root)
    return Path(root)


# Overrides that fit the bundled specs to the tiny checkpoints (float32 on CPU, small sizes, few steps).
TINY_OVERRIDES = {
    "flux": ["model.dtype=float32", "recipe.defaults.height=32", "recipe.defaults.width=32",
             "recipe.defaults.steps=3", "recipe.defaults.max_sequence_length=16", "runtime.progress=false"],
    "sd3": ["model.dtype=float32", "recipe.defaults.height=32", "recipe.defaults.width=32",
            "recipe.defaults.steps=3", "recipe.defaults.max_sequence_length=16", "runtime.progress=false"],
    "wan": ["model.dtype=float32", "recipe.defaults.height=32", "recipe.defaults.width=32",
            "recipe.defaults.frames=5", "recipe.defaults.steps=4", "recipe.defaults.max_sequence_length=16",
            "runtime.progress=false"],
}
# Wan2.1 I2V splits its cross-attention context assuming 512 text tokens.
TINY_OVERRIDES["wan_i2v"] = [*TINY_OVERRIDES["wan"], "recipe.defaults.max_sequence_length=512",
                             "model.components.image_encoder.dtype=float32"]
TINY_OVERRIDES["wan22_i2v"] = TINY_OVERRIDES["wan"]
