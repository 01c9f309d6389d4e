"""Krea 2 text-to-image (``Krea2Pipeline``; the Raw checkpoint).

Prompts are a Qwen3-VL text model's hidden states at twelve layers, stacked per token, in a fixed-length template
padded in its middle (a boolean mask marks the real tokens). ``Krea2Pipeline`` hands every forward the whole template
and its mask; here each prompt keeps its valid tokens alone (``text_padding``), and a forward's rows share one count
of them, so no forward has a mask and attention runs on the flash-class kernels. The same outputs: the transformer
masks padded tokens out as keys everywhere and drops the text at its output, its text fusion's per-token blocks and
text refiner have no positions, and every text token's rotary position is 0, so where a token sat changes nothing.
Latents are packed 2x2 patches in the prompt embeddings' dtype; text tokens sit at position 0 and
image tokens at their latent-grid (0, row, column). The transformer takes ``sigma`` as its timestep. CFG is written
``cond + g (cond - uncond)`` (a ``cfg`` term with ``formulation: original``). Decoding is Qwen-Image's VAE with its
latent mean and std.
"""

from __future__ import annotations

import torch
from diffusers import Krea2Pipeline

from ... import bridge
from ...spec.request import Request
from ...targets import AttentionTarget, BlocksTarget, GuidanceTarget, ParallelTarget, Targets
from .base import Family
from .checks import CheckpointMatch
from .latents import PackedLatents, decode_images
from .text_padding import per_length, valid_first
from .types import Conditioning, Decoded, Geometry, Perturbation, Streams

UNREGISTERED = ("diffusers' block hooks do not know Krea2TransformerBlock (it is not in their "
                "TransformerBlockRegistry)")
PROMPT_KEYS = frozenset({"encoder_hidden_states", "encoder_attention_mask"})
# The text encoder's hidden states the released checkpoint stacks (Krea2Pipeline's default taps); a checkpoint that
# names others in its model_index.json is refused, as the helper is built with these.
SELECT_LAYERS = [2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35]


class Krea2Family(PackedLatents, Family):
    name = "krea2"
    pipeline_class = Krea2Pipeline
    targets = Targets(
        attention=AttentionTarget({"joint": ("transformer_blocks.*.attn",), "text": ("text_fusion.*.attn",)}),
        blocks=BlocksTarget(("transformer_blocks",), shared_inputs=("rotary_emb", "time_mod_proj")),
        parallel=ParallelTarget(sequence_refusal="Krea2Transformer2DModel has no diffusers context-parallel plan"),
        guidance=GuidanceTarget(skip_layer_refusal=UNREGISTERED),
        cache_limits={"first_block": UNREGISTERED, "magcache": UNREGISTERED},
    )
    required = {"text_encoder": "encoder", "tokenizer": "tokenizer", "vae": "vae"}
    ragged_passes_apart = True  # Krea2Pipeline's CFG: two forwards; here each at its own prompt's valid tokens
    checkpoints = CheckpointMatch(model_index_values={"patch_size": (None, 2),
                                                      "text_encoder_select_layers": (None, SELECT_LAYERS)})

    @classmethod
    def index_problems(cls, spec, index) -> list[tuple[str, str]]:
        """Besides the settings above: the few-step distilled (TDM) checkpoint, which diffusers runs at a fixed time
        shift whatever the size, is refused rather than run on the Raw model's resolution-aware schedule."""
        problems = super().index_problems(spec, index)
        if index.get("is_distilled"):
            problems.append(("model.source", (
                "the checkpoint is Krea 2's few-step distilled model (is_distilled: true in model_index.json), which "
                "diffusers runs with a fixed time shift (mu 1.15), 8 steps and no CFG; family 'krea2' runs the Raw "
                "checkpoint's recipe")))
        return problems

    def make_helper(self, components):
        denoisers = [n for n, c in self.spec.model.components.items() if c.role == "denoiser"]
        return Krea2Pipeline(scheduler=components.get("scheduler"), vae=components["vae"],
                             text_encoder=components["text_encoder"], tokenizer=components["tokenizer"],
                             transformer=components.get(denoisers[0]), text_encoder_select_layers=SELECT_LAYERS)

    def encode(self, prompts: list[str], request: Request) -> Conditioning:
        embeds, mask = self.helper.encode_prompt(list(prompts), device=self.device,
                                                 max_sequence_length=request.max_sequence_length or 512)
        embeds, mask, counts = valid_first(embeds, mask)
        return Conditioning({"encoder_hidden_states": embeds, "encoder_attention_mask": mask, "prompt_tokens": counts},
                            ragged=PROMPT_KEYS)

    def latent_dtype(self, denoiser) -> torch.dtype:
        return self.helper.text_encoder.dtype  # Krea2Pipeline draws and steps latents in the prompt's dtype

    def initial_latents(self, geometry: Geometry, generators: list[torch.Generator]) -> Streams:
        helper = self.helper
        channels = helper.transformer.config.in_channels // helper.patch_size**2
        return {"latents": helper.prepare_latents(len(generators), channels, geometry.height, geometry.width,
                                                  self.latent_dtype(None), self.device, generators)}

    def noise(self, latents: Streams, geometry: Geometry, generators: list[torch.Generator]) -> Streams:
        return self.initial_latents(geometry, generators)  # drawn unpacked, then packed

    def pack(self, stream: str, spatial: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        b, c, h, w = spatial.shape
        return bridge.pack_latents(self.helper, spatial, b, c, h, w)

    def unpack(self, stream: str, latents: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        return bridge.unpack_latents(self.helper, latents, geometry.height, geometry.width).squeeze(2)

    def _position_ids(self, text_tokens: int, geometry: Geometry) -> torch.Tensor:
        """The pipeline's rotary coordinates for this many text tokens and the walk's grid, built once per length."""
        key = ("krea2_position_ids", text_tokens)
        if key not in geometry.extra:
            h, w = self._latent_hw(geometry)
            geometry.extra[key] = self.helper.prepare_position_ids(text_tokens, h // 2, w // 2, self.device)
        return geometry.extra[key]

    def predict(self, denoiser, latents: Streams, timestep, cond, geometry, *, embedded=None,
                perturbation: Perturbation | None = None) -> Streams:
        """One forward per count of valid prompt tokens among the rows, each with its prompts cut to that count and
        no mask (the module docstring says why the outputs are the same)."""
        x = latents["latents"].to(self.latent_dtype(denoiser))
        embeds = cond.batched["encoder_hidden_states"]

        def forward(index: torch.Tensor | None, tokens: int) -> torch.Tensor:
            rows_x, rows_embeds = (x, embeds) if index is None else (x[index], embeds[index])
            return denoiser(hidden_states=rows_x, encoder_hidden_states=rows_embeds[:, :tokens],
                            timestep=(timestep / 1000).expand(rows_x.shape[0]).to(x.dtype),
                            position_ids=self._position_ids(tokens, geometry), encoder_attention_mask=None,
                            attention_kwargs={}, return_dict=False)[0]

        return {"latents": per_length(cond.batched["prompt_tokens"].tolist(), forward, x.device)}

    def decode(self, latents: Streams, geometry: Geometry) -> Decoded:
        helper, vae = self.helper, self.helper.vae
        x = bridge.unpack_latents(helper, latents["latents"], geometry.height, geometry.width).to(vae.dtype)
        z = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(x)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(x)
        image = vae.decode(x / inv_std + mean, return_dict=False)[0][:, :, 0]
        return Decoded(decode_images(helper, image))
