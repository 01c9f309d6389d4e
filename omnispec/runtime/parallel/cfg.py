"""CFG parallel: a step's guidance passes go round-robin over the ranks of a cfg group; each rank runs its share
in one batched forward, the shares are all-gathered (padded to the largest share, zeros not computed; sent as
float32 and cast back to the dtype the model produced), and every rank applies the same combine, so all ranks hold
the serial result. A step with a single pass is computed by cfg rank 0 and broadcast: the other ranks of the group
wait (there is no second pass to give them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .base import Axis
from .context import ParallelContext


class CFGAxis(Axis):
    pass  # nothing to refuse or prepare: any family's passes can be shared


CFG = CFGAxis()


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
