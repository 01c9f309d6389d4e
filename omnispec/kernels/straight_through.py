"""Approximate attention forwards as torch operators whose backward is exact attention's (straight-through).

Quantized attention has no useful derivative, so the gradient its operators give is exact attention's at the saved
q, k and v, recomputed by torch's SDPA kernels (``sdpa.exact_attention_gradients``), as SageAttention's training
variants do. The forward a replay with gradients computes is the quantized forward its rollout computed, bit for
bit, so an unchanged model replays with a log-prob ratio of exactly 1.

Operators (``torch.library``), not an ``autograd.Function``: compiled code calls them as they are (Triton kernels
launched by a package's Python are not for dynamo to trace), and AOT autograd puts the backward operator into a
training graph. Each counts as SDPA's attention of the same shapes for ``FlopCounterMode`` (``flops.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .flops import register_attention_flops
from .sdpa import exact_attention_gradients

Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "float | None"], torch.Tensor]


def straight_through_attention(name: str, forward: Forward, tokens_major_output: bool = False) -> Callable:
    """Registers ``omnispec::<name>`` (``forward`` of (batch, heads, tokens, head size) q, k and v and the softmax
    scale or None) and ``omnispec::<name>_backward`` (exact attention's gradients); returns the forward operator.
    ``tokens_major_output``: the output is a [batch, heads, tokens, dim] view of [batch, tokens, heads, dim] memory,
    the layout the model's next projection reads (no copy back), else contiguous as it is indexed."""

    def arrange(out: torch.Tensor) -> torch.Tensor:
        return out.transpose(1, 2).contiguous().transpose(1, 2) if tokens_major_output else out.contiguous()

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
        return arrange(forward(q, k, v, scale))

    def shaped(q, k, v, scale):
        return arrange(q.new_empty(*q.shape[:-1], v.shape[-1]))

    def gradients(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(g.contiguous() for g in exact_attention_gradients(grad_out, q, k, v, scale))  # type: ignore

    def gradients_shaped(grad_out, q, k, v, scale):
        return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))

    forward_op = torch.library.custom_op(f"omnispec::{name}", run, mutates_args=())
    forward_op.register_fake(shaped)
    backward_op = torch.library.custom_op(f"omnispec::{name}_backward", gradients, mutates_args=())
    backward_op.register_fake(gradients_shaped)
    registered_backward = getattr(torch.ops.omnispec, f"{name}_backward")

    def save(ctx, inputs, output):
        q, k, v, scale = inputs
        ctx.save_for_backward(q, k, v)
        ctx.scale = scale

    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        return (*registered_backward(grad_out.contiguous(), q, k, v, ctx.scale), None)

    forward_op.register_autograd(backward, setup_context=save)
    registered = getattr(torch.ops.omnispec, name)
    register_attention_flops(registered, registered_backward)
    return registered
