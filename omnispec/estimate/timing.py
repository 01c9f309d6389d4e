"""Rates measured on the target device: matmul and attention calls, copies, launches, host-to-device."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.utils._pytree import tree_map

# ---- timing on the device -----------------------------------------------------------------------------------

def _real(value: Any, device: torch.device) -> Any:
    if not isinstance(value, torch.Tensor) or value.device.type != "meta":
        return value
    if value.is_floating_point():
        out = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device)
        return out.normal_() if out.numel() else out
    return torch.zeros(value.shape, dtype=value.dtype, device=device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(func: Any, args: tuple, kwargs: dict, device: torch.device, budget: float = 0.1) -> float:
    """Seconds per call of ``func`` on ``device`` with random inputs shaped as ``args``."""
    args, kwargs = tree_map(lambda v: _real(v, device), (args, kwargs))
    with torch.no_grad():
        for _ in range(2):
            func(*args, **kwargs)
        _sync(device)
        calls, start = 0, time.perf_counter()
        while calls < 3 or (time.perf_counter() - start < budget and calls < 200):
            func(*args, **kwargs)
            calls += 1
            if calls % 10 == 0:
                _sync(device)
        _sync(device)
    return (time.perf_counter() - start) / calls


def copy_rate(device: torch.device) -> float:
    """Bytes per second read plus written by a device-to-device copy (what memory-bound ops move)."""
    nbytes = (256 << 20) if device.type == "cuda" else (64 << 20)
    source = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    target = torch.empty_like(source)
    seconds = time_call(torch.Tensor.copy_, (target, source), {}, device)
    return 2 * nbytes / seconds


def launch_seconds(device: torch.device, ops: int = 200) -> float:
    """The cost of one small op from Python (eager dispatch and kernel launch)."""
    x = torch.zeros(16, device=device)
    for _ in range(20):
        x.add_(1)
    _sync(device)
    start = time.perf_counter()
    for _ in range(ops):
        x.add_(1)
    _sync(device)
    return (time.perf_counter() - start) / ops


def host_to_device_rate(device: torch.device, nbytes: int = 256 << 20) -> float:
    """Bytes per second of a pinned host-to-device copy."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target.copy_(host, non_blocking=True)
    _sync(device)
    start = time.perf_counter()
    for _ in range(3):
        target.copy_(host, non_blocking=True)
    _sync(device)
    return 3 * nbytes / (time.perf_counter() - start)


