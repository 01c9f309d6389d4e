"""The compile policy's ``fast_tanh``: an inductor graph pass, in a module of its own because importing inductor
takes about a second, which only a run that asks for it should pay."""

from __future__ import annotations

from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files


class FastTanh(CustomGraphPass):
    """Replace every ``aten.tanh`` of a post-grad graph by ``2*sigmoid(2x) - 1``, computed in float32.

    Why not a decomposition for ``aten.gelu``: inductor takes a custom table only through ``compile_fx``'s argument,
    which its caches do not key on (a warm cache could hand back the other variant's code); a custom pass is keyed by
    its ``uuid``. Triton's ``sigmoid`` is ``1 / (1 + exp(-x))`` with the hardware's approximate exponential and
    division, a few instructions against libdevice ``tanh``'s polynomial and branches; the result is within about
    2e-7 of tanh (absolute), so a value near 0 keeps that absolute error rather than tanh's relative one."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        aten, prims = torch.ops.aten, torch.ops.prims
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not aten.tanh.default:
                continue
            value = node.meta.get("val")
            if value is None or value.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                continue
            (x,) = node.args

            def add(target: Any, *args: Any) -> torch.fx.Node:
                made = graph.call_function(target, args)
                made.meta["val"] = target(*(a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args))
                return made

            with graph.inserting_before(node):
                wide = x if value.dtype == torch.float32 else add(prims.convert_element_type.default, x, torch.float32)
                s = add(aten.sigmoid.default, add(aten.mul.Tensor, wide, 2.0))
                out = add(aten.sub.Tensor, add(aten.mul.Tensor, s, 2.0), 1.0)
                if value.dtype != torch.float32:
                    out = add(prims.convert_element_type.default, out, value.dtype)
            node.replace_all_uses_with(out)
            graph.erase_node(node)

    def uuid(self) -> bytes:
        """Inductor's caches key compiled code on this: this file's text."""
        return get_hash_for_files((__file__,))


FAST_TANH = FastTanh()
