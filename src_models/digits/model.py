"""The embedded default model: a small flow-matching DiT that draws 32x32 handwritten digits from text.

Both modules are diffusers ``ModelMixin``/``ConfigMixin`` so they save and load through the same
``from_pretrained`` path as any checkpoint. The DiT is built from diffusers' own ``Attention`` and
``FeedForward`` blocks so that diffusers' hooks (layer skip, caches, attention backends) apply to it
as they do to the big models.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry
from diffusers.models.attention import FeedForward
from diffusers.models.attention_processor import Attention
from diffusers.loaders import PeftAdapterMixin
from diffusers.models.modeling_utils import ModelMixin
from torch import nn


class DigitsTextEncoder(ModelMixin, ConfigMixin):
    """Word embeddings + a small transformer encoder, pooled over the prompt (BOS included)."""

    @register_to_config
    def __init__(self, vocab_size: int = 64, dim: int = 96, layers: int = 1, heads: int = 4, max_length: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(torch.zeros(1, max_length, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, dim * 2, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + self.pos[:, : input_ids.shape[1]]
        x = self.encoder(x, src_key_padding_mask=attention_mask == 0)
        mask = attention_mask.unsqueeze(-1).to(x.dtype)
        return self.norm((x * mask).sum(1) / mask.sum(1).clamp(min=1.0))


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of ``t`` in [0, 1] (scaled by 1000, as diffusion timesteps are)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = (t.float() * 1000.0)[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class DigitsBlock(nn.Module):
    """Pre-norm DiT block with adaLN-Zero modulation from the pooled condition."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(query_dim=dim, heads=heads, dim_head=dim // heads, bias=True, out_bias=True)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ff = FeedForward(dim, mult=2, activation_fn="gelu-approximate")
        self.modulation = nn.Linear(dim, 6 * dim)
        nn.init.zeros_(self.modulation.weight)
        nn.init.zeros_(self.modulation.bias)

    def forward(self, hidden_states: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.modulation(F.silu(temb))[:, None].chunk(6, dim=-1)
        h = self.norm1(hidden_states) * (1 + scale1) + shift1
        hidden_states = hidden_states + gate1 * self.attn(h)
        h = self.norm2(hidden_states) * (1 + scale2) + shift2
        return hidden_states + gate2 * self.ff(h)


TransformerBlockRegistry.register(DigitsBlock, TransformerBlockMetadata(return_hidden_states_index=0))


class DigitsDiT(ModelMixin, ConfigMixin, PeftAdapterMixin):
    """Predicts the flow velocity ``noise - image`` of a 1x32x32 image at timestep ``t`` (sigma x 1000)."""

    _repeated_blocks = ["DigitsBlock"]
    _supports_gradient_checkpointing = True

    @register_to_config
    def __init__(self, sample_size: int = 32, patch_size: int = 8, in_channels: int = 1, dim: int = 96,
                 depth: int = 5, heads: int = 4, text_dim: int = 96):
        super().__init__()
        self.patch = nn.Conv2d(in_channels, dim, patch_size, stride=patch_size)
        tokens = (sample_size // patch_size) ** 2
        self.pos = nn.Parameter(torch.randn(1, tokens, dim) * 0.02)
        self.time_mlp = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.text_proj = nn.Linear(text_dim, dim)
        self.blocks = nn.ModuleList(DigitsBlock(dim, heads) for _ in range(depth))
        self.norm_out = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mod_out = nn.Linear(dim, 2 * dim)
        self.proj_out = nn.Linear(dim, patch_size * patch_size * in_channels)
        for layer in (self.mod_out, self.proj_out):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)
        self.gradient_checkpointing = False  # diffusers' enable_gradient_checkpointing switches it

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, text_embeds: torch.Tensor,
                return_dict: bool = False) -> tuple[torch.Tensor]:
        b, c, h, w = hidden_states.shape
        p = self.config.patch_size
        x = self.patch(hidden_states).flatten(2).transpose(1, 2) + self.pos
        temb = self.time_mlp(timestep_embedding(timestep / 1000.0, self.config.dim).to(x.dtype))
        temb = temb + self.text_proj(text_embeds.to(x.dtype))
        for block in self.blocks:
            if torch.is_grad_enabled() and self.gradient_checkpointing:
                x = self._gradient_checkpointing_func(block, x, temb)
            else:
                x = block(x, temb)
        shift, scale = self.mod_out(F.silu(temb))[:, None].chunk(2, dim=-1)
        x = self.proj_out(self.norm_out(x) * (1 + scale) + shift)
        x = x.view(b, h // p, w // p, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)
        return (x,)
