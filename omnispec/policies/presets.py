"""Resolving ``policies.preset`` at build: each of the preset's fields (``spec/presets.py``) is set where the spec
leaves it unset, its condition holds on this family and device, and it adds no problem to the spec's rules or to
``policy_problems``; the resolved spec names the preset ``none`` and carries the fields (the spec as run, which a
record stores and a replay rebuilds), and the outcome says what was turned on, kept and left out, and why."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from pydantic import ValidationError

from ..spec import PipelineSpec, SpecError
from ..spec.errors import Problem
from ..spec.presets import PRESETS, PresetField, explicit, field_label
from ..targets import Targets


@dataclass(frozen=True)
class DeviceFacts:
    """What the preset's conditions ask of the device: CUDA or not, its compute capability, why FlashAttention-4
    cannot run (None: it can), whether torchao is installed."""

    cuda: bool
    capability: tuple[int, int] | None = None
    flash4_refusal: str | None = "not a CUDA device"
    torchao: bool = False

    @classmethod
    def of(cls, device: torch.device, dtype: torch.dtype) -> DeviceFacts:
        if device.type != "cuda":
            return cls(cuda=False, torchao=importlib.util.find_spec("torchao") is not None)
        from .attention_kernels import usable

        return cls(cuda=True, capability=torch.cuda.get_device_capability(device),
                   flash4_refusal=usable("flash4", device, dtype, 128),
                   torchao=importlib.util.find_spec("torchao") is not None)


@dataclass
class PresetOutcome:
    """What a preset did: the fields it set, those the spec sets itself (kept, with their value), and those left
    out with the reason."""

    name: str
    turned_on: list[PresetField] = field(default_factory=list)
    kept: list[tuple[PresetField, Any]] = field(default_factory=list)
    left_out: list[tuple[PresetField, str]] = field(default_factory=list)

    @property
    def approximate(self) -> list[str]:
        return [f.label for f in self.turned_on if f.approximate]

    def note(self) -> str:
        """explain's line: what the preset turned on (approximate ones marked), kept and left out."""
        on = [f.label + (" (approximate)" if f.approximate else "") for f in self.turned_on]
        parts = [f"{self.name}: " + (", ".join(on) if on else "nothing turned on")]
        parts += [f"kept {field_label(f.path)} = {value!r} (set by the spec)" for f, value in self.kept]
        reasons: dict[str, list[str]] = {}
        for f, why in self.left_out:
            reasons.setdefault(why, []).append(f.label)
        parts += [f"left out {', '.join(labels)} ({why})" for why, labels in reasons.items()]
        return "; ".join(parts)

    def record(self) -> dict[str, Any]:
        """What an output's record says of the preset."""
        return {"name": self.name,
                "turned_on": {field_label(f.path): f.value for f in self.turned_on},
                "approximate": self.approximate,
                "left_out": {field_label(f.path): why for f, why in self.left_out}}


def _conditions(targets: Targets, facts: DeviceFacts) -> dict[str, str | None]:
    """Each condition of ``spec/presets.py``: None where it holds, else why not."""
    cuda = None if facts.cuda else "CUDA devices only"
    fp8 = cuda or (None if facts.capability and facts.capability >= (8, 9) else
                   f"fp8 matmuls need compute capability 8.9 or more (this GPU: {facts.capability})")
    return {
        "cuda": cuda,
        "flash4": cuda or (f"FlashAttention-4 cannot run here ({facts.flash4_refusal})" if facts.flash4_refusal
                           else None if targets.attention.roles else targets.missing("attention")),
        "qk_norm_rope": cuda or (None if targets.attention.qk_norm_rope_processor is not None
                                 else targets.missing("qk_norm_rope")),
        "fused_gelu": cuda or (None if targets.mlp is not None else targets.missing("mlp")),
        "modulation": None if targets.modulation is not None else targets.missing("modulation"),
        "fp8": fp8 or (None if facts.torchao else "torchao is not installed (pip install 'omnispec-diffusion[quant]')"),
    }


def resolve_preset(spec: PipelineSpec, targets: Targets, facts: DeviceFacts,
                   problems: Callable[[PipelineSpec], list[Problem]]) -> tuple[PipelineSpec, PresetOutcome]:
    """The spec with its preset's fields set (in the preset's order, each checked on the spec so far), and what the
    preset did. ``problems`` lists what cannot run of a spec here (``policy_problems`` at build)."""
    outcome = PresetOutcome(spec.policies.preset)
    if outcome.name == "none":
        return spec, outcome
    conditions = _conditions(targets, facts)
    data = _data(spec)
    data["policies"]["preset"] = "none"
    current = PipelineSpec.model_validate(data)
    known = {str(p) for p in problems(current)}
    for preset_field in PRESETS[outcome.name]:
        if explicit(spec, preset_field.path):
            outcome.kept.append((preset_field, _value(spec, preset_field.path)))
            continue
        if (why := conditions[preset_field.needs]) is not None:
            outcome.left_out.append((preset_field, why))
            continue
        preset_field = _fitted(preset_field, current, targets)
        candidate_data = _data(current)
        _set(candidate_data["policies"], preset_field.path, preset_field.value)
        try:
            candidate = PipelineSpec.model_validate(candidate_data)
        except (ValidationError, SpecError) as exc:
            outcome.left_out.append((preset_field, _first_message(exc)))
            continue
        added = [p for p in problems(candidate) if str(p) not in known]
        if added:
            outcome.left_out.append((preset_field, added[0].message))
            continue
        current = candidate
        outcome.turned_on.append(preset_field)
    return current, outcome


def _fitted(preset_field: PresetField, current: PipelineSpec, targets: Targets) -> PresetField:
    """``preset_field`` with its value fitted to the spec so far. One case: where the modulation table is on, the
    denoisers' fp8 matmuls leave out the modulation linears (``exclude``). The table computes them once per phase in
    the model's dtype and cannot stand in for a quantized layer (the build would refuse the pair), and quantized
    they would save nothing there."""
    if (preset_field.path == ("quantization", "denoiser") and current.policies.mlp.precomputed_modulation
            and targets.modulation is not None):
        return replace(preset_field, value={**preset_field.value, "exclude": targets.modulation.leaves()})
    return preset_field


def preset_here(spec: PipelineSpec, targets: Targets, device: torch.device) -> tuple[PipelineSpec, PresetOutcome]:
    """``resolve_preset`` on this device, against what ``policy_problems`` finds here."""
    from .apply import _DTYPES, policy_problems

    return resolve_preset(spec, targets, DeviceFacts.of(device, _DTYPES[spec.model.dtype]),
                          lambda candidate: policy_problems(candidate, targets, device))


def _data(spec: PipelineSpec) -> dict[str, Any]:
    """The spec's data as written (fields it sets), so what it leaves unset stays unset."""
    data = spec.model_dump(mode="json", by_alias=True, exclude_unset=True)
    data.setdefault("policies", {})
    return data


def _set(node: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value


def _value(spec: PipelineSpec, path: tuple[str, ...]) -> Any:
    if path[0] == "quantization":
        return {k: q.model_dump(mode="json", exclude_defaults=True) for k, q in spec.policies.quantization.items()}
    node: Any = spec.policies
    for key in path:
        node = getattr(node, key)
    return node


def _first_message(exc: Exception) -> str:
    if isinstance(exc, SpecError):
        return exc.problems[0].message
    return str(exc.errors()[0].get("msg", exc)).removeprefix("Value error, ")  # type: ignore[attr-defined]
