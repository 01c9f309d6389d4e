"""FLUX.2 [dev] (``Flux2Pipeline``): FLUX.2 [klein]'s latents, reference images, schedule and decode, with two
differences. Prompts are a Mistral3 model's hidden states at layers 10, 20 and 30 after the pipeline's system turn
(klein's ``encode`` calls the helper's ``encode_prompt``, Flux2Pipeline's here); guidance is embedded in the
transformer (a ``guidance`` input per row, 4.0 unless the recipe's ``embedded`` sets it) instead of CFG passes.

Its size (a 32B transformer, a 24B text encoder) is why users run it with ``policies.offload`` and fp8 weights
(``policies.quantization``); both apply to it as to every family (docs/families.md, "FLUX.2 [dev]")."""

from __future__ import annotations

import torch
from diffusers import Flux2Pipeline

from ... import bridge
from .flux2_klein import Flux2KleinFamily
from .types import Geometry

DEFAULT_EMBEDDED_GUIDANCE = 4.0  # Flux2Pipeline.__call__'s guidance_scale default


class Flux2Family(Flux2KleinFamily):
    name = "flux2"
    pipeline_class = Flux2Pipeline

    @classmethod
    def index_problems(cls, spec, index) -> list[tuple[str, str]]:
        """Klein's checkpoints (``Flux2KleinPipeline``) embed no guidance and encode with Qwen3: family flux2_klein
        runs them (the component classes differ too; this says which family to use)."""
        problems = super().index_problems(spec, index)
        if index.get("_class_name") == "Flux2KleinPipeline":
            problems.append(("model.family", "the checkpoint is FLUX.2 [klein]'s (Flux2KleinPipeline in "
                                             "model_index.json): run it with family flux2_klein (spec "
                                             "flux2-klein-4b or flux2-klein-base-4b)"))
        return problems

    def make_helper(self, components):
        denoisers = [n for n, c in self.spec.model.components.items() if c.role == "denoiser"]
        return Flux2Pipeline(scheduler=components.get("scheduler"), vae=components["vae"],
                             text_encoder=components["text_encoder"], tokenizer=components["tokenizer"],
                             transformer=components.get(denoisers[0]))

    def guidance_input(self, denoiser, rows: int, embedded: float | None, device: torch.device
                       ) -> torch.Tensor | None:
        """The embedded guidance, float32 per row, as Flux2Pipeline always passes it (the recipe's ``embedded``,
        else the pipeline's default)."""
        scale = DEFAULT_EMBEDDED_GUIDANCE if embedded is None else embedded
        return torch.full([rows], scale, device=device, dtype=torch.float32)

    def latent_grid(self, x: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        """Flux2Pipeline's scatter takes no grid size (it reads it from the ids): the same grid."""
        return bridge.unpack_latents_with_ids(self.helper, x, geometry.extra["latent_ids"].expand(x.shape[0], -1, -1))
