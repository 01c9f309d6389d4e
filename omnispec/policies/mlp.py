"""The feed-forward layers' kernels (``policies.mlp``).

``fused_gelu``: compiled, a FLUX.1-dev 1024² step spends about 5.6 ms of its 131 on passes inductor writes after the
matmuls: each single block's ``cat(attention, gelu(proj_mlp(x)))`` and each feed-forward's GELU, memory-bound
kernels at 2.5-2.8 TB/s (BENCHMARKS.md, 2026-12-03). cuBLASLt applies a bias and the tanh GELU in the matmul's
epilogue, before the product leaves the chip (``torch._addmm_activation``), and a projection of a concatenation is
the sum of two matmuls over the weight's halves (the second accumulating into the first's output), so neither needs
a pass: 1,159 µs against inductor's 1,231 for a single block's MLP at 1024² on an H200, 918 against 965 for a
double block's feed-forward (the matmuls alone: 1,135 and 890); a compiled step under CUDA graphs, 126.0 ms against
130.5 (BENCHMARKS.md, 2026-12-04).

Both are operators the compiler keeps whole (``torch.library.custom_op``): inductor would otherwise split the
epilogue back into a matmul and a pointwise GELU, and a replay with gradients must run the kernels its rollout ran.
Numerics: the GELU of the float32 product, rounded once, where the model rounds the product to bfloat16 first; the
second half of a split projection adds to the first half's rounded sum. Outputs differ from the model's by about one
bfloat16 step (cosine 0.99999 at FLUX's shapes). Elsewhere than CUDA (cuBLASLt's epilogue is CUDA's; on the CPU
``_addmm_activation`` takes the exact GELU) the operators run the model's own operations. The backwards are the
model's formulas, written out.

Which modules: every diffusers ``GELU`` with the tanh approximation (the feed-forwards of FLUX, SD3, Wan, LTX-2,
Qwen-Image), and what the family's ``parallel_mlp_hooks`` hook (FLUX's single blocks). A module whose weights are
not plain tensors on the input's device (a LoRA, fp8 or sharded weights, an offloaded layer) runs its own forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.hooks import HookRegistry
from diffusers.models.activations import GELU
from torch.utils.flop_counter import register_flop_formula

from ..bridge import remove_hook
from ..spec import PipelineSpec, SpecError

HOOK_NAME = "omnispec_fused_gelu"


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
        out = torch._addmm_activation(bias, _rows(x), weight.t(), use_gelu=True)
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
    """What a family's ``parallel_mlp_hooks`` builds on: the fused operators and the test of a linear they take."""

    linear_gelu: Callable[..., torch.Tensor]
    linear_of_pair: Callable[..., torch.Tensor]
    takes: Callable[[Any, torch.Tensor], bool]


OPERATORS = MlpOperators(linear_gelu, linear_of_pair, plain_linear)


class FusedGelu(torch.nn.Module):
    """A diffusers ``GELU`` (tanh) module's projection and GELU as ``linear_gelu``, in its place: the same ``proj``
    (so its weights keep their names), its own arithmetic where the projection's weights are not plain
    (``plain_linear``: a LoRA, quantized weights). A module put in place rather than a hook on the ``GELU``: dynamo
    guards a hooked module's forward by identity, and a regionally compiled block would recompile for each block."""

    def __init__(self, replaced: GELU):
        super().__init__()
        self.proj = replaced.proj
        self.__dict__["replaced"] = replaced  # not a submodule: its weights are ``proj``'s

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not plain_linear(self.proj, hidden_states):
            return self.replaced.gelu(self.proj(hidden_states))
        return linear_gelu(hidden_states, self.proj.weight, self.proj.bias)

    def restored(self) -> GELU:
        """The ``GELU`` it replaced, with the projection it holds now (a LoRA may have wrapped it since)."""
        self.replaced.proj = self.proj
        return self.replaced


def fuse_gelus(model: torch.nn.Module) -> int:
    """Put ``FusedGelu`` in place of ``model``'s tanh-GELU projections; returns how many."""
    return _swap_children(model, lambda m: FusedGelu(m) if isinstance(m, GELU) and m.approximate == "tanh"
                          and type(m.proj) is torch.nn.Linear else None)


def unfuse_gelus(model: torch.nn.Module) -> None:
    """Undo ``fused_gelu`` on ``model``: each ``GELU`` back in place, the parallel blocks' hooks removed."""
    for module in model.modules():
        remove_hook(module, HOOK_NAME)
    _swap_children(model, lambda m: m.restored() if isinstance(m, FusedGelu) else None)


def _swap_children(model: torch.nn.Module, swap: Callable[[torch.nn.Module], torch.nn.Module | None]) -> int:
    """Replace each submodule for which ``swap`` returns a module; returns how many were replaced."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (replacement := swap(child)) is not None:
                setattr(parent, name, replacement)
                swapped += 1
    return swapped


def apply_mlp(spec: PipelineSpec, family: Any, denoisers: Mapping[str, torch.nn.Module]) -> str | None:
    """Put ``FusedGelu`` in place of the denoisers' tanh-GELU projections and hook the family's parallel blocks
    (``fused_gelu``); a rebuild over the same modules first undoes what an earlier build did. Returns explain's note
    (None: nothing fused)."""
    fused = spec.policies.mlp.fused_gelu
    notes = []
    for name, denoiser in denoisers.items():
        unfuse_gelus(denoiser)
        if not fused:
            continue
        gelus = fuse_gelus(denoiser)
        blocks = family.parallel_mlp_hooks(denoiser, OPERATORS) if family.parallel_mlp_hooks is not None else []
        for module, hook in blocks:
            HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, HOOK_NAME)
        if not gelus and not blocks:
            raise SpecError.single(f"{name} has no tanh-GELU feed-forward for fused_gelu to fuse (its family "
                                   f"{family.name!r} gates or uses another activation)", "policies.mlp.fused_gelu")
        notes.append(f"{name}: bias + GELU in the matmul for {gelus} feed-forward projections"
                     + (f", {len(blocks)} parallel blocks projected without concatenating" if blocks else ""))
    if not fused:
        return None
    return "; ".join(notes) + " (CUDA; the model's own operations elsewhere)"
