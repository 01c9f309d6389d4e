"""The ranks of a parallel run: the process group, the device mesh over the axes (``spec.policies.PARALLEL_AXES``
in mesh order) and each rank's place in it."""

from __future__ import annotations

import atexit
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...spec import PipelineSpec, SpecError
from ...spec.errors import LaunchError
from ...spec.policies import PARALLEL_AXES
from .launch import environment_integer, launch_environment, rendezvous


@dataclass
class ParallelContext:
    rank: int
    world_size: int
    cfg: int
    data: int
    ring: int
    ulysses: int
    cfg_index: int
    data_index: int
    cfg_group: Any  # process group of this rank's cfg peers
    data_group: Any  # process group of this rank's data peers (same place in every other axis)
    cfg_root: int  # global rank of cfg index 0 in this rank's cfg group
    sp_mesh: Any = None  # DeviceMesh ("ring", "ulysses") of this rank's sequence-parallel peers
    shard: int = 1
    tensor: int = 1
    shard_index: int = 0
    samples_group: Any = None  # process group over (data, shard): the groups a request's samples are split over
    shard_mesh: Any = None  # DeviceMesh ("data", "shard") the weights are sharded over (replicated across data)
    tensor_mesh: Any = None  # DeviceMesh ("tensor",) of this rank's tensor-parallel peers
    vae_patch: int = 1
    vae_group: Any = None  # process group of the ranks this rank shares a VAE decode's tiles with
    vae_index: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sequence(self) -> int:
        return self.ring * self.ulysses

    @property
    def samples(self) -> int:
        """How many groups a request's samples are split over (data x shard)."""
        return self.data * self.shard

    @property
    def sample_index(self) -> int:
        return self.data_index * self.shard + self.shard_index


def _ensure_process_group(world: int, device: torch.device) -> None:
    if dist.is_initialized():
        return
    env_world = environment_integer("WORLD_SIZE", 1)
    if env_world == 1:
        raise SpecError.single(
            f"the degrees multiply to {world} processes but this is a single process; launch with "
            f"torchrun --nproc-per-node {world} -m omnispec run ...", "policies.parallel")
    if env_world != world:
        # the launch disagrees with the spec: every rank says so, none can tell whether rank 0 exists
        raise LaunchError.single(f"the degrees multiply to {world} processes but WORLD_SIZE is {env_world}",
                                 "policies.parallel")
    if device.type == "cuda":
        torch.cuda.set_device(_local_cuda_device())
    launch = launch_environment(world)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=rendezvous(launch), rank=launch.rank,
                            world_size=world)
    atexit.register(_leave_group)  # the group omnispec made is left before exit


def _local_cuda_device() -> int:
    """This rank's CUDA device: its LOCAL_RANK, one device per process as NCCL needs. More processes on this host
    than devices is refused on every rank alike (torchrun sets LOCAL_WORLD_SIZE), before any rendezvous: a rank
    that failed alone would leave the others waiting for it."""
    local_rank = environment_integer("LOCAL_RANK", 0)
    processes = max(environment_integer("LOCAL_WORLD_SIZE", 1), local_rank + 1)
    devices = torch.cuda.device_count()
    if processes > devices:
        raise SpecError.single(
            f"{processes} processes on this host but {devices} CUDA device(s): a parallel "
            f"run on CUDA takes one device per process; launch at most {devices} per host "
            f"(torchrun --nproc-per-node {devices}), or run the ranks on the CPU with runtime.device=cpu",
            "policies.parallel")
    return local_rank


def _leave_group() -> None:
    """Destroy the process group omnispec initialised: one torn down by the interpreter's exit with its threads
    still running can abort the process (gloo: "terminate called without an active exception", exit -6) after
    the outputs were written."""
    if dist.is_initialized():
        dist.destroy_process_group()


def setup(spec: PipelineSpec, device: torch.device, group: Any = None) -> ParallelContext | None:
    """The run's parallel context, or None for one process. Checks the degrees against the world size
    before any collective, so a mismatch fails cleanly on every rank instead of hanging.

    Ranks form a DeviceMesh over ``PARALLEL_AXES``' mesh axes in their order (row-major: data, shard, cfg, tensor,
    ring, ulysses). A caller's own ``group`` is supported for cfg/data degrees (the other axes need the mesh over
    the default group).
    """
    par = spec.policies.parallel
    world = par.world_size
    if world == 1:
        return None
    _ensure_process_group(world, device)
    size = dist.get_world_size(group)
    if size != world:
        raise SpecError.single(f"the degrees multiply to {world} but the process group has {size} ranks",
                               "policies.parallel")
    rank = dist.get_rank(group)
    if group is not None and group is not dist.group.WORLD:
        if par.sequence > 1 or par.shard > 1 or par.tensor > 1 or par.vae_patch > 1:
            raise SpecError.single("ulysses, ring, shard, tensor and vae_patch run on the default process group "
                                   "(a caller's own group serves cfg and data)", "policies.parallel")
        return _manual_groups(par, rank, dist.get_process_group_ranks(group))
    from torch.distributed.device_mesh import init_device_mesh

    names = PARALLEL_AXES.mesh_names
    mesh = init_device_mesh(device.type, tuple(getattr(par, n) for n in names), mesh_dim_names=names)
    coords = dict(zip(names, mesh.get_coordinate()))
    cfg_ranks = mesh["cfg"].mesh.flatten().tolist()
    return ParallelContext(
        rank, size, par.cfg, par.data, par.ring, par.ulysses, cfg_index=coords["cfg"], data_index=coords["data"],
        cfg_group=mesh.get_group("cfg"), data_group=mesh.get_group("data"), cfg_root=cfg_ranks[0],
        sp_mesh=mesh["ring", "ulysses"] if par.sequence > 1 else None,
        shard=par.shard, tensor=par.tensor, shard_index=coords["shard"],
        samples_group=_samples_group(mesh, par, rank) if par.shard > 1 else mesh.get_group("data"),
        shard_mesh=(mesh["data", "shard"] if par.data > 1 else mesh["shard"]) if par.shard > 1 else None,
        tensor_mesh=mesh["tensor"] if par.tensor > 1 else None,
        **_vae_groups(mesh, par, rank),
    )


def _layout(mesh: Any, par: Any) -> Any:
    """The ranks as (sample group, place in step): the mesh axes are row-major with data and shard outermost."""
    return mesh.mesh.reshape(par.data * par.shard, par.in_step)


def _samples_group(mesh: Any, par: Any, rank: int) -> Any:
    """This rank's group over (data, shard): the ranks at its place in every other axis. Every rank creates every
    group, in one order, as new_group requires."""
    mine = None
    for column in _layout(mesh, par).t().tolist():
        group = dist.new_group(column)
        if rank in column:
            mine = group
    return mine


def _vae_groups(mesh: Any, par: Any, rank: int) -> dict[str, Any]:
    """The vae_patch groups: each cfg x tensor x ring x ulysses group (ranks holding the same latents) cut into
    runs of vae_patch consecutive ranks, every group created by every rank."""
    if par.vae_patch == 1:
        return {}
    mine: dict[str, Any] = {}
    for row in _layout(mesh, par).tolist():
        for start in range(0, len(row), par.vae_patch):
            ranks = row[start:start + par.vae_patch]
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = {"vae_patch": par.vae_patch, "vae_group": group, "vae_index": ranks.index(rank)}
    return mine


def _manual_groups(par: Any, rank: int, ranks: list[int]) -> ParallelContext:
    cfg_index, data_index = rank % par.cfg, rank // par.cfg
    cfg_group = data_group = None
    # new_group must be called by every rank for every group, in the same order.
    for d in range(par.data):
        g = dist.new_group([ranks[d * par.cfg + c] for c in range(par.cfg)])
        if d == data_index:
            cfg_group = g
    for c in range(par.cfg):
        g = dist.new_group([ranks[d * par.cfg + c] for d in range(par.data)])
        if c == cfg_index:
            data_group = g
    return ParallelContext(rank, len(ranks), par.cfg, par.data, 1, 1, cfg_index, data_index, cfg_group, data_group,
                           cfg_root=ranks[data_index * par.cfg], samples_group=data_group)


