"""torch's SDPA kernels as omnispec chooses among them: which forwards may be differentiated (``training_forwards``,
``may_train``), cuDNN attention kept out where the dispatcher would be free to pick it for them (``safe_sdpa``), exact
attention's gradients for the backward operators of omnispec's own attention kernels
(``exact_attention_gradients``), and the record of a kernel's failures."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
import torch.nn.functional as F
from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..log import logger
from ..spec.errors import first_line
from .torch_internals import (
    _scaled_dot_product_efficient_attention,
    _scaled_dot_product_efficient_attention_backward,
    _scaled_dot_product_flash_attention,
    _scaled_dot_product_flash_attention_backward,
    _scaled_dot_product_flash_attention_for_cpu,
    _scaled_dot_product_flash_attention_for_cpu_backward,
)

# SDPA's kernels in the order the dispatcher tries them while cuDNN attention is off.
_SAFE_ORDER = ((SDPBackend.FLASH_ATTENTION, torch.backends.cuda.flash_sdp_enabled),
               (SDPBackend.EFFICIENT_ATTENTION, torch.backends.cuda.mem_efficient_sdp_enabled),
               (SDPBackend.MATH, torch.backends.cuda.math_sdp_enabled))
# Scores the float32 math gradients hold at once (query rows times key tokens, over batch and heads).
_SCORES_AT_ONCE = 1 << 24


def _safe_kernels() -> list[SDPBackend] | None:
    """The kernels an SDPA call may run on while the dispatcher is free to pick cuDNN attention (it is on beside
    another kernel): the others that are on, in the dispatcher's order; None where the choice is already made.
    Compiled code cannot read the switches (dynamo does not trace them), and there no kernel was named (only
    ``flash4``, which bypasses SDPA): all three."""
    if torch.compiler.is_compiling():
        return [kernel for kernel, _ in _SAFE_ORDER]
    if not torch.backends.cuda.cudnn_sdp_enabled():
        return None
    safe = [kernel for kernel, enabled in _SAFE_ORDER if enabled()]
    return safe or None  # cuDNN alone: a spec named it


def safe_sdpa() -> AbstractContextManager:
    """cuDNN attention off for the SDPA calls inside, where the dispatcher would otherwise be free to pick it."""
    safe = _safe_kernels()
    return sdpa_kernel(safe, set_priority=True) if safe is not None else nullcontext()


def exact_attention_gradients(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients at (batch, heads, tokens, dim) ``q``, ``k``, ``v`` of exact attention, given ``grad_out`` of its
    output: the forward recomputed and differentiated by aten's own SDPA operators, on the first of flash and
    memory-efficient attention that is on and takes the call (on the CPU its flash kernel), else in float32 math.
    cuDNN attention never: its backward can fail with a sticky CUDA error.

    For the body of a backward operator, which runs below autograd, where plain autograd records nothing. Why not
    ``torch.func.vjp`` there: its wrapper tensors have no storage a TorchDispatchMode can read, so the backward failed
    under every one (FlopCounterMode, the profiler's memory modes)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if q.device.type == "cpu" and q.shape[-1] == v.shape[-1]:
        out, lse = _scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)
        return _scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, False, scale=scale)
    if q.device.type == "cuda":
        params = SDPAParams(q, k, v, None, 0.0, False, False)
        if torch.backends.cuda.flash_sdp_enabled() and can_use_flash_attention(params):
            return _flash_gradients(grad_out, q, k, v, scale)
        if torch.backends.cuda.mem_efficient_sdp_enabled() and can_use_efficient_attention(params):
            out, lse, seed, offset = _scaled_dot_product_efficient_attention(
                q, k, v, None, True, 0.0, False, scale=scale)
            dq, dk, dv, _ = _scaled_dot_product_efficient_attention_backward(
                grad_out, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], False, scale=scale)
            return dq, dk, dv
    return _math_gradients(grad_out, q, k, v, scale)


def _flash_gradients(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flash attention's forward and backward, the head size padded with zeros to a multiple of 8 as SDPA pads it
    (the scale is the unpadded size's)."""
    dim = q.shape[-1]
    padded = [F.pad(t, (0, -dim % 8)) if dim % 8 else t for t in (q, k, v, grad_out)]
    q_p, k_p, v_p, grad_p = (t if t.stride(-1) == 1 else t.contiguous() for t in padded)
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = _scaled_dot_product_flash_attention(
        q_p, k_p, v_p, 0.0, False, False, scale=scale)
    grads = _scaled_dot_product_flash_attention_backward(
        grad_p, q_p, k_p, v_p, out, lse, cum_q, cum_k, max_q, max_k, 0.0, False, seed, offset, scale=scale)
    return tuple(g[..., :dim] for g in grads)  # type: ignore[return-value]


def _math_gradients(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention's gradients in float32, a block of query rows at a time (their scores held at once)."""
    k32, v32 = k.float(), v.float()
    dq, dk, dv = [], torch.zeros_like(k32), torch.zeros_like(v32)
    rows = max(1, _SCORES_AT_ONCE // max(1, q.shape[0] * q.shape[1] * k.shape[-2]))
    for start in range(0, q.shape[-2], rows):
        q32, g32 = q[..., start:start + rows, :].float(), grad_out[..., start:start + rows, :].float()
        probs = torch.softmax((q32 @ k32.transpose(-2, -1)) * scale, dim=-1)
        dv += probs.transpose(-2, -1) @ g32
        d_probs = g32 @ v32.transpose(-2, -1)
        d_scores = probs * (d_probs - (d_probs * probs).sum(-1, keepdim=True)) * scale
        dq.append(d_scores @ k32)
        dk += d_scores.transpose(-2, -1) @ q32
    return torch.cat(dq, dim=-2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def remember_failure(failures: dict[tuple, str], key: tuple, exc: BaseException, what: str) -> None:
    """Keep why the calls of ``key`` failed, warning once (``what`` says which calls); those calls then run on
    torch's SDPA. Running out of memory is no failure of a kernel: it is raised again."""
    if isinstance(exc, torch.OutOfMemoryError):
        raise exc
    if key not in failures:
        failures[key] = f"{type(exc).__name__}: {first_line(exc)}"
        logger.warning(f"{what} ({failures[key]}); those calls run on torch's SDPA from now on")


# How many ``training_forwards`` blocks are open: a plain module global, which dynamo guards on where a whole
# denoiser is compiled with the hook that reads it.
_training_depth = 0


@contextmanager
def training_forwards() -> Iterator[None]:
    """Forwards inside run with the kernels a backward may follow, gradients or not: rollouts and their replays,
    so a replay with gradients computes the forward its rollout computed."""
    global _training_depth
    _training_depth += 1
    try:
        yield
    finally:
        _training_depth -= 1


def may_train() -> bool:
    """Whether a forward starting now may be differentiated: gradients are on, or it is a rollout's or a replay's."""
    return torch.is_grad_enabled() or _training_depth > 0
