"""Inductor graph passes tried on the fp8 activation quantization (benchmark experiments, not policies).

A compiled fp8_dynamic row quantization fuses into one kernel: a first loop over each row computes the input (say
a GELU) and its amax, a second divides by the row's scale and casts. What inductor keeps between the loops, and how
much each element costs to compute, set that kernel's time (BENCHMARKS.md, issue 27, 2026-12-03). Each pass here is
an inductor post-grad custom pass (keyed in inductor's caches by this file's text), installed for the whole process
by ``install`` or handed to one compile as ``Passes(names)``; omnispec's own pass
(``omnispec/kernels/inductor_passes.py``, which began here as ``narrow_stores``) runs first and then these:

- ``fast_tanh``: each tanh computed as ``2*sigmoid(2x) - 1`` (one fast exponential) instead of libdevice's accurate
  tanh, within 2e-7; measured to change nothing on the H200 (the kernel is not bound by the GELU's tanh).

A shared module of the benchmarks (``--inductor-passes``): it imports no benchmark module
(``tests/test_benchmark_smoke.py`` checks).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from omnispec.kernels.inductor_passes import NARROW


def _add(graph: torch.fx.Graph, target: Any, *args: Any) -> torch.fx.Node:
    """A new call of ``target`` on ``args``, with the fake value later passes and lowering read."""
    made = graph.call_function(target, args)
    made.meta["val"] = target(*(a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args))
    return made


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


PASSES = {"fast_tanh": fast_tanh}


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


def add_argument(parser: argparse.ArgumentParser) -> None:
    """The benchmarks' ``--inductor-passes`` option, which ``install`` takes."""
    parser.add_argument("--inductor-passes", default="", metavar="PASS[,PASS...]",
                        help=f"an experiment: inductor graph passes from benchmarks/inductor_passes.py "
                             f"({', '.join(PASSES)}), after omnispec's own, in every compile of the process")


def install(names: str | list[str]) -> Passes | None:
    """Run the named passes (a list, or ``--inductor-passes``' comma-separated names) in every compile of this
    process (inductor's ``post_grad_custom_pre_pass``); omnispec's compile options chain them after their own pass,
    so its compiles take them too."""
    names = [n for n in names.split(",") if n] if isinstance(names, str) else names
    if not names:
        return None
    import torch._inductor.config as inductor

    passes = Passes(names)
    inductor.post_grad_custom_pre_pass = passes
    return passes
