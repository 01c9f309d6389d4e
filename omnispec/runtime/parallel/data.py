"""Data parallel: a request's samples are split over data groups and the outputs gathered in request order;
per-sample seeds make them equal to the single-process run."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .base import Axis
from .context import ParallelContext


class DataAxis(Axis):
    pass  # nothing to refuse or prepare: samples are independent in every family


DATA = DataAxis()


def _share(ctx: ParallelContext, count: int) -> range:
    bounds = [round(i * count / ctx.samples) for i in range(ctx.samples + 1)]
    return range(bounds[ctx.sample_index], bounds[ctx.sample_index + 1])


def data_slice(ctx: ParallelContext | None, count: int) -> range:
    """The samples of a request this rank's group runs: the request split over data x shard groups. A shard rank
    left without a sample runs a copy of the last one (``is_padding``): the ranks of a shard group gather each
    block's weights together, so each of them must run every block."""
    if ctx is None or ctx.samples == 1:
        return range(count)
    return range(count - 1, count) if is_padding(ctx, count) else _share(ctx, count)


def is_padding(ctx: ParallelContext | None, count: int) -> bool:
    """Whether this rank's share (``data_slice``) is a copy run only to keep its shard group in step."""
    return ctx is not None and ctx.shard > 1 and count > 0 and not _share(ctx, count)


def gather_samples(ctx: ParallelContext, value: Any) -> list[Any]:
    """All sample groups' values (any picklable), in request order."""
    out: list[Any] = [None] * ctx.samples
    dist.all_gather_object(out, value, group=ctx.samples_group)
    return out


def gather_outputs(ctx: Any, latents: dict[str, torch.Tensor], decoded: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """Every sample group's output latents and decoded samples (a family's ``Decoded``), in request order; a
    group that ran no sample (or only a padding copy) gives empty ``latents``."""
    local = (decoded.array, {k: v.cpu() for k, v in latents.items()}, decoded.audio, decoded.sample_rate)
    parts = [p for p in gather_samples(ctx, local if latents else None) if p is not None]
    latents = {k: torch.cat([lat[k] for _, lat, _, _ in parts]) for k in parts[0][1]}
    audio = np.concatenate([a for _, _, a, _ in parts]) if parts[0][2] is not None else None
    return latents, type(decoded)(np.concatenate([a for a, _, _, _ in parts]), audio, parts[0][3])
