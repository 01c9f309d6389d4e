"""Tiny MiniMax-H3 checkpoint (``MiniMaxH3ModularPipeline``): random weights in the real repository's layout.

Sizes are the smallest that keep every code path of the t2va workflow alive: a Qwen3-VL conditioner deep enough
to have the hidden state MiniMax-H3 reads (``hidden_states[50]``), the video VAE at its real spatial (16) and
temporal chunking (17 frames to 5 latents) with 4 channels, and a mono audio VAE whose hop gives the model's 40
latents a second at a 320 Hz sample rate."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .fixtures import TINY_OVERRIDES
from .vl_encoders import qwen3_vl_encoder

# The stereo audio and video schedules' shifts of the released scheduler configs (video 12, audio 3).
VIDEO_SHIFT, AUDIO_SHIFT = 12.0, 3.0
LATENT_CHANNELS, AUDIO_CHANNELS, TEXT_DIM = 4, 4, 16


def _seeded(seed: int) -> None:
    torch.manual_seed(seed)


def _processor_class():
    from transformers import Qwen3VLProcessor

    class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
        """A ``Qwen3VLProcessor`` without the video processor that transformers builds only with torchvision."""

        def check_argument_for_proper_class(self, name, arg):
            if arg is None or isinstance(arg, FrameVideoProcessor):
                return None
            return super().check_argument_for_proper_class(name, arg)

    return ImageOnlyQwen3VLProcessor


class FrameVideoProcessor:
    """Qwen3-VL's video processing without torchvision (what a ref2va video reference's sampled frames go through in
    the tiny fixture): each frame resized (PIL bicubic) to multiples of 28 within a small pixel budget, normalised,
    frames in pairs (the last repeated), and patches laid out as ``Qwen3VLVideoProcessor`` lays them out."""

    patch_size, temporal_patch_size, merge_size, max_pixels = 14, 2, 2, 56 * 56

    def __call__(self, videos, do_sample_frames: bool = False, return_tensors: str = "pt", **_: object) -> dict:
        import numpy as np
        from PIL import Image

        pixels, grids = [], []
        p, tp, m = self.patch_size, self.temporal_patch_size, self.merge_size
        for video in videos:
            frames = np.asarray(video)
            height, width = frames.shape[1:3]
            scale = min(1.0, (self.max_pixels / (height * width)) ** 0.5)
            h, w = (max(p * m, round(n * scale / (p * m)) * p * m) for n in (height, width))
            resized = np.stack([np.asarray(Image.fromarray(f).resize((w, h), Image.Resampling.BICUBIC)) for f in frames])
            x = (torch.from_numpy(resized).float().permute(0, 3, 1, 2) / 255.0 - 0.5) / 0.5
            if pad := -x.shape[0] % tp:
                x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
            gt, gh, gw = x.shape[0] // tp, h // p, w // p
            x = x.reshape(gt, tp, 3, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
            pixels.append(x.reshape(gt * gh * gw, 3 * tp * p * p))
            grids.append([gt, gh, gw])
        return {"pixel_values_videos": torch.cat(pixels), "video_grid_thw": torch.tensor(grids)}


class ImageOnlyQwen3VLProcessorLoader:
    """Loads a saved ``processor/`` folder as ``minimax_h3_processor`` builds it: what a spec names as the
    processor's class to run MiniMax-H3's text workflows without torchvision (``--set
    model.components.processor.class=omnispec.testing.fixtures_minimax_h3:ImageOnlyQwen3VLProcessorLoader``)."""

    @classmethod
    def from_pretrained(cls, path, subfolder: str | None = None, **_: object):
        return minimax_h3_processor(Path(path) / (subfolder or ""))


def minimax_h3_processor(tokenizer_or_path):
    """A ``Qwen3VLProcessor`` from a tokenizer (or a saved ``processor/`` folder), without the video processor that
    transformers builds only with torchvision; MiniMax-H3's text workflows read only its token-type ids."""
    from .tokenizers import qwen_vl_parts

    images, tokenizer = qwen_vl_parts(tokenizer_or_path)
    return _processor_class()(image_processor=images, tokenizer=tokenizer, video_processor=FrameVideoProcessor())


def minimax_h3_components(seed: int = 0) -> dict:
    """Tiny modules of ``MiniMaxH3ModularPipeline``'s workflows (``transformer_ref``: ref2va's partition)."""
    from diffusers import (
        AutoencoderKLMiniMaxH3,
        AutoencoderKLMiniMaxH3Audio,
        MiniMaxH3Scheduler,
        MiniMaxH3Transformer3DModel,
    )

    from .tokenizers import qwen_tokenizer

    tokenizer = qwen_tokenizer()
    ids = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
                                           "<|endoftext|>"])
    _seeded(seed)
    transformer = MiniMaxH3Transformer3DModel(
        num_attention_heads=2, attention_head_dim=16, hidden_size=32, num_layers=2, num_refiner_layers=1, ffn_dim=32,
        in_channels=LATENT_CHANNELS, audio_in_channels=AUDIO_CHANNELS, text_dim=TEXT_DIM, freq_dim=16,
        time_embed_hidden_dim=32, time_embed_dim=16, rope_freq_dim=2).eval()
    _seeded(seed + 1)  # the ref2va partition: the same architecture, other weights
    transformer_ref = MiniMaxH3Transformer3DModel.from_config(transformer.config).eval()
    _seeded(seed)
    vae = AutoencoderKLMiniMaxH3(
        latent_channels=LATENT_CHANNELS, block_out_channels=(8, 8, 8, 8, 8, 8), layers_per_block=1, norm_num_groups=4,
        decoder_num_layers=1, decoder_num_attention_heads=1, decoder_attention_head_dim=16,
        decoder_num_register_tokens=1, decoder_ffn_mult=1, latents_mean=(0.1, -0.2, 0.3, 0.0),
        latents_std=(1.5, 2.0, 0.5, 1.0)).eval()
    _seeded(seed)
    audio_vae = AutoencoderKLMiniMaxH3Audio(
        encoder_dim=4, encoder_rates=(2, 4), latent_dim=8, latent_channels=AUDIO_CHANNELS, num_attention_heads=1,
        decoder_dim=8, decoder_rates=(4, 2), decoder_kernel_sizes=(8, 4), resblock_kernel_sizes=(3,),
        resblock_dilation_sizes=((1,),), sampling_rate=320, latents_mean=[0.2, 0.0, -0.1, 0.0],
        latents_std=[1.0, 0.5, 2.0, 1.0]).eval()
    _seeded(seed)
    text_encoder = qwen3_vl_encoder(ids, TEXT_DIM, 51)
    return dict(transformer=transformer, transformer_ref=transformer_ref, vae=vae, audio_vae=audio_vae, text_encoder=text_encoder, tokenizer=tokenizer,
                processor=minimax_h3_processor(tokenizer), scheduler=MiniMaxH3Scheduler(shift=VIDEO_SHIFT),
                audio_scheduler=MiniMaxH3Scheduler(shift=AUDIO_SHIFT))


def tiny_minimax_h3(root: str | Path, seed: int = 0) -> Path:
    """The released repository's layout: one folder per module and a ``model_index.json`` naming
    ``MiniMaxH3ModularPipeline`` and each module's class. The processor is saved as its image processor and
    tokenizer (load it with ``minimax_h3_processor(root / "processor")``: transformers loads a ``Qwen3VLProcessor``
    only with torchvision installed)."""
    root = Path(root)
    modules = minimax_h3_components(seed)
    processor = modules.pop("processor")
    index: dict = {"_class_name": "MiniMaxH3ModularPipeline", "_diffusers_version": "0.42.1"}
    for name, module in modules.items():
        module.save_pretrained(root / name)
        library = "transformers" if type(module).__module__.startswith("transformers") else "diffusers"
        index[name] = [library, type(module).__name__]
    processor.image_processor.save_pretrained(root / "processor")
    processor.tokenizer.save_pretrained(root / "processor")
    index["processor"] = ["transformers", "Qwen3VLProcessor"]
    (root / "model_index.json").write_text(json.dumps(index, indent=2))
    return root


# Float32, a 32-pixel square (one token per latent frame), the shortest clip (124 frames: 5.17 s at 24 fps), 3 steps.
TINY_OVERRIDES["minimax_h3"] = ["model.dtype=float32", "recipe.defaults.height=32", "recipe.defaults.width=32",
                                "recipe.defaults.steps=3", "runtime.progress=false"]
# ref2va: references on 32-pixel canvases too (an image at a 32-pixel short edge, a video on the 32x32 canvas).
REF2VA_CONFIGS = {"canvas_short_edge": 32, "canvas_max_pixels": 32 * 32, "reference_image_short_edge": 32}
TINY_OVERRIDES["minimax_h3_ref2va"] = [*TINY_OVERRIDES["minimax_h3"], "model.options={canvas_short_edge: 32, "
                                       "canvas_max_pixels: 1024, reference_image_short_edge: 32}"]
