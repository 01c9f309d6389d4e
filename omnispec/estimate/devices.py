"""Devices an estimate is for, by their published figures: dense matmul peaks per dtype, memory bandwidth, the
host-to-device link, and what share of the peak an eager or compiled denoiser forward reaches.

An estimate times no run of the model: a per-step time measured on a busy machine swings with its load, and one
measured at 1024x1024 on a CPU takes minutes. Only the CPU kind is measured, on small fixed stacks (``calibrate``).
Time is FLOPs over the device's peak for the model's dtype times the share a denoiser reaches, plus the other ops'
bytes over its bandwidth, or the ops' launch cost where that is larger. The shares come from FLUX.1-dev's eager and
compiled steps recorded in BENCHMARKS.md ("Interpreter overhead and per-family parity", "Compile: regional, full, CUDA
graphs, autotune").
"""

from __future__ import annotations

from dataclasses import dataclass

EAGER_SHARE = 0.43
COMPILED_SHARE = 0.56
BANDWIDTH_SHARE = 0.7  # of the published memory bandwidth that elementwise ops reach


@dataclass(frozen=True)
class DeviceKind:
    name: str
    tflops: dict[str, float]  # dense peak per dtype (bfloat16, float16, float32, float8)
    bandwidth: float  # bytes per second
    host_link: float | None  # pinned host-to-device bytes per second (None: the host is the device)
    launch_seconds: float  # per op, eager dispatch and launch
    share: float | None = None  # of the matmul peak a forward reaches, when not EAGER_SHARE / COMPILED_SHARE
    # Whether an op's dispatch overlaps the device's work on earlier ops (a GPU's queue); on a CPU the thread that
    # dispatches an op also runs it, so the two add up.
    overlaps: bool = True
    basis: str = "published figures"  # where the figures come from (the CPU's: measured here)

    def seconds(self, flops: float, dtype: str, compiled: bool) -> float:
        share = self.share or (COMPILED_SHARE if compiled else EAGER_SHARE)
        return flops / (self.tflops[dtype] * 1e12 * share)


def _cpu(threads: int | None) -> DeviceKind:
    """This machine's CPU at ``threads`` (``runtime.threads``; unset: what a run here would choose), measured
    (``calibrate``): CPUs publish no figure that predicts eager torch on them."""
    from .calibrate import cpu_kind

    return cpu_kind(threads)


# Published dense (no sparsity) tensor-core peaks; float32 is the plain (non-TF32) rate, as torch runs float32
# matmuls by default.
KINDS = {
    "h200": DeviceKind("NVIDIA H200", {"bfloat16": 989, "float16": 989, "float8": 1979, "float32": 67}, 4.8e12, 55e9,
                       6e-6),
    "h100": DeviceKind("NVIDIA H100 SXM", {"bfloat16": 989, "float16": 989, "float8": 1979, "float32": 67}, 3.35e12,
                       55e9, 6e-6),
    "a100": DeviceKind("NVIDIA A100 80GB SXM", {"bfloat16": 312, "float16": 312, "float8": 312, "float32": 19.5},
                       2.04e12, 25e9, 6e-6),
    "l40s": DeviceKind("NVIDIA L40S", {"bfloat16": 362, "float16": 362, "float8": 733, "float32": 91.6}, 864e9, 25e9,
                       6e-6),
    "4090": DeviceKind("NVIDIA GeForce RTX 4090", {"bfloat16": 165, "float16": 165, "float8": 330, "float32": 82.6},
                       1.0e12, 25e9, 6e-6),
}
NAMES = (*KINDS, "cpu")


def device_kind(name: str | None, threads: int | None = None) -> DeviceKind:
    """The named kind, or this machine's (its GPU when torch names one of the kinds, else its CPU at ``threads``)."""
    if name == "cpu":
        return _cpu(threads)
    if name is not None:
        if name not in KINDS:
            from ..spec import SpecError

            raise SpecError.single(f"unknown device kind {name!r}; known: {', '.join(NAMES)}", "--device-kind")
        return KINDS[name]
    return local_kind() or _cpu(threads)


def local_kind() -> DeviceKind | None:
    """The kind of this machine's first CUDA device, when it is one of ``KINDS``."""
    import torch

    if not torch.cuda.is_available():
        return None
    gpu = torch.cuda.get_device_name(0).lower()
    for key, kind in KINDS.items():
        if key in gpu.replace(" ", "").replace("-", "") or kind.name.lower() in gpu:
            return kind
    return None


__all__ = ["COMPILED_SHARE", "EAGER_SHARE", "KINDS", "NAMES", "DeviceKind", "device_kind", "local_kind"]
