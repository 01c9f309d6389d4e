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
class OpTiming:
    op: str
    shapes: list[list[int]]
    dtype: str
    calls: int
    flops: float  # per call
    seconds: float | None = None  # per call, measured on the device
    replay: Any = field(default=None, repr=False, compare=False)  # (func, meta args, kwargs) to time it again

    @property
    def tflops(self) -> float | None:
        return self.flops / self.seconds / 1e12 if self.seconds else None


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
    weights_on_device: dict[str, int] = field(default_factory=dict)  # stage -> bytes
    ops: list[OpTiming] = field(default_factory=list)
    coverage: float | None = None  # share of forward FLOPs in the timed ops
    compute_seconds: float | None = None  # per forward: matmuls and attention, as timed
    kernels: int | None = None  # device ops per forward
    moved_bytes: int | None = None  # bytes read and written per forward by the other ops
    memory_seconds: float | None = None  # per forward: moved_bytes at the measured copy rate
    overhead_seconds: float | None = None  # per forward: kernels x the measured cost of launching one
    transfer_seconds: float | None = None  # per forward (offload)
    step_seconds: float | None = None
    steps: int | None = None
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        ops, self.ops = self.ops, []
        try:
            out = asdict(self)
        finally:
            self.ops = ops
        out["ops"] = [{"op": op.op, "shapes": op.shapes, "dtype": op.dtype, "calls": op.calls, "flops": op.flops,
                       "seconds": op.seconds, "tflops": op.tflops} for op in ops]
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
    if e.step_seconds is not None:
        rate = (e.forward_flops or 0) / e.compute_seconds / 1e12 if e.compute_seconds else 0
        line = (f"  time per step: {e.step_seconds * 1e3:.4g} ms ({e.forwards_per_step} forward(s); matmuls and "
                f"attention timed on this device: {e.compute_seconds * 1e3:.4g} ms, {100 * (e.coverage or 0):.0f}% of "
                f"the FLOPs at {rate:.3g} TFLOP/s; other ops {_size(e.moved_bytes or 0)} moved: "
                f"{(e.memory_seconds or 0) * 1e3:.3g} ms; {e.kernels} ops launched: {(e.overhead_seconds or 0) * 1e3:.3g} ms")
        if e.transfer_seconds is not None:
            line += f"; block copies {e.transfer_seconds * 1e3:.4g} ms per forward"
        lines.append(line + ")")
        if e.steps:
            lines.append(f"  denoising {e.steps} steps: {e.step_seconds * e.steps:.3g} s (encoding and decoding not "
                         "included)")
    lines += [f"  note: {note}" for note in e.notes]
    return "\n".join(lines)

