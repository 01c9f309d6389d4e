"""Inductor graph passes tried on the fp8 activation quantization (benchmark experiments, not policies).

A compiled fp8_dynamic row quantization fuses into one kernel: a first loop over each row computes the input (say
a GELU) and its amax, a second divides by the row's scale and casts. What inductor stores between the loops is the
first value whose expression passes its 30-operation rule: in FLUX's single blocks (a concatenation and a GELU),
torchao's ``x.to(float32)``, four bytes an element each way where the bf16 value would take two; after a plain GELU,
nothing (it computes the GELU in both loops) (BENCHMARKS.md, issue 27, 2026-12-03). Each pass here is an inductor post-grad custom pass (keyed in inductor's
caches by this file's text), installed for the whole process by ``install`` or handed to one compile as
``Passes(names)``:

- ``narrow_stores``: the quantization's bf16 input is made a buffer of its own (inductor's
  ``force_stride_order``), so what the kernel stores between its loops is that bf16 value and the float32 one is a
  conversion of it recomputed in each loop. Converting is exact, so the results keep their bits.
- ``fast_tanh``: each tanh computed as ``2*sigmoid(2x) - 1`` (one fast exponential) instead of libdevice's accurate
  tanh, within 2e-7; measured to change nothing on the H200 (the kernel is bound by its stores, not the GELU).
"""

from __future__ import annotations

from typing import Any

import torch
import torch._inductor.inductor_prims  # noqa: F401  (registers prims.inductor_force_stride_order)
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

NARROW = (torch.bfloat16, torch.float16)
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def _add(graph: torch.fx.Graph, target: Any, *args: Any) -> torch.fx.Node:
    """A new call of ``target`` on ``args``, with the fake value later passes and lowering read."""
    made = graph.call_function(target, args)
    made.meta["val"] = target(*(a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args))
    return made


def narrow_stores(graph: torch.fx.Graph) -> int:
    """Make inductor store a dynamic fp8 quantization's input at its own width: for each bf16/fp16 value ``x`` that a
    widening conversion hands to a division cast to fp8 (torchao's ``x.to(float32) / scale``, then clamp and cast),
    every reader of ``x`` reads ``inductor_force_stride_order(x, x's strides)`` instead, which makes ``x`` a buffer
    (two bytes an element) so that the widened value is a cheap conversion of it, recomputed where read. Left alone,
    torch 2.11 stores the widened value (four bytes) once the expression behind it passes its 30-operation
    threshold. Returns how many values it routed so."""
    convert = torch.ops.prims.convert_element_type.default
    force = torch.ops.prims.inductor_force_stride_order.default
    routed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not convert or node.args[1] != torch.float32:
            continue
        x = node.args[0]
        value = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        if value is None or x.op != "call_function" or value.dtype not in NARROW or not _cast_to_fp8(node):
            continue
        if x.target is force or any(user.target is force for user in x.users):
            continue  # routed already (by an earlier run, or for another conversion of the same value)
        with graph.inserting_after(x):
            forced = _add(graph, force, x, list(value.stride()))
        x.replace_all_uses_with(forced, delete_user_cb=lambda user, forced=forced: user is not forced)
        routed += 1
    return routed


def _cast_to_fp8(node: torch.fx.Node, depth: int = 4) -> bool:
    """Whether ``node``'s value reaches a conversion to an fp8 dtype through at most ``depth`` elementwise steps."""
    steps = {torch.ops.aten.div.Tensor, torch.ops.aten.mul.Tensor, torch.ops.aten.clamp_min.default,
             torch.ops.aten.clamp_max.default, torch.ops.aten.clamp.default}
    for user in node.users:
        if user.target is torch.ops.prims.convert_element_type.default and user.args[1] in FP8:
            return True
        if depth > 1 and user.target in steps and _cast_to_fp8(user, depth - 1):
            return True
    return False


def fast_tanh(graph: torch.fx.Graph) -> int:
    """Replace each float tanh by ``2*sigmoid(2x) - 1`` in float32 (the result keeps the tanh's dtype); returns how
    many were replaced."""
    aten, convert = torch.ops.aten, torch.ops.prims.convert_element_type.default
    replaced = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.tanh.default:
            continue
        value = node.meta.get("val")
        if value is None or value.dtype not in (torch.float32, *NARROW):
            continue
        (x,) = node.args
        with graph.inserting_before(node):
            wide = x if value.dtype == torch.float32 else _add(graph, convert, x, torch.float32)
            s = _add(graph, aten.sigmoid.default, _add(graph, aten.mul.Tensor, wide, 2.0))
            out = _add(graph, aten.sub.Tensor, _add(graph, aten.mul.Tensor, s, 2.0), 1.0)
            if value.dtype != torch.float32:
                out = _add(graph, convert, out, value.dtype)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        replaced += 1
    return replaced


PASSES = {"narrow_stores": narrow_stores, "fast_tanh": fast_tanh}


class Passes(CustomGraphPass):
    """The named passes in order, as one inductor post-grad pre-pass; ``applied`` counts each one's changes in this
    process (0 after a run means it never ran: a cache hit, or an inductor that does not call it)."""

    def __init__(self, names: list[str]) -> None:
        if unknown := set(names) - set(PASSES):
            raise ValueError(f"unknown inductor passes {sorted(unknown)}; choose from {sorted(PASSES)}")
        self.names = list(names)
        self.applied = dict.fromkeys(self.names, 0)

    def __call__(self, graph: torch.fx.Graph) -> None:
        for name in self.names:
            self.applied[name] += PASSES[name](graph)

    def uuid(self) -> tuple[bytes, tuple[str, ...]]:
        return get_hash_for_files((__file__,)), tuple(self.names)


def install(names: list[str]) -> Passes | None:
    """Run the named passes in every compile of this process (inductor's ``post_grad_custom_pre_pass``); omnispec's
    compile options leave that key alone, so its compiles take them too."""
    if not names:
        return None
    import torch._inductor.config as inductor

    passes = Passes(names)
    inductor.post_grad_custom_pre_pass = passes
    return passes
