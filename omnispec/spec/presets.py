"""``policies.preset``: named bundles of speed-ups, as data (no torch).

``fast`` asks for every exact speed-up omnispec has (the output is the same computation, rounded differently);
``fastest`` adds the approximate ones, whose quality cost is measured (BENCHMARKS.md, section "fp8 and int8
quantization"). A preset never overrides a field the spec sets itself, and each of its fields applies only where
the family and the device support it: ``policies/presets.py`` resolves it at build against the family's targets
and the device, and says what it turned on, what it left and why. ``explain`` without a build shows what a preset
asks for (``asked``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

if TYPE_CHECKING:
    from .pipeline import PipelineSpec


@dataclass(frozen=True)
class PresetField:
    """One field a preset sets: where in ``policies``, to what, what it is for a reader, whether it approximates,
    and the condition the resolver checks (``needs``: a key of ``policies/presets.py``'s conditions)."""

    path: tuple[str, ...]
    value: Any
    label: str
    needs: str
    approximate: bool = False


FAST = (
    PresetField(("compile", "mode"), "regional", "regional compile of the denoiser's blocks", "cuda"),
    PresetField(("compile", "cudagraphs"), True, "CUDA graphs of the compiled blocks", "cuda"),
    PresetField(("attention", "default"), "flash4", "FlashAttention-4 for every attention", "flash4"),
    PresetField(("attention", "fused_qk_norm_rope"), True, "q/k norms + RoPE in one kernel", "qk_norm_rope"),
    PresetField(("mlp", "fused_gelu"), True, "bias + GELU in the feed-forward matmul", "fused_gelu"),
    PresetField(("mlp", "precomputed_modulation"), True, "modulation linears precomputed per request", "modulation"),
)
# fp8 matmuls with a scale per row: the setting whose cosine against bf16 BENCHMARKS.md records for each family. No
# approximate attention: ``sage`` lost to FlashAttention-4 on Hopper, and whether ``int8_fp8`` beats it is not
# measured yet (BENCHMARKS.md, "int8 Q·K, fp8 P·V attention").
FASTEST = FAST + (
    PresetField(("quantization", "denoiser"), {"method": "fp8_dynamic", "granularity": "row"},
                "fp8 matmuls in the denoisers (torchao, a scale per row)", "fp8", approximate=True),
)
PRESETS: dict[str, tuple[PresetField, ...]] = {"none": (), "fast": FAST, "fastest": FASTEST}


def field_label(path: tuple[str, ...]) -> str:
    return "policies." + ".".join(path)


def explicit(spec: PipelineSpec, path: tuple[str, ...]) -> bool:
    """Whether the spec sets ``policies.<path>`` itself (a key written in a spec file, an ``extends`` base or an
    override), which a preset leaves as it is. For the denoisers' quantization: any entry that names the role or a
    denoiser component."""
    if path[0] == "quantization":
        denoisers = {name for name, c in spec.model.components.items() if c.role == "denoiser"}
        return any(key == "denoiser" or key in denoisers for key in spec.policies.quantization)
    node: Any = spec.policies
    for key in path:
        if not isinstance(node, BaseModel) or key not in node.model_fields_set:
            return False
        node = getattr(node, key)
    return True


def asked(name: str) -> list[dict[str, Any]]:
    """What preset ``name`` asks for, as explain shows it before a build."""
    return [{"field": field_label(f.path), "value": f.value, "what": f.label, "approximate": f.approximate,
             "where": _WHERE[f.needs]} for f in PRESETS[name]]


# what each condition means, for a reader
_WHERE = {
    "cuda": "on CUDA devices",
    "flash4": "where FlashAttention-4 is installed and runs on the device (Hopper, Blackwell)",
    "qk_norm_rope": "on families with a fused q/k norm + RoPE processor",
    "fused_gelu": "on CUDA, families whose feed-forwards are tanh-GELU",
    "modulation": "on families with a modulation table, without offload or sharding",
    "fp8": "on CUDA devices with fp8 matmuls (compute capability 8.9 and up), torchao installed",
}
