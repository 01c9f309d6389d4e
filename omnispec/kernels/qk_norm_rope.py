"""An attention's query and key preparation as one operator: per-head RMS norms and the interleaved RoPE
(``policies.attention.fused_qk_norm_rope``).

Why a kernel of omnispec's own: compiled, inductor turns FLUX's norms and RoPE into kernels that read each token's
float32 angles once per head (24 times, four times the bytes of q itself). The Triton kernel here takes a block of
tokens and loops over a group of heads, reading the angles once for the group (what it gives: BENCHMARKS.md, "Fused
q/k RMS norm + RoPE"). torch, diffusers and torchao have no kernel fusing a
per-head RMS norm with an interleaved RoPE. q and k share their angles, so one launch prepares both: a program reads
its tokens' angles once for its heads of q and the same heads of k (``launch(paired=False)``, one launch per tensor,
is kept for the benchmark's comparison).

Numerics: the norm in float32, rounded to the input's dtype where ``torch.nn.RMSNorm`` rounds, then the RoPE with
``apply_rotary_emb``'s float32 products (no fused multiply-adds) and one rounding. It differs from eager only where
the sum of squares adds up in another order: about 3 elements in a million, by one bf16 step of a normed value, as
inductor's own kernels do. Each (token, head) row is computed alone, so a row's result does not depend on its
batch-mates (exact RL replay), nor on whether q and k share a launch. Elsewhere than CUDA, and for shapes the kernel
does not take, the operator runs diffusers' own code (``reference``), equal to the model's unfused forward. The
backward is the model's formula, written out (``_backward``): a replay with gradients runs the same forward kernel its
rollout ran.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

# Launch shape: 16 tokens of 4 heads a program, 4 warps (the fastest of the shapes tried: BENCHMARKS.md, "Fused q/k
# RMS norm + RoPE").
TOKENS_PER_PROGRAM, HEADS_PER_PROGRAM, WARPS = 16, 4, 4


def reference_one(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                  text: torch.Tensor | None = None, text_weight: torch.Tensor | None = None) -> torch.Tensor:
    """What FLUX's attention does to its queries or its keys (diffusers' ``FluxAttnProcessor``): ``x`` (batch,
    tokens, heads, head_dim) RMS-normed per head, after ``text`` normed with its own weight when given, then the
    interleaved RoPE by the (tokens, head_dim) ``cos`` and ``sin``."""
    from diffusers.models.embeddings import apply_rotary_emb

    normed = F.rms_norm(x, x.shape[-1:], weight, eps)
    if text is not None:
        normed = torch.cat([F.rms_norm(text, text.shape[-1:], text_weight, eps), normed], dim=1)
    return apply_rotary_emb(normed, (cos, sin), sequence_dim=1)


def reference(query: torch.Tensor, key: torch.Tensor, query_weight: torch.Tensor, key_weight: torch.Tensor,
              eps: float, cos: torch.Tensor, sin: torch.Tensor, text_query: torch.Tensor | None = None,
              text_key: torch.Tensor | None = None, text_query_weight: torch.Tensor | None = None,
              text_key_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference_one`` of the queries and of the keys."""
    return (reference_one(query, query_weight, eps, cos, sin, text_query, text_query_weight),
            reference_one(key, key_weight, eps, cos, sin, text_key, text_key_weight))


@functools.cache
def _kernel() -> tuple[Any, Any]:
    """triton and the kernel, imported when first launched: triton is not a dependency off CUDA."""
    import triton

    from .qk_norm_rope_triton import qk_norm_rope_kernel

    return triton, qk_norm_rope_kernel


def kernel_refusal(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, text_query: torch.Tensor | None = None,
                   text_key: torch.Tensor | None = None) -> str | None:
    """Why the Triton kernel cannot take these tensors (``reference`` runs instead), or None."""
    if not (query.is_cuda and key.is_cuda):
        return "not on CUDA"
    d = query.shape[-1]
    texts = () if text_query is None else (text_query, text_key)
    if query.dim() != 4 or d & (d - 1) or any(t.stride(-1) != 1 for t in (query, key, *texts)):
        return "not (batch, tokens, heads, a power-of-two head size) with contiguous heads"
    if key.shape != query.shape or (text_query is not None and (text_key is None
                                                                 or text_key.shape != text_query.shape)):
        return "queries and keys of different shapes"
    if cos.dtype != torch.float32:
        return f"angles in {cos.dtype}, not float32"
    try:
        _kernel()
    except ImportError:
        return "triton is not installed"
    return None


def launch(query: torch.Tensor, key: torch.Tensor, query_weight: torch.Tensor, key_weight: torch.Tensor, eps: float,
           cos: torch.Tensor, sin: torch.Tensor, text_query: torch.Tensor | None = None,
           text_key: torch.Tensor | None = None, text_query_weight: torch.Tensor | None = None,
           text_key_weight: torch.Tensor | None = None, *, tokens_per_program: int = TOKENS_PER_PROGRAM,
           heads_per_program: int = HEADS_PER_PROGRAM, warps: int = WARPS,
           paired: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference``'s result from the Triton kernel (``kernel_refusal`` must be None): q and k in one launch, or
    one launch each (``paired=False``, the same values)."""
    triton, kernel = _kernel()
    batch, heads, d = query.shape[0], query.shape[2], query.shape[3]
    text_tokens = 0 if text_query is None else text_query.shape[1]
    tokens = query.shape[1] + text_tokens
    outs = tuple(torch.empty(batch, tokens, heads, d, device=query.device, dtype=query.dtype) for _ in range(2))

    def side(x, weight, text, text_weight, out):  # the text stream is the first part when there is one
        first, first_weight = (text, text_weight) if text is not None else (x, weight)
        return (first, x, out, first_weight, weight, *first.stride()[:3], *x.stride()[:3])

    sides = (side(query, query_weight, text_query, text_query_weight, outs[0]),
             side(key, key_weight, text_key, text_key_weight, outs[1]))
    per_program = next(n for n in range(min(heads_per_program, heads), 0, -1) if heads % n == 0)
    grid = (triton.cdiv(tokens, tokens_per_program), heads // per_program, batch)
    shared = (cos.contiguous(), sin.contiguous(), tokens, text_tokens or tokens, eps, *outs[0].stride()[:3])
    settings = {"TOKENS": tokens_per_program, "HEADS": per_program, "D": d, "num_warps": warps,
                "enable_fp_fusion": False}  # no fused multiply-adds: eager's roundings
    for pair in [sides] if paired else [(s, s) for s in sides]:
        kernel[grid](*pair[0], *pair[1], *shared, PAIRED=paired, **settings)
    return outs


@torch.library.custom_op("omnispec::qk_norm_rope", mutates_args=())
def qk_norm_rope(query: torch.Tensor, key: torch.Tensor, query_weight: torch.Tensor, key_weight: torch.Tensor,
                 eps: float, cos: torch.Tensor, sin: torch.Tensor, text_query: torch.Tensor | None,
                 text_key: torch.Tensor | None, text_query_weight: torch.Tensor | None,
                 text_key_weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference``'s result: the Triton kernel where it runs. An operator the compiler keeps whole (and a CUDA
    graph records like any kernel)."""
    inputs = (query, key, query_weight, key_weight, eps, cos, sin, text_query, text_key, text_query_weight,
              text_key_weight)
    if kernel_refusal(query, key, cos, text_query, text_key) is None:
        return launch(*inputs)
    return reference(*inputs)


@qk_norm_rope.register_fake
def _(query, key, query_weight, key_weight, eps, cos, sin, text_query, text_key, text_query_weight, text_key_weight):
    def out(x, text):
        return x.new_empty(x.shape[0], x.shape[1] + (text.shape[1] if text is not None else 0), *x.shape[2:])

    return out(query, text_query), out(key, text_key)


def _setup_context(ctx, inputs, output):
    query, key, query_weight, key_weight, eps, cos, sin, text_query, text_key, text_query_weight, \
        text_key_weight = inputs
    ctx.eps, ctx.has_text = eps, text_query is not None
    texts = (text_query, text_key, text_query_weight, text_key_weight) if ctx.has_text else ()
    ctx.save_for_backward(query, key, query_weight, key_weight, cos, sin, *texts)


def _rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float):
    """The gradients of ``rms_norm(x, weight)`` for the ``grad`` of its output (float32 or wider)."""
    xf = x.to(grad.dtype)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    weighted = grad * weight.to(grad.dtype)
    grad_x = rstd * (weighted - xf * rstd.pow(2) * (weighted * xf).mean(-1, keepdim=True))
    grad_weight = (grad * xf * rstd).flatten(0, -2).sum(0)
    return grad_x.to(x.dtype), grad_weight.to(weight.dtype)


def _one_backward(grad, x, weight, eps, cos, sin, text, text_weight):
    """One tensor's gradients (x, weight, text, text_weight): the RoPE is a rotation, so its gradient rotates back;
    then the norm's, whose rounding to the input's dtype passes the gradient straight through."""
    g = grad.to(torch.promote_types(grad.dtype, torch.float32))
    g_sin = g * sin[None, :, None, :]
    even, odd = g_sin.unflatten(-1, (-1, 2)).unbind(-1)
    grad_normed = g * cos[None, :, None, :] + torch.stack([odd, -even], dim=-1).flatten(-2)
    grad_x, grad_weight = _rms_norm_backward(grad_normed[:, grad_normed.shape[1] - x.shape[1]:], x, weight, eps)
    if text is None:
        return grad_x, grad_weight, None, None
    return (grad_x, grad_weight,
            *_rms_norm_backward(grad_normed[:, :text.shape[1]], text, text_weight, eps))


def _backward(ctx, grad_query, grad_key):
    """Written out as plain operations, so the compiler traces it."""
    query, key, query_weight, key_weight, cos, sin, *texts = ctx.saved_tensors
    text_query, text_key, text_query_weight, text_key_weight = texts if ctx.has_text else (None,) * 4
    gq, gqw, gtq, gtqw = _one_backward(grad_query, query, query_weight, ctx.eps, cos, sin, text_query,
                                       text_query_weight)
    gk, gkw, gtk, gtkw = _one_backward(grad_key, key, key_weight, ctx.eps, cos, sin, text_key, text_key_weight)
    return gq, gk, gqw, gkw, None, None, None, gtq, gtk, gtqw, gtkw


qk_norm_rope.register_autograd(_backward, setup_context=_setup_context)
