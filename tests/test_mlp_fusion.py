"""The fused feed-forward operators (``policies.mlp.fused_gelu``): their gradients, the split projection's
arithmetic, the hook's fallback for weights the operators do not take, and on CUDA cuBLASLt's epilogue against the
model's own operations."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from diffusers.models.activations import GELU

import omnispec
from omnispec.kernels.gemm_epilogue import by_halves, linear_gelu, linear_of_pair, plain_linear
from omnispec.policies import mlp
from omnispec.testing import TINY_OVERRIDES

from conftest import SPECS


def _rand(*shape, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator(device).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dtype)


def test_the_operators_gradients_and_registrations_check_out():
    x, w, b = _rand(2, 5, 8, seed=1), _rand(12, 8, seed=2), _rand(12, seed=3)
    first, second, w_out, b_out = _rand(2, 5, 4, seed=4), _rand(2, 5, 12, seed=5), _rand(3, 16, seed=6), _rand(3)
    for op, inputs in ((linear_gelu, (x, w, b)), (linear_of_pair, (first, second, w_out, b_out))):
        inputs = tuple(t.requires_grad_() for t in inputs)
        assert torch.autograd.gradcheck(op, inputs)
        torch.library.opcheck(op, inputs)
    assert torch.autograd.gradcheck(linear_gelu, (x.requires_grad_(), w.requires_grad_(), None))


def test_torchs_flop_counter_counts_the_operators_matmuls():
    """What MFU figures and ``explain --estimate`` count with: the operators' kernels run out of the counter's sight."""
    from torch.utils.flop_counter import FlopCounterMode

    x, w, b = _rand(2, 5, 8), _rand(12, 8), _rand(12)
    with FlopCounterMode(display=False) as counter:
        linear_of_pair(x, linear_gelu(x, w, b), _rand(3, 20), _rand(3))
    assert counter.get_total_flops() == 2 * 10 * 8 * 12 + 2 * 10 * 20 * 3


def test_the_split_projection_is_the_projection_of_the_concatenation():
    first, second, weight, bias = _rand(2, 5, 4), _rand(2, 5, 12, seed=1), _rand(3, 16, seed=2), _rand(3, seed=3)
    torch.testing.assert_close(by_halves(first, second, weight, bias),
                               F.linear(torch.cat([first, second], -1), weight, bias))


def test_the_operators_compile_with_their_gradients():
    x, w, b = _rand(2, 5, 8, dtype=torch.float32), _rand(12, 8, dtype=torch.float32, seed=1), _rand(12, seed=2,
                                                                                                    dtype=torch.float32)
    for t in (x, w, b):
        t.requires_grad_()

    def loss(x, w, b):
        return linear_of_pair(x, linear_gelu(x, w, b), torch.ones(3, 20), torch.zeros(3)).square().sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    for got, want in zip(torch.autograd.grad(compiled(x, w, b), (x, w, b)),
                         torch.autograd.grad(loss(x, w, b), (x, w, b)), strict=True):
        torch.testing.assert_close(got, want)


def test_a_projection_the_operators_do_not_take_runs_its_own_forward(monkeypatch):
    calls = []
    monkeypatch.setattr(mlp, "linear_gelu", lambda *args: calls.append(args) or linear_gelu(*args))
    original = GELU(8, 16, approximate="tanh")
    fused = mlp.FusedGelu(original)
    assert list(fused.state_dict()) == list(original.state_dict())  # the weights keep their names
    x = _rand(2, 8, dtype=torch.float32)
    torch.testing.assert_close(fused(x), original(x))
    assert len(calls) == 1
    assert not plain_linear(fused.proj, x.double())  # another dtype
    fused.proj = type("Wrapped", (torch.nn.Linear,), {})(8, 16)  # a LoRA or quantized layer is another class
    assert not plain_linear(fused.proj, x)
    torch.testing.assert_close(fused(x), F.gelu(fused.proj(x), approximate="tanh"))
    assert len(calls) == 1
    assert fused.restored() is original and original.proj is fused.proj  # the wrapped layer stays


cuda = pytest.mark.gpu  # cuBLASLt's epilogue runs on CUDA


@cuda
def test_the_epilogue_is_the_model_operations_within_a_rounding():
    x, w, b = _rand(3, 300, 256, dtype=torch.bfloat16, device="cuda"), _rand(1024, 256, dtype=torch.bfloat16,
                                                                             device="cuda", seed=1) / 16, _rand(
        1024, dtype=torch.bfloat16, device="cuda", seed=2)
    got, want = linear_gelu(x, w, b), F.gelu(F.linear(x, w, b), approximate="tanh")
    # the GELU of the float32 product, rounded once: within two bf16 steps of the model's two roundings
    torch.testing.assert_close(got, want, rtol=2 ** -7, atol=2 ** -7)
    first, second, wo, bo = _rand(3, 300, 256, dtype=torch.bfloat16, device="cuda"), got, _rand(
        256, 1280, dtype=torch.bfloat16, device="cuda", seed=3) / 32, _rand(256, dtype=torch.bfloat16, device="cuda")
    torch.testing.assert_close(linear_of_pair(first, second, wo, bo),
                               F.linear(torch.cat([first, second], -1), wo, bo), rtol=2 ** -6, atol=2 ** -6)


@cuda
def test_a_row_is_computed_as_in_any_batch_and_as_compiled():
    """Exact RL replay: a sample's numbers do not depend on its batch-mates or on compilation."""
    x, w, b = _rand(2, 4608, 3072, dtype=torch.bfloat16, device="cuda"), _rand(
        12288, 3072, dtype=torch.bfloat16, device="cuda", seed=1) / 64, _rand(12288, dtype=torch.bfloat16,
                                                                             device="cuda", seed=2)
    wo, bo = _rand(3072, 15360, dtype=torch.bfloat16, device="cuda", seed=3) / 128, _rand(3072, dtype=torch.bfloat16,
                                                                                         device="cuda", seed=4)

    def mlp_block(x):
        return linear_of_pair(x, linear_gelu(x, w, b), wo, bo)

    with torch.no_grad():
        both = mlp_block(x)
        assert torch.equal(mlp_block(x[1:]), both[1:])
        assert torch.equal(torch.compile(mlp_block, fullgraph=True)(x), both)


FAMILIES = [("flux_dir", "flux1-dev.yaml", "flux"), ("sd3_dir", "sd3.5-medium.yaml", "sd3"),
            ("wan_dir", "wan2.1-t2v-1.3b.yaml", "wan"), ("qwen_image_dir", "qwen-image.yaml", "qwen_image")]


def _image(request, fixture, spec, family, device, *overrides):
    pipe = omnispec.build(SPECS / spec, source=str(request.getfixturevalue(fixture)), device=device,
                          overrides=[*TINY_OVERRIDES[family], *overrides])
    return pipe, pipe("a cat", seed=0).array


@pytest.mark.parametrize("fixture, spec, family", FAMILIES[1:], ids=[f for _, _, f in FAMILIES[1:]])
def test_other_families_feed_forwards_are_fused_and_give_the_plain_output(request, fixture, spec, family):
    pipe, fused = _image(request, fixture, spec, family, "cpu", "policies.mlp.fused_gelu=true")
    note = pipe.explain(as_dict=True)["applied"]["mlp"]
    assert note.startswith("transformer: bias + GELU in the matmul for ") and "parallel" not in note
    assert int(note.split(" for ")[1].split()[0]) > 0
    assert np.array_equal(fused, _image(request, fixture, spec, family, "cpu")[1])  # the model's operations off CUDA


@cuda
@pytest.mark.parametrize("fixture, spec, family", FAMILIES, ids=[f for _, _, f in FAMILIES])
def test_a_run_with_the_fused_feed_forwards_is_the_plain_run_within_roundings(request, fixture, spec, family):
    _, plain = _image(request, fixture, spec, family, "cuda")
    _, fused = _image(request, fixture, spec, family, "cuda", "policies.mlp.fused_gelu=true")
    assert np.abs(fused - plain).max() <= 1e-3  # float32: the epilogue's GELU may differ in its last bits


def test_quantized_feed_forwards_are_left_to_their_own_matmuls(request):
    """``fused_gelu`` with the denoiser quantized at load (``preset: fastest`` asks for both): the projections are
    quantized layers, which the fused operators do not take; the build says so instead of refusing, and the run is
    the quantized one's."""
    int8 = "policies.quantization={transformer: {method: int8_weight_only}}"
    pipe, both = _image(request, "qwen_image_dir", "qwen-image.yaml", "qwen_image", "cpu", int8,
                        "policies.mlp.fused_gelu=true")
    note = pipe.explain(as_dict=True)["applied"]["mlp"]
    assert note.startswith("transformer: nothing fused: its ") and "quantized or wrapped" in note
    assert int(note.split(" its ")[1].split()[0]) > 0
    assert np.array_equal(both, _image(request, "qwen_image_dir", "qwen-image.yaml", "qwen_image", "cpu", int8)[1])
