"""The family protocol: the only place that knows a model's quirks.

A family encodes prompts, prepares latents (shape, packing), calls its denoiser on a batch of
passes, and decodes. It reuses the diffusers pipeline's own helpers by holding an instance of that
pipeline built from the already-loaded components (construction loads nothing), so prompt
encoding, packing and VAE normalisation equal diffusers' by construction.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from ...spec import PipelineSpec, SkipLayer, SpecError
from ...spec.request import Request


@dataclass
class Conditioning:
    """Encoded prompts: ``batched`` tensors have one row per sample; ``shared`` ones serve every sample."""

    batched: dict[str, torch.Tensor]
    shared: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return next(iter(self.batched.values())).shape[0]

    def rows(self, index: torch.Tensor | slice | Sequence[int]) -> Conditioning:
        return Conditioning({k: v[index] for k, v in self.batched.items()}, self.shared)

    @staticmethod
    def cat(parts: Sequence[Conditioning]) -> Conditioning:
        if len(parts) == 1:
            return parts[0]
        keys = parts[0].batched
        return Conditioning({k: torch.cat([p.batched[k] for p in parts]) for k in keys}, parts[0].shared)


@dataclass
class Geometry:
    """Pixel size of a phase's output and anything a family needs to (un)pack its latents."""

    height: int
    width: int
    frames: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Family:
    """Base class of family adapters; subclasses set ``name`` and ``pipeline_class`` and fill the hooks."""

    name: ClassVar[str]
    pipeline_class: ClassVar[type | None] = None
    # Block lists that policies (offload, compile, cache, layer skip) may address, in forward order.
    block_lists: ClassVar[tuple[str, ...]] = ("transformer_blocks",)
    # Attention roles of this family's denoiser: role -> fnmatch patterns of attention module names.
    attention_roles: ClassVar[Mapping[str, tuple[str, ...]]] = {"self": ("*attn*",)}
    # Which component names the helper pipeline expects, with the role each must have.
    required: ClassVar[Mapping[str, str]] = {}
    supports_modality: ClassVar[bool] = False
    # Whether the denoiser has a diffusers context-parallel plan (``_cp_plan``) for ulysses / ring.
    context_parallel: ClassVar[bool] = False
    # Cache kinds this family's denoiser cannot take, with the reason (checked before loading).
    cache_limits: ClassVar[Mapping[str, str]] = {}

    def __init__(self, spec: PipelineSpec, components: dict[str, Any], device: torch.device):
        self.spec = spec
        self.components = components
        self.device = device
        self.helper = self.make_helper(components) if self.pipeline_class is not None else None

    # ---- checks before any weight loads -------------------------------------------------------------

    @classmethod
    def check_spec(cls, spec: PipelineSpec) -> None:
        comps = spec.model.components
        problems = []
        for name, role in cls.required.items():
            if name not in comps:
                problems.append(f"family {cls.name!r} needs a component named {name!r} (role {role})")
            elif comps[name].role != role:
                problems.append(f"family {cls.name!r} needs {name!r} to have role {role!r}")
        for phase in spec.recipe.phases:
            for term in phase.guidance.terms:
                if term.kind == "modality" and not cls.supports_modality:
                    problems.append(f"family {cls.name!r} has no modalities to isolate (phase {phase.name!r})")
        if problems:
            raise SpecError.single("; ".join(problems), "model.family")

    def make_helper(self, components: dict[str, Any]) -> Any:
        assert self.pipeline_class is not None
        kwargs = {name: components.get(name) for name in self.helper_components()}
        return self.pipeline_class(**kwargs)

    def helper_components(self) -> Sequence[str]:
        return tuple(self.required)

    # ---- the protocol --------------------------------------------------------------------------------

    def encode(self, prompts: list[str], request: Request) -> Conditioning:
        raise NotImplementedError

    def geometry(self, request: Request, size_scale: float) -> Geometry:
        h = int(round(request.height * size_scale)) if request.height else 0
        w = int(round(request.width * size_scale)) if request.width else 0
        return Geometry(h, w, request.frames)

    def initial_latents(self, geometry: Geometry, generators: list[torch.Generator]) -> torch.Tensor:
        """Pure noise in the denoiser's layout, one generator per sample (as diffusers' ``randn_tensor``)."""
        raise NotImplementedError

    def seq_len(self, latents: torch.Tensor, geometry: Geometry) -> int:
        """Image tokens per sample (for a dynamic schedule shift)."""
        raise NotImplementedError

    def predict(
        self,
        denoiser: torch.nn.Module,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        cond: Conditioning,
        geometry: Geometry,
        *,
        embedded: float | None = None,
        skip: SkipLayer | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, latents: torch.Tensor, geometry: Geometry) -> np.ndarray:
        """float32 in [0, 1], channels last: (B, H, W, C) for images, (B, F, H, W, C) for videos."""
        raise NotImplementedError

    # Spatial view of the latents for phase transforms (identity unless the family packs them).
    def unpack(self, latents: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        return latents

    def pack(self, spatial: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        return spatial

    def latent_dtype(self, denoiser: torch.nn.Module) -> torch.dtype:
        return denoiser.dtype

    # ---- shared helpers -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def layer_skip(self, denoiser: torch.nn.Module, skip: SkipLayer | None) -> Iterator[None]:
        """Apply a skip-layer perturbation with diffusers' layer-skip hooks for one forward, then remove it."""
        if skip is None:
            yield
            return
        from diffusers.hooks import LayerSkipConfig
        from diffusers.hooks.layer_skip import _apply_layer_skip_hook

        from ...policies.hooks import remove_hook

        config = LayerSkipConfig(
            indices=list(skip.layers),
            fqn=skip.blocks or self.block_lists[0],
            skip_attention=skip.skip in ("block", "attention"),
            skip_attention_scores=skip.skip == "attention_scores",
            skip_ff=skip.skip in ("block", "ff"),
        )
        hook_name = "omnispec_layer_skip"
        _apply_layer_skip_hook(denoiser, config, name=hook_name)
        try:
            yield
        finally:
            blocks = denoiser.get_submodule(config.fqn)
            for i in config.indices:
                for module in blocks[i].modules():
                    remove_hook(module, hook_name)


def decode_images(helper: Any, decoded: torch.Tensor) -> np.ndarray:
    """VAE output in [-1, 1] (B, C, H, W) -> float32 (B, H, W, C) in [0, 1] via diffusers' postprocess."""
    return helper.image_processor.postprocess(decoded, output_type="np").astype(np.float32)
