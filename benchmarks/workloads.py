"""The benchmarks' workloads: each family's modules at their real configs with random bf16 weights (tiny ones under
``--smoke``), the inputs requests take, and the ``WORKLOADS`` table of spec, diffusers pipeline, request and step
counts that ``gpu_interpreter`` times and other benchmarks build on; LTX-2's modules, size and guidance plan with the
step comparison that ``gpu_interpreter`` and ``gpu_ltx2`` both run.

A shared module: it imports ``harness`` and no benchmark module (``tests/test_benchmark_smoke.py`` checks). The
text encoders are one-layer stand-ins of the real widths (they run once per request, so their cost cancels in
per-step times). Under smoke (``harness.enable_smoke``) every builder makes tiny modules on the CPU and the tables
shrink to tiny requests.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch

from . import harness

# ---- each family's modules -------------------------------------------------------------------------------------------


@contextmanager
def on_card() -> Iterator[None]:
    """Modules made inside are made on the benchmark's device and, at real sizes, in bf16 from the start. Made in
    float32 and cast after (4 bytes a weight), the largest would not fit the card before their cast: FLUX.2 [dev]'s
    32B transformer would take 129 GB, MiniMax-H3's 33B 132 GB, and LTX-2's 19B (76 GB) or Wan2.2's second 14B
    expert beside the first overflow an 80 GB card. The weights are random either way, and modules meant to stay in
    float32 are cast back after. Under smoke the tiny modules keep float32."""
    previous = torch.get_default_dtype()
    with torch.device(harness.DEVICE):
        if not harness.SMOKE:
            torch.set_default_dtype(torch.bfloat16)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)

# --smoke sizes: the text encoders' widths (CLIP, T5), the image VAE's and Wan VAE's (the offline fixtures' tiny ones,
# keeping the real models' downsampling, so requests make the same latent shapes)
SMOKE_TEXT = (32, 32)
SMOKE_IMAGE_VAE = dict(block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4)
SMOKE_WAN_VAE = dict(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                     temperal_downsample=[False, True, True])


def _text_encoders(clip_hidden: int, t5_dim: int, umt5: bool = False):
    import transformers

    from omnispec.testing import clip_tokenizer, t5_tokenizer

    # --smoke: two heads of 16 dims (the widths the callers pass are the tiny ones there)
    clip_heads, t5_heads = ((2, dict(d_kv=16, d_ff=64, num_heads=2)) if harness.SMOKE
                            else (12, dict(d_kv=64, d_ff=1024, num_heads=64)))
    clip = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        hidden_size=clip_hidden, intermediate_size=clip_hidden, num_attention_heads=clip_heads, num_hidden_layers=1,
        vocab_size=400, projection_dim=clip_hidden, max_position_embeddings=77, bos_token_id=0, eos_token_id=1))
    cfg_cls = transformers.UMT5Config if umt5 else transformers.T5Config
    t5_cls = transformers.UMT5EncoderModel if umt5 else transformers.T5EncoderModel
    t5 = t5_cls(cfg_cls(d_model=t5_dim, num_layers=1, vocab_size=256, decoder_start_token_id=0, pad_token_id=0,
                        eos_token_id=1, **t5_heads))
    return clip, clip_tokenizer(), t5, t5_tokenizer()


def flux_components(fill: bool = False) -> dict:
    """FLUX.1-dev's modules; ``fill``: FLUX.1-Fill-dev's transformer, which also takes the masked image's packed
    latents and the mask folded into channels (64 + 64 + 256 = 384 inputs at the real size, 64 outputs)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    clip, tok, t5, tok2 = _text_encoders(*SMOKE_TEXT) if harness.SMOKE else _text_encoders(768, 4096)
    # --smoke: one block of each kind, two heads of 16 dims (FLUX's own layout otherwise: 64 packed channels)
    size = dict(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                joint_attention_dim=SMOKE_TEXT[1], pooled_projection_dim=SMOKE_TEXT[0],
                axes_dims_rope=(4, 4, 8)) if harness.SMOKE else {}
    vae_size = SMOKE_IMAGE_VAE if harness.SMOKE else dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2)
    if fill:
        scale = 2 ** (len(vae_size["block_out_channels"]) - 1)
        size |= dict(in_channels=2 * 64 + 4 * scale * scale, out_channels=64)
    with on_card():
        transformer = FluxTransformer2DModel(guidance_embeds=True, **size).to(torch.bfloat16)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, shift_factor=0.1159, scaling_factor=0.3611,
                        use_quant_conv=False, use_post_quant_conv=False, **vae_size)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    mods = dict(transformer=transformer, text_encoder=clip, tokenizer=tok, text_encoder_2=t5, tokenizer_2=tok2,
                vae=vae, scheduler=scheduler)
    for k in ("text_encoder", "text_encoder_2", "vae"):
        mods[k] = mods[k].to(harness.DEVICE, torch.bfloat16).eval()
    return mods


def wan_components(with_transformer: bool = True) -> dict:
    """Wan2.1 T2V 14B's modules (``with_transformer=False``: all but the transformer, for the VACE workload)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel

    _, _, umt5, tok = _text_encoders(*SMOKE_TEXT, umt5=True) if harness.SMOKE else _text_encoders(768, 4096, umt5=True)
    # --smoke: one block, two heads of 16 dims, and the offline fixtures' tiny VAE (same classes)
    size = dict(num_attention_heads=40, attention_head_dim=128, text_dim=4096, ffn_dim=13824, num_layers=40)
    if harness.SMOKE:
        size = dict(num_attention_heads=2, attention_head_dim=16, text_dim=SMOKE_TEXT[1], ffn_dim=32, num_layers=1)
    transformer = None
    if with_transformer:
        with on_card():
            transformer = WanTransformer3DModel(
                patch_size=(1, 2, 2), in_channels=16, out_channels=16, freq_dim=256, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024, **size,
            ).to(torch.bfloat16)
    vae = AutoencoderKLWan(**SMOKE_WAN_VAE) if harness.SMOKE else AutoencoderKLWan()
    return dict(transformer=transformer, text_encoder=umt5.to(harness.DEVICE, torch.bfloat16).eval(), tokenizer=tok,
                vae=vae.to(harness.DEVICE, torch.float32).eval(),
                scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                  flow_shift=3.0, num_train_timesteps=1000))


def wan_i2v_components() -> dict:
    """Wan2.1 I2V 14B's transformer at its real config (36 input channels: noise, the first frame's latents and its
    mask; image cross-attention of 1280-wide CLIP features), a one-layer CLIP vision tower of the real width (it runs
    once per request), the Wan workload's text encoder and VAE."""
    import transformers
    from diffusers import WanTransformer3DModel

    mods = wan_components(with_transformer=False)
    size = dict(num_attention_heads=40, attention_head_dim=128, text_dim=4096, ffn_dim=13824, num_layers=40,
                image_dim=1280, added_kv_proj_dim=5120)
    vision = dict(hidden_size=1280, intermediate_size=5120, num_attention_heads=16, image_size=224, patch_size=14)
    if harness.SMOKE:
        size = dict(num_attention_heads=2, attention_head_dim=16, text_dim=SMOKE_TEXT[1], ffn_dim=32, num_layers=1,
                    image_dim=16, added_kv_proj_dim=32)
        vision = dict(hidden_size=16, intermediate_size=16, num_attention_heads=2, image_size=32, patch_size=8)
    with on_card():
        mods["transformer"] = WanTransformer3DModel(
            patch_size=(1, 2, 2), in_channels=36, out_channels=16, freq_dim=256, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024, **size).to(torch.bfloat16)
    mods["image_encoder"] = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(
        num_hidden_layers=1, **vision)).to(harness.DEVICE, torch.float32).eval()  # float32, as the spec loads it
    side = vision["image_size"]
    mods["image_processor"] = transformers.CLIPImageProcessor(size={"shortest_edge": side},
                                                              crop_size={"height": side, "width": side})
    return mods


def wan_vace_components() -> dict:
    """Wan2.1 VACE 1.3B's transformer at its real config (30 blocks of 12 heads of 128, VACE layers every second
    block, 96 control channels), Wan2.1's VAE; text encoders as the Wan workload's."""
    from diffusers import WanVACETransformer3DModel

    mods = wan_components(with_transformer=False)
    size = dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30,
                vace_layers=list(range(0, 30, 2)))
    if harness.SMOKE:
        size = dict(num_attention_heads=2, attention_head_dim=16, ffn_dim=32, num_layers=2, vace_layers=[0])
    with on_card():
        mods["transformer"] = WanVACETransformer3DModel(
            patch_size=(1, 2, 2), in_channels=16, out_channels=16, text_dim=SMOKE_TEXT[1] if harness.SMOKE else 4096,
            freq_dim=256, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
            vace_in_channels=96, **size).to(torch.bfloat16)
    return mods


def wan_ti2v_components() -> dict:
    """Wan2.2 TI2V-5B's transformer at its real config (24 heads of 128, 30 blocks, 48 latent channels) and the
    Wan2.2 VAE's config (residual, 2x2 pixel patches, 16x spatial), as the checkpoint's convert script builds them."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel

    _, _, umt5, tok = _text_encoders(*SMOKE_TEXT, umt5=True) if harness.SMOKE else _text_encoders(768, 4096, umt5=True)
    size = dict(num_attention_heads=24, attention_head_dim=128, text_dim=4096, ffn_dim=14336, num_layers=30)
    vae = dict(base_dim=160, decoder_base_dim=256, dim_mult=[1, 2, 4, 4])
    if harness.SMOKE:
        size = dict(num_attention_heads=2, attention_head_dim=16, text_dim=SMOKE_TEXT[1], ffn_dim=32, num_layers=1)
        vae = dict(base_dim=3, dim_mult=[1, 1, 1, 1], num_res_blocks=1)
    with on_card():
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2), in_channels=48, out_channels=48, freq_dim=256, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024, **size,
        ).to(torch.bfloat16)
    vae = AutoencoderKLWan(z_dim=48, in_channels=12, out_channels=12, is_residual=True, patch_size=2,
                           scale_factor_spatial=16, scale_factor_temporal=4, temperal_downsample=[False, True, True],
                           latents_mean=[0.0] * 48, latents_std=[1.0] * 48, **vae)
    return dict(transformer=transformer, text_encoder=umt5.to(harness.DEVICE, torch.bfloat16).eval(), tokenizer=tok,
                vae=vae.to(harness.DEVICE, torch.float32).eval(),
                scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                  flow_shift=5.0, num_train_timesteps=1000))


def flux2_klein_components() -> dict:
    """FLUX.2 [klein] 4B's transformer at its published shape (5 double and 20 single blocks of 24 heads of 128,
    prompts 3 x 2560 wide); a 27-layer Qwen3 2560 wide with a narrow MLP (the prompt is its hidden states at layers
    9, 18 and 27), FLUX.2's VAE at its default config."""
    import transformers
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    from omnispec.testing import qwen_tokenizer
    from omnispec.testing.tokenizers import QWEN3_CHAT_TEMPLATE

    width, layers = (16, 27) if harness.SMOKE else (2560, 27)
    size = dict(num_layers=5, num_single_layers=20, attention_head_dim=128, num_attention_heads=24,
                axes_dims_rope=(32, 32, 32, 32), in_channels=128)
    if harness.SMOKE:
        size = dict(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                    axes_dims_rope=(4, 4, 4, 4), in_channels=16)
    with on_card():
        transformer = Flux2Transformer2DModel(joint_attention_dim=3 * width, timestep_guidance_channels=256,
                                              guidance_embeds=False, **size).to(torch.bfloat16)
    text_encoder = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        hidden_size=width, intermediate_size=16 if harness.SMOKE else 1024, num_hidden_layers=layers,
        num_attention_heads=2 if harness.SMOKE else 32, num_key_value_heads=2 if harness.SMOKE else 8,
        head_dim=8 if harness.SMOKE else 128, vocab_size=512))
    vae = AutoencoderKLFlux2(**(dict(block_out_channels=(8, 8), down_block_types=("DownEncoderBlock2D",) * 2,
                                     up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, latent_channels=4,
                                     norm_num_groups=4) if harness.SMOKE else {}))
    scheduler = FlowMatchEulerDiscreteScheduler(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096,
                                                max_shift=1.15, shift=3.0, time_shift_type="exponential",
                                                use_dynamic_shifting=True)
    mods = dict(transformer=transformer, text_encoder=text_encoder, tokenizer=qwen_tokenizer(QWEN3_CHAT_TEMPLATE),
                vae=vae, scheduler=scheduler)
    return _on_device(mods, ("text_encoder", "vae"))


def _on_device(mods: dict, names: tuple[str, ...]) -> dict:
    for k in names:
        mods[k] = mods[k].to(harness.DEVICE, torch.bfloat16).eval()
    return mods


def qwen_image_components() -> dict:
    """Qwen-Image's transformer at its real config (20B); a one-layer Qwen2.5-VL text encoder of its width."""
    import transformers
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    from omnispec.testing import qwen_tokenizer
    from omnispec.testing.fixtures import QWEN_SCHEDULER

    tokenizer = qwen_tokenizer()
    ids = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
                                           "<|video_pad|>"])
    with on_card():
        transformer = QwenImageTransformer2DModel(num_layers=1 if harness.SMOKE else 60).to(torch.bfloat16)
    text_encoder = transformers.Qwen2_5_VLForConditionalGeneration(transformers.Qwen2_5_VLConfig(
        text_config={"hidden_size": 3584, "intermediate_size": 1024, "num_hidden_layers": 1, "num_attention_heads": 28,
                     "num_key_value_heads": 4, "vocab_size": 512,
                     "rope_scaling": {"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"}},
        vision_config={"depth": 1, "hidden_size": 64, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 3584},
        vocab_size=512, vision_start_token_id=ids[0], vision_end_token_id=ids[1], vision_token_id=ids[2],
        image_token_id=ids[3], video_token_id=ids[4]))
    mods = dict(transformer=transformer, text_encoder=text_encoder, tokenizer=tokenizer, vae=AutoencoderKLQwenImage(),
                scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER))
    return _on_device(mods, ("text_encoder", "vae"))


def z_image_components() -> dict:
    """Z-Image-Turbo's transformer at its real config (6B); a one-layer Qwen3 text encoder of its width."""
    import transformers
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel

    from omnispec.testing import qwen_tokenizer
    from omnispec.testing.tokenizers import QWEN3_CHAT_TEMPLATE

    with on_card():
        transformer = ZImageTransformer2DModel(
            axes_lens=[1536, 512, 512], **(dict(n_layers=1, n_refiner_layers=1) if harness.SMOKE else {}),
        ).to(torch.bfloat16)
        with torch.no_grad():  # created with torch.empty
            transformer.x_pad_token.normal_()
            transformer.cap_pad_token.normal_()
    text_encoder = transformers.Qwen3Model(transformers.Qwen3Config(
        hidden_size=2560, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, vocab_size=512))
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
                        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                        layers_per_block=2, shift_factor=0.1159, scaling_factor=0.3611, use_quant_conv=False,
                        use_post_quant_conv=False)
    mods = dict(transformer=transformer, text_encoder=text_encoder, tokenizer=qwen_tokenizer(QWEN3_CHAT_TEMPLATE),
                vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))
    return _on_device(mods, ("text_encoder", "vae"))


def with_lora(mods: dict, targets: list[str], rank: int = 32, alpha: int = 64) -> dict:
    """``mods`` frozen, with a fresh LoRA (PEFT's adapter "default") on ``targets`` of the transformer: what an RL
    trainer trains."""
    from peft import LoraConfig

    for module in mods.values():
        if isinstance(module, torch.nn.Module):
            module.eval().requires_grad_(False)
    mods["transformer"].add_adapter(LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets))
    return mods


# Wan's self- and cross-attention projections (a LoRA's usual targets in Flow-GRPO's and DanceGRPO's Wan runs).
WAN_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def wan22_i2v_components() -> dict:
    """Wan2.2 I2V A14B's two experts at their real config (``transformer`` above the checkpoint's boundary 0.9,
    ``transformer_2`` below it; 36 input channels: noise, the first frame's latents and its mask; no image encoder),
    the Wan workload's text encoder and VAE, and the checkpoint's UniPC flow shift of 5."""
    from diffusers import UniPCMultistepScheduler, WanTransformer3DModel

    mods = wan_components(with_transformer=False)
    size = dict(num_attention_heads=40, attention_head_dim=128, text_dim=4096, ffn_dim=13824, num_layers=40)
    if harness.SMOKE:
        size = dict(num_attention_heads=2, attention_head_dim=16, text_dim=SMOKE_TEXT[1], ffn_dim=32, num_layers=1)
    for name in ("transformer", "transformer_2"):
        with on_card():
            mods[name] = WanTransformer3DModel(
                patch_size=(1, 2, 2), in_channels=36, out_channels=16, freq_dim=256, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024, **size).to(torch.bfloat16)
    mods["scheduler"] = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                flow_shift=5.0, num_train_timesteps=1000)
    return mods


def hunyuan_video15_components() -> dict:
    """HunyuanVideo-1.5's transformer at its real config (8.3B, 480p text-to-video); small Qwen2.5-VL (two layers:
    the pipeline reads the third hidden state from the end) and ByT5 text encoders of their widths."""
    import transformers
    from diffusers import AutoencoderKLHunyuanVideo15, FlowMatchEulerDiscreteScheduler, HunyuanVideo15Transformer3DModel

    from omnispec.testing import qwen_tokenizer

    with on_card():
        transformer = HunyuanVideo15Transformer3DModel(
            task_type="t2v", **(dict(num_layers=1, num_refiner_layers=1) if harness.SMOKE else {})).to(torch.bfloat16)
    text_encoder = transformers.Qwen2_5_VLTextModel(transformers.Qwen2_5_VLTextConfig(
        hidden_size=3584, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=28, num_key_value_heads=4,
        vocab_size=512, rope_scaling={"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"}))
    glyphs = transformers.T5EncoderModel(transformers.T5Config(
        d_model=1472, d_kv=64, d_ff=1024, num_layers=1, num_heads=6, vocab_size=384, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1))
    # --smoke: the VAE's 16x / 4x compression and 32 latent channels, narrow
    vae = AutoencoderKLHunyuanVideo15(**(dict(block_out_channels=(64,) * 5, layers_per_block=1) if harness.SMOKE
                                         else {}))
    mods = dict(transformer=transformer, text_encoder=text_encoder, tokenizer=qwen_tokenizer(), text_encoder_2=glyphs,
                tokenizer_2=transformers.ByT5Tokenizer(), vae=vae,
                scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0))
    return _on_device(mods, ("text_encoder", "text_encoder_2", "vae"))


def hunyuan_video15_i2v_components() -> dict:
    """HunyuanVideo-1.5 480p image-to-video: the transformer at its real config with ``task_type="i2v"``, a
    one-layer SigLIP vision tower of the real width (1152; it runs once per request), the text encoders and VAE of
    the text-to-video workload."""
    import transformers
    from diffusers import HunyuanVideo15Transformer3DModel

    mods = hunyuan_video15_components()
    # --smoke: a 64-pixel bucket (the image's size), as the t2v workload's request
    smoke = dict(num_layers=1, num_refiner_layers=1, target_size=64) if harness.SMOKE else {}
    with on_card():
        mods["transformer"] = HunyuanVideo15Transformer3DModel(task_type="i2v", **smoke).to(torch.bfloat16)
    mods["image_encoder"] = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(
        hidden_size=1152, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=16, image_size=384,
        patch_size=14)).to(harness.DEVICE, torch.bfloat16).eval()
    mods["feature_extractor"] = transformers.SiglipImageProcessor(size={"height": 384, "width": 384})
    return mods


def qwen_image_edit_components() -> dict:
    """Qwen-Image's modules with the ``Qwen2VLProcessor`` the editing pipelines feed the image through (built
    without its video processor, which needs torchvision)."""
    from omnispec.testing import qwen_vl_processor

    mods = qwen_image_components()
    mods["processor"] = qwen_vl_processor(mods["tokenizer"])
    return mods


def hunyuan_video15_guider() -> dict:
    from diffusers.guiders import ClassifierFreeGuidance

    return {"guider": ClassifierFreeGuidance(guidance_scale=6.0)}  # the 480p checkpoint's; the spec's cfg 6.0


# The attention projections a rank-32 LoRA adapts in Flow-GRPO's SD3 runs.
SD3_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]


def sd3_components(lora: bool = True) -> dict:
    """SD3.5-medium's modules at their real sizes (MMDiT-X 24 blocks, CLIP-L, CLIP-G, T5-XXL, the 16-channel VAE),
    frozen; ``lora``: a rank-32 LoRA on the attention projections, as in Flow-GRPO's SD3 runs."""
    import transformers
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    from omnispec.testing import clip_tokenizer, t5_tokenizer

    tiny = harness.SMOKE

    def clip(hidden: int, layers: int, heads: int):
        return transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(
            hidden_size=hidden, intermediate_size=4 * hidden, num_attention_heads=heads, projection_dim=hidden,
            num_hidden_layers=1 if tiny else layers, vocab_size=400, max_position_embeddings=77, bos_token_id=0,
            eos_token_id=1, hidden_act="gelu"))

    # --smoke: two heads of 16 dims everywhere (the CLIPs' 16 + 16 pooled and padded to T5's 32), the tiny VAE
    width = dict(attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32,
                 pooled_projection_dim=32) if tiny else dict(
        attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
        pooled_projection_dim=2048)
    t5_width = dict(d_model=32, d_kv=16, d_ff=64, num_heads=2) if tiny else dict(d_model=4096, d_kv=64, d_ff=10240,
                                                                                   num_heads=64)
    vae_size = SMOKE_IMAGE_VAE if tiny else dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2)
    with on_card():
        transformer = SD3Transformer2DModel(
            sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=2 if tiny else 24,
            pos_embed_max_size=384, qk_norm="rms_norm", dual_attention_layers=(0,) if tiny else tuple(range(13)),
            **width)
        encoders = [clip(16, 12, 2) if tiny else clip(768, 12, 12), clip(16, 32, 2) if tiny else clip(1280, 32, 20),
                    transformers.T5EncoderModel(transformers.T5Config(
                        num_layers=1 if tiny else 24, vocab_size=256, feed_forward_proj="gated-gelu",
                        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, **t5_width))]
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16,
                            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                            shift_factor=0.0609, scaling_factor=1.5305, use_quant_conv=False, use_post_quant_conv=False,
                            **vae_size)
    mods = dict(transformer=transformer.to(torch.bfloat16), text_encoder=encoders[0], tokenizer=clip_tokenizer(),
                text_encoder_2=encoders[1], tokenizer_2=clip_tokenizer(), text_encoder_3=encoders[2],
                tokenizer_3=t5_tokenizer(), vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))
    for k in ("text_encoder", "text_encoder_2", "text_encoder_3", "vae"):
        mods[k] = mods[k].to(harness.DEVICE, torch.bfloat16).eval().requires_grad_(False)
    mods["transformer"].eval().requires_grad_(False)
    return with_lora(mods, SD3_LORA_TARGETS) if lora else mods


# ---- inputs of requests ----------------------------------------------------------------------------------------------

def conditioning_inputs(height: int, width: int):
    """A random RGB picture and a mask repainting its right half."""
    import numpy as np
    from PIL import Image

    picture = Image.fromarray((np.random.RandomState(0).rand(height, width, 3) * 255).astype(np.uint8))
    held = np.zeros((height, width), np.uint8)
    held[:, width // 2:] = 255
    return picture, Image.fromarray(held, "L")


def vace_keyframes(height: int, width: int, frames: int):
    """A first and a last frame: omnispec's ``conditions``, and diffusers' VACE example's video and mask of them."""
    from PIL import Image

    first = conditioning_inputs(height, width)[0]
    last = first.rotate(180)
    video = [first, *[Image.new("RGB", (width, height), (128, 128, 128))] * (frames - 2), last]
    black, white = Image.new("L", (width, height), 0), Image.new("L", (width, height), 255)
    return ([{"image": first, "frame": 0}, {"image": last, "frame": -1}],
            {"video": video, "mask": [black, *[white] * (frames - 2), black]})


# ---- other builds ----------------------------------------------------------------------------------------------------

def tiny_components(name: str) -> dict:
    """FLUX's or Wan's modules at the offline fixtures' tiny sizes, of the same classes, with more blocks than the
    fixtures so block caches have something to skip (``gpu_peers``' smoke)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    from omnispec.testing import clip_tokenizer, t5_tokenizer
    from omnispec.testing import fixtures as fx

    if name == "flux":
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=fx.TEXT_DIM, pooled_projection_dim=fx.TEXT_DIM,
            axes_dims_rope=(4, 4, 8), guidance_embeds=True).eval()
        return {"transformer": transformer, "text_encoder": fx._clip(), "tokenizer": clip_tokenizer(),
                "text_encoder_2": fx._t5(), "tokenizer_2": t5_tokenizer(),
                "vae": fx._image_vae(4, shift_factor=0.0609, scaling_factor=1.5035, use_quant_conv=False,
                                     use_post_quant_conv=False),
                "scheduler": FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                                             max_shift=1.15, base_image_seq_len=256,
                                                             max_image_seq_len=4096)}
    return {"transformer": fx._wan_transformer(), "text_encoder": fx._t5("UMT5EncoderModel"),
            "tokenizer": t5_tokenizer(), "vae": fx._wan_vae(), "scheduler": fx._unipc()}


def plain_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of a denoiser as diffusers made it, whatever an omnispec build did to it: without the attention hooks
    (a per-module hooked forward makes dynamo recompile each repeated block), the fused q/k and feed-forward
    processors and hooks (they hold omnispec's custom operators, which cannot be copied: shared by the copy, then
    removed from it), the CUDA-graph hooks (graph generations, kept block inputs) and the compiled calls (a copy
    would share the original's compiled code; the peer compiles its own)."""
    import copy

    from omnispec.kernels.qk_norm_rope import qk_norm_rope
    from omnispec.policies import mlp
    from omnispec.policies.attention import unfused_attention
    from omnispec.policies.compile import uncompiled

    twin = copy.deepcopy(module, memo={id(op): op for op in (mlp.OPERATORS, qk_norm_rope)})
    mlp.unfuse_gelus(twin)
    uncompiled(twin)
    for m in twin.modules():
        unfused_attention(m)
        m._compiled_call_impl = None
    return twin


# ---- LTX-2 (audio and video): its modules, size and guidance plan, and the step comparison against diffusers ---------

LTX2_SIZE = dict(height=512, width=768, frames=121, fps=24)
LTX2_PROMPT = "a jazz band playing in a small club at night, warm light, close-up of the saxophone player"


def ltx2_components() -> dict:
    """LTX-2 19B's modules at their real configs with random weights (bf16), or the tiny test ones under smoke.
    The text encoder is a one-layer Gemma 3 of the real width (the 12B encoder only runs once per request and its
    cost cancels in per-step times); the connectors have the real width and depth with a projection sized to that
    encoder. The VAEs, vocoder and latent upsampler have their default (real) configs."""
    if harness.SMOKE:
        from diffusers.pipelines.ltx2 import LTX2LatentUpsamplerModel

        from omnispec.testing.ltx2_fixtures import ltx2_components as tiny_ltx2_components

        mods = tiny_ltx2_components(version="2.0")
        mods["latent_upsampler"] = LTX2LatentUpsamplerModel(in_channels=4, mid_channels=32, num_blocks_per_stage=1)
        return mods
    import transformers
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2LatentUpsamplerModel, LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    from omnispec.testing import gemma_tokenizer

    tokenizer = gemma_tokenizer()
    v = len(tokenizer)
    with on_card():
        text_encoder = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
            text_config={"vocab_size": v, "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 1,
                         "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256},
            vision_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                           "num_attention_heads": 2, "image_size": 28, "patch_size": 14},
            mm_tokens_per_image=4, boi_token_index=v - 3, eoi_token_index=v - 2, image_token_index=v - 1))
        # LTX-2 19B (diffusers' conversion config "2.0"): the class defaults, with the real split RoPE.
        transformer = LTX2VideoTransformer3DModel(rope_type="split")
        connectors = LTX2TextConnectors(
            caption_channels=3840, text_proj_in_factor=2, video_connector_num_attention_heads=30,
            video_connector_attention_head_dim=128, video_connector_num_layers=2,
            video_connector_num_learnable_registers=128, audio_connector_num_attention_heads=30,
            audio_connector_attention_head_dim=128, audio_connector_num_layers=2,
            audio_connector_num_learnable_registers=128, connector_rope_base_seq_len=4096, rope_type="split")
        # The VAEs and vocoder of LTX-2 (diffusers' conversion config "2.0"; the classes' defaults differ).
        vae = AutoencoderKLLTX2Video(
            latent_channels=128, block_out_channels=(256, 512, 1024, 2048), decoder_block_out_channels=(256, 512, 1024),
            layers_per_block=(4, 6, 6, 2, 2), decoder_layers_per_block=(5, 5, 5, 5),
            spatio_temporal_scaling=(True, True, True, True), decoder_spatio_temporal_scaling=(True, True, True),
            decoder_inject_noise=(False, False, False, False),
            downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
            upsample_type=("spatiotemporal", "spatiotemporal", "spatiotemporal"), upsample_residual=(True, True, True),
            upsample_factor=(2, 2, 2), timestep_conditioning=False, patch_size=4, patch_size_t=1, resnet_norm_eps=1e-6,
            encoder_causal=True, decoder_causal=False, encoder_spatial_padding_mode="zeros",
            decoder_spatial_padding_mode="reflect", spatial_compression_ratio=32, temporal_compression_ratio=8)
        audio_vae = AutoencoderKLLTX2Audio(
            base_channels=128, output_channels=2, ch_mult=(1, 2, 4), num_res_blocks=2, attn_resolutions=None,
            in_channels=2, resolution=256, latent_channels=8, norm_type="pixel", causality_axis="height", dropout=0.0,
            mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=64,
            double_z=True)
        vocoder = LTX2Vocoder(
            in_channels=128, hidden_channels=1024, out_channels=2, upsample_kernel_sizes=[16, 15, 8, 4, 4],
            upsample_factors=[6, 5, 2, 2, 2], resnet_kernel_sizes=[3, 7, 11], resnet_dilations=[[1, 3, 5]] * 3,
            leaky_relu_negative_slope=0.1, output_sampling_rate=24000)
        mods = dict(transformer=transformer, text_encoder=text_encoder, connectors=connectors, vae=vae,
                    audio_vae=audio_vae, vocoder=vocoder)
    mods["latent_upsampler"] = LTX2LatentUpsamplerModel()  # its blur kernel is built by a matmul CUDA lacks for int64
    mods = {k: m.to(harness.DEVICE, torch.bfloat16).eval() for k, m in mods.items()}
    mods["tokenizer"] = tokenizer
    mods["scheduler"] = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024, max_image_seq_len=4096,
        shift_terminal=0.1)
    return mods


def ltx2_spec_overrides() -> list[str]:
    over = ["runtime.progress=false", "model.check_checkpoint=false"]
    if harness.SMOKE:
        over += ["model.dtype=float32", "recipe.constraints.frames_multiple_of=4",
                 "recipe.constraints.size_multiple_of=16", "recipe.phases.0.guidance.terms.1.layers=[1]"]
    return over


def ltx2_guidance_kwargs() -> dict:
    return dict(guidance_scale=3.0, audio_guidance_scale=7.0, stg_scale=1.0, audio_stg_scale=1.0, modality_scale=3.0,
                audio_modality_scale=3.0, guidance_rescale=0.7, audio_guidance_rescale=0.7,
                spatio_temporal_guidance_blocks=[1] if harness.SMOKE else [28])


def ltx2_diffusers_size() -> dict:
    return dict(height=LTX2_SIZE["height"], width=LTX2_SIZE["width"], num_frames=LTX2_SIZE["frames"],
                frame_rate=float(LTX2_SIZE["fps"]))


def ltx2_build(spec: str, mods: dict, extra: list[str] = ()):
    import omnispec

    keep = {k: v for k, v in mods.items() if k != "latent_upsampler" or "two-stage" in spec}
    return omnispec.build(harness.ROOT / "specs" / spec, components=keep, device=harness.DEVICE,
                          overrides=[*ltx2_spec_overrides(), *extra])


def ltx2_step_part(mods: dict, repeats: int, ceiling: float, overrides: list[str] = (), also: list[str] = ()) -> dict:
    from diffusers.pipelines.ltx2 import LTX2Pipeline

    return _ltx2_step_rows("step", ("ltx2-t2v.yaml", overrides, also), LTX2Pipeline, mods, {}, {}, repeats, ceiling)


def ltx2_keyframes_part(mods: dict, repeats: int, ceiling: float, overrides: list[str] = (),
                        also: list[str] = ()) -> dict:
    """The ltx2_condition family: ltx2-keyframes with an image at the first and at the last frame, against
    ``LTX2ConditionPipeline`` with the same two conditions. The first replaces latent frame 0's tokens, the last is
    appended as one latent frame of keyframe tokens (6,144 video tokens become 6,912 at 512x768x121)."""
    from diffusers.pipelines.ltx2 import LTX2ConditionPipeline, LTX2VideoCondition
    from PIL import Image

    first, _ = conditioning_inputs(LTX2_SIZE["height"], LTX2_SIZE["width"])
    last = first.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    ours = {"conditions": [{"image": first, "frame": 0}, {"image": last, "frame": -1}]}
    theirs = {"conditions": [LTX2VideoCondition(frames=first, index=0), LTX2VideoCondition(frames=last, index=-1)]}
    return _ltx2_step_rows("keyframes", ("ltx2-keyframes.yaml", overrides, also), LTX2ConditionPipeline, mods, ours,
                           theirs, repeats, ceiling)


def _ltx2_step_rows(part: str, build: tuple[str, list[str], list[str]], pipeline_class, mods: dict,
                    ours_kwargs: dict, theirs_kwargs: dict, repeats: int, ceiling: float) -> dict:
    """Per-step time of omnispec's pipeline (``build``: its spec and overrides) against ``pipeline_class`` on the same
    modules (one round of each per repeat, interleaved), MFU, and the cosine of the two 2-step runs' video latents
    (unpacked, keyframes dropped). ``build``'s third item, where given, adds a side as ``gpu_interpreter --also`` does:
    omnispec with those overrides too over its own copy of the transformer, with its 2-step video latents' and first
    step's prediction's (video, row 0) cosines against omnispec's."""
    spec, overrides, also = build
    pipe = ltx2_build(spec, mods, overrides)
    ref = pipeline_class(**{k: v for k, v in mods.items() if k != "latent_upsampler"})

    def ours(n, pipe=pipe):
        return pipe.generate(pipe.request(LTX2_PROMPT, 0, steps=n, **LTX2_SIZE, **ours_kwargs), decode=False)

    def theirs(n):
        return ref(prompt=LTX2_PROMPT, num_inference_steps=n, generator=torch.Generator("cpu").manual_seed(0),
                   output_type="latent", return_dict=False, **ltx2_diffusers_size(), **ltx2_guidance_kwargs(),
                   **theirs_kwargs)

    sides = {"diffusers": theirs, "omnispec": ours}
    if also:
        label = f"omnispec + {' + '.join(also)}"
        copy_ = copy.deepcopy(mods["transformer"])
        other = ltx2_build(spec, {**mods, "transformer": copy_}, [*overrides, *also])
        sides[label] = functools.partial(ours, pipe=other)
    # --smoke: fewer steps (one would give diffusers NaN sigmas), no warm-up
    lo, hi = (2, 3) if harness.SMOKE else (2, 4)
    with torch.no_grad():
        if not harness.SMOKE:
            harness.warm_up_sides(sides, lo, hi, overrides, also)
        flops = harness.flops_per_step(ours, steps=2) / 2
        timed = harness.per_step_sides(sides, lo, hi, repeats)
        rows = {label: {"ms_per_step": med * 1e3, "samples_ms": [s * 1e3 for s in samples],
                        "mfu": flops / med / ceiling} for label, (med, samples) in timed.items()}
        a = ours(2).latents
        video, _ = theirs(2)
    geometry = pipe.family.geometry(pipe.request(LTX2_PROMPT, 0, **LTX2_SIZE, **ours_kwargs), 1.0)
    unpacked = pipe.family.unpack("video", a["video"], geometry)
    out = {"part": part, "tflop_per_step": flops / 1e12, **rows,
           "ratio": rows["omnispec"]["ms_per_step"] / rows["diffusers"]["ms_per_step"],
           "video_latent_cosine": harness.cosine(unpacked, video)}
    if also:
        with torch.no_grad():
            c = sides[label](2).latents
        step, _ = harness.first_output(ours, mods["transformer"])
        out |= {f"ratio ({label})": rows[label]["ms_per_step"] / rows["diffusers"]["ms_per_step"],
                f"latent_cosine ({label})": harness.cosine(c["video"], a["video"]),
                f"step_cosine ({label})": harness.cosine(harness.first_output(sides[label], copy_)[0], step)}
    return out


def ltx2_row(workload: str, part: str, repeats: int, ceiling: float, overrides: list[str],
             also: list[str] = ()) -> dict:
    """A ``gpu_interpreter`` row (its keys) from LTX-2's ``step`` or ``keyframes`` comparison, so that one command
    times every family; with ``also``, its third side's rows as ``gpu_interpreter --also`` names them."""
    run, components = LTX2_PARTS[part]
    row = run(components(), repeats, ceiling, overrides, also)
    harness.free_device_memory(compiled=True)
    third = {k: v for k, v in row.items()
             if k.startswith(("omnispec + ", "ratio (", "latent_cosine (", "step_cosine ("))}
    return {"workload": workload, "overrides": list(overrides), "tflop_per_step": row["tflop_per_step"],
            "diffusers": row["diffusers"], "omnispec": row["omnispec"], "ratio": row["ratio"],
            "latent_cosine": row["video_latent_cosine"], **third}


# ---- the workloads: spec, modules, diffusers pipeline, request and the steps of a short and a long run ---------------

WORKLOADS = {
    # LTX-2 (audio and video), 512x768x121, timed by ``ltx2_row`` (its own modules, size and guidance plan, above):
    # ltx2 is the t2v plan against LTX2Pipeline, ltx2_condition first- and last-frame keyframes against
    # LTX2ConditionPipeline.
    "ltx2": dict(ltx2_part="step"),
    "ltx2_condition": dict(ltx2_part="keyframes"),
    "flux": dict(spec="flux1-dev.yaml", components=flux_components, pipeline="FluxPipeline",
                 request=dict(height=1024, width=1024, max_sequence_length=512), steps=(2, 6),
                 diffusers_kwargs=dict(height=1024, width=1024, guidance_scale=3.5, max_sequence_length=512)),
    "wan": dict(spec="wan2.1-t2v-1.3b.yaml", components=wan_components, pipeline="WanPipeline",
                request=dict(height=480, width=832, frames=81, max_sequence_length=512), steps=(1, 3),
                diffusers_kwargs=dict(height=480, width=832, num_frames=81, guidance_scale=5.0,
                                      max_sequence_length=512)),
    # the base model's CFG on both sides (two forwards against the empty prompt), 1024²: 4,096 image tokens
    "flux2_klein": dict(spec="flux2-klein-base-4b.yaml", components=flux2_klein_components,
                        pipeline="Flux2KleinPipeline", compare="images",
                        request=dict(height=1024, width=1024, max_sequence_length=512),
                        steps=(2, 6), diffusers_kwargs=dict(height=1024, width=1024, guidance_scale=4.0,
                                                            max_sequence_length=512)),
    # the first frame's latents and mask beside the noise, CLIP image features in cross-attention; 33 frames (9 latent
    # frames, 14,040 tokens a row) so that two repeats fit one call at 14B
    "wan_i2v": dict(spec="wan2.1-i2v-14b-480p.yaml", components=wan_i2v_components, pipeline="WanImageToVideoPipeline",
                    inputs=("image",), request=dict(height=480, width=832, frames=33, max_sequence_length=512),
                    steps=(1, 3), diffusers_kwargs=dict(height=480, width=832, num_frames=33, guidance_scale=5.0,
                                                        max_sequence_length=512)),
    # Wan2.2 I2V A14B at the spec's 480x832x81 (32,760 tokens a row), guidance 3.5 for both experts: the first step
    # of a short or long run is the high-noise expert's, the long run's later ones the low-noise expert's
    "wan22_i2v": dict(spec="wan2.2-i2v-a14b.yaml", components=wan22_i2v_components,
                      pipeline="WanImageToVideoPipeline", diffusers_only=lambda: {"boundary_ratio": 0.9},
                      inputs=("image",), request=dict(height=480, width=832, frames=81, max_sequence_length=512),
                      steps=(1, 3), diffusers_kwargs=dict(height=480, width=832, num_frames=81, guidance_scale=3.5,
                                                          max_sequence_length=512)),
    # keyframes (first and last frame) on both sides: 96 control channels beside the noise, VACE hints every 2nd block
    "wan_vace": dict(spec="wan2.1-vace-1.3b.yaml", components=wan_vace_components, pipeline="WanVACEPipeline",
                     inputs=("keyframes",), request=dict(height=480, width=832, frames=81, max_sequence_length=512),
                     steps=(1, 3), diffusers_kwargs=dict(height=480, width=832, num_frames=81, guidance_scale=5.0,
                                                         max_sequence_length=512)),
    # a timestep per token on both sides (WanPipeline with expand_timesteps); 704x1280x121: 27,280 tokens a row
    "wan_ti2v": dict(spec="wan2.2-ti2v-5b.yaml", components=wan_ti2v_components, pipeline="WanPipeline",
                     diffusers_only=lambda: {"expand_timesteps": True},
                     request=dict(height=704, width=1280, frames=121, max_sequence_length=512), steps=(1, 3),
                     diffusers_kwargs=dict(height=704, width=1280, num_frames=121, guidance_scale=5.0,
                                           max_sequence_length=512)),
    # inpainting at strength 1 on both sides (all steps run: per-step times compare), the right half repainted
    "flux_fill": dict(spec="flux1-fill-dev.yaml", components=functools.partial(flux_components, fill=True),
                      pipeline="FluxFillPipeline", inputs=("image", "mask"),
                      request=dict(height=1024, width=1024, max_sequence_length=512, strength=1.0), steps=(2, 6),
                      diffusers_kwargs=dict(height=1024, width=1024, guidance_scale=30.0, max_sequence_length=512,
                                            strength=1.0)),
    "qwen_image_inpaint": dict(spec="qwen-image-inpaint.yaml", components=qwen_image_components,
                               pipeline="QwenImageInpaintPipeline", inputs=("image", "mask"),
                               request=dict(height=1024, width=1024, max_sequence_length=512, strength=1.0),
                               steps=(2, 6), diffusers_kwargs=dict(height=1024, width=1024, true_cfg_scale=4.0,
                                                                   negative_prompt=" ", max_sequence_length=512,
                                                                   strength=1.0)),
    # CFG 4.5 on both sides (the spec's skip-layer term is at scale 0: off); no LoRA
    "sd3": dict(spec="sd3.5-medium.yaml", components=functools.partial(sd3_components, lora=False),
                pipeline="StableDiffusion3Pipeline",
                request=dict(height=1024, width=1024, max_sequence_length=256), steps=(2, 6),
                diffusers_kwargs=dict(height=1024, width=1024, guidance_scale=4.5, max_sequence_length=256)),
    # the reference image's 4,096 tokens after the noise tokens (1024² in, 1024² out, no resize on either side)
    "flux_kontext": dict(spec="flux1-kontext-dev.yaml", components=flux_components, pipeline="FluxKontextPipeline",
                         inputs=("image",), overrides=["model.options.auto_resize=false"],
                         request=dict(height=1024, width=1024, max_sequence_length=512), steps=(2, 6),
                         diffusers_kwargs=dict(height=1024, width=1024, guidance_scale=2.5, max_sequence_length=512,
                                               _auto_resize=False)),
    # true CFG with its per-token renorm on both sides (the spec's negative prompt " " is the model card's)
    "qwen_image": dict(spec="qwen-image.yaml", components=qwen_image_components, pipeline="QwenImagePipeline",
                       request=dict(height=1024, width=1024, max_sequence_length=512), steps=(2, 6),
                       diffusers_kwargs=dict(height=1024, width=1024, true_cfg_scale=4.0, negative_prompt=" ",
                                             max_sequence_length=512)),
    "z_image": dict(spec="z-image-turbo.yaml", components=z_image_components, pipeline="ZImagePipeline",
                    request=dict(height=1024, width=1024, max_sequence_length=512), steps=(2, 6),
                    diffusers_kwargs=dict(height=1024, width=1024, guidance_scale=0.0, max_sequence_length=512)),
    # the output size is the image's aspect bucket on both sides (a 480x848 image: the 16:9 bucket); 33 frames
    "hunyuan_video15_i2v": dict(spec="hunyuanvideo-1.5-i2v.yaml", components=hunyuan_video15_i2v_components,
                                pipeline="HunyuanVideo15ImageToVideoPipeline", diffusers_only=hunyuan_video15_guider,
                                inputs=("image",), image_size=(480, 848), request=dict(frames=33), steps=(1, 3),
                                diffusers_kwargs=dict(num_frames=33)),
    # the reference image's 4,096 tokens after the noise tokens, and fed to the text encoder's vision tower
    "qwen_image_edit": dict(spec="qwen-image-edit.yaml", components=qwen_image_edit_components,
                            pipeline="QwenImageEditPipeline", inputs=("image",),
                            request=dict(height=1024, width=1024), steps=(2, 6),
                            diffusers_kwargs=dict(height=1024, width=1024, true_cfg_scale=4.0, negative_prompt=" ")),
    "qwen_image_edit_plus": dict(spec="qwen-image-edit-plus.yaml", components=qwen_image_edit_components,
                                 pipeline="QwenImageEditPlusPipeline", inputs=("image",),
                                 request=dict(height=1024, width=1024), steps=(2, 6),
                                 diffusers_kwargs=dict(height=1024, width=1024, true_cfg_scale=4.0,
                                                       negative_prompt=" ")),
    # 480x848x121: 49290 video tokens, so cond and uncond run as separate forwards on both sides
    "hunyuan_video15": dict(spec="hunyuanvideo-1.5-t2v.yaml", components=hunyuan_video15_components,
                            pipeline="HunyuanVideo15Pipeline", diffusers_only=hunyuan_video15_guider,
                            request=dict(height=480, width=848, frames=121), steps=(1, 3),
                            diffusers_kwargs=dict(height=480, width=848, num_frames=121)),
}


# ---- the parallel configurations of ``gpu_parallel`` (and ``gpu_peers --parallel``) ----------------------------------

PARALLEL_DEGREES = {"single": {}, "single-unbatched": {}, "cfg2": {"cfg": 2}, "ulysses2": {"ulysses": 2},
                    "ring2": {"ring": 2}}


def parallel_overrides(name: str, label: str) -> list[str]:
    """The spec overrides of workload ``name`` under parallel configuration ``label`` (``PARALLEL_DEGREES``): one
    attention kernel for every run compared, FLUX with true CFG (two passes to split)."""
    degrees = PARALLEL_DEGREES[label]
    out = ["runtime.progress=false", "policies.attention.default=sdpa"]  # one kernel for every run compared
    if label == "single-unbatched":
        # one sample row per forward, as each cfg rank runs: how far bf16 moves with the batch shape alone
        out.append("runtime.max_batch=1")
    if name == "flux":
        out.append("recipe.phases.0.guidance.terms=[{kind: true_cfg, scale: 4.0}]")
    if degrees:
        out.append("policies.parallel={" + ", ".join(f"{k}: {v}" for k, v in degrees.items()) + "}")
    return out


@harness.on_smoke
def _tiny_workloads() -> None:
    """Under smoke: 64 px requests (5 frames for video), 1 and 2 steps; LTX-2 at 32x32x5."""
    for w in WORKLOADS.values():
        if "ltx2_part" in w:  # sized by LTX2_SIZE
            continue
        w["steps"] = (1, 2)
        sized = "image_size" not in w  # a family that takes its size from the image: the image's size only
        w["request"] |= ({"height": 64, "width": 64} if sized else {}) | (
            {"frames": 5} if "frames" in w["request"] else {})
        w["diffusers_kwargs"] |= ({"height": 64, "width": 64} if sized else {}) | (
            {"num_frames": 5} if "num_frames" in w["diffusers_kwargs"] else {})
        w["image_size"] = (64, 64)
    LTX2_SIZE.update(height=32, width=32, frames=5, fps=25)


def flux2_components() -> dict:
    """FLUX.2 [dev]'s transformer at its published shape (diffusers' Flux2Transformer2DModel defaults: 8 double and
    48 single blocks of 48 heads of 128, guidance embeddings, prompts 3 x 5120 wide: 32B); a 30-layer Mistral3
    language model 5120 wide with a narrow MLP and a one-layer vision tower (the prompt is its hidden states at layers
    10, 20 and 30), FLUX.2's VAE at its default config."""
    import transformers
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    from omnispec.testing.fixtures_flux2 import mistral_tokenizer

    tokenizer = mistral_tokenizer()
    width = 16 if harness.SMOKE else 5120
    size = dict(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                axes_dims_rope=(4, 4, 4, 4), in_channels=16) if harness.SMOKE else {}
    with on_card():
        transformer = Flux2Transformer2DModel(joint_attention_dim=3 * width, guidance_embeds=True,
                                              **size).to(torch.bfloat16)
    text_encoder = transformers.Mistral3ForConditionalGeneration(transformers.Mistral3Config(
        text_config=transformers.MistralConfig(
            hidden_size=width, intermediate_size=16 if harness.SMOKE else 1024, num_hidden_layers=30,
            num_attention_heads=2 if harness.SMOKE else 32, num_key_value_heads=2 if harness.SMOKE else 8,
            head_dim=8 if harness.SMOKE else 128, vocab_size=512, max_position_embeddings=1024),
        vision_config=transformers.PixtralVisionConfig(hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                                       num_attention_heads=2, head_dim=8, image_size=64,
                                                       patch_size=8),
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=1))
    vae = AutoencoderKLFlux2(**(dict(block_out_channels=(8, 8), down_block_types=("DownEncoderBlock2D",) * 2,
                                     up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, latent_channels=4,
                                     norm_num_groups=4) if harness.SMOKE else {}))
    scheduler = FlowMatchEulerDiscreteScheduler(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096,
                                                max_shift=1.15, shift=3.0, time_shift_type="exponential",
                                                use_dynamic_shifting=True)
    mods = dict(transformer=transformer, text_encoder=text_encoder, tokenizer=tokenizer, vae=vae, scheduler=scheduler)
    return _on_device(mods, ("text_encoder", "vae"))


# FLUX.2 [dev]: embedded guidance 4.0 on both sides (one forward a step), 1024²: 4,096 image tokens
WORKLOADS["flux2"] = dict(spec="flux2-dev.yaml", components=flux2_components, pipeline="Flux2Pipeline",
                          compare="images", request=dict(height=1024, width=1024, max_sequence_length=512),
                          steps=(2, 6), diffusers_kwargs=dict(height=1024, width=1024, guidance_scale=4.0,
                                                              max_sequence_length=512))
if harness.SMOKE:  # appended after the smoke hook resized the table: the same tiny sizes
    WORKLOADS["flux2"].update(steps=(1, 2), image_size=(64, 64))
    WORKLOADS["flux2"]["request"] |= {"height": 64, "width": 64}
    WORKLOADS["flux2"]["diffusers_kwargs"] |= {"height": 64, "width": 64}


# ---- Kandinsky 6 (video and audio) -----------------------------------------------------------------------------------

def kandinsky6_components() -> dict:
    """Kandinsky 6.0 Pro distilled: the transformer at the released checkpoint's architecture (60 fused video/audio
    blocks of widths 4096 / 2048, feed-forwards 16384 / 7168, four text blocks per stream, 16 video and 40 audio
    latent channels, the reference-frame token types) with a PiflowScheduler's widened outputs (its class default of
    10 grid points per channel); two-layer Qwen2.5-VL and one-layer CLIP text encoders of the real widths (3584, 768);
    HunyuanVideo's VAE and MMAudio's audio VAE and vocoder at their class defaults (the real ones: 16 channels,
    8x / 4x; 40 channels at 44.1 kHz). Under smoke, the offline fixture's tiny modules."""
    if harness.SMOKE:
        from omnispec.testing.fixtures_kandinsky6 import kandinsky6_components as tiny

        return tiny()
    import transformers
    from diffusers import (AutoencoderKLHunyuanVideo, Kandinsky6Transformer3DModel, MMAudioVAE, MMAudioVocoder,
                           PiflowScheduler)

    from omnispec.testing import clip_tokenizer, qwen_tokenizer

    scheduler = PiflowScheduler(shift=5.0)
    grid = scheduler.config.n_grid
    with on_card():
        transformer = Kandinsky6Transformer3DModel(
            in_visual_dim=16, out_visual_dim=16 * grid, in_text_dim=3584, in_text_dim2=768, time_dim=1024,
            patch_size=(1, 2, 2), model_dim=4096, ff_dim=16384, num_text_blocks=4, num_visual_blocks=60,
            axes_dims=(32, 48, 48), visual_cond=True, in_audio_dim=40, out_audio_dim=40 * grid, model_dim_a=2048,
            time_dim_a=1024, ff_dim_a=7168, axes_dims_a=(32, 48, 48), audio_freqs_scaling=0.144,
            text_token_padding=True, ca_rope=True, cross_gates=True, fix_modulation=True,
            visual_token_type_num_embeddings=2).to(torch.bfloat16)
    tokenizer = qwen_tokenizer()
    end = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    text_encoder = transformers.Qwen2_5_VLForConditionalGeneration(transformers.Qwen2_5_VLConfig(
        text_config={"hidden_size": 3584, "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 28,
                     "num_key_value_heads": 4, "vocab_size": 512, "bos_token_id": end, "eos_token_id": end,
                     "rope_scaling": {"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"}},
        vision_config={"depth": 1, "hidden_size": 64, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 3584},
        vocab_size=512, bos_token_id=end, eos_token_id=end))
    clip = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        hidden_size=768, intermediate_size=768, num_attention_heads=12, num_hidden_layers=1, vocab_size=400,
        projection_dim=768, max_position_embeddings=77, bos_token_id=0, eos_token_id=1))
    # The equality check decodes both sides' clips through this one module: tiled, that decode fits an 80 GB card
    # beside the 30B transformer (both sides' images still go through the same decode, and it is not timed)
    vae = AutoencoderKLHunyuanVideo()
    vae.enable_tiling()
    mods = dict(transformer=transformer, vae=vae, text_encoder=text_encoder,
                tokenizer=tokenizer, text_encoder_2=clip, tokenizer_2=clip_tokenizer(), scheduler=scheduler,
                audio_vae=MMAudioVAE(), vocoder=MMAudioVocoder())
    return _on_device(mods, ("text_encoder", "text_encoder_2", "vae", "audio_vae", "vocoder"))


# Text-to-video with audio at the docstring's 480x864, 33 frames (14,580 video tokens a row; decoding 121 frames for
# the equality check would not fit beside the 29B transformer), no CFG on either side; compared decoded (the
# pipeline's "latent" output is (B, C, F, H, W), the loop's (B, F, H, W, C)).
WORKLOADS["kandinsky6"] = dict(
    spec="kandinsky6-distill-t2v.yaml", components=kandinsky6_components, pipeline="Kandinsky6TI2VAPipeline",
    compare="images", request=dict(height=480, width=864, frames=33, max_sequence_length=1024), steps=(1, 3),
    diffusers_kwargs=dict(height=480, width=864, num_frames=33, guidance_scale=1.0, max_sequence_length=1024))


@harness.on_smoke
def _tiny_kandinsky6() -> None:
    """Under smoke (now, when this module is imported after the switch): 64x64, 5 frames, 1 and 2 steps."""
    w = WORKLOADS["kandinsky6"]
    w.update(steps=(1, 2), image_size=(64, 64))
    w["request"] |= {"height": 64, "width": 64, "frames": 5}
    w["diffusers_kwargs"] |= {"height": 64, "width": 64, "num_frames": 5}
# ---- Kandinsky 6 super-resolution (a video in, 2.25x larger out, refined tile by tile) -------------------------------

def kandinsky6_sr_components() -> dict:
    """The SR release at its class defaults, which are its architecture: the 1.4B transformer (32 blocks of width
    1792, NABLA sparse attention) with a PiflowScheduler's widened outputs (10 grid points per channel), the K-VAE (64
    channels, 16x / 4x) and the x2 / x4 latent upscaler bank. The transformer's blocks are compiled on both sides'
    shared modules (``compile_repeated_blocks``, as the pipeline's docstring does): its flex attention, eager,
    materialises the whole score matrix. Under smoke, the offline fixture's tiny modules."""
    if harness.SMOKE:
        from omnispec.testing.fixtures_kandinsky6_sr import kandinsky6_sr_components as tiny

        return tiny()
    from diffusers import (Kandinsky6SRLatentUpscalerBank, Kandinsky6SRTransformer3DModel, Kandinsky6SRVAE,
                           PiflowScheduler)

    with on_card():
        transformer = Kandinsky6SRTransformer3DModel().to(torch.bfloat16)
        mods = dict(transformer=transformer, vae=Kandinsky6SRVAE(), latent_upscaler=Kandinsky6SRLatentUpscalerBank(),
                    scheduler=PiflowScheduler())
    transformer.compile_repeated_blocks(fullgraph=True)
    return _on_device(mods, ("vae", "latent_upscaler"))


def kandinsky6_sr_reference(mods: dict):
    """diffusers' side: ``Kandinsky6SRPipeline`` on the request's video, as a function of the step count returning
    the decoded frames (the pipeline decodes every tile inside its loop; per-step times cancel that out)."""
    from diffusers import Kandinsky6SRPipeline

    pipe = Kandinsky6SRPipeline(**mods)
    pipe.set_progress_bar_config(disable=True)

    def run(n: int, *, video: list, **kwargs):
        return torch.from_numpy(pipe(video=video, num_inference_steps=n, generator=torch.Generator("cpu").manual_seed(0),
                                     output_type="np", **kwargs).frames)

    return run


def kandinsky6_sr_flops(pipe, request: dict) -> float:
    """One step's matmul FLOPs, 2 x tokens (every tile's) x the transformer's per-token linear weights: torch's
    FlopCounterMode has no count for flex attention's operator, so the sparse attention is left out and the MFU is a
    lower bound."""
    from omnispec.spec.request import resolve_request

    geometry = pipe.family.geometry(resolve_request(pipe.spec, "", 0, planning=True, **request), 1.0)
    weights = sum(m.weight.numel() for name, m in pipe.components["transformer"].named_modules()
                  if isinstance(m, torch.nn.Linear) and "modulation" not in name and "time_embeddings" not in name)
    return 2.0 * pipe.family.tokens(geometry) * weights


# kandinsky6-distill-t2v's 480x864 output, 33 frames (the kandinsky6 workload's), to 1080x1944 (2.25x): 9 tiles of
# 512x768 (9 latent frames of 32x48, 13,824 tokens each), one tile a forward, 9 forwards a step on both sides.
WORKLOADS["kandinsky6_sr"] = dict(
    spec="kandinsky6-sr.yaml", components=kandinsky6_sr_components, reference=kandinsky6_sr_reference,
    flops=kandinsky6_sr_flops, compare="images", inputs=("video",), image_size=(480, 864),
    request=dict(height=480, width=864, frames=33), steps=(1, 2), diffusers_kwargs=dict())


@harness.on_smoke
def _tiny_kandinsky6_sr() -> None:
    """Under smoke: a 32x48 video of 5 frames (the fixture's K-VAE compresses 4x), 1 and 2 steps."""
    w = WORKLOADS["kandinsky6_sr"]
    w.update(steps=(1, 2), image_size=(32, 48))
    w["request"] |= {"height": 32, "width": 48, "frames": 5}


# ---- LTX-2.3's modules; LTX-2.5: LTX-2's step comparison on its modules, against LTX25ModularPipeline --------------

# LTX-2.3's architecture flags in diffusers (gated attention, prompt AdaLN, perturbable self-attention; the prompt
# projections move from the transformer into the connectors, one per stream).
LTX23_TRANSFORMER_FLAGS = dict(perturbed_attn=True, gated_attn=True, cross_attn_mod=True, audio_gated_attn=True,
                               audio_cross_attn_mod=True, use_prompt_embeddings=False)


def ltx23_denoiser_and_connectors(caption_channels: int = 3840, text_layers: int = 1) -> dict:
    """LTX-2.3's transformer (LTX-2 19B's widths and depth with LTX-2.3's flags) and its connectors, which project
    the prompt to each stream's width (4,096 video, 2,048 audio: what the transformer's cross-attentions take once
    it has no prompt projection of its own), random bf16 weights on the device. The connectors' depth is LTX-2's
    (their cost is per request and cancels in per-step times)."""
    from diffusers import LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    with on_card():
        transformer = LTX2VideoTransformer3DModel(rope_type="split", **LTX23_TRANSFORMER_FLAGS)
        connectors = LTX2TextConnectors(
            caption_channels=caption_channels, text_proj_in_factor=text_layers + 1, per_modality_projections=True,
            video_hidden_dim=4096, audio_hidden_dim=2048, proj_bias=True, video_gated_attn=True,
            audio_gated_attn=True, video_connector_num_attention_heads=32, video_connector_attention_head_dim=128,
            video_connector_num_layers=2, video_connector_num_learnable_registers=128,
            audio_connector_num_attention_heads=32, audio_connector_attention_head_dim=64,
            audio_connector_num_layers=2, audio_connector_num_learnable_registers=128,
            connector_rope_base_seq_len=4096, rope_type="split")
    return {name: m.to(harness.DEVICE, torch.bfloat16).eval()
            for name, m in (("transformer", transformer), ("connectors", connectors))}


def ltx23_components() -> dict:
    """LTX-2.3's modules with random bf16 weights, or the tiny test ones under smoke: LTX-2's (``ltx2_components``:
    the one-layer Gemma 3 of the real width, the VAEs) with LTX-2.3's transformer and connectors
    (``ltx23_denoiser_and_connectors``) and its vocoder with bandwidth extension to 48 kHz (the class defaults,
    which are the release's). No latent upsampler: the one-stage spec has none."""
    if harness.SMOKE:
        from omnispec.testing.ltx2_fixtures import ltx2_components as tiny_ltx2_components

        return tiny_ltx2_components(version="2.3", bwe=True)
    from diffusers.pipelines.ltx2.vocoder import LTX2VocoderWithBWE

    mods = ltx2_components()
    del mods["transformer"], mods["connectors"], mods["vocoder"], mods["latent_upsampler"]
    harness.free_device_memory()
    mods |= ltx23_denoiser_and_connectors()
    mods["vocoder"] = LTX2VocoderWithBWE().to(harness.DEVICE, torch.bfloat16).eval()
    return mods


def ltx25_components() -> dict:
    """LTX-2.5's modules with random bf16 weights, or the tiny test ones under smoke: LTX-2's (``ltx2_components``)
    with LTX-2.3's transformer and connectors (``ltx23_denoiser_and_connectors``: diffusers ships no config of the
    22B transformer), a one-layer Gemma-4 text encoder of Gemma 3 12B's width in place of Gemma 3 (its cost cancels
    in per-step times, as LTX-2's), the diffusion video decoder at its class defaults (the production config) and the
    48 kHz vocoder with bandwidth extension."""
    if harness.SMOKE:
        from omnispec.testing.fixtures_ltx25 import ltx25_components as tiny_ltx25_components

        return tiny_ltx25_components()
    import transformers
    from diffusers import LTX2VideoDiffusionDecoderModel
    from diffusers.pipelines.ltx2.vocoder import LTX2VocoderWithBWE

    mods = ltx2_components()
    del mods["transformer"], mods["connectors"], mods["text_encoder"], mods["latent_upsampler"], mods["vocoder"]
    harness.free_device_memory()
    v = len(mods["tokenizer"])
    with on_card():
        mods["text_encoder"] = transformers.Gemma4UnifiedForConditionalGeneration(transformers.Gemma4UnifiedConfig(
            text_config={"vocab_size": v, "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 1,
                         "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
                         "layer_types": ["full_attention"]},
            vision_config=None, audio_config=None))
        mods["diffusion_decoder"] = LTX2VideoDiffusionDecoderModel()
        mods["vocoder"] = LTX2VocoderWithBWE()  # the 48 kHz vocoder the spec names
    for name in ("text_encoder", "diffusion_decoder", "vocoder"):
        mods[name] = mods[name].to(harness.DEVICE, torch.bfloat16).eval()
    return mods | ltx23_denoiser_and_connectors()


class LTX25Modular:
    """``LTX25ModularPipeline`` called as ``_ltx2_step_rows`` calls ``LTX2Pipeline``: the guidance keywords become
    its ``guider`` and ``audio_guider``, and it returns (video, audio)."""

    def __init__(self, **mods):
        from diffusers.modular_pipelines import LTX25AutoBlocks

        self.pipe = LTX25AutoBlocks().init_pipeline()
        self.pipe.update_components(**mods)

    def set_progress_bar_config(self, **kwargs) -> None:
        self.pipe.set_progress_bar_config(**kwargs)

    def __call__(self, *, return_dict: bool, spatio_temporal_guidance_blocks, **kwargs):
        from diffusers.guiders import LTX2Guidance

        guiders = {}
        for stream, prefix in (("guider", ""), ("audio_guider", "audio_")):
            scales = {k: kwargs.pop(prefix + k) for k in ("guidance_scale", "stg_scale", "modality_scale",
                                                          "guidance_rescale")}
            blocks = spatio_temporal_guidance_blocks if stream == "guider" else None
            guiders[stream] = LTX2Guidance(**scales, spatio_temporal_guidance_blocks=blocks)
        self.pipe.update_components(**guiders)
        out = self.pipe(**kwargs, output=["videos", "audio"])
        return out["videos"], out["audio"]


def ltx25_step_part(mods: dict, repeats: int, ceiling: float, overrides: list[str] = (), also: list[str] = ()) -> dict:
    """The ltx25 family: ltx2.5-t2v's plan against the modular pipeline's text2video workflow (latents out: the
    diffusion decoder is not timed)."""
    return _ltx2_step_rows("ltx25", ("ltx2.5-t2v.yaml", overrides, also), LTX25Modular, mods, {}, {}, repeats, ceiling)


def ltx25_keyframes_part(mods: dict, repeats: int, ceiling: float, overrides: list[str] = (),
                          also: list[str] = ()) -> dict:
    """The ltx25_condition family: ltx2.5-keyframes with an image at the first and at the last frame, against the
    modular pipeline's condition workflow."""
    from diffusers.pipelines.ltx2 import LTX2VideoCondition
    from PIL import Image

    first, _ = conditioning_inputs(LTX2_SIZE["height"], LTX2_SIZE["width"])
    last = first.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    ours = {"conditions": [{"image": first, "frame": 0}, {"image": last, "frame": -1}]}
    theirs = {"conditions": [LTX2VideoCondition(frames=first, index=0), LTX2VideoCondition(frames=last, index=-1)]}
    return _ltx2_step_rows("ltx25_keyframes", ("ltx2.5-keyframes.yaml", overrides, also), LTX25Modular, mods, ours,
                           theirs, repeats, ceiling)


def ltx25_ic_part(mods: dict, repeats: int, ceiling: float, overrides: list[str] = (), also: list[str] = ()) -> dict:
    """The ltx25_ic family: ltx2.5-ic-lora with one 25-frame reference video at the output's size (its clean tokens
    appended to the video's), against the modular pipeline's in_context workflow; no LoRA on either side (its
    weights change no shape)."""
    import numpy as np
    from diffusers.pipelines.ltx2 import LTX2ReferenceCondition
    from PIL import Image

    rng = np.random.default_rng(0)
    frames = [Image.fromarray(rng.integers(0, 256, (LTX2_SIZE["height"], LTX2_SIZE["width"], 3), dtype=np.uint8))
              for _ in range(25)]
    return _ltx2_step_rows("ltx25_ic", ("ltx2.5-ic-lora.yaml", overrides, also), LTX25Modular, mods,
                           {"references": [{"video": frames}]},
                           {"reference_conditions": [LTX2ReferenceCondition(frames=frames)]}, repeats, ceiling)


# ``ltx2_row``'s parts: the comparison and the modules it runs on.
LTX2_PARTS = {"step": (ltx2_step_part, ltx2_components), "keyframes": (ltx2_keyframes_part, ltx2_components),
              "ltx25": (ltx25_step_part, ltx25_components), "ltx25_keyframes": (ltx25_keyframes_part, ltx25_components),
              "ltx25_ic": (ltx25_ic_part, ltx25_components)}
# LTX-2.5 at LTX-2's size (LTX2_SIZE; the bundled spec's 704 width differs by one latent column).
WORKLOADS["ltx25"] = dict(ltx2_part="ltx25")
WORKLOADS["ltx25_condition"] = dict(ltx2_part="ltx25_keyframes")
WORKLOADS["ltx25_ic"] = dict(ltx2_part="ltx25_ic")
def krea2_components() -> dict:
    """Krea 2's transformer at its real config; a Qwen3-VL text model of Qwen3-VL-4B's width with the 36 layers the
    pipeline taps (small feed-forwards). Under smoke the text width is small on both sides."""
    import transformers
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, Krea2Transformer2DModel

    from omnispec.testing import qwen_tokenizer
    from omnispec.testing.fixtures_krea2 import KREA2_SCHEDULER

    text, heads, head_dim = (64, 2, 32) if harness.SMOKE else (2560, 32, 128)
    with on_card():
        transformer = Krea2Transformer2DModel(**(dict(
            num_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256, text_hidden_dim=text,
            text_num_attention_heads=2, text_num_key_value_heads=2, text_intermediate_size=64)
            if harness.SMOKE else {})).to(torch.bfloat16)
    section = [head_dim // 2 - 2 * (head_dim * 5 // 32), head_dim * 5 // 32, head_dim * 5 // 32]  # 4B's [24, 20, 20]
    tokenizer = qwen_tokenizer()
    text_encoder = transformers.Qwen3VLModel(transformers.Qwen3VLConfig(
        text_config={"hidden_size": text, "intermediate_size": 1024, "num_hidden_layers": 36,
                     "num_attention_heads": heads, "num_key_value_heads": heads // 4 or 1, "head_dim": head_dim,
                     "vocab_size": 512, "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0,
                                                            "mrope_section": section, "mrope_interleaved": True}},
        vision_config={"depth": 1, "hidden_size": 64, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": text,
                       "deepstack_visual_indexes": [0]},
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>")))
    mods = dict(transformer=transformer, text_encoder=text_encoder, tokenizer=tokenizer, vae=AutoencoderKLQwenImage(),
                scheduler=FlowMatchEulerDiscreteScheduler(**KREA2_SCHEDULER))
    return _on_device(mods, ("text_encoder", "vae"))


# CFG 4.5 in Krea's formulation on both sides (two forwards against the empty prompt), 1024²: 4,096 image tokens
# beside the 512 text tokens
WORKLOADS["krea2"] = dict(spec="krea2-raw.yaml", components=krea2_components, pipeline="Krea2Pipeline",
                          request=dict(height=1024, width=1024, max_sequence_length=512), steps=(2, 6),
                          diffusers_kwargs=dict(height=1024, width=1024, guidance_scale=4.5, max_sequence_length=512))
if harness.SMOKE:  # appended after the smoke hook resized the table: the same tiny sizes
    WORKLOADS["krea2"].update(steps=(1, 2), image_size=(64, 64))
    WORKLOADS["krea2"]["request"] |= {"height": 64, "width": 64}
    WORKLOADS["krea2"]["diffusers_kwargs"] |= {"height": 64, "width": 64}
QWEN21_SCHEDULE = ("recipe.phases.0.schedule={kind: flow_match, shift: dynamic, base_shift: 0.5, max_shift: 0.9, "
                   "base_seq_len: 256, max_seq_len: 8192}")


def qwen_image21_components() -> dict:
    """Qwen-Image-2.1's transformer and VAE at their real configs (diffusers' defaults: 32 single-stream blocks of
    4096, a 64-channel 16x VAE); a one-layer Qwen3-VL text encoder of Qwen3-VL-8B's width, with the image-only
    processor of the offline fixtures (this workload is text-to-image)."""
    import transformers
    from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Transformer2DModel

    from omnispec.testing import qwen21_processor, qwen_tokenizer
    from omnispec.testing.fixtures_qwen_image21 import CHAT_TEMPLATE

    tokenizer = qwen_tokenizer(CHAT_TEMPLATE)
    ids = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    with on_card():
        transformer = QwenImage21Transformer2DModel(num_layers=1 if harness.SMOKE else 32).to(torch.bfloat16)
    text_encoder = transformers.Qwen3VLForConditionalGeneration(transformers.Qwen3VLConfig(
        text_config={"hidden_size": 4096, "intermediate_size": 1024, "num_hidden_layers": 1, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 512,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0,
                                         "mrope_section": [24, 20, 20]}},
        vision_config={"depth": 1, "hidden_size": 64, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 4096,
                       "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                       "num_position_embeddings": 64, "deepstack_visual_indexes": [0]},
        vision_start_token_id=ids[0], vision_end_token_id=ids[1], image_token_id=ids[2], video_token_id=ids[3]))
    # a dynamic shift (QWEN21_SCHEDULE says it to the spec); no terminal stretch, which diffusers' scheduler divides
    # by zero on the smoke run's one step
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                                                base_image_seq_len=256, max_image_seq_len=8192,
                                                time_shift_type="exponential")
    mods = dict(transformer=transformer, text_encoder=text_encoder, processor=qwen21_processor(tokenizer),
                vae=AutoencoderKLQwenImage21(), scheduler=scheduler)
    return _on_device(mods, ("text_encoder", "vae"))



# Qwen-Image-2.1: 1024x1024 (4,096 target tokens after the prompt's in one sequence), no guidance on both sides (the
# defaults); the schedule written out as the components' scheduler has it (no checkpoint to follow)
WORKLOADS["qwen_image21"] = dict(spec="qwen-image-2.1.yaml", components=qwen_image21_components,
                                 pipeline="QwenImage21Pipeline", overrides=[QWEN21_SCHEDULE],
                                 request=dict(height=1024, width=1024), steps=(2, 6),
                                 diffusers_kwargs=dict(height=1024, width=1024))
if harness.SMOKE:  # appended after the smoke hook resized the table: the same tiny sizes
    WORKLOADS["qwen_image21"].update(steps=(1, 2), image_size=(64, 64))
    WORKLOADS["qwen_image21"]["request"] |= {"height": 64, "width": 64}
    WORKLOADS["qwen_image21"]["diffusers_kwargs"] |= {"height": 64, "width": 64}
# ---- MiniMax-H3 (a modular pipeline only) ----------------------------------------------------------------------------

def _keeping_fp32(model: torch.nn.Module) -> torch.nn.Module:
    """The model as ``from_pretrained(dtype=bfloat16)`` loads it: the modules its class keeps in float32 (MiniMax-H3's
    patch projections, time embedder and heads; its VAEs' encoders and norms) back in float32."""
    keep = getattr(model, "_keep_in_fp32_modules", None) or ()
    for name, module in model.named_modules():
        if name and any(k in name.split(".") or name.endswith(k) for k in keep):
            module.float()
    return model


def minimax_h3_components(denoiser: str = "transformer", quantize: Callable | None = None) -> dict:
    """MiniMax-H3's transformer, video VAE and audio VAE at their real configs (the classes' defaults are the released
    ones: 50 blocks of width 5376, 56 heads of 128); a Qwen3-VL text encoder of the real width (5120) with the 51
    layers the model reads ``hidden_states[50]`` from, but narrow attention and feed-forwards (it runs once per
    request), and a one-block vision tower with the 14-pixel patches of the fixture's image processor (ref2va shows it
    its image references). ``denoiser``: the checkpoint partition built, ``transformer`` (t2va, fl2va) or
    ``transformer_ref`` (ref2va), of the same architecture. ``quantize``: a function that puts the denoiser, made on
    the host, on the card quantized (``minimax_h3_fp8_components``). --smoke: the offline fixture's tiny modules,
    without the other partition (a spec names one, and its family calls the other foreign)."""
    import transformers
    from diffusers import (AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Scheduler,
                           MiniMaxH3Transformer3DModel)

    from omnispec.testing.fixtures_minimax_h3 import minimax_h3_components as tiny_minimax_h3_components
    from omnispec.testing.fixtures_minimax_h3 import minimax_h3_processor
    from omnispec.testing.tokenizers import qwen_tokenizer

    if harness.SMOKE:
        mods = tiny_minimax_h3_components()
        mods.pop("transformer" if denoiser == "transformer_ref" else "transformer_ref", None)
        mods = {k: (_keeping_fp32(m.to(torch.bfloat16)) if isinstance(m, torch.nn.Module) else m)
                for k, m in mods.items()}
        if quantize is not None:
            mods[denoiser] = quantize(mods[denoiser])
        return mods
    tokenizer = qwen_tokenizer()
    ids = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    # to be quantized: made on the host in bf16 (66 GB, more than the 80 GB card holds beside the rest)
    with on_card(), torch.device("cpu") if quantize is not None else nullcontext():
        transformer = MiniMaxH3Transformer3DModel()
    with on_card():
        text_encoder = transformers.Qwen3VLForConditionalGeneration(transformers.Qwen3VLConfig(
            text_config={"hidden_size": 5120, "intermediate_size": 1024, "num_hidden_layers": 51,
                         "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 512,
                         "rope_theta": 5000000.0,
                         "rope_scaling": {"mrope_section": [24, 20, 20], "rope_type": "default",
                                          "mrope_interleaved": True}},
            vision_config={"depth": 1, "hidden_size": 64, "intermediate_size": 64, "num_heads": 2,
                           "out_hidden_size": 5120, "deepstack_visual_indexes": [0], "patch_size": 14,
                           "spatial_merge_size": 2, "temporal_patch_size": 2},
            vision_start_token_id=ids[0], vision_end_token_id=ids[1], image_token_id=ids[2], video_token_id=ids[3]))
        # the audio VAE's class leaves its 32 latent channels' statistics unset (the release's config sets them), and
        # both the reference encoding (ref2va) and the audio decode read them
        vae, audio_vae = AutoencoderKLMiniMaxH3(), AutoencoderKLMiniMaxH3Audio(latents_mean=[0.0] * 32,
                                                                            latents_std=[1.0] * 32)
    mods = {denoiser: transformer, "text_encoder": text_encoder, "vae": vae, "audio_vae": audio_vae}

    def placed(name: str, module: torch.nn.Module) -> torch.nn.Module:  # a denoiser to quantize stays on the host
        return module if name == denoiser and quantize is not None else module.to(harness.DEVICE, torch.bfloat16)

    mods = {k: _keeping_fp32(placed(k, m).eval()) for k, m in mods.items()}
    if quantize is not None:
        mods[denoiser] = quantize(mods[denoiser])  # onto the card as it quantizes; no dtype cast after it
    return {**mods, "tokenizer": tokenizer, "processor": minimax_h3_processor(tokenizer),
            "scheduler": MiniMaxH3Scheduler(shift=12.0), "audio_scheduler": MiniMaxH3Scheduler(shift=3.0)}


def minimax_h3_reference(mods: dict, configs: dict | None = None):
    """diffusers' side of MiniMax-H3: the modular pipeline's blocks up to the denoised rows (no decode), as a function
    of the step count returning the video rows in omnispec's layout. ``num_inference_steps`` counts the grid's
    terminal 0, so ``n`` forwards are ``n + 1`` of it. ``configs``: the blocks' configs to set (ref2va's canvas and
    reference sizes under smoke); the workflow is the one the call's inputs select (``references``: ref2va)."""
    from diffusers.modular_pipelines import MiniMaxH3Blocks, SequentialPipelineBlocks
    from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents

    blocks = MiniMaxH3Blocks()
    denoise = SequentialPipelineBlocks.from_blocks_dict(
        {name: blocks.sub_blocks[name] for name in ("before_encode", "text_encoder", "vae_encoder", "denoise")})
    ref = denoise.init_pipeline()
    ref.update_components(**mods)
    if configs:
        ref.register_to_config(**configs)

    def run(n: int, **kwargs):
        out = ref(prompt="a photo of a cat", num_inference_steps=n + 1,
                  generator=torch.Generator("cpu").manual_seed(0), output="latents", **kwargs)
        return patchify_video_latents(out, ref.patch_size)[None]

    return run


# 124 frames (5.2 s, the shortest and the default) at the default 768x1344 canvas: 37 latent frames of 24x42
# patches, 37,296 video rows and 414 audio rows in one packed sequence; one forward per step (guidance-distilled).
WORKLOADS["minimax_h3"] = dict(spec="minimax-h3-t2v.yaml", components=minimax_h3_components,
                               reference=minimax_h3_reference, stream="video",
                               request=dict(height=768, width=1344), steps=(1, 3),
                               diffusers_kwargs=dict(height=768, width=1344))  # num_frames: the blocks' 124


def minimax_h3_fp8_components() -> dict:
    """``minimax_h3_components`` for an 80 GB card: the 33B transformer made on the host and quantized on its way to
    the card to fp8 matmuls with a scale per row (omnispec's ``fp8_dynamic`` row setting, through the policy's own
    torchao config), 33 GB there instead of 66. Its linears kept in float32 stay unquantized (per-row fp8 takes bf16
    weights), as omnispec's policy leaves them. Both sides of the comparison then run these same modules. --smoke:
    int8 weights (a CPU has no fp8 matmuls)."""
    from torchao.quantization import quantize_

    from omnispec.policies.quantization import torchao_config

    config = torchao_config("int8_weight_only") if harness.SMOKE else torchao_config("fp8_dynamic", "row")

    def quantize(model: torch.nn.Module) -> torch.nn.Module:
        quantize_(model, config, device=harness.DEVICE,
                  filter_fn=lambda m, _: isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.bfloat16)
        return model.to(harness.DEVICE)  # the modules quantize_ left alone (norms, embeddings), no dtype cast

    return minimax_h3_components(quantize=quantize)


# The 80 GB card's MiniMax-H3 row: both sides over the same fp8 transformer (``minimax_h3_fp8_components``)
WORKLOADS["minimax_h3_fp8"] = {**WORKLOADS["minimax_h3"], "components": minimax_h3_fp8_components}


# ---- MiniMax-H3 ref2va: one image reference ahead of the generated rows, against the blocks' ref2va workflow ---------

# --smoke: the blocks' canvas and reference sizes at the tiny request's (an image reference at its real 2048-pixel
# short edge would dwarf a 64-pixel clip)
SMOKE_REF2VA_OPTIONS = {"canvas_short_edge": 64, "canvas_max_pixels": 64 * 64, "reference_image_short_edge": 64}


def minimax_h3_ref2va_reference(mods: dict):
    """diffusers' side of ref2va: ``minimax_h3_reference`` with the request's images as the blocks' image references
    (their ``references`` input selects the workflow and its ``transformer_ref``)."""
    from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3ImageReference

    run = minimax_h3_reference(mods, SMOKE_REF2VA_OPTIONS if harness.SMOKE else None)

    def run_ref2va(n: int, *, references: list, **kwargs):
        return run(n, references=[MiniMaxH3ImageReference(image=image) for image in references], **kwargs)

    return run_ref2va


# The default 768x1344 canvas and 124 frames (37,296 video rows, 414 audio rows) with one 16:9 image reference of the
# canvas' size, which the blocks encode at its 2048-pixel short edge (2048x3584: 7,168 more rows in every forward,
# held at t = 0.999); one forward a step, against transformer_ref. gpu_interpreter gives both sides the same picture
# (``inputs``); diffusers' ref2va takes num_frames, which the request sets too.
WORKLOADS["minimax_h3_ref2va"] = dict(
    spec="minimax-h3-ref2va.yaml", components=functools.partial(minimax_h3_components, denoiser="transformer_ref"),
    reference=minimax_h3_ref2va_reference, stream="video", inputs=("references",),
    request=dict(height=768, width=1344, frames=124), steps=(1, 3),
    diffusers_kwargs=dict(height=768, width=1344, num_frames=124))


# ---- FLUX.3 [klein] (modular pipelines only) -------------------------------------------------------------------------

def flux3_components(distilled: bool = False) -> dict:
    """FLUX.3 [klein]'s transformer at its released shape (diffusers' Flux3Transformer2DModel defaults: 5 per-mode and
    28 joint blocks of 24 heads of 128, 128 latent channels, prompts 8 x 2560 wide: 5.5B; ``distilled``: the
    step-distilled flow map, which embeds the target timestep too), FLUX.2's VAE at its default config; a Qwen3-VL
    text model of Qwen3-VL-4B's width (2560) with the 32 layers whose hidden states the blocks stack (4, 8, ..., 32)
    but a narrow feed-forward (it runs once per request), and a one-block vision tower (text-to-image: never run). The
    ``tokenizer`` component is the fixture's torchvision-free Qwen3-VL processor. --smoke: the offline fixture's
    tiny modules."""
    import transformers
    from diffusers import AutoencoderKLFlux2, Flux3Transformer2DModel

    from omnispec.testing.fixtures_flux3 import flux3_components as tiny_flux3_components
    from omnispec.testing.fixtures_flux3 import flux3_processor
    from omnispec.testing.tokenizers import QWEN3_CHAT_TEMPLATE, qwen_tokenizer

    if harness.SMOKE:
        mods = tiny_flux3_components(distilled=distilled)
        return {k: (m.to(torch.bfloat16) if isinstance(m, torch.nn.Module) else m) for k, m in mods.items()}
    tokenizer = qwen_tokenizer(QWEN3_CHAT_TEMPLATE)
    ids = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    with on_card():
        transformer = Flux3Transformer2DModel(flow_map=distilled)
        text_encoder = transformers.Qwen3VLForConditionalGeneration(transformers.Qwen3VLConfig(
            text_config={"hidden_size": 2560, "intermediate_size": 1024, "num_hidden_layers": 32,
                         "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 512,
                         "rope_theta": 5000000.0,
                         "rope_scaling": {"mrope_section": [24, 20, 20], "rope_type": "default",
                                          "mrope_interleaved": True}},
            vision_config={"depth": 1, "hidden_size": 64, "intermediate_size": 64, "num_heads": 2,
                           "out_hidden_size": 2560, "deepstack_visual_indexes": [0], "patch_size": 14,
                           "spatial_merge_size": 2, "temporal_patch_size": 2},
            vision_start_token_id=ids[0], vision_end_token_id=ids[1], image_token_id=ids[2], video_token_id=ids[3]))
        vae = AutoencoderKLFlux2()
    mods = {k: m.to(harness.DEVICE, torch.bfloat16).eval()
            for k, m in dict(transformer=transformer, text_encoder=text_encoder, vae=vae).items()}
    return {**mods, "tokenizer": flux3_processor(tokenizer)}


def flux3_reference(mods: dict, distilled: bool = False):
    """diffusers' side of FLUX.3 [klein]: ``Flux3ModularPipeline``'s blocks (``Flux3DistilledModularPipeline``'s for
    the distilled model) without the prompt upsampler (omnispec encodes the prompt as given) and without the decode,
    as a function of the step count returning the denoised latents as omnispec's tokens (the blocks unpack them onto
    their (C, H/16, W/16) grid; omnispec keeps the (H/16 x W/16, C) rows)."""
    from diffusers.modular_pipelines import Flux3AutoBlocks, Flux3DistilledAutoBlocks

    blocks = (Flux3DistilledAutoBlocks if distilled else Flux3AutoBlocks)()
    for name in ("prompt_upsampler", "decode"):
        blocks.sub_blocks.pop(name)
    ref = blocks.init_pipeline()
    ref.update_components(**mods)

    def run(n: int, **kwargs):
        out = ref(prompt="a photo of a cat", num_inference_steps=n, generator=torch.Generator("cpu").manual_seed(0),
                  output="latents", **kwargs)
        return out.flatten(2).transpose(1, 2)

    return run


# 1024² (4,096 image tokens beside the prompt's 80-token window): the base model with CFG 3.5 against the empty
# prompt on both sides (the blocks' guider and omnispec's spec; two forwards a step), the distilled flow map with one
# forward a step.
WORKLOADS["flux3"] = dict(spec="flux3-klein-base.yaml", components=flux3_components, reference=flux3_reference,
                          request=dict(height=1024, width=1024), steps=(2, 6),
                          diffusers_kwargs=dict(height=1024, width=1024))
WORKLOADS["flux3_distilled"] = dict(spec="flux3-klein.yaml",
                                    components=functools.partial(flux3_components, distilled=True),
                                    reference=functools.partial(flux3_reference, distilled=True),
                                    request=dict(height=1024, width=1024), steps=(2, 6),
                                    diffusers_kwargs=dict(height=1024, width=1024))


@harness.on_smoke
def _tiny_modular() -> None:
    """Under smoke (at once, when this module is imported after the switch): ``_tiny_workloads``' sizes for the
    workloads above (64 px, 1 and 2 steps), ref2va at its shortest clip (124 frames, not ``_tiny_workloads``' 5) with
    its references on 64-pixel canvases."""
    for name in ("minimax_h3_ref2va", "flux3", "flux3_distilled"):
        w = WORKLOADS[name]
        w.update(steps=(1, 2), image_size=(64, 64))
        w["request"] |= {"height": 64, "width": 64}
        w["diffusers_kwargs"] |= {"height": 64, "width": 64}
    ref2va = WORKLOADS["minimax_h3_ref2va"]
    ref2va["request"]["frames"] = ref2va["diffusers_kwargs"]["num_frames"] = 124
    options = ", ".join(f"{k}: {v}" for k, v in SMOKE_REF2VA_OPTIONS.items())
    ref2va["overrides"] = [f"model.options={{{options}}}"]
