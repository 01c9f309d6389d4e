"""This machine's CPU as an estimate's device kind, measured on two small stacks of transformer-like blocks.

A CPU has no published figure to take: machines that run the same wheel differ threefold in the time eager torch
takes to dispatch one op, and more in what small matmuls reach. So the CPU kind is measured here, once a process
and thread count (the count a run here would use), in tens of milliseconds: a stack of narrow blocks, whose time is all dispatch, gives the cost of one
op; a stack of wider ones, at the size of the tiny models omnispec runs on CPUs, gives the matmul rate left once
dispatch and the other ops' bytes are taken out. Each time is the fastest of several repeats, so other processes'
load lifts it only as far as it lifts every op of a run. Ops are counted as the estimate counts a model's forward
(``counting.counting`` on the CPU), so the cost per op is per counted op.
"""

from __future__ import annotations

import functools
import time

from .devices import BANDWIDTH_SHARE, DeviceKind

CPU_BANDWIDTH = 20e9  # bytes per second that elementwise ops reach on one socket, a figure most servers exceed
_REPEATS = 7


def cpu_kind(wanted_threads: int | None = None) -> DeviceKind:
    """The CPU at the torch threads a run here would use (``runtime.threads``, else ``threads.cpu_threads``'s
    choice)."""
    from ..runtime.threads import cpu_threads

    return _measured(cpu_threads(wanted_threads))


@functools.cache
def _measured(threads: int) -> DeviceKind:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        narrow_kernels, _, _, narrow_seconds = _timed(width=16, tokens=4)  # its matmuls and bytes: nanoseconds
        launch = narrow_seconds / narrow_kernels
        kernels, flops, moved, seconds = _timed(width=128, tokens=64)
    finally:
        torch.set_num_threads(before)
    matmul_seconds = seconds - kernels * launch - moved / (CPU_BANDWIDTH * BANDWIDTH_SHARE)
    # The matmuls are given at least half the wide stack's time: where an op's dispatch costs more there than in the
    # narrow stack, the subtraction would leave almost nothing, and an absurd rate.
    rate = flops / max(matmul_seconds, seconds / 2) / 1e12
    return DeviceKind("cpu", {"float32": rate, "bfloat16": rate / 2, "float16": rate / 2, "float8": rate / 2},
                      CPU_BANDWIDTH, None, launch, share=1.0, overlaps=False,
                      basis=f"measured here at {threads} torch thread(s): {launch * 1e6:.3g} µs an op")


def _blocks(width: int):
    """Four pre-norm blocks of diffusers' ``Attention`` and ``FeedForward``, the modules most families' denoisers
    are made of: their Python around each op is part of what an op costs."""
    import torch
    from diffusers.models.attention import FeedForward
    from diffusers.models.attention_processor import Attention
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1 = nn.LayerNorm(width)
            self.attn = Attention(query_dim=width, heads=4, dim_head=width // 4, bias=True, out_bias=True)
            self.norm2 = nn.LayerNorm(width)
            self.ff = FeedForward(width, mult=4, activation_fn="gelu-approximate")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(self.norm1(x))
            return x + self.ff(self.norm2(x))

    torch.manual_seed(0)
    return nn.Sequential(*(Block() for _ in range(4)))


def _timed(width: int, tokens: int) -> tuple[int, float, int, float]:
    """Counted ops, matmul FLOPs, other ops' bytes and the fastest time of one forward of a stack at this size."""
    import torch

    from .counting import Shadow, counting

    model = _blocks(width)
    x = torch.randn(2, tokens, width)
    with counting(Shadow(), device_type="cpu") as counter:
        model(x)
    with torch.inference_mode():
        fastest = float("inf")
        for _ in range(_REPEATS):
            start = time.perf_counter()
            model(x)
            fastest = min(fastest, time.perf_counter() - start)
    flops = sum(group.flops * group.calls for group in counter.groups.values())
    return counter.kernels, flops, counter.moved, fastest


__all__ = ["cpu_kind"]
