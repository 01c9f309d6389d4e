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
from .vl_encoders import qwen25_vl_encoder

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


def tiny_flux(root: str | Path, seed: int = 0, guidance_embeds: bool = True, fill: bool = False) -> Path:
    """FLUX.1-dev layout (``guidance_embeds=False`` gives schnell's: no guidance embedding, and its scheduler's
    static shift 1); VAE scale 2, so 32 px -> 64 tokens. ``fill`` gives FLUX.1-Fill-dev's: a transformer taking the
    noise, the masked image's latents and the mask folded into channels (16 + 16 + 16 = 48 in, 16 out),
    ``FluxFillPipeline`` in model_index.json."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxFillPipeline, FluxPipeline, FluxTransformer2DModel

    _seeded(seed)
    pipe = (FluxFillPipeline if fill else FluxPipeline)(
        transformer=FluxTransformer2DModel(
            patch_size=1, in_channels=48 if fill else 16, out_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=TEXT_DIM, pooled_projection_dim=TEXT_DIM,
            axes_dims_rope=(4, 4, 8), guidance_embeds=guidance_embeds,
        ).eval(),
        text_encoder=_clip(), tokenizer=clip_tokenizer(), text_encoder_2=_t5(), tokenizer_2=t5_tokenizer(),
        vae=_image_vae(4, shift_factor=0.0609, scaling_factor=1.5035, use_quant_conv=False, use_post_quant_conv=False),
        scheduler=FlowMatchEulerDiscreteScheduler(
            shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
            base_image_seq_len=256, max_image_seq_len=4096,
        ) if guidance_embeds else FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False),
    )
    pipe.save_pretrained(root)
    return Path(root)


def flux2_image_modules(seed: int, guidance_embeds: bool) -> tuple:
    """FLUX.2's tiny transformer (guidance embeddings for [dev], none for [klein]), VAE and scheduler, each module
    seeded alike, as both FLUX.2 fixtures build them."""
    import torch
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    _seeded(seed)
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=48, timestep_guidance_channels=256, axes_dims_rope=[4, 4, 4, 4],
        guidance_embeds=guidance_embeds).eval()
    _seeded(seed)
    vae = AutoencoderKLFlux2(
        sample_size=32, in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 8), layers_per_block=1, latent_channels=4,
        norm_num_groups=4, use_quant_conv=False, use_post_quant_conv=False).eval()
    with torch.no_grad():  # 16 = 4 latent channels x a 2x2 patch
        vae.bn.running_mean.copy_(torch.linspace(-0.3, 0.3, 16))
        vae.bn.running_var.copy_(torch.linspace(0.5, 2.0, 16))
    scheduler = FlowMatchEulerDiscreteScheduler(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096,
                                                max_shift=1.15, shift=3.0, time_shift_type="exponential",
                                                use_dynamic_shifting=True)
    return transformer, vae, scheduler


def tiny_flux2_klein(root: str | Path, seed: int = 0, distilled: bool = False) -> Path:
    """FLUX.2 [klein] layout: a 27-layer Qwen3 causal LM 16 wide (the prompt is its hidden states at layers 9, 18
    and 27, stacked), a one-double one-single block transformer, FLUX.2's VAE at scale 2 with non-trivial batch-norm
    statistics, and the real scheduler config (dynamic, exponential; the pipeline computes mu itself)."""
    import transformers
    from diffusers import Flux2KleinPipeline

    from .tokenizers import QWEN3_CHAT_TEMPLATE, qwen_tokenizer

    _seeded(seed)
    text_encoder = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        hidden_size=16, intermediate_size=16, num_hidden_layers=27, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=512, max_position_embeddings=512, head_dim=8)).eval()
    transformer, vae, scheduler = flux2_image_modules(seed, guidance_embeds=False)
    Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=qwen_tokenizer(
        QWEN3_CHAT_TEMPLATE), transformer=transformer, is_distilled=distilled).save_pretrained(root)
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


def _wan_transformer(in_channels: int = 16, out_channels: int = 16, **extra):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=in_channels,
        out_channels=out_channels,
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


def tiny_wan_vace(root: str | Path, seed: int = 0) -> Path:
    """``WanVACEPipeline`` layout: the tiny Wan transformer with a control branch (3 blocks, VACE layers 0 and 2, 96
    control channels, as diffusers' VACE test) and UniPC as the real checkpoints."""
    from diffusers import WanVACEPipeline, WanVACETransformer3DModel

    _seeded(seed)
    transformer = WanVACETransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
        text_dim=TEXT_DIM, freq_dim=256, ffn_dim=32, num_layers=3, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32, vace_layers=[0, 2], vace_in_channels=96).eval()
    WanVACEPipeline(tokenizer=t5_tokenizer(), text_encoder=_t5("UMT5EncoderModel"), vae=_wan_vae(),
                    scheduler=_unipc(), transformer=transformer).save_pretrained(root)
    return Path(root)


def tiny_wan_ti2v(root: str | Path, seed: int = 0) -> Path:
    """Wan2.2 TI2V-5B layout: ``WanPipeline`` with ``expand_timesteps`` (a timestep per token), the Wan2.2 VAE
    (residual, 2x2 pixel patches, 48 latent channels, 16x spatial) and UniPC at the checkpoint's flow_shift 5."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline

    _seeded(seed)
    vae = AutoencoderKLWan(base_dim=3, z_dim=48, in_channels=12, out_channels=12, is_residual=True, patch_size=2,
                           latents_mean=[0.05 * (i % 7 - 3) for i in range(48)],
                           latents_std=[0.5 + 0.05 * (i % 11) for i in range(48)], dim_mult=[1, 1, 1, 1],
                           num_res_blocks=1, scale_factor_spatial=16, scale_factor_temporal=4,
                           temperal_downsample=[False, True, True]).eval()
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0,
                                        num_train_timesteps=1000)
    pipe = WanPipeline(tokenizer=t5_tokenizer(), text_encoder=_t5("UMT5EncoderModel"), vae=vae, scheduler=scheduler,
                       transformer=_wan_transformer(48, out_channels=48), transformer_2=None, boundary_ratio=None,
                       expand_timesteps=True)
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
TINY_OVERRIDES["flux2_klein"] = ["model.dtype=float32", "recipe.defaults.height=32", "recipe.defaults.width=48",
                                 "recipe.defaults.steps=3", "recipe.defaults.max_sequence_length=64",
                                 "runtime.progress=false"]
# Wan2.1 I2V splits its cross-attention context assuming 512 text tokens.
TINY_OVERRIDES["wan_i2v"] = [*TINY_OVERRIDES["wan"], "recipe.defaults.max_sequence_length=512",
                             "model.components.image_encoder.dtype=float32"]
TINY_OVERRIDES["wan22_i2v"] = TINY_OVERRIDES["wan"]
TINY_OVERRIDES["ltx2"] = ["model.dtype=float32", "recipe.constraints.frames_multiple_of=4",
                          "recipe.constraints.size_multiple_of=16",
                          "recipe.defaults.height=32", "recipe.defaults.width=32",
                          "recipe.defaults.frames=5", "recipe.defaults.fps=25", "recipe.defaults.steps=3",
                          "recipe.defaults.max_sequence_length=16", "runtime.progress=false"]


# ---- Qwen-Image, Z-Image, HunyuanVideo-1.5 ----------------------------------------------------------------

# The real checkpoints' scheduler configs, so the bundled specs' schedules pass the checkpoint checks unchanged.
QWEN_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9, shift=1.0,
                      shift_terminal=0.02, time_shift_type="exponential", use_dynamic_shifting=True)


def qwen_image_components(seed: int = 0, edit: bool = False) -> dict:
    """Tiny ``QwenImagePipeline`` modules: a Qwen2.5-VL text encoder (with its vision tower, which editing feeds)
    and a 4-channel Qwen VAE at scale 16 (so an editing reference, always about 1024x1024 pixels, is 1024 tokens)
    with non-trivial latent mean/std; ``edit`` adds the ``Qwen2VLProcessor`` (``QwenImageEditPipeline`` and
    ``QwenImageEditPlusPipeline`` take the same modules)."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    from .tokenizers import qwen_tokenizer, qwen_vl_processor

    tokenizer = qwen_tokenizer()
    ids = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
                                           "<|video_pad|>", "<|endoftext|>"])
    _seeded(seed)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4)).eval()
    _seeded(seed)
    vae = AutoencoderKLQwenImage(base_dim=2, z_dim=4, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1,
                                 temperal_downsample=[False, False, True, True], latents_mean=[0.1, -0.2, 0.3, 0.0],
                                 latents_std=[1.5, 2.0, 0.5, 1.0]).eval()
    _seeded(seed)
    text_encoder = qwen25_vl_encoder(ids, vision_depth=2)
    modules = dict(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                   scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER))
    if edit:
        modules["processor"] = qwen_vl_processor(tokenizer)
    return modules


def tiny_qwen_image(root: str | Path, seed: int = 0, edit: bool = False) -> Path:
    """``QwenImagePipeline`` layout; ``edit`` gives the editing pipelines' (``processor/`` added). The processor is
    saved as its image processor and tokenizer (load it with ``omnispec.testing.qwen_vl_processor(root /
    "processor")``: transformers loads a ``Qwen2VLProcessor`` only with torchvision installed)."""
    import json

    from diffusers import QwenImageEditPipeline, QwenImagePipeline

    modules = qwen_image_components(seed, edit)
    processor = modules.pop("processor", None)
    (QwenImageEditPipeline(processor=None, **modules) if edit else QwenImagePipeline(**modules)).save_pretrained(root)
    if processor is not None:
        processor.image_processor.save_pretrained(Path(root) / "processor")
        processor.tokenizer.save_pretrained(Path(root) / "processor")
        index = Path(root) / "model_index.json"
        index.write_text(json.dumps({**json.loads(index.read_text()),
                                     "processor": ["transformers", "Qwen2VLProcessor"]}, indent=2))
    return Path(root)


def z_image_components(seed: int = 0) -> dict:
    """Tiny ``ZImagePipeline`` modules: a Qwen3 text encoder, FLUX's VAE layout at scale 2 (16 latent channels),
    and Z-Image-Turbo's scheduler (static shift 3)."""
    import transformers
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel

    from .tokenizers import QWEN3_CHAT_TEMPLATE, qwen_tokenizer

    _seeded(seed)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2, n_refiner_layers=1, n_heads=2,
        n_kv_heads=2, norm_eps=1e-5, qk_norm=True, cap_feat_dim=16, rope_theta=256.0, t_scale=1000.0,
        axes_dims=[8, 4, 4], axes_lens=[256, 32, 32]).eval()
    with torch.no_grad():  # created with torch.empty: give the pad tokens values
        transformer.x_pad_token.copy_(torch.ones_like(transformer.x_pad_token))
        transformer.cap_pad_token.copy_(torch.ones_like(transformer.cap_pad_token))
    _seeded(seed)
    text_encoder = transformers.Qwen3Model(transformers.Qwen3Config(
        hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=512, max_position_embeddings=512, head_dim=8)).eval()
    return dict(transformer=transformer, vae=_image_vae(16, scaling_factor=0.3611, shift_factor=0.1159),
                text_encoder=text_encoder, tokenizer=qwen_tokenizer(QWEN3_CHAT_TEMPLATE),
                scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))


def tiny_z_image(root: str | Path, seed: int = 0) -> Path:
    from diffusers import ZImagePipeline

    ZImagePipeline(**z_image_components(seed)).save_pretrained(root)
    return Path(root)


def hunyuan_video15_components(seed: int = 0, i2v: bool = False) -> dict:
    """Tiny ``HunyuanVideo15Pipeline`` modules (``i2v``: the image-to-video pipeline's, with a SigLIP image encoder
    and its processor): a Qwen2.5-VL text model, a ByT5 glyph encoder, a VAE compressing 4x in space and 2x in time,
    the 480p checkpoints' scheduler (shift 5) and their guider (CFG 6)."""
    import transformers
    from diffusers import AutoencoderKLHunyuanVideo15, FlowMatchEulerDiscreteScheduler, HunyuanVideo15Transformer3DModel
    from diffusers.guiders import ClassifierFreeGuidance

    from .tokenizers import qwen_tokenizer

    _seeded(seed)
    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1, num_refiner_layers=1,
        mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=16, text_embed_2_dim=32, image_embed_dim=12,
        rope_axes_dim=(2, 2, 4), target_size=16, task_type="i2v" if i2v else "t2v").eval()
    _seeded(seed)
    vae = AutoencoderKLHunyuanVideo15(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(16, 16), layers_per_block=1,
        spatial_compression_ratio=4, temporal_compression_ratio=2, downsample_match_channel=False,
        upsample_match_channel=False).eval()
    tokenizer = qwen_tokenizer()
    end = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    _seeded(seed)
    text_encoder = transformers.Qwen2_5_VLTextModel(transformers.Qwen2_5_VLTextConfig(
        hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        rope_theta=1000000.0, vocab_size=512, bos_token_id=end, eos_token_id=end,
        rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"})).eval()
    _seeded(seed)
    glyph_encoder = transformers.T5EncoderModel(transformers.T5Config(  # ByT5: 3 specials, 256 bytes, 125 extra ids
        d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, vocab_size=384, relative_attention_num_buckets=8,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)).eval()
    modules = dict(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                   text_encoder_2=glyph_encoder, tokenizer_2=transformers.ByT5Tokenizer(),
                   scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), guider=ClassifierFreeGuidance(guidance_scale=6.0))
    if i2v:
        _seeded(seed)
        modules["image_encoder"] = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(
            hidden_size=12, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=32,
            patch_size=8)).eval()
        modules["feature_extractor"] = transformers.SiglipImageProcessor(size={"height": 32, "width": 32})
    return modules


def tiny_hunyuan_video15(root: str | Path, seed: int = 0, i2v: bool = False) -> Path:
    """``HunyuanVideo15Pipeline`` layout (``i2v``: ``HunyuanVideo15ImageToVideoPipeline``'s); ``target_size`` 16, so
    text-to-video's default size is 12x20 and images are bucketed near 16x16 pixels."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline

    cls = HunyuanVideo15ImageToVideoPipeline if i2v else HunyuanVideo15Pipeline
    cls(**hunyuan_video15_components(seed, i2v)).save_pretrained(root)
    return Path(root)


TINY_OVERRIDES["qwen_image"] = ["model.dtype=float32", "recipe.defaults.height=32", "recipe.defaults.width=64",
                                "recipe.defaults.steps=3", "runtime.progress=false"]
TINY_OVERRIDES["qwen_image_edit"] = ["model.dtype=float32", "recipe.defaults.steps=2", "runtime.progress=false"]
TINY_OVERRIDES["z_image"] = ["model.dtype=float32", "recipe.defaults.height=32", "recipe.defaults.width=48",
                             "recipe.defaults.steps=4", "recipe.defaults.max_sequence_length=64", "runtime.progress=false"]
TINY_OVERRIDES["hunyuan_video15"] = ["model.dtype=float32", "recipe.defaults.height=16", "recipe.defaults.width=32",
                                     "recipe.defaults.frames=9", "recipe.defaults.steps=2", "runtime.progress=false"]
TINY_OVERRIDES["hunyuan_video15_i2v"] = ["model.dtype=float32", "recipe.defaults.frames=9", "recipe.defaults.steps=2",
                                         "runtime.progress=false"]
TINY_OVERRIDES["kandinsky6"] = ["model.dtype=float32", "recipe.defaults.height=32", "recipe.defaults.width=32",
                                "recipe.defaults.frames=5", "recipe.defaults.steps=3",
                                "recipe.defaults.max_sequence_length=16", "runtime.progress=false"]
# a 24x40 video of 5 frames (the K-VAE of the fixture compresses 4x in space)
TINY_OVERRIDES["kandinsky6_sr"] = ["model.dtype=float32", "recipe.defaults.height=24", "recipe.defaults.width=40",
                                   "recipe.defaults.frames=5", "recipe.constraints.size_multiple_of=4",
                                   "runtime.progress=false"]

from .fixtures_qwen_image21 import TINY_OVERRIDES_QWEN21, tiny_qwen_image21  # noqa: E402

TINY_OVERRIDES.update(TINY_OVERRIDES_QWEN21)
