"""Whether a device a spec or a caller names is on this machine, told before the model libraries are imported: a
``cuda:N`` or ``mps`` asks torch alone (about a second, where diffusers and transformers take several more); ``auto``
and ``cpu`` ask nothing. The one function of the spec layer that may import torch, and only when called."""

from __future__ import annotations

import re

from .base import DEVICE_PATTERN
from .errors import SpecError, quoted


def check_device_name(device: str, where: str = "device") -> None:
    """``device`` names a device this machine has: ``auto``, ``cpu``, ``mps``, ``cuda`` or ``cuda:N``."""
    if not re.fullmatch(DEVICE_PATTERN, device):
        raise SpecError.single(f"unknown device {quoted(device)}; expected auto, cpu, mps, cuda or cuda:N", where)
    if device in ("auto", "cpu"):
        return
    import torch

    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SpecError.single(f"device {device!r} requested but CUDA is not available here", where)
        index, count = int(device.partition(":")[2] or 0), torch.cuda.device_count()
        if index >= count:
            raise SpecError.single(f"device {device!r}: this machine has {count} CUDA device(s), cuda:0 to "
                                   f"cuda:{count - 1}", where)
    if device == "mps" and not torch.backends.mps.is_available():
        raise SpecError.single("device 'mps' requested but MPS is not available here", where)
