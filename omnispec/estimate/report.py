"""What an estimate holds, and how it reads."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class ComponentBytes:
    name: str
    role: str
    params: int
    stored_bytes: int
    bytes: int  # on the device, in its load dtype and quantization
    how: str  # "safetensors header" or "config (meta)"
    blocks: dict[str, int] = field(default_factory=dict)  # repeated block -> bytes (offload streams these)


@dataclass
class OpCount:
    op: str
    shapes: list[list[int]]
    dtype: str
    calls: int
    flops: float  # per call


@dataclass
class Estimate:
    device: str
    request: dict[str, Any]
    components: list[ComponentBytes]
    denoiser: str | None = None
    passes: int = 1
    rows_per_forward: int = 1
    forwards_per_step: int = 1
    forward_flops: float | None = None
    step_flops: float | None = None
    activation_bytes: dict[str, int] = field(default_factory=dict)  # stage -> peak live bytes
    peak_bytes: int | None = None
    peak_stage: str | None = None
    host_bytes: int = 0  # weights the offload policy keeps in host memory (one copy, page-locked by default)
    weights_on_device: dict[str, int] = field(default_factory=dict)  # stage -> bytes
    ops: list[OpCount] = field(default_factory=list)
    compute_seconds: float | None = None  # per forward: its FLOPs at the device kind's peak and share
    kernels: int | None = None  # device ops per forward
    moved_bytes: int | None = None  # bytes read and written per forward by the other ops
    memory_seconds: float | None = None  # per forward: moved_bytes at the device kind's bandwidth
    overhead_seconds: float | None = None  # per forward: kernels x the device kind's cost of launching one
    timed_for: str | None = None  # the device kind and rate the times are for
    transfer_seconds: float | None = None  # per forward (offload)
    step_seconds: float | None = None
    steps: int | None = None
    notes: list[str] = field(default_factory=list)
    mesh: list[str] = field(default_factory=list)  # which rank holds and runs what (several processes)
    denoiser_bytes_per_rank: int | None = None  # the denoisers' bytes one rank keeps between forwards
    host_bytes_per_rank: int | None = None  # of them, in host memory (distributed offload)

    def as_dict(self) -> dict[str, Any]:
        ops, self.ops = self.ops, []
        try:
            out = asdict(self)
        finally:
            self.ops = ops
        out["ops"] = [{"op": op.op, "shapes": op.shapes, "dtype": op.dtype, "calls": op.calls, "flops": op.flops}
                      for op in ops]
        return out




# ---- rendering ----------------------------------------------------------------------------------------------

def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.3g} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return str(n)


def _count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(int(n))


def _flops(n: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.3g} FLOP"


def render_estimate(e: Estimate) -> str:
    request = ", ".join(f"{k} {v}" for k, v in e.request.items())
    lines = [f"estimate for {e.device} ({request}):"]
    lines.append(f"  {'component':<16} {'role':<10} {'params':>8} {'stored':>10} {'on device':>10}  from")
    for c in e.components:
        lines.append(f"  {c.name:<16} {c.role:<10} {_count(c.params):>8} {_size(c.stored_bytes):>10} "
                     f"{_size(c.bytes):>10}  {c.how}")
    if e.forward_flops is not None:
        lines.append(f"  denoiser forward ({e.denoiser}, {e.rows_per_forward} row(s)): {_flops(e.forward_flops)}; "
                     f"per step {_flops(e.step_flops or 0)}")
    if e.peak_bytes is not None:
        weights = e.weights_on_device.get(e.peak_stage or "", 0)
        act = e.activation_bytes.get(e.peak_stage or "", 0)
        lines.append(f"  peak device memory: {_size(e.peak_bytes)} while {e.peak_stage} (weights {_size(weights)} + "
                     f"activations {_size(act)})")
    if e.host_bytes:
        lines.append(f"  host memory for offloaded weights: {_size(e.host_bytes)} (one copy, page-locked unless "
                     "pin_memory: false)")
    if e.step_seconds is not None:
        line = (f"  time per step: {e.step_seconds * 1e3:.4g} ms ({e.forwards_per_step} forward(s) on {e.timed_for}: "
                f"FLOPs {(e.compute_seconds or 0) * 1e3:.4g} ms; other ops {_size(e.moved_bytes or 0)} moved: "
                f"{(e.memory_seconds or 0) * 1e3:.3g} ms; {e.kernels} ops launched: {(e.overhead_seconds or 0) * 1e3:.3g} ms")
        if e.transfer_seconds is not None:
            line += f"; block copies {e.transfer_seconds * 1e3:.4g} ms per forward"
        lines.append(line + ")")
        if e.steps:
            lines.append(f"  denoising {e.steps} steps: {e.step_seconds * e.steps:.3g} s (encoding and decoding not "
                         "included)")
    if e.mesh:
        lines.append(f"  per rank ({len(e.mesh)} ranks): denoisers {_size(e.denoiser_bytes_per_rank or 0)} on the "
                     f"device and {_size(e.host_bytes_per_rank or 0)} in host memory between forwards; the peak above "
                     "is one rank's")
        lines += [f"    {line}" for line in e.mesh]
    lines += [f"  note: {note}" for note in e.notes]
    return "\n".join(lines)

