"""Tiny FLUX.3 [klein] checkpoints (``Flux3ModularPipeline``, ``Flux3DistilledModularPipeline``): random weights in
the layout the modular pipeline saves.

A Qwen3-VL text encoder 16 wide and deep enough for the hidden states the blocks stack (layers 4, 8, ..., 32: 128
wide), FLUX.3's transformer with one per-mode and one joint block (a flow map for the distilled checkpoint), FLUX.2's
tiny VAE (scale 2, non-trivial batch-norm statistics) and a Qwen tokenizer trained here. The ``tokenizer`` component
is a ``Qwen3VLProcessor``, which transformers builds only with torchvision: it is saved as its image processor and
tokenizer; ``flux3_processor`` loads it without the video processor (``AutoProcessor`` loads its tokenizer alone
without torchvision, which the family takes too)."""

from __future__ import annotations

import json
from pathlib import Path

from .fixtures import TINY_OVERRIDES, _seeded, flux2_image_modules
from .fixtures_minimax_h3 import minimax_h3_processor
from .vl_encoders import qwen3_vl_encoder

TEXT_DIM, TEXT_LAYERS = 16, 32


def flux3_processor(tokenizer_or_path):
    """The ``tokenizer`` component: a torchvision-free Qwen3-VL processor (the one MiniMax-H3's fixture builds) from a
    tokenizer or a saved folder, with the tokenizer's chat template."""
    processor = minimax_h3_processor(tokenizer_or_path)
    processor.chat_template = processor.tokenizer.chat_template
    return processor


def flux3_components(seed: int = 0, distilled: bool = False) -> dict:
    from diffusers import Flux3Transformer2DModel

    from .tokenizers import QWEN3_CHAT_TEMPLATE, qwen_tokenizer

    tokenizer = qwen_tokenizer(QWEN3_CHAT_TEMPLATE)
    ids = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    _seeded(seed)
    text_encoder = qwen3_vl_encoder(ids, TEXT_DIM, TEXT_LAYERS)
    _, vae, _ = flux2_image_modules(seed, guidance_embeds=False)
    _seeded(seed)
    transformer = Flux3Transformer2DModel(
        in_channels=16, cond_in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=8 * TEXT_DIM, timestep_channels=32, axes_dims_rope=(4, 4, 4, 4),
        flow_map=distilled).eval()
    return dict(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=flux3_processor(tokenizer))


def tiny_flux3(root: str | Path, seed: int = 0, distilled: bool = False) -> Path:
    """The layout the modular pipeline saves (``save_pretrained``): one folder per loaded module and a
    ``modular_model_index.json`` naming the pipeline class (``Flux3DistilledModularPipeline`` for the flow map) and
    each module's class with where it loads from. The processor, which transformers cannot save without its video
    processor, is saved as its image processor and tokenizer, and its entry written as a real one would be."""
    from diffusers.modular_pipelines import Flux3AutoBlocks, Flux3DistilledAutoBlocks

    root = Path(root)
    modules = flux3_components(seed, distilled)
    processor = modules.pop("tokenizer")
    pipe = (Flux3DistilledAutoBlocks if distilled else Flux3AutoBlocks)().init_pipeline()
    pipe.update_components(**modules)
    pipe.save_pretrained(str(root), overwrite_modular_index=True)
    processor.image_processor.save_pretrained(root / "tokenizer")
    processor.tokenizer.save_pretrained(root / "tokenizer")
    index_file = root / "modular_model_index.json"
    index = json.loads(index_file.read_text())
    loads = {"pretrained_model_name_or_path": str(root), "revision": None, "subfolder": "tokenizer",
             "type_hint": ["transformers", "Qwen3VLProcessor"], "variant": None}
    index["tokenizer"] = ["transformers", "Qwen3VLProcessor", loads]
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True))
    return root


# Float32, a 32-pixel square (64 tokens on the tiny VAE), 2 steps; the edit spec keeps the references' size.
TINY_OVERRIDES["flux3_edit"] = ["model.dtype=float32", "recipe.defaults.steps=2", "runtime.progress=false"]
TINY_OVERRIDES["flux3"] = [*TINY_OVERRIDES["flux3_edit"], "recipe.defaults.height=32", "recipe.defaults.width=32"]
