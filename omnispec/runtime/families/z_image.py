"""Z-Image (``ZImagePipeline``; Z-Image-Turbo): a single-stream DiT over image and caption tokens.

Latents stay float32 and unpacked (the transformer patchifies a list of per-sample tensors). Prompts are the Qwen3
encoder's second-to-last hidden states of each prompt's own tokens, a list of different lengths: here zero-padded with
a mask (``ragged``), and cut back to a list per forward. The transformer takes ``1 - sigma`` as its timestep and
predicts the negated velocity. Guidance is CFG in its original formulation (``cond + g (cond - uncond)``, a ``cfg``
term with ``formulation: original``), ``cfg_normalization`` a per-sample norm cap (``renorm: {over: sample,
max_ratio: k}``) and ``cfg_truncation`` a sigma window on the term.
"""

from __future__ import annotations

import torch
from diffusers import ZImagePipeline

from ...spec.request import Request
from ...targets import AttentionTarget, BlocksTarget, GuidanceTarget, ParallelTarget, Targets
from .base import Family
from .latents import PackedLatents, decode_images
from .perturbations import layer_skip
from .types import Conditioning, Decoded, Geometry, Perturbation, Streams

PROMPT_KEYS = frozenset({"cap_feats", "cap_mask"})
BLOCK_HOOKS = "diffusers' block hooks cannot find ZImageTransformerBlock's hidden states (its argument is named x)"


class ZImageFamily(PackedLatents, Family):
    name = "z_image"
    pipeline_class = ZImagePipeline
    # diffusers 0.42 registers ZImageTransformerBlock for its block hooks without the name of its hidden-states
    # argument (``x``), so every hook that reads it fails: first-block cache, MagCache and layer skip.
    targets = Targets(
        attention=AttentionTarget({"joint": ("layers.*.attention",), "image": ("noise_refiner.*.attention",),
                                   "text": ("context_refiner.*.attention",)}),
        blocks=BlocksTarget(("layers", "noise_refiner", "context_refiner")),
        parallel=ParallelTarget(sequence_refusal="ZImageTransformer2DModel has no diffusers context-parallel plan"),
        guidance=GuidanceTarget(skip_layer_refusal=BLOCK_HOOKS),
        cache_limits={kind: BLOCK_HOOKS for kind in ("first_block", "magcache")},
    )
    required = {"text_encoder": "encoder", "tokenizer": "tokenizer", "vae": "vae"}

    def helper_components(self):
        return (*self.required, "scheduler", "transformer")

    def encode(self, prompts: list[str], request: Request) -> Conditioning:
        # A copy: the pipeline writes the chat-templated prompts back into the list it is given.
        embeds, _ = self.helper.encode_prompt(list(prompts), device=self.device, do_classifier_free_guidance=False,
                                              max_sequence_length=request.max_sequence_length or 512)
        longest = max(e.shape[0] for e in embeds)
        padded = torch.stack([torch.nn.functional.pad(e, (0, 0, 0, longest - e.shape[0])) for e in embeds])
        # The mask stays on the host: every forward cuts the captions back to their lengths, and reading them
        # from a device tensor would make the host wait for the GPU at each step.
        mask = torch.stack([torch.arange(longest) < e.shape[0] for e in embeds]).long()
        return Conditioning({"cap_feats": padded, "cap_mask": mask}, ragged=PROMPT_KEYS)

    def latent_dtype(self, denoiser) -> torch.dtype:
        return torch.float32  # ZImagePipeline steps float32 latents and casts only the model input

    def initial_latents(self, geometry: Geometry, generators: list[torch.Generator]) -> Streams:
        helper = self.helper
        return {"latents": helper.prepare_latents(len(generators), helper.transformer.in_channels, geometry.height,
                                                  geometry.width, torch.float32, self.device, generators)}

    def predict(self, denoiser, latents: Streams, timestep, cond, geometry, *, embedded=None,
                perturbation: Perturbation | None = None) -> Streams:
        x = latents["latents"]
        b = x.shape[0]
        lengths = cond.batched["cap_mask"].sum(dim=1).tolist()
        captions = [e[:n] for e, n in zip(cond.batched["cap_feats"], lengths)]
        with layer_skip(denoiser, perturbation, self.targets):
            out = denoiser(list(x.to(denoiser.dtype).unsqueeze(2).unbind(0)), (1000 - timestep.expand(b)) / 1000,
                           captions, return_dict=False)[0]
        return {"latents": -torch.stack([o.float() for o in out]).squeeze(2)}

    def decode(self, latents: Streams, geometry: Geometry) -> Decoded:
        vae = self.helper.vae
        x = latents["latents"].to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        return Decoded(decode_images(self.helper, vae.decode(x, return_dict=False)[0]))
