"""Phase planning: which phases walk one schedule together, which steps each owns, where a walk begins
(re-noising, image strength), how latents pass between phases, and which adapter slot is on."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..spec import Phase, PipelineSpec
from ..spec.recipe import ImageInput, LatentUpsample, PreviousInput, Resize
from .families import Family, Geometry, Streams
from .lora import AdapterState, adapter_target
from .schedule import Steps, resolve_steps


def phase_groups(spec: PipelineSpec) -> list[list[int]]:
    """Consecutive segments of one shared schedule form one group (one walk, one scheduler state)."""
    groups: list[list[int]] = []
    prev_of: str | None = None
    for i, phase in enumerate(spec.recipe.phases):
        of = phase.schedule.segment_of
        if of is not None and of == prev_of:
            groups[-1].append(i)
        else:
            groups.append([i])
        prev_of = of
    return groups


def group_steps(spec: PipelineSpec, group: list[int], steps: int, seq_len: int, components: dict[str, Any],
                device: torch.device) -> tuple[Steps, list[list[int]]]:
    """The walk of a group over ``steps`` and, per phase of the group, the step indices it owns."""
    phases = [spec.recipe.phases[i] for i in group]
    first = phases[0].schedule
    walk = resolve_steps(first.walked(spec.recipe.schedules), steps, seq_len, components, device)
    if first.segment_of is None:
        return walk, [list(range(len(walk)))]
    owned: list[list[int]] = [[] for _ in phases]
    T = walk.num_train_timesteps
    for i, t in enumerate(walk.timesteps.tolist()):
        for k, phase in enumerate(phases):
            if phase.schedule.contains(t / T):  # a group of several phases is one of segments
                owned[k].append(i)
                break
        else:
            raise ValueError(f"step {i} (t={t:g}) lies in no segment of {first.segment_of!r}")
    return walk, owned


def checkpoint_sigmas(spec: PipelineSpec, schedulers: dict[str, dict[str, Any]], steps: int) -> dict[str, list[float]]:
    """Per phase, the sigmas it walks, for the walks a checkpoint's scheduler config decides alone (explain
    --source: no weights, and no dynamic shift, whose sequence length needs the family's geometry)."""
    from .components import component_class

    components: dict[str, Any] = {}
    for name, component in spec.model.components.items():
        config = schedulers.get(component.subfolder or "")
        if component.role == "scheduler" and config is not None and not config.get("use_dynamic_shifting"):
            components[name] = component_class(component).from_config(config)
    out: dict[str, list[float]] = {}
    for group in phase_groups(spec):
        phases = [spec.recipe.phases[i] for i in group]
        if phases[0].schedule.walked(spec.recipe.schedules).scheduler_component not in components:
            continue
        walk, owned = group_steps(spec, group, steps, 0, components, torch.device("cpu"))
        for phase, mine in zip(phases, owned):
            out[phase.name] = [walk.step_sigmas[i] for i in mine]
    return out


def first_step(phase: Phase, steps: Steps, strength: float | None) -> int:
    """The step a walk starts at: 0, the first with sigma <= a ``renoise`` target, or where an image input's
    strength enters (diffusers' ``get_timesteps``: the last ``int(strength * steps)`` steps run)."""
    n = len(steps)
    if isinstance(phase.input, ImageInput):
        assert strength is not None
        return int(max(n - min(n * strength, n), 0))
    if isinstance(phase.input, PreviousInput) and phase.input.renoise not in (None, "first"):
        target = float(phase.input.renoise)  # type: ignore[arg-type]
        return next((i for i, s in enumerate(steps.step_sigmas) if s <= target + 1e-9), n)
    return 0


def transform_latents(family: Family, phase: Phase, latents: Streams, prev: Geometry, new: Geometry,
                      components: dict[str, Any]) -> Streams:
    """The previous phase's streams at this phase's size: the spatial streams go through the phase's transform
    (an upsampler component, or interpolation); the others pass as they are."""
    assert isinstance(phase.input, PreviousInput)
    transform = phase.input.transform
    if transform is None:
        return dict(latents)
    out = dict(latents)
    for stream in family.spatial_streams:
        out[stream] = _transform_stream(family, phase, stream, latents[stream], prev, new, components)
    return out


def _transform_stream(family: Family, phase: Phase, stream: str, latents: torch.Tensor, prev: Geometry,
                      new: Geometry, components: dict[str, Any]) -> torch.Tensor:
    assert isinstance(phase.input, PreviousInput)
    transform = phase.input.transform
    spatial = family.unpack(stream, latents, prev)
    ratio_h, ratio_w = new.height / prev.height, new.width / prev.width
    size = (*spatial.shape[2:-2], round(spatial.shape[-2] * ratio_h), round(spatial.shape[-1] * ratio_w))
    if isinstance(transform, LatentUpsample) and transform.upsampler is not None:
        upsampler = components[transform.upsampler]
        out = upsampler(spatial.to(upsampler.dtype)).to(spatial.dtype)
    else:
        assert isinstance(transform, (LatentUpsample, Resize))
        mode = transform.mode
        if spatial.ndim == 5 and mode in ("bilinear", "bicubic"):
            mode = "trilinear"
        kwargs = {} if mode == "nearest" else {"align_corners": False}
        out = F.interpolate(spatial.float(), size=size, mode=mode, **kwargs).to(spatial.dtype)
    if tuple(out.shape[2:]) != tuple(size):
        raise ValueError(f"phase {phase.name!r}: transform gave latents {tuple(out.shape[2:])}, expected {size}")
    return family.pack(stream, out, new)


def renoise(family: Family, latents: Streams, sigma: float, geometry: Geometry, generators: list[torch.Generator]
            ) -> Streams:
    """Flow-matching forward process to ``sigma``: ``sigma * noise + (1 - sigma) * x`` (diffusers'
    ``scale_noise``), with noise drawn by the family per sample, stream by stream."""
    noise = family.noise(latents, geometry, generators)
    return {name: sigma * noise[name] + (1.0 - sigma) * x for name, x in latents.items()}


def set_adapter(spec: PipelineSpec, phase: Phase, components: dict[str, Any], live: AdapterState) -> None:
    """Switch on the phase's adapter slot and the ``always`` slots on their targets at their scales (the spec's,
    or what the RL side's ``scale_lora`` set since), every other slot off; none while ``live.off`` (the KL
    reference of the RL side's ``reference``)."""
    if not spec.model.adapters:
        return
    by_target: dict[str, list[str]] = {}
    for slot in spec.model.adapters:
        by_target.setdefault(adapter_target(spec, slot), []).append(slot)
    for target, slots in by_target.items():
        module = components[target]
        active = [] if live.off else [s for s in slots if s == phase.adapter or spec.model.adapters[s].always]
        if active:
            module.enable_adapters()
            module.set_adapters(active, weights=[live.scales.get(s, spec.model.adapters[s].scale) for s in active])
        else:
            module.disable_adapters()
