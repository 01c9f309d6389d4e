"""Per-step denoise time through omnispec and through the diffusers pipeline, real sizes, random bf16 weights.

``python -m benchmarks.gpu_interpreter [--workloads flux,wan] [--repeats 3] [--json FILE]``  (needs CUDA)

Both run the same in-memory modules (omnispec gets them through ``build(..., components=...)``), the
same prompt, size and seed, with latents returned undecoded. Per-step time is the difference between
a long and a short run divided by the step difference, so prompt encoding and set-up cancel out. MFU
is FLOPs per step (counted by torch's FlopCounterMode on one denoiser forward) over the measured
bf16 matmul ceiling of this GPU. Rounds alternate between the two sides (``per_step_sides``); ``--also OVERRIDE``
adds a third, omnispec with that override too over its own copy of the denoisers (an in-process A/B of a policy).

The workloads cover every family with a diffusers pipeline (all but the embedded digits model, which has none);
``ltx2`` and ``ltx2_condition`` are timed by ``benchmarks/gpu_ltx2.py``'s step and keyframes parts.
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import json
import re
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def matmul_ceiling(n: int = 8192, iters: int = 20) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * iters / (time.perf_counter() - start)


def _text_encoders(clip_hidden: int, t5_dim: int, umt5: bool = False):
    import transformers

    from omnispec.testing import clip_tokenizer, t5_tokenizer

    # --smoke: two heads of 16 dims (the widths the callers pass are the tiny ones there)
    clip_heads, t5_heads = ((2, dict(d_kv=16, d_ff=64, num_heads=2)) if SMOKE
                            else (12, dict(d_kv=64, d_ff=1024, num_heads=64)))
    clip = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        hidden_size=clip_hidden, intermediate_size=clip_hidden, num_attention_heads=clip_heads, num_hidden_layers=1,
        vocab_size=400, projection_dim=clip_hidden, max_position_embeddings=77, bos_token_id=0, eos_token_id=1))
    cfg_cls = transformers.UMT5Config if umt5 else transformers.T5Config
    t5_cls = transformers.UMT5EncoderModel if umt5 else transformers.T5EncoderModel
    t5 = t5_cls(cfg_cls(d_model=t5_dim, num_layers=1, vocab_size=256, decoder_start_token_id=0, pad_token_id=0,
                        eos_token_id=1, **t5_heads))
    return clip, clip_tokenizer(), t5, t5_tokenizer()


SMOKE = False  # --smoke: tiny models on the CPU, to check this script without a GPU
DEVICE = "cuda"
# --smoke sizes: the text encoders' widths (CLIP, T5), the image VAE's and Wan VAE's (the offline fixtures' tiny ones,
# keeping the real models' downsampling, so requests make the same latent shapes)
SMOKE_TEXT = (32, 32)
SMOKE_IMAGE_VAE = dict(block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4)
SMOKE_WAN_VAE = dict(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                     temperal_downsample=[False, True, True])


def flux_components(fill: bool = False) -> dict:
    """FLUX.1-dev's modules; ``fill``: FLUX.1-Fill-dev's transformer, which also takes the masked image's packed
    latents and the mask folded into channels (64 + 64 + 256 = 384 inputs at the real size, 64 outputs)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    clip, tok, t5, tok2 = _text_encoders(*SMOKE_TEXT) if SMOKE else _text_encoders(768, 4096)
    # --smoke: one block of each kind, two heads of 16 dims (FLUX's own layout otherwise: 64 packed channels)
    size = dict(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                joint_attention_dim=SMOKE_TEXT[1], pooled_projection_dim=SMOKE_TEXT[0],
                axes_dims_rope=(4, 4, 8)) if SMOKE else {}
    vae_size = SMOKE_IMAGE_VAE if SMOKE else dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2)
    if fill:
        scale = 2 ** (len(vae_size["block_out_channels"]) - 1)
        size |= dict(in_channels=2 * 64 + 4 * scale * scale, out_channels=64)
    with torch.device(DEVICE):
        transformer = FluxTransformer2DModel(guidance_embeds=True, **size).to(torch.bfloat16)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, shift_factor=0.1159, scaling_factor=0.3611,
                        use_quant_conv=False, use_post_quant_conv=False, **vae_size)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    mods = dict(transformer=transformer, text_encoder=clip, tokenizer=tok, text_encoder_2=t5, tokenizer_2=tok2,
                vae=vae, scheduler=scheduler)
    for k in ("text_encoder", "text_encoder_2", "vae"):
        mods[k] = mods[k].to(DEVICE, torch.bfloat16).eval()
    return mods


def wan_components(with_transformer: bool = True) -> dict:
    """Wan2.1 T2V 14B's modules (``with_transformer=False``: all but the transformer, for the VACE workload)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel

    _, _, umt5, tok = _text_encoders(*SMOKE_TEXT, umt5=True) if SMOKE else _text_encoders(768, 4096, umt5=True)
    # --smoke: one block, two heads of 16 dims, and the offline fixtures' tiny VAE (same classes)
    size = dict(num_attention_heads=40, attention_head_dim=128, text_dim=4096, ffn_dim=13824, num_layers=40)
    if SMOKE:
        size = dict(num_attention_heads=2, attention_head_dim=16, text_dim=SMOKE_TEXT[1], ffn_dim=32, num_layers=1)
    transformer = None
    if with_transformer:
        with torch.device(DEVICE):
            transformer = WanTransformer3DModel(
                patch_size=(1, 2, 2), in_channels=16, out_channels=16, freq_dim=256, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024, **size,
            ).to(torch.bfloat16)
    vae = AutoencoderKLWan(**SMOKE_WAN_VAE) if SMOKE else AutoencoderKLWan()
    return dict(transformer=transformer, text_encoder=umt5.to(DEVICE, torch.bfloat16).eval(), tokenizer=tok,
                vae=vae.to(DEVICE, torch.float32).eval(),
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
    if SMOKE:
        size = dict(num_attention_heads=2, attention_head_dim=16, text_dim=SMOKE_TEXT[1], ffn_dim=32, num_layers=1,
                    image_dim=16, added_kv_proj_dim=32)
        vision = dict(hidden_size=16, intermediate_size=16, num_attention_heads=2, image_size=32, patch_size=8)
    with torch.device(DEVICE):
        mods["transformer"] = WanTransformer3DModel(
            patch_size=(1, 2, 2), in_channels=36, out_channels=16, freq_dim=256, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024, **size).to(torch.bfloat16)
    mods["image_encoder"] = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(
        num_hidden_layers=1, **vision)).to(DEVICE, torch.float32).eval()  # float32, as the spec loads it
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
    if SMOKE:
        size = dict(num_attention_heads=2, attention_head_dim=16, ffn_dim=32, num_layers=2, vace_layers=[0])
    with torch.device(DEVICE):
        mods["transformer"] = WanVACETransformer3DModel(
            patch_size=(1, 2, 2), in_channels=16, out_channels=16, text_dim=SMOKE_TEXT[1] if SMOKE else 4096,
            freq_dim=256, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
            vace_in_channels=96, **size).to(torch.bfloat16)
    return mods


def vace_keyframes(height: int, width: int, frames: int):
    """A first and a last frame: omnispec's ``conditions``, and diffusers' VACE example's video and mask of them."""
    from PIL import Image

    first = conditioning_inputs(height, width)[0]
    last = first.rotate(180)
    video = [first, *[Image.new("RGB", (width, height), (128, 128, 128))] * (frames - 2), last]
    black, white = Image.new("L", (width, height), 0), Image.new("L", (width, height), 255)
    return ([{"image": first, "frame": 0}, {"image": last, "frame": -1}],
            {"video": video, "mask": [black, *[white] * (frames - 2), black]})


def wan_ti2v_components() -> dict:
    """Wan2.2 TI2V-5B's transformer at its real config (24 heads of 128, 30 blocks, 48 latent channels) and the
    Wan2.2 VAE's config (residual, 2x2 pixel patches, 16x spatial), as the checkpoint's convert script builds them."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel

    _, _, umt5, tok = _text_encoders(*SMOKE_TEXT, umt5=True) if SMOKE else _text_encoders(768, 4096, umt5=True)
    size = dict(num_attention_heads=24, attention_head_dim=128, text_dim=4096, ffn_dim=14336, num_layers=30)
    vae = dict(base_dim=160, decoder_base_dim=256, dim_mult=[1, 2, 4, 4])
    if SMOKE:
        size = dict(num_attention_heads=2, attention_head_dim=16, text_dim=SMOKE_TEXT[1], ffn_dim=32, num_layers=1)
        vae = dict(base_dim=3, dim_mult=[1, 1, 1, 1], num_res_blocks=1)
    with torch.device(DEVICE):
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2), in_channels=48, out_channels=48, freq_dim=256, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024, **size,
        ).to(torch.bfloat16)
    vae = AutoencoderKLWan(z_dim=48, in_channels=12, out_channels=12, is_residual=True, patch_size=2,
                           scale_factor_spatial=16, scale_factor_temporal=4, temperal_downsample=[False, True, True],
                           latents_mean=[0.0] * 48, latents_std=[1.0] * 48, **vae)
    return dict(transformer=transformer, text_encoder=umt5.to(DEVICE, torch.bfloat16).eval(), tokenizer=tok,
                vae=vae.to(DEVICE, torch.float32).eval(),
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

    width, layers = (16, 27) if SMOKE else (2560, 27)
    size = dict(num_layers=5, num_single_layers=20, attention_head_dim=128, num_attention_heads=24,
                axes_dims_rope=(32, 32, 32, 32), in_channels=128)
    if SMOKE:
        size = dict(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                    axes_dims_rope=(4, 4, 4, 4), in_channels=16)
    with torch.device(DEVICE):
        transformer = Flux2Transformer2DModel(joint_attention_dim=3 * width, timestep_guidance_channels=256,
                                              guidance_embeds=False, **size).to(torch.bfloat16)
    text_encoder = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        hidden_size=width, intermediate_size=16 if SMOKE else 1024, num_hidden_layers=layers,
        num_attention_heads=2 if SMOKE else 32, num_key_value_heads=2 if SMOKE else 8, head_dim=8 if SMOKE else 128,
        vocab_size=512))
    vae = AutoencoderKLFlux2(**(dict(block_out_channels=(8, 8), down_block_types=("DownEncoderBlock2D",) * 2,
                                     up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, latent_channels=4,
                                     norm_num_groups=4) if SMOKE else {}))
    scheduler = FlowMatchEulerDiscreteScheduler(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096,
                                                max_shift=1.15, shift=3.0, time_shift_type="exponential",
                                                use_dynamic_shifting=True)
    mods = dict(transformer=transformer, text_encoder=text_encoder, tokenizer=qwen_tokenizer(QWEN3_CHAT_TEMPLATE),
                vae=vae, scheduler=scheduler)
    return _on_device(mods, ("text_encoder", "vae"))


def _sd3_components() -> dict:
    """SD3.5-medium's modules at their real sizes (the rollout benchmark's), without its LoRA."""
    from . import gpu_rollout

    # run as __main__, this module is not the gpu_interpreter that gpu_rollout imported: hand it the settings
    gpu_rollout.gi.SMOKE, gpu_rollout.gi.DEVICE = SMOKE, DEVICE
    return gpu_rollout.sd3_components(lora=False)


def _on_device(mods: dict, names: tuple[str, ...]) -> dict:
    for k in names:
        mods[k] = mods[k].to(DEVICE, torch.bfloat16).eval()
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
    with torch.device(DEVICE):
        transformer = QwenImageTransformer2DModel(num_layers=1 if SMOKE else 60).to(torch.bfloat16)
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

    with torch.device(DEVICE):
        transformer = ZImageTransformer2DModel(
            axes_lens=[1536, 512, 512], **(dict(n_layers=1, n_refiner_layers=1) if SMOKE else {})).to(torch.bfloat16)
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


def hunyuan_video15_components() -> dict:
    """HunyuanVideo-1.5's transformer at its real config (8.3B, 480p text-to-video); small Qwen2.5-VL (two layers:
    the pipeline reads the third hidden state from the end) and ByT5 text encoders of their widths."""
    import transformers
    from diffusers import AutoencoderKLHunyuanVideo15, FlowMatchEulerDiscreteScheduler, HunyuanVideo15Transformer3DModel

    from omnispec.testing import qwen_tokenizer

    with torch.device(DEVICE):
        transformer = HunyuanVideo15Transformer3DModel(
            task_type="t2v", **(dict(num_layers=1, num_refiner_layers=1) if SMOKE else {})).to(torch.bfloat16)
    text_encoder = transformers.Qwen2_5_VLTextModel(transformers.Qwen2_5_VLTextConfig(
        hidden_size=3584, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=28, num_key_value_heads=4,
        vocab_size=512, rope_scaling={"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"}))
    glyphs = transformers.T5EncoderModel(transformers.T5Config(
        d_model=1472, d_kv=64, d_ff=1024, num_layers=1, num_heads=6, vocab_size=384, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1))
    # --smoke: the VAE's 16x / 4x compression and 32 latent channels, narrow
    vae = AutoencoderKLHunyuanVideo15(**(dict(block_out_channels=(64,) * 5, layers_per_block=1) if SMOKE else {}))
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
    smoke = dict(num_layers=1, num_refiner_layers=1, target_size=64) if SMOKE else {}
    with torch.device(DEVICE):
        mods["transformer"] = HunyuanVideo15Transformer3DModel(task_type="i2v", **smoke).to(torch.bfloat16)
    mods["image_encoder"] = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(
        hidden_size=1152, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=16, image_size=384,
        patch_size=14)).to(DEVICE, torch.bfloat16).eval()
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


WORKLOADS = {
    # LTX-2 (audio and video): its modules, size (512x768x121) and guidance plan live in gpu_ltx2, which times it
    # the same way; ltx2 is the t2v plan against LTX2Pipeline, ltx2_condition first- and last-frame keyframes
    # against LTX2ConditionPipeline.
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
    "flux_fill": dict(spec="flux1-fill-dev.yaml", components=lambda: flux_components(fill=True),
                      pipeline="FluxFillPipeline", inputs=("image", "mask"),
                      request=dict(height=1024, width=1024, max_sequence_length=512, strength=1.0), steps=(2, 6),
                      diffusers_kwargs=dict(height=1024, width=1024, guidance_scale=30.0, max_sequence_length=512,
                                            strength=1.0)),
    "qwen_image_inpaint": dict(spec="qwen-image-inpaint.yaml", components=lambda: qwen_image_components(),
                               pipeline="QwenImageInpaintPipeline", inputs=("image", "mask"),
                               request=dict(height=1024, width=1024, max_sequence_length=512, strength=1.0),
                               steps=(2, 6), diffusers_kwargs=dict(height=1024, width=1024, true_cfg_scale=4.0,
                                                                   negative_prompt=" ", max_sequence_length=512,
                                                                   strength=1.0)),
    # CFG 4.5 on both sides (the spec's skip-layer term is at scale 0: off); no LoRA
    "sd3": dict(spec="sd3.5-medium.yaml", components=lambda: _sd3_components(), pipeline="StableDiffusion3Pipeline",
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


def enable_smoke() -> None:
    """Tiny models (one block, two heads of 16 dims, tiny encoders and VAEs) at 64 px on the CPU, 1 and 2 steps:
    checks a benchmark script without a GPU (its numbers mean nothing)."""
    global SMOKE, DEVICE
    SMOKE, DEVICE = True, "cpu"
    for w in WORKLOADS.values():
        if "ltx2_part" in w:  # sized by gpu_ltx2's own smoke mode
            continue
        w["steps"] = (1, 2)
        sized = "image_size" not in w  # a family that takes its size from the image: the image's size only
        w["request"] |= ({"height": 64, "width": 64} if sized else {}) | (
            {"frames": 5} if "frames" in w["request"] else {})
        w["diffusers_kwargs"] |= ({"height": 64, "width": 64} if sized else {}) | (
            {"num_frames": 5} if "num_frames" in w["diffusers_kwargs"] else {})
        w["image_size"] = (64, 64)


def flops_per_step(run, steps: int = 1) -> float:
    """FLOPs of a ``steps``-step run (plus the tiny text encoders): one denoise step's with the default."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad():
        run(steps)  # warm-up: first-use work (auto attention trials, compilation) must not be counted
    counter = FlopCounterMode(display=False)
    # eager: a compiled frame run under a dispatch mode is skipped by dynamo, and skipped for good (torch 2.11 and
    # 2.13), so the compiled sides would then time eager blocks whose nested calls dynamo compiles one by one
    with torch.compiler.set_stance("force_eager"), counter, torch.no_grad():
        run(steps)
    return float(counter.get_total_flops())


# Phases of a compilation, as torch._dynamo.utils.compile_times names them: all of it, dynamo's bytecode tracing,
# AOTAutograd, inductor's code generation (a warm inductor cache shortens the last, never the first two).
COMPILE_PHASES = {"total": "_compile.compile_inner", "dynamo tracing": "bytecode_tracing",
                  "aot autograd": "create_aot_dispatcher_function", "inductor": "fx_codegen_and_compile"}


def _compile_seconds() -> dict[str, float]:
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv", aggregate=True)
    spent = dict(zip(names, (float(v) for v in values)))
    return {phase: spent.get(name, 0.0) for phase, name in COMPILE_PHASES.items()}


class CompileWatch:
    """Counts what dynamo does while a block runs: frames compiled, graphs, graph breaks, recompiles with
    their first guard failures, and the seconds each compilation phase took. A compiled region that recompiles
    per block, or breaks its graph, shows here rather than as an unexplained slow or noisy step time."""

    def __init__(self) -> None:
        self.recompiles: list[str] = []

    def __enter__(self) -> "CompileWatch":
        import logging

        from torch._dynamo.utils import counters

        self._start = {"graphs": counters["stats"]["unique_graphs"],
                       "breaks": sum(counters["graph_break"].values())}
        self._seconds = _compile_seconds()
        torch._logging.set_logs(recompiles=True)
        self._logger = logging.getLogger("torch._dynamo.guards.__recompiles")
        self._handler = logging.Handler()
        self._handler.emit = lambda record: self.recompiles.append(record.getMessage())  # type: ignore[method-assign]
        self._logger.addHandler(self._handler)
        self._logger.propagate = False  # collected, not printed
        return self

    def __exit__(self, *exc) -> None:
        self._logger.removeHandler(self._handler)
        self._logger.propagate = True
        torch._logging.set_logs()

    def summary(self) -> dict:
        import re

        from torch._dynamo.utils import counters

        reasons = [re.sub(r"\s+#.*", "", line.strip()) for msg in self.recompiles for line in msg.splitlines()
                   if re.match(r"\s*- \d+/\d+: ", line)]
        breaks = counters["graph_break"]
        return {"graphs": counters["stats"]["unique_graphs"] - self._start["graphs"],
                "graph_breaks": sum(breaks.values()) - self._start["breaks"],
                "graph_break_reasons": [r[:160] for r, _ in breaks.most_common(3)],
                "recompiles": len(self.recompiles),
                "recompile_reasons": list(dict.fromkeys(r[:200] for r in reasons))[:6],
                "compile_seconds": {k: round(v - self._seconds[k], 2) for k, v in _compile_seconds().items()}}


class StackSampler:
    """Where the main thread spends a long first call: its Python stack sampled every ``interval`` seconds from a
    side thread, so time that dynamo's compile metrics do not count (kernel compilation in worker processes,
    autotuning at first launch, guard evaluation, the run itself) still shows where it went. ``top()`` gives the
    innermost frames seen most (where the time is spent, the last frames of the stack) and the functions seen most
    anywhere on the stack. With ``dump_to``, ``top()`` is also written there every ``dump_every_s`` seconds, so a
    call cut by a timeout still leaves its samples."""

    def __init__(self, interval: float = 0.5, dump_to: Path | None = None, dump_every_s: float = 15.0) -> None:
        self.interval, self.samples, self.dump_to, self.dump_every_s = interval, 0, dump_to, dump_every_s
        self.counts: dict[str, int] = {}
        self.innermost: dict[str, int] = {}

    def __enter__(self) -> "StackSampler":
        import sys
        import threading

        main, self._stop = threading.main_thread().ident, threading.Event()
        every = max(1, round(self.dump_every_s / self.interval))

        def sample() -> None:
            while not self._stop.wait(self.interval):
                frame, stack = sys._current_frames().get(main), []
                while frame is not None:
                    code = frame.f_code
                    stack.append(f"{'/'.join(code.co_filename.split('/')[-2:])}:{code.co_name}")
                    frame = frame.f_back
                for key in set(stack):
                    self.counts[key] = self.counts.get(key, 0) + 1
                if stack:
                    leaf = " < ".join(stack[:4])
                    self.innermost[leaf] = self.innermost.get(leaf, 0) + 1
                self.samples += 1
                if self.dump_to is not None and self.samples % every == 0:
                    self.dump_to.write_text(json.dumps(self.top(), indent=1))

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self.dump_to is not None:
            self.dump_to.write_text(json.dumps(self.top(), indent=1))

    def top(self, n: int = 25) -> dict:
        def ranked(counts: dict[str, int]) -> dict[str, float]:
            return {key: round(count * self.interval, 1)
                    for key, count in sorted(counts.items(), key=lambda kv: -kv[1])[:n]}

        return {"samples": self.samples, "interval_s": self.interval, "innermost": ranked(self.innermost),
                "functions": ranked(self.counts)}


def stacks_file(results: Path | None, label: str) -> Path | None:
    """Where a ``StackSampler`` for ``label`` writes, beside the results file (None without one)."""
    if results is None:
        return None
    return results.with_name(f"{results.stem}_stacks_{re.sub(r'[^a-z0-9]+', '_', label.lower()).strip('_')}.json")


def free_device_memory() -> None:
    """Collect dropped modules and return the device cache, so the next build starts from an empty GPU."""
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def per_step(run, lo: int, hi: int, repeats: int, queued: list[float] | None = None) -> tuple[float, list[float]]:
    """Median seconds per step ((time of ``hi`` steps - time of ``lo``) / (hi - lo)) and the samples. ``queued``, if
    given, collects how long the device was still busy after each ``run(hi)`` returned (the wait in the synchronize
    after it): near zero means the host set the pace, not the device."""
    samples = []
    for _ in range(repeats):
        times = {}
        for n in (lo, hi):
            _sync()
            start = time.perf_counter()
            run(n)
            returned = time.perf_counter()
            _sync()
            times[n] = time.perf_counter() - start
            if n == hi and queued is not None:
                queued.append(time.perf_counter() - returned)
        samples.append((times[hi] - times[lo]) / (hi - lo))
    return statistics.median(samples), samples


def per_step_sides(sides: dict, lo: int, hi: int, repeats: int) -> dict[str, tuple[float, list[float]]]:
    """``per_step`` for several sides at once, one sample of each per round, the order reversed every other round:
    clocks that drift during a call (the GPU warming up, a neighbour's load) then hit every side alike, where
    timing one side's repeats after the other's would put the whole drift between them."""
    samples: dict[str, list[float]] = {label: [] for label in sides}
    order = list(sides)
    for r in range(repeats):
        for label in order if r % 2 == 0 else order[::-1]:
            samples[label].append(per_step(sides[label], lo, hi, 1)[1][0])
    return {label: (statistics.median(times), times) for label, times in samples.items()}


def per_request(run, steps: int, repeats: int) -> tuple[float, list[float]]:
    """Median seconds of a whole ``steps``-step request without gradients, and the samples."""
    samples = []
    for _ in range(repeats):
        _sync()
        start = time.perf_counter()
        with torch.no_grad():
            run(steps)
        _sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples), samples


def conditioning_inputs(height: int, width: int):
    """A random RGB picture and a mask repainting its right half."""
    import numpy as np
    from PIL import Image

    picture = Image.fromarray((np.random.RandomState(0).rand(height, width, 3) * 255).astype(np.uint8))
    held = np.zeros((height, width), np.uint8)
    held[:, width // 2:] = 255
    return picture, Image.fromarray(held, "L")


def measure(name: str, repeats: int, ceiling: float, overrides: list[str] = (), also: list[str] = ()) -> dict:
    """One workload's per-step time, omnispec (``overrides``) against diffusers on the same modules, interleaved;
    with ``also``, a third side: omnispec with those overrides too, over its own copy of the denoisers (a policy may
    change the modules it is given, which the first side shares with diffusers)."""
    import diffusers

    import omnispec
    from omnispec.spec.request import resolve_request

    w = WORKLOADS[name]
    if "ltx2_part" in w:
        from benchmarks import gpu_ltx2

        row = gpu_ltx2.interpreter_row(name, w["ltx2_part"], repeats, ceiling, list(overrides), SMOKE)
        return {**row, **({"also": "not measured: LTX-2's rows are gpu_ltx2's"} if also else {})}
    mods = w["components"]()
    pipe = omnispec.build(ROOT / "specs" / w["spec"], components=mods, device=DEVICE,
                          overrides=["runtime.progress=false", *w.get("overrides", ()), *overrides])
    ref = getattr(diffusers, w["pipeline"])(**mods, **w.get("diffusers_only", dict)())  # e.g. HunyuanVideo's guider
    ref.set_progress_bar_config(disable=True)

    def run_ours(n, pipe=pipe):
        pipe.generate(resolve_request(pipe.spec, "a photo of a cat", 0, steps=n, **w["request"]), decode=False)

    def run_ref(n):
        ref(prompt="a photo of a cat", num_inference_steps=n, generator=torch.Generator("cpu").manual_seed(0),
            output_type="latent", **w["diffusers_kwargs"])

    sides = {"diffusers": run_ref, "omnispec": run_ours}
    if also:
        denoisers = {k: copy.deepcopy(v) for k, v in mods.items() if k.startswith("transformer")}
        other = omnispec.build(ROOT / "specs" / w["spec"], components={**mods, **denoisers}, device=DEVICE,
                               overrides=["runtime.progress=false", *w.get("overrides", ()), *overrides, *also])
        sides[f"omnispec + {' + '.join(also)}"] = functools.partial(run_ours, pipe=other)

    if w.get("inputs") == ("keyframes",):  # VACE: omnispec's conditions, diffusers' video and mask of them
        conditions, theirs = vace_keyframes(w["request"]["height"], w["request"]["width"], w["request"]["frames"])
        w = {**w, "request": {**w["request"], "conditions": conditions},
             "diffusers_kwargs": {**w["diffusers_kwargs"], **theirs}}
    elif w.get("inputs"):  # an image (and a mask of its size), the same for both sides
        size = w.get("image_size") or (w["request"]["height"], w["request"]["width"])
        given = dict(zip(("image", "mask"), conditioning_inputs(*size)))
        ours = {k: given[k] for k in w["inputs"]}
        theirs = {{"mask": "mask_image"}.get(k, k): v for k, v in ours.items()}
        w = {**w, "request": {**w["request"], **ours}, "diffusers_kwargs": {**w["diffusers_kwargs"], **theirs}}
    lo, hi = w["steps"]
    if not SMOKE:  # --smoke: no timing worth warming up for
        for run in sides.values():  # warm-up
            run(lo)
    flops = flops_per_step(run_ours)
    with torch.no_grad():
        timed = per_step_sides(sides, lo, hi, repeats)
    results = {label: {"ms_per_step": med * 1e3, "samples_ms": [s * 1e3 for s in samples], "mfu": flops / med / ceiling}
               for label, (med, samples) in timed.items()}
    # Equality of the two runs' latents (same seed), bf16; decoded images where the pipeline's "latent" output is
    # not its loop's latents (FLUX.2 returns them unpacked and denormalised).
    images = w.get("compare") == "images"
    a = pipe.generate(resolve_request(pipe.spec, "a photo of a cat", 0, steps=lo, **w["request"]), decode=images)
    a = torch.from_numpy(a.array) if images else a.latents["latents"]
    b = ref(prompt="a photo of a cat", num_inference_steps=lo, generator=torch.Generator("cpu").manual_seed(0),
            output_type="np" if images else "latent", **w["diffusers_kwargs"])
    b = (b.images if hasattr(b, "images") else b.frames)
    b = torch.from_numpy(b) if images else b
    cos = torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()
    out = {"workload": name, "overrides": list(overrides), "tflop_per_step": flops / 1e12, **results,
           "ratio": results["omnispec"]["ms_per_step"] / results["diffusers"]["ms_per_step"],
           **{f"ratio ({label})": r["ms_per_step"] / results["diffusers"]["ms_per_step"]
              for label, r in results.items() if label not in ("diffusers", "omnispec")},
           "latent_cosine": cos, "latent_max_abs_diff": (a.float() - b.float()).abs().max().item()}
    pipe = ref = mods = sides = None  # free the GPU memory before the next workload
    free_device_memory()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="flux,wan")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="omnispec spec override")
    parser.add_argument("--also", action="append", default=[], metavar="OVERRIDE",
                        help="a third side timed in the same rounds: omnispec with this override too (repeatable), "
                             "over its own copy of the denoisers; e.g. --also policies.mlp.fused_gelu=true")
    parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU (checks the script only)")
    args = parser.parse_args()
    if args.smoke:
        enable_smoke()
        ceiling = 1e12
    else:
        ceiling = matmul_ceiling()
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke)"
    print(f"{name}  torch {torch.__version__}  bf16 matmul ceiling {ceiling / 1e12:.0f} TFLOP/s")
    rows = []
    for name in args.workloads.split(","):
        row = measure(name, args.repeats, ceiling, args.overrides, args.also)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            args.json.write_text(json.dumps({"ceiling_tflops": ceiling / 1e12, "rows": rows}, indent=1))
    print("| workload | TFLOP/step | diffusers ms/step (MFU) | omnispec ms/step (MFU) | ratio | latent cosine |")
    for r in rows:
        print(f"| {r['workload']} | {r['tflop_per_step']:.1f} | {r['diffusers']['ms_per_step']:.1f} "
              f"({r['diffusers']['mfu']:.0%}) | {r['omnispec']['ms_per_step']:.1f} ({r['omnispec']['mfu']:.0%}) | "
              f"{r['ratio']:.3f} | {r['latent_cosine']:.5f} |")
        for label in (k for k in r if k.startswith("omnispec + ")):
            print(f"| {r['workload']}, {label[len('omnispec + '):]} | | | {r[label]['ms_per_step']:.1f} "
                  f"({r[label]['mfu']:.0%}) | {r[f'ratio ({label})']:.3f} | |")


if __name__ == "__main__":
    main()
