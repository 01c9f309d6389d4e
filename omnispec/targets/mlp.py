"""``policies.mlp.fused_gelu``'s target: a family whose feed-forwards are tanh-GELU declares one (the policy finds those
projections itself), with the hooks of its parallel blocks where it has them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MlpTarget:
    """Declared: the denoiser's feed-forwards are tanh-GELU, which ``fused_gelu`` fuses (a preset turns it on only
    where this is declared). ``parallel_hooks``: the (block, hook) pairs the policy registers for the denoiser's
    parallel blocks (attention and MLP side by side, projected back together), given the denoiser and the fused
    operators the policy hands over (``kernels.gemm_epilogue.MlpOperators``); None: no parallel blocks."""

    parallel_hooks: Callable[[Any, Any], list[tuple[Any, Any]]] | None = None
