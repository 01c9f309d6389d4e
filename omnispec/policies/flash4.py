"""FlashAttention-4 (package ``flash-attn-4``) as torch operators: ``omnispec::flash4_attention`` and its backward.

Why operators: FA4's CuTe kernels are built and launched by its own DSL, which dynamo cannot trace, so compiled code
could not call the package's ``flash_attn_func``. As an operator with a fake (the output shapes) the call stays one
opaque node in a compiled graph, and AOT autograd puts the registered backward into a training graph. Eager runs call
the same operators, so a rollout and its replay run the same kernels compiled or not.

Why FA4's private ``_flash_attn_bwd``: the public entry is an autograd Function whose backward cannot be called on
its own, and recomputing the forward inside a backward operator would cost one more attention per call. The extra
pins flash-attn-4 below 4.1 for that reason.

Layout: FA4's own, [batch, tokens, heads, dim]; the log-sum-exp, float32 [batch, heads, tokens], is what the
backward needs. Any failure of the package except running out of memory (its ``assert``s on head size and dtype, its
DSL compiler's errors) becomes a RuntimeError naming it, which the eager guards turn into a fallback to SDPA.
"""

from __future__ import annotations

import torch


def _refused(exc: Exception) -> RuntimeError:
    why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return RuntimeError(f"flash-attn-4 refused this call: {why}")


@torch.library.custom_op("omnispec::flash4_attention", mutates_args=())
def flash4_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of [batch, tokens, heads, dim] ``q``, ``k``, ``v``: the output (same layout) and the log-sum-exp."""
    from flash_attn.cute import flash_attn_func

    try:
        with torch.no_grad():  # the operator's registered backward differentiates it, not the package's Function
            out, lse = flash_attn_func(q, k, v, softmax_scale=scale, return_lse=True)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - see the module docstring
        raise _refused(exc) from exc
    return out.contiguous(), lse.contiguous()


@flash4_attention.register_fake
def _(q, k, v, scale):
    batch, tokens, heads, _ = q.shape
    return (q.new_empty(batch, tokens, heads, v.shape[-1]),
            q.new_empty(batch, heads, tokens, dtype=torch.float32))


@torch.library.custom_op("omnispec::flash4_attention_backward", mutates_args=())
def flash4_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              out: torch.Tensor, lse: torch.Tensor,
                              scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from flash_attn.cute.interface import _flash_attn_bwd

    try:
        grads = _flash_attn_bwd(q, k, v, out, grad_out, lse, scale)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - see the module docstring
        raise _refused(exc) from exc
    return tuple(g.contiguous() for g in grads[:3])  # type: ignore[return-value]


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


def flash4_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """FA4 in SDPA's [batch, heads, tokens, dim] layout: the models' views are transposed back to FA4's, no copy."""
    out, _ = torch.ops.omnispec.flash4_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale)
    return out.transpose(1, 2)
