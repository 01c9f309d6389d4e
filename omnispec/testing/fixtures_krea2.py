"""Tiny Krea 2 checkpoint (``Krea2Pipeline``): a Qwen3-VL text model whose hidden states are tapped at twelve layers,
a single-stream transformer with a text-fusion stage, and a Qwen-Image VAE at scale 16 with non-trivial latent
statistics. The scheduler config is the real checkpoint's (dynamic exponential shift to 6400 tokens)."""

from __future__ import annotations

from pathlib import Path

from .fixtures import TINY_OVERRIDES, _seeded

# The real checkpoint's scheduler: Krea2Pipeline's docstring gives the shift parameters.
KREA2_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=6400, max_shift=1.15, shift=1.0,
                       time_shift_type="exponential", use_dynamic_shifting=True)
# Krea2Pipeline's default taps (hidden states 2, 5, ..., 35 of Qwen3-VL-4B's 36 layers): the tiny text model has as
# many layers, so the real checkpoint's setting runs unchanged.
TEXT_LAYERS = 36
SELECT_LAYERS = 12


def krea2_components(seed: int = 0) -> dict:
    """Tiny ``Krea2Pipeline`` modules."""
    import transformers
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, Krea2Transformer2DModel

    from .tokenizers import qwen_tokenizer

    tokenizer = qwen_tokenizer()
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    _seeded(seed)
    transformer = Krea2Transformer2DModel(
        in_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=32, timestep_embed_dim=16, text_hidden_dim=16, num_text_layers=SELECT_LAYERS,
        text_num_attention_heads=2, text_num_key_value_heads=2, text_intermediate_size=32,
        num_layerwise_text_blocks=1, num_refiner_text_blocks=1, axes_dims_rope=(4, 6, 6)).eval()
    with_values(transformer, seed)
    _seeded(seed)
    vae = AutoencoderKLQwenImage(base_dim=2, z_dim=4, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1,
                                 temperal_downsample=[False, False, True, True], latents_mean=[0.1, -0.2, 0.3, 0.0],
                                 latents_std=[1.5, 2.0, 0.5, 1.0]).eval()
    _seeded(seed)
    text_encoder = transformers.Qwen3VLModel(transformers.Qwen3VLConfig(
        text_config={"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": TEXT_LAYERS,
                     "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 512,
                     "max_position_embeddings": 512,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0, "mrope_section": [2, 1, 1],
                                         "mrope_interleaved": True},
                     "pad_token_id": pad},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16,
                       "patch_size": 4, "num_position_embeddings": 16, "deepstack_visual_indexes": [0]},
        pad_token_id=pad)).eval()
    return dict(scheduler=FlowMatchEulerDiscreteScheduler(**KREA2_SCHEDULER), vae=vae, text_encoder=text_encoder,
                tokenizer=tokenizer, transformer=transformer)


def with_values(transformer, seed: int) -> None:
    """The model zero-initialises its norm weights and modulation tables (trained values replace them): give them
    small random values, so every path changes the output."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in transformer.named_parameters():
            if name.endswith(("scale_shift_table", "norm.weight", "norm1.weight", "norm2.weight")) or ".norm_" in name:
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))


def tiny_krea2(root: str | Path, seed: int = 0) -> Path:
    from diffusers import Krea2Pipeline

    Krea2Pipeline(**krea2_components(seed)).save_pretrained(root)
    return Path(root)


TINY_OVERRIDES["krea2"] = ["model.dtype=float32", "recipe.defaults.height=32", "recipe.defaults.width=64",
                           "recipe.defaults.steps=3", "recipe.defaults.max_sequence_length=16",
                           "runtime.progress=false"]
