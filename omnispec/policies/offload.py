"""Offload: keep weights on the host and bring them to the device when they run.

``model``: one role-group at a time on the device (encoders, then denoisers, then VAE/upsampler);
``resident`` and ``other`` roles stay put. Written here as a diffusers ``ModelHook`` on each component
and its direct children (so ``vae.decode``, which never calls ``vae.forward``, still triggers it), because
diffusers' own model offload is a pipeline method and omnispec applies policies to modules.
``layerwise``/``group``: diffusers' ``apply_group_offloading`` on each denoiser (block level, N blocks per
group, side-stream prefetch on CUDA).
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.hooks import HookRegistry, ModelHook

from ..spec import PipelineSpec
from .hooks import remove_hook

GROUPS = {"encoder": "encoders", "denoiser": "denoisers", "vae": "decoders", "upsampler": "decoders"}
HOOK_NAME = "omnispec_model_offload"


def _to(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


class _Placement:
    """Which group is on the device now; moving one group in moves the others out."""

    def __init__(self, groups: dict[str, list[torch.nn.Module]], device: torch.device):
        self.groups, self.device, self.current = groups, device, None

    def bring(self, group: str) -> None:
        if self.current == group:
            return
        for name, modules in self.groups.items():
            if name != group:
                for m in modules:
                    m.to("cpu")
        for m in self.groups[group]:
            m.to(self.device)
        self.current = group


class _BringGroupHook(ModelHook):
    def __init__(self, placement: _Placement, group: str):
        super().__init__()
        self.placement, self.group = placement, group

    def pre_forward(self, module, *args, **kwargs):
        self.placement.bring(self.group)
        return _to(args, self.placement.device), _to(kwargs, self.placement.device)


def apply_offload(spec: PipelineSpec, components: dict[str, Any], device: torch.device) -> str:
    strategy = spec.policies.offload
    roles = {name: c.role for name, c in spec.model.components.items()}
    modules = {n: m for n, m in components.items() if isinstance(m, torch.nn.Module)}
    for m in modules.values():  # an earlier build's model offload over these modules ends here
        for target in (m, *m.children()):
            remove_hook(target, HOOK_NAME)
    if strategy.strategy == "none":
        return "none: every component on " + str(device)
    if strategy.strategy == "model":
        groups: dict[str, list[torch.nn.Module]] = {}
        for name, m in modules.items():
            group = GROUPS.get(roles[name])
            if group is None:  # resident / other: stay on the device
                m.to(device)
                continue
            m.to("cpu")
            groups.setdefault(group, []).append(m)
        placement = _Placement(groups, device)
        for group, members in groups.items():
            for m in members:
                for target in (m, *m.children()):
                    registry = HookRegistry.check_if_exists_or_initialize(target)
                    registry.register_hook(_BringGroupHook(placement, group), HOOK_NAME)
        return "model: " + ", ".join(f"{g} [{len(ms)}]" for g, ms in groups.items()) + " take turns on " + str(device)
    from diffusers.hooks import apply_group_offloading

    per_group = 1 if strategy.strategy == "layerwise" else strategy.blocks_per_group
    use_stream = strategy.prefetch and device.type == "cuda"
    for name, m in modules.items():
        if roles[name] == "denoiser":
            apply_group_offloading(m, onload_device=device, offload_device=torch.device("cpu"),
                                   offload_type="block_level", num_blocks_per_group=per_group,
                                   use_stream=use_stream, record_stream=use_stream,
                                   low_cpu_mem_usage=not strategy.pin_memory)
        else:
            m.to(device)
    return (f"{strategy.strategy}: denoiser blocks streamed {per_group} at a time"
            f"{' with side-stream prefetch' if use_stream else ''}; other components on {device}")
