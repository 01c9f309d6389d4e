"""``policies.parallel`` on torch.distributed: CFG-parallel and data-parallel (NCCL on GPUs, gloo on CPUs).

Ulysses and ring split each forward's sequence over ``ring x ulysses`` ranks through diffusers' context
parallelism (the models' context-parallel plans); every rank of a sequence group runs the same passes. A step's guidance passes go round-robin over the ranks of a cfg group; each rank runs its share
in one batched forward, the shares are all-gathered (padded to the largest share, zeros not computed; sent as float32 and cast back
to the dtype the model produced), and
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

from .. import bridge
from ..spec import PipelineSpec, SpecError


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
    data_group: Any  # process group of this rank's data peers
    cfg_root: int  # global rank of cfg index 0 in this rank's cfg group
    sp_mesh: Any = None  # DeviceMesh ("ring", "ulysses") of this rank's sequence-parallel peers

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sequence(self) -> int:
        return self.ring * self.ulysses


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
    before any collective, so a mismatch fails cleanly on every rank instead of hanging.

    Ranks form a DeviceMesh ``(data, cfg, ring, ulysses)`` in that order (row-major). A caller's own
    ``group`` is supported for cfg/data degrees (sequence parallel needs the mesh over the default group).
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
        if par.ring * par.ulysses > 1:
            raise SpecError.single("sequence parallel runs on the default process group", "policies.parallel")
        return _manual_groups(par, rank, dist.get_process_group_ranks(group))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (par.data, par.cfg, par.ring, par.ulysses),
                            mesh_dim_names=("data", "cfg", "ring", "ulysses"))
    coords = mesh.get_coordinate()
    cfg_ranks = mesh["cfg"].mesh.flatten().tolist()
    return ParallelContext(
        rank, size, par.cfg, par.data, par.ring, par.ulysses, cfg_index=coords[1], data_index=coords[0],
        cfg_group=mesh.get_group("cfg"), data_group=mesh.get_group("data"), cfg_root=cfg_ranks[0],
        sp_mesh=mesh["ring", "ulysses"] if par.ring * par.ulysses > 1 else None,
    )


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
                           cfg_root=ranks[data_index * par.cfg])


def enable_sequence_parallel(ctx: ParallelContext, family: Any, denoisers: dict[str, torch.nn.Module]) -> None:
    """Ulysses / ring through diffusers' context parallelism (the models' context-parallel plans)."""
    from diffusers import ContextParallelConfig

    config = ContextParallelConfig(ring_degree=ctx.ring, ulysses_degree=ctx.ulysses, mesh=ctx.sp_mesh)
    for name, module in denoisers.items():
        heads = getattr(module.config, "num_attention_heads", None)
        if heads is not None and heads % ctx.ulysses:
            raise SpecError.single(f"{name} has {heads} attention heads, not divisible by ulysses {ctx.ulysses}",
                                   "policies.parallel.ulysses")
        if ctx.ring > 1:
            module.set_attention_backend(bridge.NATIVE_FLASH_BACKEND)  # ring needs a kernel that returns the log-sum-exp
            if next(module.parameters()).device.type == "cpu":
                _install_cpu_flash_kernel()
        if torch.accelerator.device_count() == 0:
            # diffusers picks a device as rank % accelerator count; on a CPU-only host that count is 0.
            import unittest.mock

            with unittest.mock.patch.object(torch.accelerator, "device_count", lambda: 1):
                module.enable_parallelism(config=config)
        else:
            module.enable_parallelism(config=config)


_CPU_FLASH: Any = None


def _install_cpu_flash_kernel() -> None:
    """Give ``aten::_scaled_dot_product_flash_attention`` a CPU kernel, so diffusers' ring attention (whose
    ``_native_flash`` backend calls that op for the log-sum-exp it merges ring steps with) runs on gloo/CPU.

    torch has the CPU flash kernel under another name (``..._for_cpu``, returning output and log-sum-exp);
    this registers it under the CUDA op's name through ``torch.library``, adding a kernel where none exists
    and touching no other device's. Forward only: the CPU path is for tests and debugging, not training.
    """
    global _CPU_FLASH
    if _CPU_FLASH is not None:
        return

    def flash_cpu(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float = 0.0,
                  is_causal: bool = False, return_debug_mask: bool = False, *, scale: float | None = None):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, scale=scale)
        unused = query.new_empty(0, dtype=torch.int64)  # cumulative lengths / philox state: varlen and dropout only
        return out, lse, unused, unused, query.shape[2], key.shape[2], unused, unused, query.new_empty(0)

    library = torch.library.Library("aten", "IMPL")
    library.impl("_scaled_dot_product_flash_attention", flash_cpu, "CPU")
    _CPU_FLASH = library  # the registration lives as long as this object


def check_sequence(ctx: ParallelContext | None, tokens: int, what: str) -> None:
    """Sequence parallel splits tokens evenly over ring x ulysses ranks: refuse lengths that don't divide."""
    if ctx is not None and ctx.sequence > 1 and tokens % ctx.sequence:
        raise SpecError.single(f"{what} of {tokens} tokens does not split over {ctx.sequence} sequence-parallel "
                               "ranks; choose a size or max_sequence_length that divides", "request")


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _root_dtype(ctx: ParallelContext, local: torch.Tensor | None, like: torch.Tensor) -> torch.dtype:
    """The predictions' dtype as cfg rank 0 (which always computes a pass) has it."""
    code = torch.tensor([_DTYPES.index(local.dtype) if local is not None else -1], device=like.device)
    dist.broadcast(code, src=ctx.cfg_root, group=ctx.cfg_group)
    return _DTYPES[int(code.item())]


def gather_passes(ctx: ParallelContext, names: list[str], local: dict[str, dict[str, torch.Tensor]],
                  like: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """All-gather the cfg group's pass predictions, stream by stream, so every rank holds all of them in the
    dtype the model produced them in (sent as float32, which holds bf16/fp16 exactly): the combine that
    follows is the serial arithmetic on every rank, including a rank that had no pass to compute."""
    out: dict[str, dict[str, torch.Tensor]] = {name: {} for name in names}
    for stream, reference in like.items():
        gathered = _gather_stream(ctx, names, {n: p[stream] for n, p in local.items()}, reference)
        for name in names:
            out[name][stream] = gathered[name]
    return out


def _gather_stream(ctx: ParallelContext, names: list[str], local: dict[str, torch.Tensor], like: torch.Tensor
                   ) -> dict[str, torch.Tensor]:
    share = -(-len(names) // ctx.cfg)
    mine = names[ctx.cfg_index::ctx.cfg]
    dtype = _root_dtype(ctx, next(iter(local.values()), None), like)
    buf = torch.zeros((share, *like.shape), dtype=torch.float32, device=like.device)
    for k, name in enumerate(mine):
        buf[k] = local[name]
    out = [torch.empty_like(buf) for _ in range(ctx.cfg)]
    dist.all_gather(out, buf, group=ctx.cfg_group)
    return {name: out[i % ctx.cfg][i // ctx.cfg].to(dtype) for i, name in enumerate(names)}


def broadcast_pass(ctx: ParallelContext, pred: dict[str, torch.Tensor] | None, like: dict[str, torch.Tensor]
                   ) -> dict[str, torch.Tensor]:
    out = {}
    for stream, reference in like.items():
        mine = None if pred is None else pred[stream]
        dtype = _root_dtype(ctx, mine, reference)
        buf = mine.to(torch.float32) if mine is not None else torch.empty(reference.shape, dtype=torch.float32,
                                                                           device=reference.device)
        dist.broadcast(buf, src=ctx.cfg_root, group=ctx.cfg_group)
        out[stream] = buf.to(dtype)
    return out


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
