"""Sage-style quantized attention with an fp8 P·V (``attention: int8_fp8``): omnispec's Triton kernel for GPUs with
8-bit tensor cores (Ada, Hopper and later), with a defined backward. The recipe is SageAttention2's (Zhang et al.,
"SageAttention2: Efficient Attention with Thorough Outlier Smoothing and Per-thread INT4 Quantization"): Q·K in int8
after smoothing K, P·V in float8.

Why a kernel of omnispec's own: sageattention's published build (1.0.6) computes P·V in 16 bits with tiles chosen for
Ampere, which lost to FlashAttention-4 at Wan2.1 14B's shapes on the H100 (BENCHMARKS.md, "Wan2.1 14B's presets with
FlashAttention-4"); its later releases, FlashAttention-3's fp8 forward and vLLM's are built from source only, and
FlashAttention-4's fp8 forward runs only on Blackwell (its interface asserts compute capability 10).

The forward, for (batch, heads, tokens, head size) inputs:

1. K smoothed: its mean over tokens subtracted (per batch, head and channel). Every score of a query row moves by the
   same ``q · mean(k)``, which softmax cancels; what it removes is the offset K's channels carry, which would
   otherwise set the scale that all of K's values are rounded against.
2. Q and the smoothed K in int8, one scale per block of ``QUANT_BLOCK`` tokens: ``max |x| / 127``, values rounded half
   away from zero. int8 rather than float8 for Q·K: on the values of a block it keeps about four times e4m3's
   precision (seven bits against three), at the same tensor-core rate.
3. V in float8 e4m3 with one scale per channel (per batch and head): ``max |v| / 448`` over the tokens.
4. Scores: int8 products summed exactly in int32 by the tensor cores, times the two blocks' scales and the softmax
   scale; the softmax online (running max and row sums, base 2), in float32.
5. P times 2^8 (exact) in float8 e4m3, so that probabilities down to 2^-17 keep a value (e4m3's least is 2^-9); P·V
   on the tensor cores; the output divided by the row sums (of the scaled P, so the 2^8 cancels), times V's scales.

``int8_fp8_reference`` is that forward in plain torch (the int8 products summed in float32, exact at these sizes; the
softmax over whole rows: the kernel's online softmax rounds P against the running maximum, so the two agree to fp8's
rounding of P, not bit for bit): the CPU path, and the check of the kernel. ``int8_fp8_attention`` runs the kernel on
CUDA and the reference on the CPU through an operator whose backward is exact attention's (``straight_through.py``).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .straight_through import straight_through_attention

# Tokens per quantization block of Q and of K, and the tile sizes divide it.
QUANT_BLOCK = 128
# The largest int8 value Q and K are scaled to, and the largest float8 e4m3 value (V).
INT8_MAX = 127.0
FP8_MAX = 448.0
# P is scaled by this power of two before rounding (the module docstring, step 5); the kernel writes it as 8.0 in
# its exponent.
P_SCALE = 256.0
# The least scale (a block or channel of zeros).
_LEAST = 1e-30
# Scores the reference holds at once (query rows times key tokens, over batch and heads).
_SCORES_AT_ONCE = 1 << 24
# Head sizes and input dtypes the kernel is built for.
GPU_HEAD_SIZES = (64, 128)
GPU_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Launch:
    """How the attention kernel runs: query rows and key rows a step (each dividing ``QUANT_BLOCK``, so a tile has
    one scale), warps, pipeline stages, and whether tiles load through tensor descriptors (Hopper's TMA) rather than
    pointers (the pipeliner's asynchronous copies)."""

    block_m: int = 128
    block_n: int = 128
    warps: int = 8
    stages: int = 3
    tma: bool = False

    @classmethod
    def parse(cls, text: str) -> Launch:
        """``128x128x8x3``, optionally ``+tma``: the benchmark's ``--int8-fp8-launches``."""
        sizes, _, flag = text.partition("+")
        try:
            block_m, block_n, warps, stages = (int(n) for n in sizes.split("x"))
        except ValueError:
            block_m = block_n = 0
        if flag not in ("", "tma") or block_m <= 0 or block_n <= 0 or any(QUANT_BLOCK % b for b in (block_m, block_n)):
            raise ValueError(f"not a launch of the int8_fp8 kernel: {text!r} (MxNxWARPSxSTAGES, M and N dividing "
                             f"{QUANT_BLOCK}, optionally +tma)")
        return cls(block_m, block_n, warps, stages, flag == "tma")

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.warps}x{self.stages}{'+tma' if self.tma else ''}"


# The attention kernel's launch by head size. How they were chosen: BENCHMARKS.md, "int8 Q·K, fp8 P·V attention".
LAUNCHES = {64: Launch(), 128: Launch()}


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float8_e4m3fn).float()


def int8_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``x`` (..., tokens, dim) in int8 with one scale per block of ``QUANT_BLOCK`` tokens, rounded half away
    from zero: the values (held in float32) and the scales broadcast over their tokens."""
    tokens = x.shape[-2]
    blocks = torch.nn.functional.pad(x, (0, 0, 0, -tokens % QUANT_BLOCK)).unflatten(-2, (-1, QUANT_BLOCK))
    scales = blocks.abs().amax(dim=(-2, -1), keepdim=True).clamp_min(_LEAST) / INT8_MAX
    scaled = blocks / scales
    values = torch.trunc(scaled + 0.5 * torch.sign(scaled)).flatten(-3, -2)[..., :tokens, :]
    return values, scales.expand(*scales.shape[:-2], QUANT_BLOCK, 1).flatten(-3, -2)[..., :tokens, :]


def int8_fp8_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                       pv_rounding: Callable[[torch.Tensor], torch.Tensor] = _e4m3) -> torch.Tensor:
    """The module docstring's forward in plain torch for (batch, heads, tokens, dim) inputs of any float dtype; the
    output has q's dtype. ``pv_rounding``: what P and V go through (float8 e4m3 and back; tests of the kernel's
    arithmetic under Triton's interpreter pass the identity, as ``int8_fp8_kernel``'s ``pv_storage`` float32)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k32 = k.float()
    k_values, k_scales = int8_blocks(k32 - k32.mean(dim=-2, keepdim=True))
    v_scales = v.float().abs().amax(dim=-2, keepdim=True).clamp_min(_LEAST) / FP8_MAX
    v_values = pv_rounding(v.float() / v_scales)
    rows = max(QUANT_BLOCK, _SCORES_AT_ONCE // max(1, k.shape[-2] * q.shape[0] * q.shape[1])
               // QUANT_BLOCK * QUANT_BLOCK)  # whole blocks, so each block's scale is the whole block's
    out = []
    for start in range(0, q.shape[-2], rows):
        q_values, q_scales = int8_blocks(q[..., start:start + rows, :].float())
        scores = (q_values @ k_values.transpose(-2, -1)) * q_scales * k_scales.transpose(-2, -1) * (scale / math.log(2))
        probs = torch.exp2(scores - scores.amax(dim=-1, keepdim=True)) * P_SCALE
        out.append((pv_rounding(probs) @ v_values) / probs.sum(dim=-1, keepdim=True) * v_scales)
    return torch.cat(out, dim=-2).to(q.dtype)


def _padded(tokens: int) -> int:
    return -(-tokens // QUANT_BLOCK) * QUANT_BLOCK


def int8_fp8_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                    pv_storage: torch.dtype = torch.float8_e4m3fn, launch: Launch | None = None) -> torch.Tensor:
    """The Triton kernels (``int8_fp8_triton.py``) on (batch, heads, tokens, dim) q, k, v whose head size is
    contiguous (others are copied): three quantizing launches, then the attention. The output is a (batch, heads,
    tokens, dim) view of [batch, tokens, heads, dim] memory. ``pv_storage``: P's and V's dtype (float32 in tests of
    the arithmetic under Triton's interpreter, whose float8 conversions do not round as GPUs do); ``launch``: the
    attention kernel's (default: ``LAUNCHES`` by head size)."""
    from . import int8_fp8_triton as kernels

    batch, heads, q_tokens, dim = q.shape
    k_tokens = k.shape[-2]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    scale = dim ** -0.5 if scale is None else scale
    q_padded, k_padded = _padded(q_tokens), _padded(k_tokens)
    f32 = torch.float32
    q8 = torch.empty(batch * heads, q_padded, dim, dtype=torch.int8, device=q.device)
    k8 = torch.empty(batch * heads, k_padded, dim, dtype=torch.int8, device=q.device)
    v8 = torch.empty(batch * heads, dim, k_padded, dtype=pv_storage, device=q.device)
    q_scales = torch.empty(batch * heads, q_padded // QUANT_BLOCK, dtype=f32, device=q.device)
    k_scales = torch.empty(batch * heads, k_padded // QUANT_BLOCK, dtype=f32, device=q.device)
    k_mean = torch.mean(k, dim=-2, dtype=f32).contiguous()
    v_scales = (torch.linalg.vector_norm(v, ord=math.inf, dim=-2, dtype=f32).clamp_min(_LEAST) / FP8_MAX).contiguous()

    def quantize(x, out, block_scales, tokens, padded, mode, out_st, out_sd):
        kernels.quantize_kernel[(padded // QUANT_BLOCK, batch * heads)](
            x, k_mean, v_scales, out, block_scales, tokens, heads, x.stride(0), x.stride(1), x.stride(2),
            out.stride(0), out_st, out_sd, padded // QUANT_BLOCK, BLOCK=QUANT_BLOCK, D=dim, MODE=mode, num_warps=4)

    quantize(q, q8, q_scales, q_tokens, q_padded, 0, dim, 1)
    quantize(k, k8, k_scales, k_tokens, k_padded, 1, dim, 1)
    quantize(v, v8, k_scales, k_tokens, k_padded, 2, 1, k_padded)  # k_scales: not written in mode 2
    out = torch.empty(batch, q_tokens, heads, dim, dtype=q.dtype, device=q.device).transpose(1, 2)
    launch = launch or LAUNCHES.get(dim, Launch())
    operands: tuple = (q8, k8, v8)
    if launch.tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        operands = (TensorDescriptor.from_tensor(q8.flatten(0, 1), [launch.block_m, dim]),
                    TensorDescriptor.from_tensor(k8.flatten(0, 1), [launch.block_n, dim]),
                    TensorDescriptor.from_tensor(v8.flatten(0, 1), [dim, launch.block_n]))
    kernels.attention_kernel[(q_padded // launch.block_m, batch * heads)](
        *operands, q_scales, k_scales, v_scales, out, q_tokens, k_tokens, heads, q_padded, k_padded,
        scale / math.log(2), out.stride(0), out.stride(1), out.stride(2), BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n, D=dim, QUANT_BLOCK=QUANT_BLOCK, TMA=launch.tma, num_warps=launch.warps,
        num_stages=launch.stages)
    return out


def refusal(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the quantized forward cannot run on ``device`` for this dtype and head size; None where it can."""
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"runs on CUDA (omnispec's Triton kernel) or on the CPU (its plain-torch reference), not {device.type}"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed; on CUDA omnispec does not run its plain-torch reference"
    if torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        return f"needs float8 tensor cores (compute capability 8.9 and up), this GPU has {major}.{minor}"
    if dtype not in GPU_DTYPES:
        return f"takes float16 or bfloat16 inputs on CUDA, not {str(dtype).removeprefix('torch.')}"
    if head_dim not in GPU_HEAD_SIZES:
        return f"the kernel takes head sizes {', '.join(map(str, GPU_HEAD_SIZES))}, not {head_dim}"
    return None


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    return int8_fp8_kernel(q, k, v, scale) if q.device.type == "cuda" else int8_fp8_reference(q, k, v, scale)


_operator = straight_through_attention("int8_fp8_attention", _forward, tokens_major_output=True)


def int8_fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """int8 Q·K, fp8 P·V attention of (batch, heads, tokens, dim) tensors, differentiable where gradients flow (the
    backward: exact attention's); the same forward with gradients or without, eager or compiled."""
    return _operator(q, k, v, scale)
