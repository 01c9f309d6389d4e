"""The feed-forward layers' fused matmuls (``policies.mlp.fused_gelu`` puts them in place).

cuBLASLt applies a bias and the tanh GELU in the matmul's epilogue, before the product leaves the chip, and a
projection of a concatenation is the sum of two matmuls over the weight's halves (the second accumulating into the
first's output), so neither needs a pass of its own after the matmul (measured: BENCHMARKS.md, "Fused GELU: cuBLASLt
epilogues").

Both are operators the compiler keeps whole (``torch.library.custom_op``): inductor would otherwise split the
epilogue back into a matmul and a pointwise GELU, and a replay with gradients must run the kernels its rollout ran.
Numerics: the GELU of the float32 product, rounded once, where the model rounds the product to bfloat16 first; the
second half of a split projection adds to the first half's rounded sum. Outputs differ from the model's by about one
bfloat16 step. Elsewhere than CUDA (cuBLASLt's epilogue is CUDA's; on the CPU the epilogue takes the exact GELU) the
operators run the model's own operations. The backwards are the model's formulas, written out.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

from .torch_internals import _addmm_activation


def plain_linear(module: Any, like: torch.Tensor) -> bool:
    """Whether ``module`` is a ``torch.nn.Linear`` whose weights are plain tensors of ``like``'s device and dtype:
    what the fused operators take (a LoRA layer, quantized or sharded weights, weights still offloaded are not)."""
    return type(module) is torch.nn.Linear and plain_weights(module, like)


def plain_weights(module: Any, like: torch.Tensor) -> bool:
    """Whether a linear ``module``'s weight and bias are plain tensors of ``like``'s device and dtype."""
    tensors = [module.weight] + ([module.bias] if module.bias is not None else [])
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.device == like.device and t.dtype == like.dtype
               for t in tensors)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _epilogue_runs(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return x.is_cuda and bias is not None and x.dtype in (torch.bfloat16, torch.float16, torch.float32)


@torch.library.custom_op("omnispec::linear_gelu", mutates_args=())
def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``gelu(linear(x, weight, bias), approximate="tanh")``, the bias and GELU in the matmul's epilogue on CUDA."""
    if _epilogue_runs(x, bias):
        out = _addmm_activation(bias, _rows(x), weight.t(), use_gelu=True)
        return out.view(*x.shape[:-1], weight.shape[0])
    return F.gelu(F.linear(x, weight, bias), approximate="tanh")


@linear_gelu.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _linear_gelu_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _linear_gelu_backward(ctx, grad):
    """The product recomputed (rounded, as the model keeps it), then GELU's and the linear's gradients."""
    x, weight, bias = ctx.saved_tensors
    grad_pre = torch.ops.aten.gelu_backward(grad, F.linear(x, weight, bias), approximate="tanh")
    return _linear_backward(ctx, _rows(grad_pre), x, weight, bias)


def _linear_backward(ctx, grad_rows, x, weight, bias):
    needs = ctx.needs_input_grad
    grad_x = (grad_rows @ weight).view(x.shape) if needs[0] else None
    grad_weight = grad_rows.t() @ _rows(x) if needs[1] else None
    grad_bias = grad_rows.sum(0) if bias is not None and needs[2] else None
    return grad_x, grad_weight, grad_bias


linear_gelu.register_autograd(_linear_gelu_backward, setup_context=_linear_gelu_context)


@torch.library.custom_op("omnispec::linear_of_pair", mutates_args=())
def linear_of_pair(first: torch.Tensor, second: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """``linear(cat([first, second], -1), weight, bias)``; on CUDA two matmuls over the weight's column halves (views,
    no copy), the second accumulating into the first's output, with no concatenation."""
    if not _epilogue_runs(first, bias):
        return F.linear(torch.cat([first, second], dim=-1), weight, bias)
    return by_halves(first, second, weight, bias)


def by_halves(first: torch.Tensor, second: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``linear_of_pair``'s CUDA arithmetic (any device): the bias and ``first``'s half in one matmul, ``second``'s
    half added to it by a second."""
    split = first.shape[-1]
    out = torch.addmm(bias, _rows(first), weight[:, :split].t())
    return out.addmm_(_rows(second), weight[:, split:].t()).view(*first.shape[:-1], weight.shape[0])


@linear_of_pair.register_fake
def _(first, second, weight, bias):
    return first.new_empty(*first.shape[:-1], weight.shape[0])


def _linear_of_pair_context(ctx, inputs, output):
    first, second, weight, bias = inputs
    ctx.save_for_backward(first, second, weight)
    ctx.has_bias = bias is not None


def _linear_of_pair_backward(ctx, grad):
    first, second, weight = ctx.saved_tensors
    needs, split, rows = ctx.needs_input_grad, first.shape[-1], _rows(grad)
    grad_first = (rows @ weight[:, :split]).view(first.shape) if needs[0] else None
    grad_second = (rows @ weight[:, split:]).view(second.shape) if needs[1] else None
    grad_weight = torch.cat([rows.t() @ _rows(first), rows.t() @ _rows(second)], dim=1) if needs[2] else None
    grad_bias = rows.sum(0) if ctx.has_bias and needs[3] else None
    return grad_first, grad_second, grad_weight, grad_bias


linear_of_pair.register_autograd(_linear_of_pair_backward, setup_context=_linear_of_pair_context)


@register_flop_formula(torch.ops.omnispec.linear_gelu)
def _linear_gelu_flops(x_shape, weight_shape, bias_shape, out_shape=None, **_) -> int:
    """The matmul's (torch's counter would see none: the operator's kernels run inside it, out of its sight)."""
    return 2 * math.prod(x_shape) * weight_shape[0]


@register_flop_formula(torch.ops.omnispec.linear_of_pair)
def _linear_of_pair_flops(first_shape, second_shape, weight_shape, bias_shape, out_shape=None, **_) -> int:
    return 2 * math.prod(out_shape[:-1]) * (first_shape[-1] + second_shape[-1]) * weight_shape[0]


@dataclass(frozen=True)
class MlpOperators:
    """What a family's ``MlpTarget.parallel_hooks`` builds on: the fused operators and the test of a linear they
    take."""

    linear_gelu: Callable[..., torch.Tensor]
    linear_of_pair: Callable[..., torch.Tensor]
    takes: Callable[[Any, torch.Tensor], bool]


OPERATORS = MlpOperators(linear_gelu, linear_of_pair, plain_linear)
