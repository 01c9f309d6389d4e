"""Tiny Qwen-Image-2.1 checkpoints (``QwenImage21Pipeline`` layout; the Turbo's adds ``sample_sigmas`` to
``model_index.json`` and a static-shift scheduler, as the real Turbo checkpoint does).

The text encoder is a two-layer Qwen3-VL with its vision tower; one merged vision token covers 32x32 pixels, the
2x2 latent tokens of the 16x VAE the transformer expands each vision slot into. The processor is built in memory
(``qwen21_processor``): transformers builds a ``Qwen3VLProcessor``'s video processor only with torchvision, so the
checkpoint stores its tokenizer and image processor and the tests hand the processor to ``build(components=...)``.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from .tokenizers import QWEN25_CHAT_TEMPLATE, qwen_tokenizer

# The pipeline runs the processor's chat template on its system turn to count the tokens it drops, so the template
# must render a system turn as the pipeline's hand-built prefix: Qwen2.5's layout does (no default system turn
# once one is given).
CHAT_TEMPLATE = QWEN25_CHAT_TEMPLATE
Z_DIM = 8  # not 4: an RGBA reference image with as many channels as the latents would read as latents
# The Turbo checkpoint's model_index.json sample_sigmas (specs/qwen-image-2.1-turbo.yaml), so the bundled spec
# passes the checkpoint checks unchanged.
TURBO_SIGMAS = [1.0, 0.978453, 0.95418, 0.926626, 0.89508, 0.845148, 0.704534, 0.414568]


@functools.cache
def _image_only():
    from transformers import Qwen3VLProcessor

    class Qwen3VLProcessorPil(Qwen3VLProcessor):
        """A ``Qwen3VLProcessor`` without its video processor (transformers builds that only with torchvision):
        the PIL-only variant a spec may name (``omnispec.testing.fixtures_qwen_image21:Qwen3VLProcessorPil``) to
        load a tiny checkpoint's ``processor/`` without torchvision, as the CLI tests do."""

        def check_argument_for_proper_class(self, name, arg):
            return None if arg is None else super().check_argument_for_proper_class(name, arg)

        @classmethod
        def from_pretrained(cls, path, subfolder: str | None = None, **kwargs):
            return qwen21_processor(Path(path) / (subfolder or ""))

    return Qwen3VLProcessorPil


def __getattr__(name: str):
    if name == "Qwen3VLProcessorPil":  # built on first use: importing this module imports no transformers
        return _image_only()
    raise AttributeError(name)


def qwen21_processor(tokenizer_or_path):
    """An image-only ``Qwen3VLProcessor``: a Qwen2-VL image processor at patch 16, merge 2, and a tokenizer (given,
    or loaded with the image processor from a saved ``processor/`` folder)."""
    from transformers import Qwen2Tokenizer, Qwen2VLImageProcessor

    if isinstance(tokenizer_or_path, (str, bytes)) or hasattr(tokenizer_or_path, "__fspath__"):
        images = Qwen2VLImageProcessor.from_pretrained(tokenizer_or_path)
        tokenizer = Qwen2Tokenizer.from_pretrained(tokenizer_or_path)
    else:
        images = Qwen2VLImageProcessor(patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=32 * 32,
                                       max_pixels=128 * 128)
        tokenizer = tokenizer_or_path
    return _image_only()(image_processor=images, tokenizer=tokenizer, video_processor=None,
                         chat_template=CHAT_TEMPLATE)


# In the spec's terms: the processor class the tiny checkpoints load with (overrides, or --set for the CLI).
PIL_PROCESSOR = "model.components.processor.class=omnispec.testing.fixtures_qwen_image21:Qwen3VLProcessorPil"


def qwen_image21_components(seed: int = 0, turbo: bool = False) -> dict:
    """Tiny ``QwenImage21Pipeline`` modules: a Qwen3-VL text encoder, an 8-channel RGBA VAE at scale 16 with
    non-trivial latent mean/std, a 2-block transformer, and the processor."""
    import transformers
    from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Transformer2DModel

    tokenizer = qwen_tokenizer(CHAT_TEMPLATE)
    ids = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
                                           "<|endoftext|>"])
    torch.manual_seed(seed)
    transformer = QwenImage21Transformer2DModel(
        patch_size=1, in_channels=Z_DIM, out_channels=Z_DIM, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, context_in_dim=16, mlp_ratio=2, axes_dims_rope=(4, 6, 6)).eval()
    torch.manual_seed(seed)
    vae = AutoencoderKLQwenImage21(
        base_dim=4, decoder_base_dim=4, z_dim=Z_DIM, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1, attn_scales=[],
        temperal_downsample=[False, True, True, True], latents_mean=[0.1 * (i - 3) for i in range(Z_DIM)],
        latents_std=[0.5 + 0.25 * i for i in range(Z_DIM)]).eval()
    torch.manual_seed(seed)
    text_encoder = transformers.Qwen3VLForConditionalGeneration(transformers.Qwen3VLConfig(
        text_config={"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 512, "bos_token_id": ids[4],
                     "eos_token_id": ids[4],
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [1, 1, 2]}},
        vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16,
                       "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                       "num_position_embeddings": 64, "deepstack_visual_indexes": [0]},
        vision_start_token_id=ids[0], vision_end_token_id=ids[1], image_token_id=ids[2], video_token_id=ids[3])).eval()
    # The real checkpoints' scheduler kinds: dynamic shift for the base model, a static one for the Turbo.
    scheduler = (FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=False, shift=1.0, shift_terminal=None)
                 if turbo else
                 FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                                                 base_image_seq_len=256, max_image_seq_len=8192,
                                                 shift_terminal=0.02, time_shift_type="exponential"))
    return dict(transformer=transformer, vae=vae, text_encoder=text_encoder, scheduler=scheduler,
                processor=qwen21_processor(tokenizer))


def tiny_qwen_image21(root: str | Path, seed: int = 0, turbo: bool = False) -> Path:
    """``QwenImage21Pipeline`` layout (``turbo``: with the Turbo's ``sample_sigmas`` and static-shift scheduler).
    The processor is saved as its image processor and tokenizer; load it with ``qwen21_processor(root /
    "processor")``."""
    from diffusers import QwenImage21Pipeline

    modules = qwen_image21_components(seed, turbo)
    processor = modules["processor"]
    pipe = QwenImage21Pipeline(**modules, sample_sigmas=TURBO_SIGMAS if turbo else None)
    pipe.register_modules(processor=None)  # saved below by hand (no video processor to save)
    pipe.save_pretrained(root)
    processor.image_processor.save_pretrained(Path(root) / "processor")
    processor.tokenizer.save_pretrained(Path(root) / "processor")
    index = Path(root) / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()),
                                 "processor": ["transformers", "Qwen3VLProcessor"]}, indent=2))
    return Path(root)


# The processor loaded without torchvision, float32, 3 steps, 32x64 outputs; output_resolution 64 keeps a condition image at 64x64 pixels' worth of its aspect,
# which the tiny processor does not resize again (its vision slots then match the VAE's latent tokens).
TINY_OVERRIDES_QWEN21 = {
    "qwen_image21": [PIL_PROCESSOR, "model.dtype=float32", "recipe.defaults.height=32", "recipe.defaults.width=64",
                     "recipe.defaults.steps=3", "model.options.output_resolution=64", "runtime.progress=false"],
    "qwen_image21_edit": [PIL_PROCESSOR, "model.dtype=float32", "recipe.defaults.steps=3", "model.options.output_resolution=64",
                          "runtime.progress=false"],
}
