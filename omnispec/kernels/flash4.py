"""FlashAttention-4 (package ``flash-attn-4``) as torch operators: ``omnispec::flash4_attention`` and its backward.

Why operators: FA4's CuTe kernels are built and launched by its own DSL, which dynamo cannot trace, so compiled code
could not call the package's ``flash_attn_func``. As an operator with a fake (the output shapes) the call stays one
opaque node in a compiled graph, and AOT autograd puts the registered backward into a training graph. Eager runs call
the same operators, so a rollout and its replay run the same kernels compiled or not.

Why FA4's private ``_flash_attn_fwd`` and ``_flash_attn_bwd``: the public entry is an autograd Function whose
backward cannot be called on its own (recomputing the forward inside a backward operator would cost one more
attention per call), and it does not take the forward's tile (``HOPPER_TILES``). The extra pins flash-attn-4 below
4.1 for that reason.

Layout: FA4's own, [batch, tokens, heads, dim]; the log-sum-exp, float32 [batch, heads, tokens], is what the
backward needs.

A call shape the package refuses (its ``assert``s on head size and dtype, its DSL compiler's errors; FA4 4.0.0b15
cannot build the backward for head size 24, for one) runs on torch's SDPA instead, from then on, with one warning:
inside the operators, so compiled code falls back as eager code does, and a training step never ends on it. The
decision is per shape without the batch and only ever goes one way, so a rollout and its replay in micro-batches
run the same kernel. Running out of memory is not a refusal.
"""

from __future__ import annotations

import torch

from .flops import register_attention_flops
from .sdpa import exact_attention_gradients, remember_failure, safe_sdpa

# FA4's forward tile on Hopper (compute capability 9), by head size: (rows of q, rows of k and v) a step. FA4 takes
# 128 x 128 at head size 128, chosen at the peak clock; a running step holds the GPU at its power cap, where
# 128 x 192 was faster (BENCHMARKS.md, "FlashAttention-4's tile"). Other head sizes and GPUs: FA4's own choice.
HOPPER_TILES = {128: (128, 192)}

# Call shapes FA4 refused in this process -> why: (q, k, v shapes without the batch, dtype, device, "forward" or
# "backward").
REFUSED: dict[tuple, str] = {}


def _key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, part: str) -> tuple:
    return (tuple(q.shape[1:]), tuple(k.shape[1:]), tuple(v.shape[1:]), q.dtype, str(q.device), part)


def _refuse(key: tuple, exc: Exception) -> None:
    remember_failure(REFUSED, key, exc, f"flash-attn-4 refused the attention {key[-1]} of shape {key[0]}")


def refused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why FA4 refused this call shape's forward in this process, or None."""
    return REFUSED.get(_key(q, k, v, "forward"))


def _tile(q: torch.Tensor, v: torch.Tensor) -> tuple[int, int] | None:
    if q.device.type != "cuda" or q.shape[-1] != v.shape[-1] or torch.cuda.get_device_capability(q.device)[0] != 9:
        return None
    return HOPPER_TILES.get(q.shape[-1])


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    # aten's operator, not F.scaled_dot_product_attention: omnispec's own redirect, active around a denoiser's call,
    # sends the latter back here. cuDNN attention off, forward and backward alike (``attention_kernels.safe_sdpa``):
    # a refused shape's backward recomputes this call, so its forward must be one whose backward is proven.
    with safe_sdpa():
        return torch.ops.aten.scaled_dot_product_attention.default(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale).transpose(1, 2)


@torch.library.custom_op("omnispec::flash4_attention", mutates_args=())
def flash4_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of [batch, tokens, heads, dim] ``q``, ``k``, ``v``: the output (same layout) and the log-sum-exp."""
    key = _key(q, k, v, "forward")
    if key not in REFUSED:
        try:
            from flash_attn.cute.interface import _flash_attn_fwd

            out, lse = _flash_attn_fwd(q, k, v, softmax_scale=scale, return_lse=True, tile_mn=_tile(q, v))
            return out.contiguous(), lse.contiguous()
        except Exception as exc:  # noqa: BLE001 - see the module docstring
            _refuse(key, exc)
    # the backward of a refused shape does not read the log-sum-exp
    batch, tokens, heads, _ = q.shape
    return _sdpa(q, k, v, scale).contiguous(), q.new_zeros(batch, heads, tokens, dtype=torch.float32)


@flash4_attention.register_fake
def _(q, k, v, scale):
    batch, tokens, heads, _ = q.shape
    return (q.new_empty(batch, tokens, heads, v.shape[-1]),
            q.new_empty(batch, heads, tokens, dtype=torch.float32))


@torch.library.custom_op("omnispec::flash4_attention_backward", mutates_args=())
def flash4_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              out: torch.Tensor, lse: torch.Tensor,
                              scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    key = _key(q, k, v, "backward")
    if _key(q, k, v, "forward") not in REFUSED and key not in REFUSED:
        try:
            from flash_attn.cute.interface import _flash_attn_bwd

            grads = _flash_attn_bwd(q, k, v, out, grad_out, lse, scale)
            return tuple(g.contiguous() for g in grads[:3])  # type: ignore[return-value]
        except Exception as exc:  # noqa: BLE001 - see the module docstring
            _refuse(key, exc)
    # SDPA's gradients of the same attention (what an eager fallback computes), in SDPA's layout
    grads = exact_attention_gradients(*(t.transpose(1, 2) for t in (grad_out, q, k, v)), scale)
    return tuple(g.transpose(1, 2).contiguous() for g in grads)  # type: ignore[return-value]


@flash4_attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, scale):
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device),
            torch.empty(v.shape, dtype=v.dtype, device=v.device))


def _save(ctx, inputs, output):
    q, k, v, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.scale = scale


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.omnispec.flash4_attention_backward(grad_out.contiguous(), q, k, v, out, lse, ctx.scale)
    return dq, dk, dv, None


flash4_attention.register_autograd(_backward, setup_context=_save)
register_attention_flops(torch.ops.omnispec.flash4_attention, torch.ops.omnispec.flash4_attention_backward,
                         tokens_first=True)


def flash4_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """FA4 in SDPA's [batch, heads, tokens, dim] layout: the models' views are transposed back to FA4's, no copy."""
    out, _ = torch.ops.omnispec.flash4_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale)
    return out.transpose(1, 2)
