"""torch's SDPA kernels as omnispec chooses among them: which forwards may be differentiated (``training_forwards``,
``may_train``), cuDNN attention kept out where the dispatcher would be free to pick it for them (``safe_sdpa``), and
the record of a kernel's failures."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..log import logger
from ..spec.errors import first_line

# SDPA's kernels in the order the dispatcher tries them while cuDNN attention is off.
_SAFE_ORDER = ((SDPBackend.FLASH_ATTENTION, torch.backends.cuda.flash_sdp_enabled),
               (SDPBackend.EFFICIENT_ATTENTION, torch.backends.cuda.mem_efficient_sdp_enabled),
               (SDPBackend.MATH, torch.backends.cuda.math_sdp_enabled))


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
