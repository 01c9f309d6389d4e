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


def gather_outputs(ctx: Any, latents: dict[str, torch.Tensor], decoded: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """Every data group's output latents and decoded samples (a family's ``Decoded``), in request order; a group
    that ran no sample gives empty ``latents``."""
    local = (decoded.array, {k: v.cpu() for k, v in latents.items()}, decoded.audio, decoded.sample_rate)
    parts = [p for p in gather_samples(ctx, local if latents else None) if p is not None]
    latents = {k: torch.cat([lat[k] for _, lat, _, _ in parts]) for k in parts[0][1]}
    audio = np.concatenate([a for _, _, a, _ in parts]) if parts[0][2] is not None else None
    return latents, type(decoded)(np.concatenate([a for a, _, _, _ in parts]), audio, parts[0][3])
