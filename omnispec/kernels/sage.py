"""Sage-style quantized attention (SageAttention, Zhang et al. 2024, "SageAttention: Accurate 8-Bit Attention for
Plug-and-play Inference Acceleration"), with a defined backward.

The forward, for (batch, heads, tokens, head size) inputs:

1. K smoothed: its mean over tokens subtracted (per batch and head). Every score of a query row moves by the same
   ``q · mean(k)``, which softmax cancels; what it removes is the channel-wise offset K carries, which would
   otherwise spend int8's range.
2. Q (with the softmax scale folded in) and the smoothed K quantized to int8 per block of tokens (``BLOCK_Q`` rows
   of Q, ``BLOCK_K`` rows of K), one scale per block: ``max |x| / 127``.
3. Scores: the int8 products summed (exact in float32 at these sizes), times the two blocks' scales.
4. Softmax in float32.
5. P·V with P rounded to the input's dtype and float32 sums (``pv="input"``, as SageAttention's fp16-PV kernels), or
   P and V in float8 e4m3 (``pv="fp8"``: V scaled per channel, P by 448), emulated with float32 sums.

``sage_reference`` is that forward in plain torch: it runs on the CPU, and it is the check of the GPU kernel
(``sageattn`` of the ``sageattention`` package, which quantizes at the same blocks). ``sage_attention`` runs the
kernel where it applies (``sageattn`` on CUDA, the reference on the CPU) through an operator whose backward is
exact attention's at the same q, k and v (``straight_through.py``: why, and why a replay with gradients still
computes its rollout's forward), which compiled code calls as it is.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .straight_through import straight_through_attention

# Tokens per quantization block of Q and of K (SageAttention's own).
BLOCK_Q = 128
BLOCK_K = 64
# The largest float8 e4m3 value: P (in [0, 1]) is scaled to it before rounding.
FP8_MAX = 448.0
# Scores computed at once by the reference (query rows times key tokens, over batch and heads): bounds its memory.
_SCORES_AT_ONCE = 1 << 24
# Head sizes ``sageattn`` (sageattention 1.0.6) has kernels for, and the dtypes omnispec hands it.
GPU_HEAD_SIZES = (64, 96, 128)
GPU_DTYPES = (torch.float16, torch.bfloat16)


def quantize_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (..., tokens, dim) as int8 values (held in float32) and one float32 scale per block of ``block`` tokens,
    broadcast back over its tokens: ``values * scales`` approximates ``x``."""
    tokens = x.shape[-2]
    padded = -tokens % block
    blocks = F.pad(x.float(), (0, 0, 0, padded)).unflatten(-2, (-1, block))
    scales = blocks.abs().amax(dim=(-2, -1), keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
    values = torch.round(blocks / scales).clamp_(-127, 127)
    per_token = scales.expand(*scales.shape[:-2], block, 1).flatten(-3, -2)[..., :tokens, :]
    return values.flatten(-3, -2)[..., :tokens, :], per_token


def _fp8(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to float8 e4m3 and back to float32."""
    return x.to(torch.float8_e4m3fn).float()


def sage_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                   pv: str = "input") -> torch.Tensor:
    """Sage-style quantized attention in plain torch (the module docstring's steps) for (batch, heads, tokens, dim)
    inputs of any float dtype; the output has q's dtype. ``pv``: ``"input"`` (P rounded to v's dtype) or ``"fp8"``."""
    if pv not in ("input", "fp8"):
        raise ValueError(f"pv must be 'input' or 'fp8', got {pv!r}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k_values, k_scales = quantize_blocks(smoothed(k), BLOCK_K)
    k_t, k_scales_t = k_values.transpose(-2, -1), k_scales.transpose(-2, -1)
    v_scales = v.float().abs().amax(dim=-2, keepdim=True).clamp_min(1e-12) / FP8_MAX if pv == "fp8" else None
    v_used = _fp8(v.float() / v_scales) if v_scales is not None else v.float()
    rows = q.shape[-2]
    # whole Q blocks at a time, so each block's scale is the one the whole block would have
    per_chunk = max(BLOCK_Q, _SCORES_AT_ONCE // max(1, k.shape[-2] * q.shape[0] * q.shape[1]) // BLOCK_Q * BLOCK_Q)
    out = []
    for start in range(0, rows, per_chunk):
        q_values, q_scales = quantize_blocks(q[..., start:start + per_chunk, :].float() * scale, BLOCK_Q)
        scores = (q_values @ k_t) * q_scales * k_scales_t
        probs = torch.softmax(scores, dim=-1)
        if v_scales is not None:
            out.append((_fp8(probs * FP8_MAX) @ v_used) * (v_scales / FP8_MAX))
        else:
            out.append(probs.to(v.dtype).float() @ v_used)
    return torch.cat(out, dim=-2).to(q.dtype)


def smoothed(k: torch.Tensor) -> torch.Tensor:
    """K less its mean over tokens (in float32), in K's dtype: a new tensor, K itself untouched."""
    return (k.float() - k.float().mean(dim=-2, keepdim=True)).to(k.dtype)


def _gpu_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """``sageattn`` on K smoothed here: its own smoothing subtracts the mean from K in place where K is contiguous in
    its dtype, which would change the caller's tensor (one autograd may have saved)."""
    from sageattention import sageattn

    kwargs = {"sm_scale": scale} if scale is not None else {}
    return sageattn(q, smoothed(k), v, tensor_layout="HND", is_causal=False, smooth_k=False, **kwargs)


def forward_kernel(device: torch.device) -> Callable[..., torch.Tensor]:
    """The quantized forward for tensors on ``device``: ``sageattn`` on CUDA, the reference on the CPU."""
    return _gpu_kernel if device.type == "cuda" else sage_reference


def refusal(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the quantized forward cannot run on ``device`` for this dtype and head size; None where it can."""
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"runs on CUDA (sageattention) or on the CPU (omnispec's plain-torch reference), not on {device.type}"
    if importlib.util.find_spec("sageattention") is None:
        return ("sageattention is not installed (pip install sageattention); on CUDA omnispec does not run its "
                "plain-torch reference, which holds the whole score matrix of a query block")
    if dtype not in GPU_DTYPES:
        return (f"omnispec runs sageattention on float16 or bfloat16 inputs, not {str(dtype).removeprefix('torch.')} "
                "(its kernels would compute them in float16)")
    if head_dim not in GPU_HEAD_SIZES:
        return f"sageattention's kernels take head sizes {', '.join(map(str, GPU_HEAD_SIZES))}, not {head_dim}"
    return None


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    return forward_kernel(q.device)(q, k, v, scale)


_operator = straight_through_attention("sage_attention", _forward)


def sage_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Sage-style attention of (batch, heads, tokens, dim) tensors, differentiable where gradients flow (the
    backward: exact attention's); the same forward with gradients or without, eager or compiled."""
    return _operator(q, k, v, scale)
