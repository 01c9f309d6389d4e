"""The inductor graph passes the fp8 benchmarks try (benchmarks/inductor_passes.py): each changes the graph as
it says, and ``narrow_stores`` keeps every result's bits, through inductor too."""

from __future__ import annotations

import torch
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

from benchmarks.inductor_passes import Passes, fast_tanh, narrow_stores

CONVERT = torch.ops.prims.convert_element_type.default


def row_quantized(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's fp8 row quantization of a GELU, as its ops reach inductor: the bf16 value widened once, read by the
    amax and by the division."""
    x = torch.nn.functional.gelu(h, approximate="tanh").to(torch.float32)
    scale = x.abs().amax(dim=-1, keepdim=True) / 448.0
    return (x / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def _graph(fn, *args) -> torch.fx.GraphModule:
    return make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)


def test_narrow_stores_gives_each_reader_of_a_widening_conversion_its_own_and_keeps_the_bits():
    h = torch.randn(16, 96, dtype=torch.bfloat16) * 3
    graph = _graph(row_quantized, h)
    widening = [n for n in graph.graph.nodes if n.target is CONVERT and n.args[1] == torch.float32
                and n.args[0].meta["val"].dtype == torch.bfloat16]
    shared = [n for n in widening if len(n.users) > 1]
    assert shared, "the traced quantization no longer widens once for two readers"
    extra_readers = sum(len(n.users) - 1 for n in shared)
    expected = graph(h)
    added = narrow_stores(graph.graph)
    graph.recompile()
    assert added == extra_readers
    assert all(len(n.users) == 1 for n in graph.graph.nodes if n.target is CONVERT and n.args[1] == torch.float32)
    for got, want in zip(graph(h), expected):
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                           want.view(torch.uint8) if want.dtype == torch.float8_e4m3fn else want)


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
    assert passes.applied["narrow_stores"] >= 1
    assert torch.equal(scale, want_scale)
    assert torch.equal(quantized.view(torch.uint8), want_quantized.view(torch.uint8))
