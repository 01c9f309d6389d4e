"""Tiny LTX-2.5 checkpoints: LTX-2.3's tiny modules (``ltx2_fixtures``) with a Gemma-4 text encoder, LTX-2.5's
48 kHz vocoder and the diffusion video decoder, in the ``LTX2Pipeline`` layout the Hub checkpoint has plus the
``diffusion_decoder/`` folder its modular pipeline decodes with."""

from __future__ import annotations

import json
from pathlib import Path

from .fixtures import TINY_OVERRIDES, _seeded
from .ltx2_fixtures import ltx2_components


def _gemma4(vocab_size: int, pad_token_id: int):
    """A text-only Gemma-4 (``gemma4_unified``, the model type diffusers reads LTX-2.5's image CRF from), 2 layers
    of width 32 as the LTX-2 fixture's Gemma 3, so the connectors take the same 3 stacked hidden states."""
    import transformers

    config = transformers.Gemma4UnifiedConfig(
        text_config={"vocab_size": vocab_size, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
                     "max_position_embeddings": 256, "sliding_window": 64, "pad_token_id": pad_token_id,
                     "layer_types": ["sliding_attention", "full_attention"]},
        vision_config=None, audio_config=None)
    return transformers.Gemma4UnifiedForConditionalGeneration(config).eval()


def diffusion_decoder(seed: int = 0):
    """A diffusion video decoder on the tiny VAE's latent space (4 channels, 2x in space and time): one
    deterministic stage upsampling 2x2x2, then one diffusion block, both with 3x3x3 neighbourhoods."""
    from diffusers import LTX2VideoDiffusionDecoderModel

    _seeded(seed)
    return LTX2VideoDiffusionDecoderModel(
        out_channels=3, latent_channels=4, patch_size=1, decoder_head_dim=8, decoder_stage_channels=(16, 8),
        decoder_stage_depths=(1, 1), decoder_stage_kernels=((3, 3, 3),), decoder_upsample_strides=((2, 2, 2),),
        decoder_upsample_channel_reductions=(2,), decoder_stage5_kernel=(3, 3, 3), decoder_t_emb_dim=16,
        spatial_compression_ratio=2, temporal_compression_ratio=2,
    ).eval()


def ltx25_components(seed: int = 0) -> dict:
    """The tiny LTX-2.5 modules, in memory: ``LTX2Pipeline``'s (LTX-2.3's transformer and connectors, the 48 kHz
    vocoder, the Gemma-4 encoder) and ``diffusion_decoder``."""
    components = ltx2_components(seed, "2.3", bwe=True)
    tokenizer = components["tokenizer"]
    _seeded(seed)
    components["text_encoder"] = _gemma4(len(tokenizer), tokenizer.pad_token_id)
    components["diffusion_decoder"] = diffusion_decoder(seed)
    return components


def tiny_ltx25(root: str | Path, seed: int = 0) -> Path:
    """``LTX2Pipeline``'s layout with ``diffusion_decoder/`` beside it, listed in ``model_index.json`` as the Hub
    checkpoint lists it."""
    from diffusers.pipelines.ltx2 import LTX2Pipeline

    components = ltx25_components(seed)
    decoder = components.pop("diffusion_decoder")
    LTX2Pipeline(**components).save_pretrained(root)
    decoder.save_pretrained(Path(root) / "diffusion_decoder")
    index_file = Path(root) / "model_index.json"
    index = json.loads(index_file.read_text())
    index["diffusion_decoder"] = ["diffusers", type(decoder).__name__]
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True))
    return Path(root)


# LTX-2's tiny sizes (32x32, 5 frames at 25 fps, 3 steps: the modular blocks' video processor rounds an image to
# 32 pixels, the real VAE's scale); the tiny transformer's STG block is 1.
TINY_OVERRIDES["ltx25"] = [*TINY_OVERRIDES["ltx2"], "recipe.phases.0.guidance.terms.1.layers=[1]"]
