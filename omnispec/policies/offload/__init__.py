"""Offload: keep weights on the host and bring them to the device when they run. Each strategy's behaviour is an
object in this package (``model.py``, ``blocks.py``), looked up through ``spec.policies.OFFLOADS``: ``apply``
places the modules, ``device_bytes`` says how many weight bytes sit on the device during a stage (what
``explain --estimate`` adds to that stage's activations)."""

from __future__ import annotations

from typing import Any

import torch

from ...spec import PipelineSpec
from ...spec.policies import OFFLOADS
from .blocks import BLOCKS
from .model import MODEL, remove_model_offload


class NoOffload:
    def apply(self, policy: Any, modules: dict[str, torch.nn.Module], roles: dict[str, str],
              device: torch.device) -> str:
        for m in modules.values():
            m.to(device)
        return "none: every component on " + str(device)

    def device_bytes(self, policy: Any, stage: str, roles: tuple[str, ...], components: list[Any],
                     accelerator: bool) -> int:
        return sum(c.bytes for c in components)

    def host_bytes(self, policy: Any, components: list[Any]) -> int:
        """Host memory the strategy keeps weights in for the pipeline's life (none: everything is on the device)."""
        return 0


NONE = NoOffload()


def apply_offload(spec: PipelineSpec, components: dict[str, Any], device: torch.device) -> str:
    """Place the components as the spec's offload strategy says (an earlier build's model offload removed first);
    returns what explain shows."""
    modules = {n: m for n, m in components.items() if isinstance(m, torch.nn.Module)}
    remove_model_offload(modules)
    roles = {name: c.role for name, c in spec.model.components.items()}
    policy = spec.policies.offload
    return OFFLOADS.implementation(policy).apply(policy, modules, roles, device)


__all__ = ["BLOCKS", "MODEL", "NONE", "apply_offload"]
