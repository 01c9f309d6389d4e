"""What a parallel axis does (one object per axis, registered by name in ``spec.policies.PARALLEL_AXES``)."""

from __future__ import annotations

from typing import Any

import torch


class Axis:
    """A degree of ``policies.parallel``: what it refuses before any weight loads, and what it puts on the loaded
    denoisers. The rest of an axis's work (splitting passes, samples or tokens) is in its own file, called by the
    step body and the pipeline where that work happens."""

    def refusal(self, spec: Any, family: Any) -> str | None:
        """Why ``family`` (a family class) cannot run ``spec`` with this axis's degree above 1, or None."""
        return None

    def enable(self, ctx: Any, family: Any, denoisers: dict[str, torch.nn.Module]) -> None:
        """Prepare the loaded denoisers for this axis (nothing for most)."""
