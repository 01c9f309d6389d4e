"""An attention's query or key preparation as one operator: per-head RMS norms and the interleaved RoPE
(``policies.attention.fused_qk_norm_rope``).

Why a kernel of omnispec's own: compiled, inductor turns FLUX's norms and RoPE into kernels that read each token's
float32 angles once per head (24 times, four times the bytes of q itself) and move their bytes at 1.0-1.5 TB/s. The
Triton kernel here takes a block of tokens and loops over a group of heads, reading the angles once for the group:
41.7 µs against inductor's 81.4 for a single block's q and k at 1024² on an H200, 42.4 against 112.5 for a double
block's (BENCHMARKS.md, 2026-12-03). torch, diffusers and torchao have no kernel fusing a per-head RMS norm with an
interleaved RoPE.

Numerics: the norm in float32, rounded to the input's dtype where ``torch.nn.RMSNorm`` rounds, then the RoPE with
``apply_rotary_emb``'s float32 products (no fused multiply-adds) and one rounding. It differs from eager only where
the sum of squares adds up in another order: about 3 elements in a million, by one bf16 step of a normed value, as
inductor's own kernels do. Each (token, head) row is computed alone, so a row's result does not depend on its
batch-mates (exact RL replay). Elsewhere than CUDA, and for shapes the kernel does not take, the operator runs
diffusers' own code (``reference``), equal to the model's unfused forward. The backward is the model's formula,
written out (``_backward``): a replay with gradients runs the same forward kernel its rollout ran.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

# Launch shape: 16 tokens of 4 heads a program, 4 warps (the fastest of seven tried, BENCHMARKS.md 2026-12-03).
TOKENS_PER_PROGRAM, HEADS_PER_PROGRAM, WARPS = 16, 4, 4


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
              text: torch.Tensor | None = None, text_weight: torch.Tensor | None = None) -> torch.Tensor:
    """What FLUX's attention does (diffusers' ``FluxAttnProcessor``): ``x`` (batch, tokens, heads, head_dim)
    RMS-normed per head, after ``text`` normed with its own weight when given, then the interleaved RoPE by the
    (tokens, head_dim) ``cos`` and ``sin``."""
    from diffusers.models.embeddings import apply_rotary_emb

    normed = F.rms_norm(x, x.shape[-1:], weight, eps)
    if text is not None:
        normed = torch.cat([F.rms_norm(text, text.shape[-1:], text_weight, eps), normed], dim=1)
    return apply_rotary_emb(normed, (cos, sin), sequence_dim=1)


@functools.cache
def _kernel() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def qk_norm_rope_kernel(first, second, out, weight_first, weight_second, cos, sin, tokens, first_tokens, eps,
                            first_sb, first_st, first_sh, second_sb, second_st, second_sh, out_sb, out_st, out_sh,
                            TOKENS: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr):
        # TOKENS tokens (the text stream's first: ``first``, then ``second``'s) of HEADS heads a program; each token's
        # angles are read once for all its heads
        t = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
        h0 = tl.program_id(1) * HEADS
        b = tl.program_id(2)
        live = (t < tokens)[:, None]
        col = tl.arange(0, D)
        in_first = (t < first_tokens)[:, None]
        angles = t[:, None] * D + col[None, :]
        cos_even, cos_odd = tl.split(tl.reshape(tl.load(cos + angles, mask=live, other=0.0), (TOKENS, D // 2, 2)))
        sin_even, sin_odd = tl.split(tl.reshape(tl.load(sin + angles, mask=live, other=0.0), (TOKENS, D // 2, 2)))
        w = tl.where(in_first, tl.load(weight_first + col)[None, :], tl.load(weight_second + col)[None, :])
        w = w.to(tl.float32)
        source = tl.where(in_first, first + (b * first_sb + t * first_st)[:, None],
                          second + (b * second_sb + (t - first_tokens) * second_st)[:, None]) + col[None, :]
        head_stride = tl.where(in_first, first_sh, second_sh)
        target = out + (b * out_sb + t * out_st)[:, None] + col[None, :]
        for i in tl.static_range(HEADS):
            h = h0 + i
            x = tl.load(source + h * head_stride, mask=live, other=0.0).to(tl.float32)
            rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
            normed = (x * rstd[:, None] * w).to(out.dtype.element_ty).to(tl.float32)  # the norm's output
            even, odd = tl.split(tl.reshape(normed, (TOKENS, D // 2, 2)))
            rotated = tl.join(even * cos_even - odd * sin_even, odd * cos_odd + even * sin_odd)
            tl.store(target + h * out_sh, tl.reshape(rotated, (TOKENS, D)).to(out.dtype.element_ty), mask=live)

    return triton, qk_norm_rope_kernel


def kernel_refusal(x: torch.Tensor, cos: torch.Tensor, text: torch.Tensor | None = None) -> str | None:
    """Why the Triton kernel cannot take these tensors (``reference`` runs instead), or None."""
    if not x.is_cuda:
        return "not on CUDA"
    d = x.shape[-1]
    if x.dim() != 4 or d & (d - 1) or any(t.stride(-1) != 1 for t in (x, *(() if text is None else (text,)))):
        return "not (batch, tokens, heads, a power-of-two head size) with contiguous heads"
    if cos.dtype != torch.float32:
        return f"angles in {cos.dtype}, not float32"
    try:
        _kernel()
    except ImportError:
        return "triton is not installed"
    return None


def launch(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
           text: torch.Tensor | None = None, text_weight: torch.Tensor | None = None, *,
           tokens_per_program: int = TOKENS_PER_PROGRAM, heads_per_program: int = HEADS_PER_PROGRAM,
           warps: int = WARPS) -> torch.Tensor:
    """``reference``'s result from the Triton kernel (``kernel_refusal`` must be None)."""
    triton, kernel = _kernel()
    first, first_weight = (text, text_weight) if text is not None else (x, weight)
    batch, heads, d = x.shape[0], x.shape[2], x.shape[3]
    tokens = x.shape[1] + (text.shape[1] if text is not None else 0)
    out = torch.empty(batch, tokens, heads, d, device=x.device, dtype=x.dtype)
    per_program = next(n for n in range(min(heads_per_program, heads), 0, -1) if heads % n == 0)
    kernel[(triton.cdiv(tokens, tokens_per_program), heads // per_program, batch)](
        first, x, out, first_weight, weight, cos.contiguous(), sin.contiguous(), tokens,
        first.shape[1] if text is not None else tokens, eps, *first.stride()[:3], *x.stride()[:3],
        *out.stride()[:3], TOKENS=tokens_per_program, HEADS=per_program, D=d, num_warps=warps,
        enable_fp_fusion=False)  # no fused multiply-adds: eager's roundings
    return out


@torch.library.custom_op("omnispec::qk_norm_rope", mutates_args=())
def qk_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                 text: torch.Tensor | None, text_weight: torch.Tensor | None) -> torch.Tensor:
    """``reference``'s result: the Triton kernel where it runs. An operator the compiler keeps whole (and a CUDA
    graph records like any kernel)."""
    if kernel_refusal(x, cos, text) is None:
        return launch(x, weight, eps, cos, sin, text, text_weight)
    return reference(x, weight, eps, cos, sin, text, text_weight)


@qk_norm_rope.register_fake
def _(x, weight, eps, cos, sin, text, text_weight):
    return x.new_empty(x.shape[0], x.shape[1] + (text.shape[1] if text is not None else 0), *x.shape[2:])


def _setup_context(ctx, inputs, output):
    x, weight, eps, cos, sin, text, text_weight = inputs
    ctx.eps, ctx.has_text = eps, text is not None
    ctx.save_for_backward(x, weight, cos, sin, *((text, text_weight) if text is not None else ()))


def _rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float):
    """The gradients of ``rms_norm(x, weight)`` for the ``grad`` of its output (float32 or wider)."""
    xf = x.to(grad.dtype)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    weighted = grad * weight.to(grad.dtype)
    grad_x = rstd * (weighted - xf * rstd.pow(2) * (weighted * xf).mean(-1, keepdim=True))
    grad_weight = (grad * xf * rstd).flatten(0, -2).sum(0)
    return grad_x.to(x.dtype), grad_weight.to(weight.dtype)


def _backward(ctx, grad):
    """Written out (the RoPE is a rotation: its gradient rotates back; then the norm's), so the compiler traces it
    as plain operations; the norm's rounding to the input's dtype passes the gradient straight through."""
    x, weight, cos, sin, *texts = ctx.saved_tensors
    g = grad.to(torch.promote_types(grad.dtype, torch.float32))
    g_sin = g * sin[None, :, None, :]
    even, odd = g_sin.unflatten(-1, (-1, 2)).unbind(-1)
    grad_normed = g * cos[None, :, None, :] + torch.stack([odd, -even], dim=-1).flatten(-2)
    grad_x, grad_weight = _rms_norm_backward(grad_normed[:, grad_normed.shape[1] - x.shape[1]:], x, weight, ctx.eps)
    grad_text = grad_text_weight = None
    if ctx.has_text:
        text, text_weight = texts
        grad_text, grad_text_weight = _rms_norm_backward(grad_normed[:, :text.shape[1]], text, text_weight, ctx.eps)
    return grad_x, grad_weight, None, None, None, grad_text, grad_text_weight


qk_norm_rope.register_autograd(_backward, setup_context=_setup_context)
