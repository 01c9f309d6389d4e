"""omnispec's inductor graph pass (omnispec/kernels/inductor_passes.py): a dynamic fp8 quantization's bf16 input is
made a buffer of its own, every result keeps its bits, eager's and through inductor, and a pass the process
installed runs after it instead of being replaced."""

from __future__ import annotations

import torch
import torch._inductor.config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

from omnispec.kernels.inductor_passes import NarrowQuantizedInputs, narrow_quantized_inputs
from omnispec.policies.compile import _torch_compile_options
from omnispec.spec.policies import CompilePolicy


def row_quantized(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's fp8 row quantization of a GELU as its ops reach inductor: the bf16 value's amax makes a bf16 scale,
    widened; the value is widened, divided by it, clamped and cast."""
    value = torch.nn.functional.gelu(h, approximate="tanh")
    scale = (value.abs().amax(dim=-1, keepdim=True) / 448.0).to(torch.float32)
    return (value.to(torch.float32) / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def unquantized(h: torch.Tensor) -> torch.Tensor:
    """A widening that no fp8 cast follows: left alone."""
    return torch.nn.functional.gelu(h, approximate="tanh").to(torch.float32) / 3.0


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _graph(fn, *args) -> torch.fx.GraphModule:
    return make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)


FORCE = torch.ops.prims.inductor_force_stride_order.default


def test_the_quantized_bf16_values_become_buffers_and_keep_their_bits():
    """The value divided and cast to fp8 and the bf16 scale go through force_stride_order, which every other reader
    reads; a second run changes nothing; a widening no fp8 cast follows is left alone."""
    h = torch.randn(16, 96, dtype=torch.bfloat16) * 3
    graph = _graph(row_quantized, h)
    expected = graph(h)
    assert narrow_quantized_inputs(graph.graph) == 2  # the GELU's value and the scale
    graph.recompile()
    forced = [n for n in graph.graph.nodes if n.target is FORCE]
    assert all(n.args[0].meta["val"].dtype == torch.bfloat16 for n in forced)
    assert all(list(n.args[0].users) == [n] for n in forced)
    assert narrow_quantized_inputs(graph.graph) == 0
    for got, want in zip(graph(h), expected):
        assert torch.equal(_bits(got), _bits(want))
    plain = _graph(unquantized, h)
    assert narrow_quantized_inputs(plain.graph) == 0


class _Counting(CustomGraphPass):
    def __init__(self, key: str | None = "counting") -> None:
        self.calls, self.key = 0, key

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.calls += 1

    def uuid(self) -> str | None:
        return self.key


def test_compile_options_carry_the_pass_and_chain_one_the_process_installed():
    policy = CompilePolicy(mode="regional")
    alone = _torch_compile_options(policy)["post_grad_custom_pre_pass"]
    assert isinstance(alone, NarrowQuantizedInputs) and alone.then == ()
    installed = _Counting()
    with inductor_config.patch(post_grad_custom_pre_pass=installed):
        chained = _torch_compile_options(policy)["post_grad_custom_pre_pass"]
    assert chained.then == (installed,)
    assert chained.uuid() != alone.uuid() and chained.uuid()[-1] == "counting"
    assert NarrowQuantizedInputs(then=_Counting(key=None)).uuid() is None  # then inductor skips its cache
    graph = _graph(row_quantized, torch.randn(4, 8, dtype=torch.bfloat16)).graph
    chained(graph)
    assert chained.routed == 2 and installed.calls == 1


def test_inductor_runs_the_pass_and_the_compiled_quantization_keeps_eagers_bits():
    """Compiled with omnispec's options (on the CPU's code generation here), the pass routes both values and the
    fp8 values and the scale equal eager's bit for bit."""
    h = torch.randn(8, 64, dtype=torch.bfloat16) * 3
    options = {**_torch_compile_options(CompilePolicy(mode="regional")), "fx_graph_cache": False}
    torch._dynamo.reset()
    quantized, scale = torch.compile(row_quantized, fullgraph=True, options=options)(h)
    want_quantized, want_scale = row_quantized(h)
    assert options["post_grad_custom_pre_pass"].routed == 2
    assert torch.equal(scale, want_scale)
    assert torch.equal(_bits(quantized), _bits(want_quantized))


def test_the_pass_keeps_inductors_graph_cache_warm(tmp_path, monkeypatch):
    """The pass keys inductor's FX graph cache by its file's hash, so a second compile of the same graph (a new
    process, a rebuilt pipeline) is a cache hit, not a bypass: the warm-cache compile times hold with it."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    counters.clear()
    h = torch.randn(8, 64, dtype=torch.bfloat16) * 3
    for _ in range(2):
        torch._dynamo.reset()
        options = {**_torch_compile_options(CompilePolicy(mode="regional")), "fx_graph_cache": True}
        with inductor_config.patch(fx_graph_remote_cache=False):
            torch.compile(row_quantized, fullgraph=True, options=options)(h)
    assert counters["inductor"]["fxgraph_cache_bypass"] == 0
    assert counters["inductor"]["fxgraph_cache_hit"] >= 1
