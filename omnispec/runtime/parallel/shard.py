"""Sharded weights (FSDP2): each denoiser block's parameters split over the ``shard`` ranks, all-gathered just before
the block runs and freed after it, so a rank holds 1/N of the blocks plus the one running. The shard ranks split a
data group's samples between them (``data.data_slice``), so their compute is not repeated; a rank left without a
sample runs a copy, because every rank of a shard group must run every block to gather its weights. With ``data``
> 1 the mesh is 2-D (replicated over data, sharded over shard): HSDP.

With ``offload: {strategy: layerwise | group, distributed: true}`` the shards stay in (pinned) host memory and move
to the device as a block is gathered (FSDP2's ``CPUOffloadPolicy``): each host keeps 1/N of the offloaded model."""

from __future__ import annotations

from typing import Any

import torch

from ...spec import PipelineSpec
from ...targets import Targets
from .base import Axis
from .context import ParallelContext


class ShardAxis(Axis):
    def distribute(self, ctx: ParallelContext, spec: PipelineSpec, targets: Targets,
                   modules: dict[str, torch.nn.Module], device: torch.device) -> None:
        offload = spec.policies.offload
        host = getattr(offload, "distributed", False)
        per_group = getattr(offload, "blocks_per_group", 1) if host else 1
        for name, component in spec.model.components.items():
            if component.role == "denoiser":
                shard_denoiser(modules[name], targets.blocks.lists, ctx, per_group=per_group, host=host,
                               pin_memory=getattr(offload, "pin_memory", True))


SHARD = ShardAxis()


def shard_denoiser(module: torch.nn.Module, block_lists: tuple[str, ...], ctx: ParallelContext, *,
                   per_group: int = 1, host: bool = False, pin_memory: bool = True) -> None:
    """``fully_shard`` each group of ``per_group`` blocks of ``module``'s block lists, then the module itself
    (embedders, norms, output projection), over ``ctx.shard_mesh``; ``host``: the shards live on the CPU."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    # On a CPU-only host the shards are in host memory already; pinning needs an accelerator.
    pinned = pin_memory and torch.cuda.is_available()
    policy: dict[str, Any] = {"offload_policy": CPUOffloadPolicy(pin_memory=pinned)} if host else {}
    mesh = ctx.shard_mesh
    blocks = [b for name in block_lists for b in getattr(module, name, ())]
    groups = [blocks[i:i + per_group] for i in range(0, len(blocks), per_group)]
    for group in groups:
        fully_shard(group if len(group) > 1 else group[0], mesh=mesh, reshard_after_forward=True, **policy)
    for first, then in zip(groups, groups[1:]):  # gather the next group's weights while this one runs
        first[0].set_modules_to_forward_prefetch(then[:1])
    # The root too is resharded after each forward (torch's default keeps a root's own parameters gathered);
    # fully_shard places the shards on the mesh's device (or, with the CPU policy, in host memory).
    fully_shard(module, mesh=mesh, reshard_after_forward=True, **policy)
