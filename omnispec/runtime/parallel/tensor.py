"""Tensor parallel: each forward's linears split over ``tensor`` ranks (torch's ``parallelize_module`` on a
``DeviceMesh``, in the styles the family's plan names: column-split projections into the heads, row-split
projections out of them, whose outputs torch all-reduces). Every rank of a tensor group runs the same passes and
ends each block with the same activations, so caches and guidance decide alike on all of them."""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
import torch.distributed as dist

from ... import bridge
from ...spec import PipelineSpec, SpecError
from ...targets import Targets, TensorPlan
from .base import Axis
from .context import ParallelContext


class TensorAxis(Axis):
    def refusal(self, spec: PipelineSpec, targets: Targets) -> str | None:
        if (why := targets.parallel.tensor_refusal) is not None:
            return targets.refused("tensor parallel", why)
        return None

    def distribute(self, ctx: ParallelContext, spec: PipelineSpec, targets: Targets,
                   modules: dict[str, torch.nn.Module], device: torch.device) -> None:
        plan_of = targets.parallel.tensor_plan
        assert plan_of is not None, "refusal() refuses a family without a tensor plan before any weight loads"
        for name, component in spec.model.components.items():
            if component.role == "denoiser":
                split_denoiser(name, modules[name], plan_of(modules[name]), ctx, device)


TENSOR = TensorAxis()


def split_denoiser(name: str, module: torch.nn.Module, plan: TensorPlan | None, ctx: ParallelContext,
                   device: torch.device) -> None:
    """Split ``module`` in place over ``ctx.tensor_mesh`` by ``plan`` (a family's ``TensorPlan``)."""
    if plan is None:
        raise SpecError.single(f"{name} ({type(module).__name__}) has no tensor-parallel plan",
                               "policies.parallel.tensor")
    degree = ctx.tensor
    heads = getattr(module.config, "num_attention_heads", None)
    if heads is not None and heads % (degree * ctx.ulysses):
        raise SpecError.single(f"{name} has {heads} attention heads, not divisible by tensor x ulysses = "
                               f"{degree * ctx.ulysses}", "policies.parallel.tensor")
    module.to(device)  # DTensor shards are cut from the module where it lies: on the device, each rank keeps 1/N
    index = ctx.tensor_mesh.get_local_rank()
    group = ctx.tensor_mesh.get_group()
    for path, child in module.named_modules():
        if any(fnmatch.fnmatchcase(path, p) for p in plan.norms):
            parent, _, leaf = path.rpartition(".")
            module.get_submodule(parent).register_module(leaf, SplitRMSNorm(child, degree, index, group))
        if any(fnmatch.fnmatchcase(path, p) for p in plan.heads):
            if child.heads % degree:
                raise SpecError.single(f"{name}.{path} has {child.heads} heads, not divisible by tensor {degree}",
                                       "policies.parallel.tensor")
            child.heads //= degree
        if any(fnmatch.fnmatchcase(path, p) for p in plan.rope):
            child.register_forward_pre_hook(RotaryShare(degree, index), with_kwargs=True)
    try:
        bridge.parallelize_with_plan(module, dict(plan.linears), ctx.tensor_mesh)
    except ValueError as exc:  # a width the degree does not divide
        raise SpecError.single(f"{name}: {exc}", "policies.parallel.tensor") from None


class RotaryShare:
    """A forward pre-hook cutting an attention's rotary tables to this rank's heads: split tables are
    (batch, heads, tokens, dim/2), cut on the heads; interleaved ones (batch, tokens, heads x dim), on the last
    axis, whose head blocks are contiguous as the column split's are."""

    def __init__(self, degree: int, index: int):
        self.degree, self.index = degree, index

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        for key in ("query_rotary_emb", "key_rotary_emb"):
            tables = kwargs.get(key)
            if tables is not None:
                kwargs[key] = tuple(t.chunk(self.degree, 1 if t.ndim == 4 else -1)[self.index] for t in tables)
        return args, kwargs


class SplitRMSNorm(torch.nn.Module):
    """An RMSNorm over all heads of a projection whose heads are split over ranks: each rank normalises its slice
    of the features with the mean square over the whole width (one all-reduce of the per-row sums of squares),
    scaled by its slice of the weight. DTensor has no sharding rule for ``rms_norm`` over a split dimension, which
    is why this is a module of its own."""

    def __init__(self, norm: torch.nn.RMSNorm, degree: int, index: int, group: Any):
        super().__init__()
        shape = norm.normalized_shape
        if len(shape) != 1 or shape[0] % degree:
            raise SpecError.single(f"an RMSNorm over {tuple(shape)} cannot split over {degree} ranks",
                                   "policies.parallel.tensor")
        self.width = shape[0]
        self.eps = norm.eps
        self.group = group
        weight = norm.weight
        self.weight = None if weight is None else torch.nn.Parameter(
            weight.detach().chunk(degree)[index].clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        squares = x.float().pow(2).sum(-1, keepdim=True)
        dist.all_reduce(squares, group=self.group)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        out = (x.float() * torch.rsqrt(squares / self.width + eps)).type_as(x)
        return out if self.weight is None else out * self.weight
