"""What guidance terms that perturb the denoiser need from it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GuidanceTarget:
    """``modalities``: what a ``modality`` term may isolate (switch off the cross-attention into).
    ``skip_layer_refusal``: why ``skip_layer`` terms cannot run on the denoiser, or None when they can (through
    diffusers' layer-skip hooks on the first block list)."""

    modalities: tuple[str, ...] = ()
    skip_layer_refusal: str | None = None
