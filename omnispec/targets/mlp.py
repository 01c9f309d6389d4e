"""``policies.mlp.fused_gelu``'s target beyond the plain feed-forwards it finds itself: parallel blocks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MlpTarget:
    """``parallel_hooks``: the (block, hook) pairs the policy registers for the denoiser's parallel blocks (attention
    and MLP side by side, projected back together), given the denoiser and the fused operators the policy hands over
    (``kernels.gemm_epilogue.MlpOperators``)."""

    parallel_hooks: Callable[[Any, Any], list[tuple[Any, Any]]]
