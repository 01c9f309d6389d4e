"""The graph pass omnispec adds to every inductor compile: a dynamic fp8 quantization stores its input narrow.

Compiled, torchao's dynamic fp8 quantization of an activation (``x.to(float32) / scale``, clamp, cast) fuses with
what produced ``x`` into one kernel of two loops over each row: the first computes ``x`` and the row's amax, the
second divides and casts. Between the loops inductor stores or recomputes by its own rule (an expression of more
than ``realize_opcount_threshold`` operations is stored): after FLUX's or SD3.5's feed-forward GELU it stores
nothing and computes the tanh GELU in both loops; after FLUX's single blocks' concatenation it stores the float32
widening (4 bytes an element). Routing ``x`` through inductor's ``force_stride_order`` makes ``x`` itself the
stored value (2 bytes) and its widening a conversion recomputed where read (what it gives: BENCHMARKS.md, "The
fp8 activation quantization's kernels"). Converting is exact, so every result keeps its bits: compiled and eager
outputs, rollouts and replays stay what they were. The threshold itself is left alone: raising or lowering it moves
every other fused kernel's choice too.

Inductor takes one post-grad custom pre-pass a compile; one installed process-wide
(inductor's ``config.post_grad_custom_pre_pass``) runs after this one, and both key inductor's caches.
"""

from __future__ import annotations

from typing import Any

import torch

from .torch_internals import CustomGraphPass, force_stride_order, get_hash_for_files  # noqa: F401 (registers the prim)

NARROW = (torch.bfloat16, torch.float16)
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
# elementwise steps between the widened value and its fp8 cast in torchao's quantization (divide, clamp)
_TO_FP8_STEPS = (torch.ops.aten.div.Tensor, torch.ops.aten.mul.Tensor, torch.ops.aten.clamp_min.default,
                 torch.ops.aten.clamp_max.default, torch.ops.aten.clamp.default)


def narrow_quantized_inputs(graph: torch.fx.Graph) -> int:
    """Route each bf16/fp16 value ``x`` whose float32 widening reaches an fp8 cast (through a division, a clamp)
    through ``inductor_force_stride_order(x, x's strides)``, which every other reader of ``x`` then reads; returns
    how many values it routed (a second run over the same graph routes none)."""
    convert = torch.ops.prims.convert_element_type.default
    force = torch.ops.prims.inductor_force_stride_order.default
    routed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not convert or node.args[1] != torch.float32:
            continue
        x = node.args[0]
        value = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        if value is None or x.op != "call_function" or value.dtype not in NARROW or not _reaches_fp8_cast(node):
            continue
        if x.target is force or any(user.target is force for user in x.users):
            continue  # routed already (by an earlier run, or for another widening of the same value)
        with graph.inserting_after(x):
            forced = graph.call_function(force, (x, list(value.stride())))
            forced.meta["val"] = force(value, list(value.stride()))
        x.replace_all_uses_with(forced, delete_user_cb=lambda user, forced=forced: user is not forced)
        routed += 1
    return routed


def _reaches_fp8_cast(node: torch.fx.Node, depth: int = 4) -> bool:
    """Whether ``node``'s value reaches a conversion to an fp8 dtype through at most ``depth`` elementwise steps."""
    for user in node.users:
        if user.target is torch.ops.prims.convert_element_type.default and user.args[1] in FP8:
            return True
        if depth > 1 and user.target in _TO_FP8_STEPS and _reaches_fp8_cast(user, depth - 1):
            return True
    return False


def installed(then: Any) -> tuple[Any, ...]:
    """What a process installed in one of inductor's custom pass slots (nothing, a pass, or a list of them), as the
    tuple of passes an omnispec pass runs after its own work: kept rather than replaced."""
    return tuple(then) if isinstance(then, (list, tuple)) else (then,) if then is not None else ()


def cache_key(source: str, then: tuple[Any, ...], *settings: Any) -> tuple[Any, ...] | None:
    """An omnispec pass's key in inductor's caches: its file's hash, its settings, and the chained passes' own keys;
    None (inductor then skips its cache, as it would for them alone) when one of those cannot say what it is."""
    chained = [c.uuid() if isinstance(c, CustomGraphPass) else None for c in then]
    if any(u is None for u in chained):
        return None
    return get_hash_for_files((source,)), *settings, *chained


class NarrowQuantizedInputs(CustomGraphPass):
    """``narrow_quantized_inputs`` as inductor's post-grad pre-pass, followed by ``then``: what was installed
    process-wide before the compile, kept rather than replaced. ``routed`` counts what it changed in this process
    (zero after a compile: a cache hit, or nothing quantized)."""

    def __init__(self, then: Any = None) -> None:
        self.then = installed(then)
        self.routed = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.routed += narrow_quantized_inputs(graph)
        for custom in self.then:
            custom(graph)

    def uuid(self) -> tuple[Any, ...] | None:
        return cache_key(__file__, self.then)
