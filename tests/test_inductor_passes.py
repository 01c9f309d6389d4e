"""The inductor graph passes the fp8 benchmarks try (benchmarks/inductor_passes.py): each changes the graph as it
says, and installed process-wide they run inside omnispec's compiles, after omnispec's own pass."""

from __future__ import annotations

import torch
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

from benchmarks.inductor_passes import Passes, fast_tanh, install


def _graph(fn, *args) -> torch.fx.GraphModule:
    return make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)


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


def test_installed_passes_run_inside_omnispecs_compiles_and_are_keyed_by_name():
    """Installed process-wide, the passes run after omnispec's own (on the CPU's code generation here): both count
    their changes, and fast_tanh's GELU stays within a bf16 rounding of eager's."""
    import torch._inductor.config as inductor_config

    from omnispec.policies.compile import _torch_compile_options
    from omnispec.spec.policies import CompilePolicy

    h = torch.randn(8, 64, dtype=torch.bfloat16) * 3
    with inductor_config.patch(post_grad_custom_pre_pass=None):
        passes = install(["fast_tanh"])
        assert passes.uuid() != Passes([]).uuid()
        options = {**_torch_compile_options(CompilePolicy(mode="regional")), "fx_graph_cache": False}
    torch._dynamo.reset()
    gelu = torch.compile(lambda x: torch.nn.functional.gelu(x, approximate="tanh").abs().amax(-1), fullgraph=True,
                         options=options)
    got, want = gelu(h), torch.nn.functional.gelu(h, approximate="tanh").abs().amax(-1)
    assert passes.applied["fast_tanh"] == 1 and options["post_grad_custom_pre_pass"].then == (passes,)
    assert (got.float() - want.float()).abs().max() <= (want.float().abs().max() * 2 ** -7)
