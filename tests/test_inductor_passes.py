"""The inductor graph passes the fp8 benchmarks try (benchmarks/inductor_passes.py): each changes the graph as
it says, and ``narrow_stores`` keeps every result's bits, through inductor too."""

from __future__ import annotations

import torch
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

from benchmarks.inductor_passes import Passes, fast_tanh, narrow_stores


def row_quantized(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's fp8 row quantization of a GELU as its ops reach inductor: the bf16 value's amax makes a bf16 scale,
    widened; the value is widened, divided by it, clamped and cast."""
    value = torch.nn.functional.gelu(h, approximate="tanh")
    scale = (value.abs().amax(dim=-1, keepdim=True) / 448.0).to(torch.float32)
    return (value.to(torch.float32) / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _graph(fn, *args) -> torch.fx.GraphModule:
    return make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)


def test_narrow_stores_makes_the_quantized_bf16_values_buffers_and_keeps_the_bits():
    """The value divided and cast to fp8 and the bf16 scale go through inductor's force_stride_order, so inductor
    stores them at two bytes rather than their float32 conversions; nothing else is touched."""
    force = torch.ops.prims.inductor_force_stride_order.default
    h = torch.randn(16, 96, dtype=torch.bfloat16) * 3
    graph = _graph(row_quantized, h)
    expected = graph(h)
    assert narrow_stores(graph.graph) == 2  # the GELU's value and the scale
    graph.recompile()
    forced = [n for n in graph.graph.nodes if n.target is force]
    assert all(n.args[0].meta["val"].dtype == torch.bfloat16 for n in forced)
    assert all(list(n.args[0].users) == [n] for n in forced)  # every other reader reads the buffer
    assert narrow_stores(graph.graph) == 0  # a second run finds them routed
    for got, want in zip(graph(h), expected):
        assert torch.equal(_bits(got), _bits(want))


def test_fast_tanh_replaces_every_tanh_within_2e_7_and_keeps_each_dtype():
    def tanhs(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.nn.functional.gelu(x, approximate="tanh"), torch.tanh(y)

    x, y = torch.randn(8, 64, dtype=torch.bfloat16), torch.linspace(-12, 12, 20001)
    graph = _graph(tanhs, x, y)
    assert fast_tanh(graph.graph) == 2
    graph.recompile()
    assert torch.ops.aten.tanh.default not in [n.target for n in graph.graph.nodes]
    gelu, tanh = graph(x, y)
    assert gelu.dtype == torch.bfloat16 and tanh.dtype == torch.float32
    assert (tanh - torch.tanh(y)).abs().max() <= 2e-7
    assert (gelu.float() - tanhs(x, y)[0].float()).abs().max() <= 2 ** -7  # one bf16 rounding apart at most


def test_passes_run_inside_inductor_and_are_keyed_by_name():
    """Handed to torch.compile as inductor's post-grad pre-pass, the passes run (on the CPU's code generation here)
    and the compiled quantization keeps eager's bits."""
    h = torch.randn(8, 64, dtype=torch.bfloat16) * 3
    passes = Passes(["narrow_stores"])
    assert passes.uuid() != Passes(["fast_tanh"]).uuid()
    torch._dynamo.reset()
    compiled = torch.compile(row_quantized, fullgraph=True,
                             options={"post_grad_custom_pre_pass": passes, "emulate_precision_casts": True,
                                      "fx_graph_cache": False})
    quantized, scale = compiled(h)
    want_quantized, want_scale = row_quantized(h)
    assert passes.applied["narrow_stores"] == 2
    assert torch.equal(scale, want_scale)
    assert torch.equal(_bits(quantized), _bits(want_quantized))
