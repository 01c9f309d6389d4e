"""The ``sage`` attention backend: Sage-style int8 attention (``kernels/sage.py``) whose plain-torch reference is close
to exact attention, whose backward is exact attention's at the same inputs, and which serves rollouts and replays with
gradients at a log-prob ratio of exactly 1; refused with the reason where it cannot run."""

import json

import pytest
import torch
import torch.nn.functional as F

import omnispec
from omnispec.cli import main
from omnispec.kernels import sage
from omnispec.policies.attention_kernels import usable

from conftest import SPECS

DIGITS = SPECS / "digits.yaml"
QUICK = ["runtime.progress=false", "recipe.defaults.steps=3", "recipe.phases.0.guidance.terms=[]"]
SDE = {"kind": "sde", "window": {"kind": "fixed", "start": 0, "length": 2}}


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


def _inputs(shape, dtype=torch.float32, seed=0, requires_grad=False):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=generator).to(dtype).requires_grad_(requires_grad) for _ in range(3)]


@pytest.mark.parametrize("shape, dtype, pv", [((1, 2, 77, 64), torch.float32, "input"),
                                              ((2, 3, 300, 32), torch.bfloat16, "input"),
                                              ((1, 2, 1000, 128), torch.bfloat16, "fp8")])
def test_the_reference_is_within_a_cosine_of_0_99_of_exact_attention_but_not_exact(shape, dtype, pv):
    q, k, v = _inputs(shape, dtype)
    out = sage.sage_reference(q, k, v, pv=pv)
    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert out.dtype == dtype and out.shape == q.shape
    assert _cosine(out, exact) >= 0.99
    assert not torch.allclose(out.float(), exact, atol=1e-4)  # quantized: not exact attention rounded


def test_smoothing_k_keeps_a_per_channel_offset_from_spending_int8s_range():
    """A large offset per channel of K, shared by every token, leaves attention as it is (softmax cancels it); without
    the mean subtracted, the blocks' scales would follow the offset (cosine about 0.95 here)."""
    q, k, v = _inputs((1, 2, 256, 64))
    k = k + 50 * torch.randn(64, generator=torch.Generator().manual_seed(1))
    assert _cosine(sage.sage_reference(q, k, v), F.scaled_dot_product_attention(q, k, v)) >= 0.999


def test_quantized_blocks_hold_int8_values_with_one_scale_per_block():
    x = torch.randn(1, 1, 150, 8) * torch.linspace(0.1, 10, 150)[:, None]
    values, scales = sage.quantize_blocks(x, 64)
    assert values.abs().max() == 127 and torch.equal(values, values.round())
    assert [len(scales[0, 0, b:b + 64].unique()) for b in (0, 64, 128)] == [1, 1, 1]
    assert torch.allclose(values * scales, x, atol=scales.max().item() / 2 + 1e-6)


def test_gradients_are_exact_attentions_at_the_same_inputs_and_the_forward_is_unchanged():
    q, k, v = _inputs((2, 2, 200, 32), requires_grad=True)
    out = sage.sage_attention(q, k, v)
    with torch.no_grad():
        assert torch.equal(out, sage.sage_attention(q, k, v))
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    exact = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v), (q, k, v), grad_out)
    for got, want in zip(grads, exact):
        assert torch.isfinite(got).all() and torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    # only the inputs that ask for a gradient get one
    (only_v,) = torch.autograd.grad(sage.sage_attention(q.detach(), k.detach(), v), (v,), grad_out)
    assert torch.allclose(only_v, exact[2], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("v_dim", [32, 48], ids=["cpu_flash_kernel", "float32_math"])
def test_exact_attention_gradients_equal_autograds_through_sdpa(v_dim):
    """The backward operators' gradients (aten's SDPA backward on the CPU, float32 math where its kernel cannot take
    the call: here a value head size unlike the query's) against autograd through SDPA."""
    from omnispec.kernels.sdpa import exact_attention_gradients

    q, k = torch.randn(2, 3, 70, 32, requires_grad=True), torch.randn(2, 3, 50, 32, requires_grad=True)
    v = torch.randn(2, 3, 50, v_dim, requires_grad=True)
    grad_out = torch.randn(2, 3, 70, v_dim)
    want = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, scale=0.3), (q, k, v), grad_out)
    with torch.no_grad():
        got = exact_attention_gradients(grad_out, q, k, v, 0.3)
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,dim,kernels", [
    (torch.bfloat16, 128, "flash"), (torch.bfloat16, 20, "flash"), (torch.float32, 64, "efficient"),
    (torch.bfloat16, 64, "math")])
def test_exact_attention_gradients_on_cuda_equal_autograds_on_the_same_kernel(dtype, dim, kernels):
    """Flash (a head size padded to 8 among them), memory-efficient and math gradients on CUDA against autograd
    through SDPA on the same kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from omnispec.kernels.sdpa import exact_attention_gradients

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "math": SDPBackend.MATH}[kernels]
    q, k, v = (torch.randn(2, 4, n, dim, device="cuda", dtype=dtype, requires_grad=True) for n in (300, 260, 260))
    grad_out = torch.randn(2, 4, 300, dim, device="cuda", dtype=dtype)
    with sdpa_kernel([backend]):
        want = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v), (q, k, v), grad_out)
        with torch.no_grad():
            got = exact_attention_gradients(grad_out, q, k, v, None)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.allclose(g.float(), w.float(), rtol=tolerance, atol=tolerance)


def _rollout_and_replay_with_gradients(pipe) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """A rollout's log-probs, its replay's with gradients, and the denoiser's gradients from the replay's backward."""
    ro = pipe.rollout(["seven"], group_size=2, seed=0, sampler=SDE)
    denoiser = pipe.components["transformer"]
    denoiser.requires_grad_(True)
    try:
        replay = pipe.log_prob(ro, grad=True)
        replay.log_probs.sum().backward()
        grads = [p.grad for p in denoiser.parameters() if p.grad is not None]
    finally:
        denoiser.requires_grad_(False).zero_grad(set_to_none=True)
    return ro.log_probs, replay.log_probs.detach(), grads


def check_quantized_rollout_replays_exactly(monkeypatch, module, reference: str, backend: str, compiled: bool) -> None:
    """An approximate backend's rollout and its replay with gradients run its quantized forward (``module``'s
    ``reference``, the CPU's path, counted), and the replay's log-probs are the rollout's, bit for bit; with
    ``compiled``, under regional compile, where the backend's operators are traced into each block (one redirect
    around the denoiser's call) with their backward registered."""
    calls = []
    original = getattr(module, reference)
    monkeypatch.setattr(module, reference, lambda *a, **k: calls.append(1) or original(*a, **k))
    torch._dynamo.reset()
    overrides = [*QUICK, f"policies.attention.default={backend}"]
    if compiled:
        overrides.append("policies.compile={mode: regional, backend: aot_eager}")
    pipe = omnispec.build(DIGITS, overrides=overrides)
    assert ("compiled in" in pipe.explain(as_dict=True)["attention"]["self"]) == compiled
    try:
        pipe.rollout(["seven"], group_size=1, seed=0, sampler=SDE)
        in_rollout = len(calls)
        rolled, replayed, grads = _rollout_and_replay_with_gradients(pipe)
    finally:
        torch._dynamo.reset()
    assert in_rollout > 0 and len(calls) > 2 * in_rollout  # the quantized kernel ran in the rollout and the replay
    assert torch.equal(replayed, rolled)
    assert grads and all(torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_sage_rollout_replays_with_gradients_at_a_ratio_of_exactly_one(monkeypatch, compiled):
    check_quantized_rollout_replays_exactly(monkeypatch, sage, "sage_reference", "sage", compiled)


def test_sage_is_refused_with_the_reason_where_it_cannot_run(monkeypatch):
    cuda = torch.device("cuda")
    assert "not installed" in usable("sage", cuda, torch.bfloat16, 128)  # its package is absent here
    monkeypatch.setattr(sage.importlib.util, "find_spec", lambda name: object())
    assert "on float16 or bfloat16 inputs, not float32" in sage.refusal(cuda, torch.float32, 128)
    assert "head sizes 64, 96, 128, not 80" in sage.refusal(cuda, torch.bfloat16, 80)
    assert sage.refusal(cuda, torch.bfloat16, 128) is None
    assert "not on mps" in sage.refusal(torch.device("mps"), torch.float16, 64)
    assert usable("sage", torch.device("cpu"), torch.float32, 24) is None  # the reference runs on the CPU


def test_sage_under_compile_beside_another_backend_is_refused_with_the_reason(capsys):
    assert main(["validate", str(DIGITS), "--set", "policies.attention.default=sage",
                 "--set", "policies.attention.per_role={cross: sdpa_flash}",
                 "--set", "policies.compile.mode=regional"]) == 2
    assert "sage runs every attention of the denoiser" in capsys.readouterr().err


def test_explain_says_sage_is_approximate_and_what_its_backward_is(capsys):
    assert main(["explain", str(DIGITS), "--set", "policies.attention.default=sage", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "approximate: Q and K" in out["attention"]["default"]
    trained = out["attention_with_gradients"]["default"]
    assert "backward is exact attention's at the same q, k and v (straight-through)" in trained
    assert "never cuDNN's" in trained


def test_the_cuda_kernel_gets_k_smoothed_here_and_leaves_the_callers_k_as_it_was(monkeypatch):
    """sageattention smooths K in place where K is contiguous in its dtype; omnispec hands it a smoothed copy and
    turns its own smoothing off, so a K that autograd saved stays as it was."""
    import sys
    import types

    seen = {}

    def fake_sageattn(q, k, v, tensor_layout, is_causal, smooth_k=True, **kwargs):
        seen.update(smooth_k=smooth_k, k=k.clone(), layout=tensor_layout)
        if smooth_k:
            k -= k.mean(dim=-2, keepdim=True)
        return sage.sage_reference(q, k, v, scale=kwargs.get("sm_scale"))

    monkeypatch.setitem(sys.modules, "sageattention", types.SimpleNamespace(sageattn=fake_sageattn))
    q, k, v = _inputs((1, 2, 64, 16))
    k = k + 3.0
    before = k.clone()
    sage._gpu_kernel(q, k, v, None)
    assert torch.equal(k, before) and seen["smooth_k"] is False and seen["layout"] == "HND"
    assert torch.allclose(seen["k"].mean(dim=-2), torch.zeros(1, 2, 16), atol=1e-5)


def test_flop_counters_count_omnispecs_attention_operators_as_the_attention_they_replace():
    """An MFU from torch's FlopCounterMode over a forward whose attention ran on ``sage`` or ``flash4`` counted the
    matmuls alone (half of Wan2.1 14B's step); both operators count as SDPA's exact attention of the same shapes
    (FA4's operator takes them tokens first)."""
    from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

    from omnispec.kernels import flash4

    q, k, v = (torch.randn(2, 3, 96, 32, requires_grad=True), torch.randn(2, 3, 80, 32, requires_grad=True),
               torch.randn(2, 3, 80, 48, requires_grad=True))
    exact = sdpa_flop_count(q.shape, k.shape, v.shape)
    grads = sdpa_backward_flop_count((*q.shape[:3], v.shape[3]), q.shape, k.shape, v.shape)
    for name, run in [("omnispec.sage_attention", lambda: sage.sage_attention(q, k, v, None)),
                      ("omnispec.flash4_attention", lambda: flash4.flash4_sdpa(q, k, v, None))]:
        counter = FlopCounterMode(display=False)
        with counter:  # the backward too: its gradients must run under a dispatch mode
            run().sum().backward()
        counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
        assert counts.get(name) == exact and counts.get(f"{name}_backward") == grads, (name, counts, exact, grads)
