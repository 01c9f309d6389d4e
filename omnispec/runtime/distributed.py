"""``policies.parallel`` on torch.distributed: CFG-parallel and data-parallel (NCCL on GPUs, gloo on CPUs).

Ranks are laid out as ``rank = data_index * cfg + cfg_index`` (sequence-parallel degrees must be 1 in this
version). A step's guidance passes go round-robin over the ranks of a cfg group; each rank runs its share
in one batched forward, the shares are all-gathered (padded to the largest share, zeros not computed), and
every rank applies the same combine, so all ranks hold the serial result. A step with a single pass is
computed by cfg rank 0 and broadcast: the other ranks of the group wait (there is no second pass to give
them). Data parallel splits a request's prompts over data groups and gathers the outputs in order;
per-sample seeds make them equal to the single-process run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..spec import PipelineSpec, SpecError


@dataclass
class ParallelContext:
    rank: int
    world_size: int
    cfg: int
    data: int
    cfg_index: int
    data_index: int
    cfg_group: Any  # process group of this rank's cfg peers (None when cfg == 1)
    data_group: Any  # process group of this rank's data peers, one per cfg index (None when data == 1)
    group: Any  # the whole group the pipeline runs in

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def cfg_root(self) -> int:
        """Global rank of cfg index 0 in this rank's cfg group."""
        return self.data_index * self.cfg


def _ensure_process_group(world: int, device: torch.device) -> None:
    if dist.is_initialized():
        return
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    if env_world == 1:
        raise SpecError.single(
            f"the degrees multiply to {world} processes but this is a single process; launch with "
            f"torchrun --nproc-per-node {world} -m omnispec run ...", "policies.parallel")
    if env_world != world:
        raise SpecError.single(f"the degrees multiply to {world} processes but WORLD_SIZE is {env_world}",
                               "policies.parallel")
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def setup(spec: PipelineSpec, device: torch.device, group: Any = None) -> ParallelContext | None:
    """The run's parallel context, or None for one process. Checks the degrees against the world size
    before any collective, so a mismatch fails cleanly on every rank instead of hanging."""
    par = spec.policies.parallel
    if par.ulysses != 1 or par.ring != 1:
        raise SpecError.single("sequence parallelism (ulysses, ring) is not available in this version",
                               "policies.parallel")
    world = par.world_size
    if world == 1:
        return None
    _ensure_process_group(world, device)
    size = dist.get_world_size(group)
    if size != world:
        raise SpecError.single(f"the degrees multiply to {world} but the process group has {size} ranks",
                               "policies.parallel")
    rank = dist.get_rank(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    cfg_index, data_index = rank % par.cfg, rank // par.cfg
    cfg_group = data_group = None
    # new_group must be called by every rank for every group, in the same order.
    for d in range(par.data):
        members = [ranks[d * par.cfg + c] for c in range(par.cfg)]
        g = dist.new_group(members) if par.cfg > 1 else None
        if d == data_index:
            cfg_group = g
    for c in range(par.cfg):
        members = [ranks[d * par.cfg + c] for d in range(par.data)]
        g = dist.new_group(members) if par.data > 1 else None
        if c == cfg_index:
            data_group = g
    return ParallelContext(rank, size, par.cfg, par.data, cfg_index, data_index, cfg_group, data_group, group)


def gather_passes(ctx: ParallelContext, names: list[str], local: dict[str, torch.Tensor], like: torch.Tensor
                  ) -> dict[str, torch.Tensor]:
    """All-gather the cfg group's pass predictions so every rank holds all of them. Exchanged in float32
    (exact for bf16/fp16 predictions), so a rank with no share of the passes still agrees on the dtype;
    the combine then runs in float32 on every rank."""
    share = -(-len(names) // ctx.cfg)
    mine = names[ctx.cfg_index::ctx.cfg]
    buf = torch.zeros((share, *like.shape), dtype=torch.float32, device=like.device)
    for k, name in enumerate(mine):
        buf[k] = local[name]
    out = [torch.empty_like(buf) for _ in range(ctx.cfg)]
    dist.all_gather(out, buf, group=ctx.cfg_group)
    return {name: out[i % ctx.cfg][i // ctx.cfg] for i, name in enumerate(names)}


def broadcast_pass(ctx: ParallelContext, pred: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    buf = pred.to(torch.float32) if pred is not None else torch.empty(like.shape, dtype=torch.float32,
                                                                         device=like.device)
    dist.broadcast(buf, src=ctx.cfg_root if ctx.group is None else dist.get_global_rank(ctx.group, ctx.cfg_root),
                   group=ctx.cfg_group)
    return buf


def data_slice(ctx: ParallelContext | None, count: int) -> range:
    """The samples of a request this rank's data group runs."""
    if ctx is None or ctx.data == 1:
        return range(count)
    bounds = [round(i * count / ctx.data) for i in range(ctx.data + 1)]
    return range(bounds[ctx.data_index], bounds[ctx.data_index + 1])


def gather_samples(ctx: ParallelContext, value: Any) -> list[Any]:
    """All data groups' values (any picklable), in data order."""
    out: list[Any] = [None] * ctx.data
    dist.all_gather_object(out, value, group=ctx.data_group)
    return out
