"""The parallel axes' target: whether the denoiser splits over sequence ranks, and its tensor-parallel plan."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TensorPlan:
    """A denoiser's tensor-parallel plan: ``linears`` in diffusers' ``_tp_plan`` format (``{glob: "colwise" |
    "rowwise" | packed marker}``, one ``*`` over a block list); ``heads``: fnmatch patterns of attention modules
    whose processor reads ``attn.heads`` (divided by the degree, each rank keeping its heads); ``norms``: patterns
    of RMSNorms over all heads at once (each rank normalises its slice with the sum of squares summed over ranks);
    ``rope``: attention modules handed rotary tables that span all heads (``query_rotary_emb``/``key_rotary_emb``:
    4-D split tables cut on the head axis, interleaved ones on the feature axis), cut to this rank's heads."""

    linears: Mapping[str, Any]
    heads: tuple[str, ...] = ()
    norms: tuple[str, ...] = ()
    rope: tuple[str, ...] = ()


@dataclass(frozen=True)
class ParallelTarget:
    """``sequence_refusal``: why ulysses / ring cannot run (None: the denoiser has a diffusers context-parallel
    plan). ``tensor_plan``: how a loaded denoiser's linears split over tensor ranks; ``tensor_refusal``: why tensor
    parallelism cannot run (None when ``tensor_plan`` gives a plan)."""

    sequence_refusal: str | None = "no context-parallel plan for ulysses/ring"
    tensor_plan: Callable[[Any], TensorPlan | None] | None = None
    tensor_refusal: str | None = "no tensor-parallel plan is written for its denoiser"
