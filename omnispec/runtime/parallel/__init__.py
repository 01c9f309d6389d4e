"""``policies.parallel`` on torch.distributed (NCCL on GPUs, gloo on CPUs): one file per axis (``cfg.py``,
``data.py``, ``shard.py``, ``tensor.py``, ``sequence.py`` for ulysses and ring, ``vae_patch.py``), each axis's object
named in ``spec.policies.PARALLEL_AXES``;
``context.py`` lays the ranks out on a device mesh over the axes."""

from __future__ import annotations

from typing import Any

import torch

from ...spec import PipelineSpec, SpecError
from ...spec.policies import PARALLEL_AXES
from ...targets import Targets
from .cfg import broadcast_pass, gather_passes
from .context import ParallelContext, setup
from .data import data_slice, gather_outputs, gather_samples, is_padding
from .sequence import check_sequence


def _used(spec: PipelineSpec) -> dict[Any, list[str]]:
    """Each implementation of an axis with degree above 1, once, with the axes it serves."""
    used: dict[Any, list[str]] = {}
    for name in PARALLEL_AXES.names:
        if getattr(spec.policies.parallel, name) > 1:
            used.setdefault(PARALLEL_AXES.implementation(name), []).append(name)
    return used


def check_axes(spec: PipelineSpec, targets: Targets) -> None:
    """Refuse, before any weight loads, an axis the family (its ``targets``) or the other policies cannot run."""
    for axis, names in _used(spec).items():
        if problem := axis.refusal(spec, targets):
            raise SpecError.single(problem, f"policies.parallel.{names[0]}")


def distribute_axes(ctx: ParallelContext | None, spec: PipelineSpec, targets: Targets,
                    modules: dict[str, torch.nn.Module], device: torch.device) -> None:
    """Split the loaded weights over the ranks (tensor, shard) and wrap the decode (vae_patch), before the policies
    place and compile the components."""
    if ctx is None:
        return
    for axis in _used(spec):
        axis.distribute(ctx, spec, targets, modules, device)


def enable_axes(ctx: ParallelContext | None, spec: PipelineSpec, targets: Targets,
                modules: dict[str, torch.nn.Module]) -> None:
    """Put each used axis on the loaded denoisers."""
    if ctx is None:
        return
    denoisers = {n: modules[n] for n, c in spec.model.components.items() if c.role == "denoiser"}
    for axis in _used(spec):
        axis.enable(ctx, targets, denoisers)


__all__ = ["ParallelContext", "broadcast_pass", "check_axes", "check_sequence", "data_slice", "distribute_axes", "enable_axes",
           "gather_outputs", "gather_samples", "gather_passes", "is_padding", "setup"]
