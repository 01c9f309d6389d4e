"""The fused feed-forward operators (``policies.mlp.fused_gelu``): their gradients, the split projection's
arithmetic, the hook's fallback for weights the operators do not take, and on CUDA cuBLASLt's epilogue against the
model's own operations."""

import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from diffusers.models.activations import GELU

import omnispec
from omnispec.policies import mlp
from omnispec.policies.mlp import by_halves, linear_gelu, linear_of_pair, plain_linear
from omnispec.spec import SpecError
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


@pytest.mark.parametrize("matmul", ["cublaslt", "quack"])
def test_inductor_keeps_the_operator_whole_with_either_matmul(matmul):
    """The operator's arguments as inductor lowers them (an argument named ``kernel`` once collided with its own)."""
    x, w, b = (_rand(2, 5, 8, dtype=torch.float32, seed=1), _rand(12, 8, dtype=torch.float32),
               _rand(12, dtype=torch.float32, seed=2))
    compiled = torch.compile(lambda x: linear_gelu(x, w, b, matmul), fullgraph=True, backend="inductor")
    torch.testing.assert_close(compiled(x), F.gelu(F.linear(x, w, b), approximate="tanh"))


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


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLASLt's epilogue runs on CUDA")
needs_quack = pytest.mark.skipif(mlp.quack_missing() is not None, reason="quack-kernels is not installed")


def test_the_quack_kernel_needs_fused_gelu_and_the_package(request, monkeypatch):
    with pytest.raises(SpecError, match=r"policies.mlp: fused_gelu_kernel 'quack' applies only with fused_gelu: true"):
        omnispec.build(SPECS / "digits.yaml", overrides=["policies.mlp.fused_gelu_kernel=quack"])
    for name in ("quack", "quack.gemm_interface"):  # an import of quack now fails, installed or not
        monkeypatch.setitem(sys.modules, name, None)
    assert mlp.quack_missing().startswith("ModuleNotFoundError")
    with pytest.raises(SpecError, match=r"policies.mlp.fused_gelu_kernel: fused_gelu_kernel quack needs the package "
                                        r"quack-kernels, which is not importable here \(ModuleNotFoundError"):
        omnispec.build(SPECS / "digits.yaml", overrides=["policies.mlp.fused_gelu=true",
                                                         "policies.mlp.fused_gelu_kernel=quack"])


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
@pytest.mark.parametrize("kernel", ["cublaslt", pytest.param("quack", marks=needs_quack)])
def test_a_row_is_computed_as_in_any_batch_and_as_compiled(kernel):
    """Exact RL replay: a sample's numbers do not depend on its batch-mates or on compilation."""
    x, w, b = _rand(2, 4608, 3072, dtype=torch.bfloat16, device="cuda"), _rand(
        12288, 3072, dtype=torch.bfloat16, device="cuda", seed=1) / 64, _rand(12288, dtype=torch.bfloat16,
                                                                             device="cuda", seed=2)
    wo, bo = _rand(3072, 15360, dtype=torch.bfloat16, device="cuda", seed=3) / 128, _rand(3072, dtype=torch.bfloat16,
                                                                                         device="cuda", seed=4)

    def mlp_block(x):
        return linear_of_pair(x, linear_gelu(x, w, b, kernel), wo, bo)

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


def _stand_in_quack(monkeypatch, gemm_act):
    """A module named as quack's GEMM interface, with ``gemm_act`` in place of quack's."""
    module = types.ModuleType("quack.gemm_interface")
    module.gemm_act = gemm_act
    monkeypatch.setitem(sys.modules, "quack", types.ModuleType("quack"))
    monkeypatch.setitem(sys.modules, "quack.gemm_interface", module)


def test_the_quack_kernel_reaches_every_fused_projection_and_off_cuda_runs_the_model(request, monkeypatch):
    """FLUX's feed-forwards and its single blocks' hooks carry the kernel into the operator; off CUDA the operator runs
    the model's own operations, so quack is never called there."""
    _stand_in_quack(monkeypatch, lambda *args, **kwargs: pytest.fail("quack was called off CUDA"))
    pipe, fused = _image(request, "flux_dir", "flux1-dev.yaml", "flux", "cpu", "policies.mlp.fused_gelu=true",
                         "policies.mlp.fused_gelu_kernel=quack")
    assert pipe.explain(as_dict=True)["applied"]["mlp"].endswith(
        "(quack's GEMM on CUDA; the model's own operations elsewhere)")
    transformer = pipe.components["transformer"]
    gelus = [m for m in transformer.modules() if isinstance(m, mlp.FusedGelu)]
    hooks = [block._diffusers_hook.get_hook(mlp.HOOK_NAME) for block in transformer.single_transformer_blocks]
    assert gelus and all(m.kernel == "quack" for m in gelus)
    assert hooks and all(hook.ops.kernel == "quack" for hook in hooks)
    assert np.array_equal(fused, _image(request, "flux_dir", "flux1-dev.yaml", "flux", "cpu")[1])


@cuda
def test_a_shape_quack_refuses_runs_on_cublaslt_from_then_on(monkeypatch, caplog):
    calls = []

    def refusing(*args, **kwargs):
        calls.append(args[0].shape)
        raise AssertionError("tile does not divide the inner size")

    _stand_in_quack(monkeypatch, refusing)
    monkeypatch.setattr(mlp, "QUACK_REFUSED", {})
    x, w, b = (_rand(2, 7, 40, dtype=torch.bfloat16, device="cuda"), _rand(24, 40, dtype=torch.bfloat16, device="cuda",
                                                                          seed=1), _rand(24, dtype=torch.bfloat16,
                                                                                         device="cuda", seed=2))
    want = linear_gelu(x, w, b)
    with caplog.at_level("WARNING"):
        assert torch.equal(linear_gelu(x, w, b, "quack"), want)
        assert torch.equal(linear_gelu(x[:1], w, b, "quack"), want[:1])  # another batch: the same shape, remembered
    assert calls == [(14, 40)]
    assert list(mlp.QUACK_REFUSED) == [(40, 24, torch.bfloat16, "cuda:0", True)]
    assert [r.getMessage() for r in caplog.records if "quack" in r.getMessage()] == [
        "quack's GEMM refused the feed-forward matmul 40 -> 24 (AssertionError: tile does not divide the inner size); "
        "those calls run on cuBLASLt from now on"]


@cuda
@needs_quack
def test_quacks_epilogue_is_the_model_operations_within_a_rounding():
    x, w, b = _rand(3, 300, 256, dtype=torch.bfloat16, device="cuda"), _rand(1024, 256, dtype=torch.bfloat16,
                                                                             device="cuda", seed=1) / 16, _rand(
        1024, dtype=torch.bfloat16, device="cuda", seed=2)
    got = linear_gelu(x, w, b, "quack")
    assert not mlp.QUACK_REFUSED
    torch.testing.assert_close(got, F.gelu(F.linear(x, w, b), approximate="tanh"), rtol=2 ** -7, atol=2 ** -7)
    torch.testing.assert_close(got, linear_gelu(x, w, b), rtol=2 ** -7, atol=2 ** -7)  # cuBLASLt's epilogue


@cuda
@needs_quack
def test_a_bfloat16_flux_run_on_quack_is_the_cublaslt_run_within_roundings(request):
    overrides = ["model.dtype=bfloat16", "policies.mlp.fused_gelu=true"]
    _, cublaslt = _image(request, "flux_dir", "flux1-dev.yaml", "flux", "cuda", *overrides)
    _, quack = _image(request, "flux_dir", "flux1-dev.yaml", "flux", "cuda", *overrides,
                      "policies.mlp.fused_gelu_kernel=quack")
    assert not mlp.QUACK_REFUSED
    a, b = (np.asarray(img, dtype=np.float64).ravel() - 0.5 for img in (cublaslt, quack))
    assert a @ b / np.sqrt((a @ a) * (b @ b)) > 0.999
