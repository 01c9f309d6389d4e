"""The attention kernels a role can run on, and whether each runs here: torch's SDPA kernels (chosen with
``torch.nn.attention.sdpa_kernel``) and the kernels that replace SDPA calls outright (xformers, SageAttention,
FlashAttention-4), each probed once per device, dtype and head size by a real call. ``policies.attention`` puts
them on the model's attentions (hooks, ``auto``'s timing, the fallbacks).

**Forwards that may be differentiated.** A forward with gradients, and every forward of a rollout or a replay (whose
log-probs a replay with gradients must reproduce bit for bit), runs the rule of ``kernels.sdpa``: an SDPA call that
torch's dispatcher would be free to send to cuDNN attention runs with cuDNN attention off (``GradientSafeSDPA``):
flash attention where the call allows it, memory-efficient attention where it has a mask, math last. Their backwards
are the ones torch trains with everywhere; cuDNN attention's backward can fail with a sticky CUDA error that no
fallback can catch (BENCHMARKS.md, "Attention with gradients"), so it runs only where a spec names ``sdpa_cudnn``.
``sage``'s and ``int8_fp8``'s forwards are quantized and their backward exact attention's at the same inputs
(``kernels.straight_through``), so a rollout and its replays with gradients share their forward."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from ..kernels.sdpa import may_train, safe_sdpa
from ..spec.errors import first_line

SDPA_KERNELS = {
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
    "sdpa_math": SDPBackend.MATH,
}
CONCRETE = ("sdpa", *SDPA_KERNELS, "xformers", "sage", "int8_fp8", "flash4")
# Kernels whose results differ from exact attention beyond rounding (both quantize Q and K to int8; int8_fp8 P and V
# to float8 too): auto considers them only when the spec allows approximation.
APPROXIMATE = ("sage", "int8_fp8")
# Never an auto candidate: the math kernel materialises the full score matrix (160 GiB for one Wan-14B
# 480p layer) and is never the fastest.
AUTO_EXCLUDED = ("sdpa_math",)
# Named kernels a forward that may be differentiated runs without a trial of its backward: torch's own flash,
# memory-efficient and math kernels (the ones it trains with everywhere) and the dispatcher restricted to them.
GRADIENT_SAFE = ("sdpa", "sdpa_flash", "sdpa_efficient", "sdpa_math")
# Never an auto candidate where a forward may be differentiated: cuDNN attention's backward runs only where named.
NOT_FOR_GRADIENTS = ("sdpa_cudnn",)


class SDPAMode(TorchFunctionMode):
    """A mode that sees every SDPA call (``on_sdpa``) and passes everything else through."""

    def on_sdpa(self, func: Callable, args: tuple, kwargs: dict):
        return func(*args, **kwargs)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self.on_sdpa(func, args, kwargs)
        if func is torch.Tensor.unflatten:
            # the same operation; under compile dynamo traces the mode and cannot follow Tensor.unflatten's
            # ``super().unflatten`` (torch 2.11 and 2.13), which every diffusers processor calls
            return torch.unflatten(*args, **kwargs)
        return func(*args, **kwargs)


# ---- forwards that may be differentiated --------------------------------------------------------------

class GradientSafeSDPA(SDPAMode):
    """SDPA calls in a forward that may be differentiated run under ``safe_sdpa``; a call whose kernel was named runs
    as named. Dynamo traces the mode into compiled blocks and guards on it, so a block compiled for generation is
    compiled again for rollouts and replays."""

    def on_sdpa(self, func: Callable, args: tuple, kwargs: dict):
        with safe_sdpa():
            return func(*args, **kwargs)


def gradient_safe_context() -> GradientSafeSDPA | nullcontext:
    """``GradientSafeSDPA`` where a forward starting now may be differentiated, else nothing."""
    return GradientSafeSDPA() if may_train() else nullcontext()


# ---- the replacement kernels ----------------------------------------------------------------------

def _xformers_attention(q, k, v, scale):
    import xformers.ops as xops

    out = xops.memory_efficient_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale)
    return out.transpose(1, 2)


def _sage_attention(q, k, v, scale):
    """Sage-style int8 attention (``kernels/sage.py``): ``sageattn`` on CUDA, omnispec's plain-torch reference on the
    CPU; where gradients flow, its backward is exact attention's at the same q, k and v."""
    from ..kernels.sage import sage_attention

    return sage_attention(q, k, v, scale)


def _int8_fp8_attention(q, k, v, scale):
    """int8 Q·K, fp8 P·V attention (``kernels/int8_fp8.py``): omnispec's Triton kernel on CUDA, its plain-torch
    reference on the CPU; where gradients flow, its backward is exact attention's at the same q, k and v."""
    from ..kernels.int8_fp8 import int8_fp8_attention

    return int8_fp8_attention(q, k, v, scale)


def _flash4_attention(q, k, v, scale):
    """FlashAttention-4's CuTe kernels (package ``flash-attn-4``; Hopper and Blackwell) through omnispec's operators
    (``flash4.py``), which compiled code can call too and which run a call shape the package refuses on SDPA (one
    warning). How it compares with cuDNN's: BENCHMARKS.md, "Attention backends and FlashAttention-4"."""
    from ..kernels.flash4 import flash4_sdpa

    return flash4_sdpa(q, k, v, scale)


_REPLACEMENTS: dict[str, Callable] = {"xformers": _xformers_attention, "sage": _sage_attention,
                                      "int8_fp8": _int8_fp8_attention, "flash4": _flash4_attention}


class _RedirectSDPA(SDPAMode):
    """Sends plain (maskless, non-causal, no dropout) SDPA calls to another kernel, only those of ``head_sizes`` when
    given; others pass through."""

    def __init__(self, kernel: Callable, head_sizes: frozenset[int] | None = None):
        super().__init__()
        self.kernel, self.head_sizes = kernel, head_sizes

    def on_sdpa(self, func: Callable, args: tuple, kwargs: dict):
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        call = dict(zip(names, args)) | kwargs  # diffusers passes query=/key=/value= by keyword
        q, k, v = call.get("query"), call.get("key"), call.get("value")
        plain = (q is not None and call.get("attn_mask") is None and not call.get("is_causal")
                 and not call.get("dropout_p") and not call.get("enable_gqa") and q.shape[-3] == k.shape[-3]
                 and (self.head_sizes is None or q.shape[-1] in self.head_sizes))
        if plain:
            return self.kernel(q, k, v, call.get("scale"))
        return func(*args, **kwargs)


def redirect_mode(backend: str, head_sizes: frozenset[int] | None = None) -> TorchFunctionMode:
    """The mode sending plain SDPA calls to a replacement kernel (``xformers``, ``sage``, ``int8_fp8``, ``flash4``)."""
    return _RedirectSDPA(_REPLACEMENTS[backend], head_sizes)


@contextmanager
def backend_context(backend: str) -> Iterator[None]:
    if backend == "sdpa":
        yield
    elif backend in SDPA_KERNELS:
        with sdpa_kernel([SDPA_KERNELS[backend]]):
            yield
    else:
        with redirect_mode(backend):
            yield


# ---- detection ------------------------------------------------------------------------------------

# The replacement kernels' packages: backend -> (module to import, package name, runs only on CUDA). ``sage`` and
# ``int8_fp8`` run on the CPU too (their plain-torch references) and say where they cannot run themselves (``refusal``).
_PACKAGES = {"xformers": ("xformers.ops", "xformers", False), "flash4": ("flash_attn.cute", "flash-attn-4", True)}


def probe(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """None when the backend runs here for this dtype and head size, else the reason it does not."""
    if backend in ("sage", "int8_fp8"):
        kernel = importlib.import_module(f"..kernels.{backend}", __package__)
        if (why := kernel.refusal(device, dtype, head_dim)) is not None:
            return why
    if backend in _PACKAGES:
        module, package, cuda_only = _PACKAGES[backend]
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - any import failure means unusable (FA4's compiler fails many ways)
            why = first_line(exc)
            return f"{package} is not importable ({type(exc).__name__}{': ' + why if why else ''})"
        if cuda_only and device.type != "cuda":
            return f"{package} runs only on CUDA"
    q = torch.randn(1, 2, 64, head_dim, device=device, dtype=dtype)
    # torch warns why each SDPA kernel it passes over cannot run (float32 on CUDA: flash, memory-efficient and cuDNN
    # each): that is the probe's answer, so it goes into the reason returned, not to the user's terminal
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        try:
            with backend_context(backend):
                out = F.scaled_dot_product_attention(q, q, q)
            if backend == "flash4":  # its operators fall back to SDPA on a refusal: ask them
                from ..kernels.flash4 import refused

                if (why := refused(*(q.transpose(1, 2),) * 3)) is not None:
                    return f"flash-attn-4 refused a test call ({why})"
            ref = F.scaled_dot_product_attention(q.float(), q.float(), q.float())
            if not torch.isfinite(out).all() or torch.nn.functional.cosine_similarity(
                out.float().flatten(), ref.flatten(), dim=0) < 0.99:
                return "gave wrong results in a test call"
        except Exception as exc:  # noqa: BLE001 - a kernel that can't run raises many kinds of errors
            said = _torch_said(caught)
            return f"{type(exc).__name__}: {first_line(exc) or 'no kernel'}" + (f" (torch: {said})" if said else "")
    return None


def _torch_said(caught: list[warnings.WarningMessage]) -> str:
    """torch's warnings from a probe call, each once, without where in torch they were raised and without the
    headings ("... not used because:") whose reasons follow as warnings of their own."""
    said: list[str] = []
    for warning in caught:
        text = str(warning.message).split(" (Triggered internally")[0].strip()
        if text and not text.endswith("because:") and text not in said:
            said.append(text)
    return "; ".join(said)


_PROBES: dict[tuple[str, str, torch.dtype, int], str | None] = {}


def usable(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    key = (backend, str(device), dtype, head_dim)
    if key not in _PROBES:
        _PROBES[key] = probe(backend, device, dtype, head_dim)
    return _PROBES[key]
