"""What a parallel axis does (one object per axis, registered by name in ``spec.policies.PARALLEL_AXES``)."""

from __future__ import annotations

import torch

from ...spec import PipelineSpec
from ...targets import Targets
from .context import ParallelContext


class Axis:
    """A degree of ``policies.parallel``: what it refuses before any weight loads, and what it puts on the loaded
    denoisers. The rest of an axis's work (splitting passes, samples or tokens) is in its own file, called by the
    step body and the pipeline where that work happens."""

    def refusal(self, spec: PipelineSpec, targets: Targets) -> str | None:
        """Why a family with these targets cannot run ``spec`` with this axis's degree above 1, or None."""
        return None

    def distribute(self, ctx: ParallelContext, spec: PipelineSpec, targets: Targets,
                   modules: dict[str, torch.nn.Module], device: torch.device) -> None:
        """Split or wrap the loaded components before the policies place and compile them (the weight axes:
        tensor, shard; vae_patch's decode). Nothing for most."""

    def enable(self, ctx: ParallelContext, targets: Targets, denoisers: dict[str, torch.nn.Module]) -> None:
        """Prepare the loaded denoisers for this axis once the policies are applied (nothing for most)."""
