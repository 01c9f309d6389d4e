"""The one place policies are checked against the target and applied, in one order."""

from __future__ import annotations

from typing import Any

import torch

from ..spec import PipelineSpec, SpecError
from ..spec.errors import Problem


def resolve_device(device: str | torch.device) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SpecError.single(f"device {device!r} requested but CUDA is not available here", "runtime.device")
    return torch.device(device)


# Policy values this build can execute; anything else is refused at build, before weights load,
# rather than silently ignored.
_SUPPORTED = {
    ("attention", "default"): ("auto", "sdpa"),
    ("offload", "strategy"): ("none",),
    ("cache", "kind"): ("none",),
    ("compile", "mode"): ("none",),
}


def check_policies(spec: PipelineSpec, family: Any, device: torch.device) -> None:
    """Refuse what cannot run here, naming the field; nothing is loaded yet."""
    p = spec.policies
    problems: list[Problem] = []
    values = {
        ("attention", "default"): p.attention.default,
        ("offload", "strategy"): p.offload.strategy,
        ("cache", "kind"): p.cache.kind,
        ("compile", "mode"): p.compile.mode,
    }
    for key, value in values.items():
        if value not in _SUPPORTED[key]:
            problems.append(Problem(f"policies.{'.'.join(key)}", f"{value!r} is not available in this build "
                                    f"(supported: {', '.join(_SUPPORTED[key])})"))
    for role, backend in p.attention.per_role.items():
        if role not in family.attention_roles:
            problems.append(Problem(f"policies.attention.per_role.{role}",
                                    f"family {family.name!r} has no attention role {role!r} "
                                    f"(roles: {', '.join(family.attention_roles)})"))
        elif backend not in _SUPPORTED[("attention", "default")]:
            problems.append(Problem(f"policies.attention.per_role.{role}", f"{backend!r} is not available in this build"))
    if p.quantization:
        problems.append(Problem("policies.quantization", "quantization is not available in this build"))
    if p.parallel.world_size != 1:
        problems.append(Problem("policies.parallel", f"world size {p.parallel.world_size} needs the parallel runtime, "
                                "which is not available in this build"))
    if problems:
        raise SpecError(problems)


def apply_policies(spec: PipelineSpec, family: Any, components: dict[str, Any], device: torch.device) -> None:
    """Quantization happened at load; here: device placement, then attention, cache, offload, compile."""
    for component in components.values():
        if isinstance(component, torch.nn.Module):
            component.to(device)
