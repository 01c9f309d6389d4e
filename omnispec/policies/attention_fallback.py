"""Attention backends that fail at run time fall back: a call a named backend cannot serve (forward, or backward
where gradients flow) runs again on SDPA, with one warning per backend and call shape (``FAILED``).

Kept apart from the attention policy (``attention.py``), which decides the backend each role runs; this module only
runs a call on it and recovers from a failure the backend raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..kernels.sdpa import remember_failure, safe_sdpa
from .attention_kernels import backend_context

# Backends that failed at run time, with why; the calls they would have served run on torch's default SDPA. A
# kernel can fail for one shape and not another (cuDNN's backward has), so a failure is per backend
# and call shape, warned once.
FAILED: dict[tuple, str] = {}
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_TENSOR_ARGS = ("query", "key", "value", "attn_mask")


def fall_back(key: tuple, exc: BaseException) -> None:
    """Remember that a backend failed for a call (``FAILED``) and warn once; its calls then run on SDPA."""
    remember_failure(FAILED, key, exc, f"attention backend {key[0]} failed for a call of shape {key[1]}")


def guarded_forward(forward: Callable, backend: str, args: tuple, kwargs: dict, grad: bool) -> Any:
    """``forward`` with its SDPA calls on ``backend``. A call the backend fails at run time reruns on SDPA with one
    warning (cuDNN attention off where the forward may be differentiated), and so does a backward it fails (with
    gradients flowing, each call's graph is kept inside ``_GuardedAttention``, whose backward falls back)."""
    if backend == "sdpa":
        return forward(*args, **kwargs)
    if grad:
        with _GuardSDPA(backend, grad):
            return forward(*args, **kwargs)
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    key = (backend, tuple(getattr(hidden, "shape", ())), getattr(hidden, "dtype", None), "forward", False)
    if key in FAILED:
        return forward(*args, **kwargs)
    try:  # without gradients the module's forward is pure: a failed call simply runs again
        with backend_context(backend):
            return forward(*args, **kwargs)
    except (RuntimeError, NotImplementedError) as exc:
        fall_back(key, exc)
        return forward(*args, **kwargs)


class _GuardSDPA(TorchFunctionMode):
    """Runs each SDPA call on ``backend`` (through ``backend_context``), falling back as ``guarded_forward`` says."""

    def __init__(self, backend: str, grad: bool):
        super().__init__()
        self.backend, self.grad = backend, grad

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        call = dict(zip(_SDPA_ARGS, args)) | kwargs
        key = (self.backend, tuple(call["query"].shape), call["query"].dtype, str(call["query"].device), self.grad)
        if key in FAILED:
            return func(**call)
        tensors = [call.get(name) for name in _TENSOR_ARGS]
        if self.grad and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
            options = {k: v for k, v in call.items() if k not in _TENSOR_ARGS}
            return _GuardedAttention.apply(self.backend, key, options, *tensors)
        try:
            with backend_context(self.backend):
                return func(**call)
        except (RuntimeError, NotImplementedError) as exc:
            fall_back(key, exc)
            return func(**call)


class _GuardedAttention(torch.autograd.Function):
    """SDPA on a backend whose backward may fail: the forward builds the call's graph on detached inputs and keeps
    it; the backward differentiates that graph, and if the backend fails there, recomputes the call on SDPA with
    cuDNN attention off and differentiates that instead (one warning). A failure that leaves the device unusable (a
    sticky CUDA error) cannot be caught: that is why a backend's backward is tried before it trains
    (``passes_gradient_trial``)."""

    @staticmethod
    def forward(ctx, backend, key, options, query, key_t, value, attn_mask):  # type: ignore[override]
        inner = [t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
                 for t in (query, key_t, value, attn_mask)]
        call = dict(zip(_TENSOR_ARGS, inner)) | options
        with torch.enable_grad():
            try:
                with backend_context(backend):
                    out = F.scaled_dot_product_attention(**call)
            except (RuntimeError, NotImplementedError) as exc:
                fall_back(key, exc)
                with safe_sdpa():
                    out = F.scaled_dot_product_attention(**call)
        ctx.key, ctx.call, ctx.inner, ctx.out = key, call, inner, out
        return out.detach()

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        wanted = [i for i, t in enumerate(ctx.inner) if isinstance(t, torch.Tensor) and t.requires_grad]
        inputs = [ctx.inner[i] for i in wanted]
        try:
            grads = torch.autograd.grad(ctx.out, inputs, grad_out, allow_unused=True)
        except (RuntimeError, NotImplementedError) as exc:
            fall_back(ctx.key, exc)
            with torch.enable_grad(), safe_sdpa():
                again = F.scaled_dot_product_attention(**ctx.call)
            grads = torch.autograd.grad(again, inputs, grad_out, allow_unused=True)
        out = [None] * 4
        for i, g in zip(wanted, grads):
            out[i] = g
        ctx.call = ctx.inner = ctx.out = None
        return None, None, None, *out
