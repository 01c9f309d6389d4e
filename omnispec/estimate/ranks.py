"""Per-rank weight bytes under tensor, shard and distributed offload, from the byte counts and meta modules the
estimate already has (no weights loaded): what each rank holds at rest and while denoising."""

from __future__ import annotations

import fnmatch
from typing import Any

from ..spec import PipelineSpec
from ..spec.explain import describe_mesh
from ..targets import ParallelTarget
from .report import ComponentBytes, Estimate


def tensor_split_bytes(target: ParallelTarget, module: Any, component: ComponentBytes, degree: int) -> int:
    """Bytes of ``module``'s parameters the family's tensor plan splits (diffusers' shard specs, on the meta
    module), in the component's bytes per parameter."""
    from diffusers.hooks.tensor_parallel import resolve_tp_shard_specs

    assert target.tensor_plan is not None, "the spec's checks refuse tensor parallelism without a plan"
    plan = target.tensor_plan(module)
    specs = resolve_tp_shard_specs(module, dict(plan.linears), degree)
    params = dict(module.named_parameters())
    split = sum(params[name].numel() for name, spec in specs.items() if spec.dim is not None and name in params)
    for path, child in module.named_modules():  # the norms over all heads split with them
        if any(fnmatch.fnmatchcase(path, p) for p in plan.norms) and getattr(child, "weight", None) is not None:
            split += child.weight.numel()
    return round(split * component.bytes / max(component.params, 1))


def per_rank(spec: PipelineSpec, target: ParallelTarget, modules: dict[str, Any], result: Estimate) -> None:
    """Fill ``result.mesh`` and the per-rank bytes: ``weights_on_device`` becomes per rank, and
    ``denoiser_bytes_per_rank`` / ``host_bytes_per_rank`` say what a rank keeps of the denoisers at rest."""
    par = spec.policies.parallel
    if par.world_size == 1:
        return
    result.mesh = describe_mesh(spec)
    distributed = getattr(spec.policies.offload, "distributed", False)
    at_rest = host = 0
    for c in result.components:
        if c.role != "denoiser":
            continue
        kept = c.bytes
        if par.tensor > 1 and modules.get(c.name) is not None:
            kept = c.bytes - tensor_split_bytes(target, modules[c.name], c, par.tensor) * (par.tensor - 1) // par.tensor
            for stage in result.weights_on_device:
                result.weights_on_device[stage] -= c.bytes - kept
        if par.shard > 1:
            kept = -(-c.bytes // par.shard)
            if distributed:
                host += kept
                kept = 0  # between forwards every shard is in host memory; the offload strategy counted the run
            else:  # while denoising: the root whole, the blocks' shards, the running and prefetched blocks whole
                streamed = sum(c.blocks.values())
                largest = max(c.blocks.values(), default=0)
                running = (c.bytes - streamed) + streamed // par.shard + 2 * largest * (par.shard - 1) // par.shard
                for stage in result.weights_on_device:
                    result.weights_on_device[stage] -= c.bytes - (running if stage == "denoise" else kept)
        at_rest += kept
    result.denoiser_bytes_per_rank = at_rest
    result.host_bytes_per_rank = host
    if par.sequence > 1 or par.tensor > 1:
        result.notes.append("activations are counted for one process; sequence and tensor ranks each hold a share")
