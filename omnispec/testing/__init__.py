"""Offline tiny fixtures: random checkpoints in diffusers layout with tokenizers trained here."""

from .fixtures import TINY_OVERRIDES, tiny_flux, tiny_sd3, tiny_wan, tiny_wan_i2v
from .tokenizers import clip_tokenizer, t5_tokenizer

__all__ = ["TINY_OVERRIDES", "clip_tokenizer", "t5_tokenizer", "tiny_flux", "tiny_sd3", "tiny_wan", "tiny_wan_i2v"]
