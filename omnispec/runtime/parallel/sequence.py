"""Sequence parallel (ulysses, ring): each forward's sequence is split over ``ring x ulysses`` ranks through
diffusers' context parallelism (the models' context-parallel plans); every rank of a sequence group runs the same
passes. One object serves both axes: diffusers takes the two degrees in one config."""

from __future__ import annotations

from typing import Any

import torch

from ... import bridge
from ...kernels.torch_internals import _scaled_dot_product_flash_attention_for_cpu
from ...spec import PipelineSpec, SpecError
from ...spec.policies import PERTURBABLE_BACKENDS
from ...targets import Targets
from .base import Axis
from .context import ParallelContext


class SequenceAxis(Axis):
    def refusal(self, spec: PipelineSpec, targets: Targets) -> str | None:
        if (why := targets.parallel.sequence_refusal) is not None:
            return targets.refused("ulysses/ring", why)
        attention = spec.policies.attention
        for backend in (attention.default, *attention.per_role.values()):
            if backend not in PERTURBABLE_BACKENDS:
                return f"attention backend {backend!r} cannot run under sequence parallelism"
        return None

    def enable(self, ctx: ParallelContext, targets: Targets, denoisers: dict[str, torch.nn.Module]) -> None:
        if ctx.sp_mesh is not None:
            enable_sequence_parallel(ctx, denoisers)


SEQUENCE = SequenceAxis()


def enable_sequence_parallel(ctx: ParallelContext, denoisers: dict[str, torch.nn.Module]) -> None:
    """Ulysses / ring through diffusers' context parallelism (the models' context-parallel plans)."""
    from diffusers import ContextParallelConfig

    config = ContextParallelConfig(ring_degree=ctx.ring, ulysses_degree=ctx.ulysses, mesh=ctx.sp_mesh)
    for name, module in denoisers.items():
        heads = getattr(module.config, "num_attention_heads", None)
        if heads is not None and heads % ctx.ulysses:
            raise SpecError.single(f"{name} has {heads} attention heads, not divisible by ulysses {ctx.ulysses}",
                                   "policies.parallel.ulysses")
        if ctx.ring > 1:
            module.set_attention_backend(bridge.NATIVE_FLASH_BACKEND)  # ring needs a kernel that returns the log-sum-exp
            if next(module.parameters()).device.type == "cpu":
                _install_cpu_flash_kernel()
        if torch.accelerator.device_count() == 0:
            # diffusers picks a device as rank % accelerator count; on a CPU-only host that count is 0.
            import unittest.mock

            with unittest.mock.patch.object(torch.accelerator, "device_count", lambda: 1):
                module.enable_parallelism(config=config)
        else:
            module.enable_parallelism(config=config)


_CPU_FLASH: Any = None


def _install_cpu_flash_kernel() -> None:
    """Give ``aten::_scaled_dot_product_flash_attention`` a CPU kernel, so diffusers' ring attention (whose
    ``_native_flash`` backend calls that op for the log-sum-exp it merges ring steps with) runs on gloo/CPU.

    torch has the CPU flash kernel under another name (``..._for_cpu``, returning output and log-sum-exp);
    this registers it under the CUDA op's name through ``torch.library``, adding a kernel where none exists
    and touching no other device's. Forward only: the CPU path is for tests and debugging, not training.
    """
    global _CPU_FLASH
    if _CPU_FLASH is not None:
        return

    def flash_cpu(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float = 0.0,
                  is_causal: bool = False, return_debug_mask: bool = False, *, scale: float | None = None):
        out, lse = _scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal, scale=scale)
        unused = query.new_empty(0, dtype=torch.int64)  # cumulative lengths / philox state: varlen and dropout only
        # the CPU kernel's log-sum-exp is a (batch, heads, tokens) view of a token-major tensor; the CUDA op's (which
        # the compiler's meta kernel describes) is contiguous
        return out, lse.contiguous(), unused, unused, query.shape[2], key.shape[2], unused, unused, query.new_empty(0)

    library = torch.library.Library("aten", "IMPL")
    library.impl("_scaled_dot_product_flash_attention", flash_cpu, "CPU")
    _CPU_FLASH = library  # the registration lives as long as this object


def check_sequence(ctx: ParallelContext | None, tokens: int, what: str) -> None:
    """Sequence parallel splits tokens evenly over ring x ulysses ranks: refuse lengths that don't divide."""
    if ctx is not None and ctx.sequence > 1 and tokens % ctx.sequence:
        raise SpecError.single(f"{what} of {tokens} tokens does not split over {ctx.sequence} sequence-parallel "
                               "ranks; choose a size or max_sequence_length that divides", "request")
