"""The fused q/k norm + RoPE operator (``policies.attention.fused_qk_norm_rope``): its gradients, and on CUDA its
Triton kernel against the model's own operations."""

import pytest
import torch

from omnispec.policies.qk_norm_rope import kernel_refusal, qk_norm_rope, reference


def _inputs(tokens: int, text_tokens: int, dtype: torch.dtype, device: str = "cpu", heads: int = 3,
            head_dim: int = 8, batch: int = 2):
    g = torch.Generator(device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dtype)

    angles = torch.rand(tokens + text_tokens, head_dim // 2, generator=g, device=device) * 6.3
    cos, sin = (f(angles).repeat_interleave(2, dim=1) for f in (torch.cos, torch.sin))
    text = rand(batch, text_tokens, heads, head_dim) * 3 if text_tokens else None
    return (rand(batch, tokens, heads, head_dim) * 3, 1 + 0.1 * rand(head_dim), 1e-6, cos, sin, text,
            1 + 0.1 * rand(head_dim) if text_tokens else None)


@pytest.mark.parametrize("text_tokens", [0, 3])
def test_gradients_are_the_model_operations_gradients(text_tokens):
    inputs = list(_inputs(5, text_tokens, torch.float64))
    wanted = [i for i in (0, 1, 5, 6) if inputs[i] is not None]
    for i in wanted:
        inputs[i].requires_grad_()
    grad = torch.randn(2, 5 + text_tokens, 3, 8, dtype=torch.float64)
    expected = torch.autograd.grad(reference(*inputs), [inputs[i] for i in wanted], grad)
    got = torch.autograd.grad(qk_norm_rope(*inputs), [inputs[i] for i in wanted], grad)
    for e, g in zip(expected, got, strict=True):
        # the model's RoPE multiplies in float32 (apply_rotary_emb's x.float()), so float32's precision
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_the_operator_compiles_with_its_gradient():
    inputs = list(_inputs(6, 2, torch.float32))
    for i in (0, 1, 5, 6):
        inputs[i].requires_grad_()

    def loss(*args):
        return qk_norm_rope(*args).square().sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(*inputs), [inputs[i] for i in (0, 1, 5, 6)])
    expected = torch.autograd.grad(loss(*inputs), [inputs[i] for i in (0, 1, 5, 6)])
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(g, e)


def test_off_cuda_the_operator_is_the_model_operations():
    inputs = _inputs(5, 3, torch.bfloat16)
    assert kernel_refusal(inputs[0], inputs[3], inputs[5]) == "not on CUDA"
    assert torch.equal(qk_norm_rope(*inputs), reference(*inputs))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel needs CUDA")
@pytest.mark.parametrize("text_tokens", [0, 512])
def test_the_kernel_matches_the_model_operations_and_ignores_batch_mates(text_tokens):
    inputs = _inputs(4096 if text_tokens else 4608, text_tokens, torch.bfloat16, "cuda", heads=24, head_dim=128)
    assert kernel_refusal(inputs[0], inputs[3], inputs[5]) is None
    got, expected = qk_norm_rope(*inputs), reference(*inputs)
    share = (got != expected).float().mean().item()
    worst = (got.float() - expected.float()).abs().max().item()
    # Where the sum of squares adds up in another order a normed value (of order 1) can round one bf16 step the
    # other way; the rotation moves the output by at most that step (1/32 for values in [4, 8)).
    assert share < 1e-4 and worst <= 2 ** -5, (share, worst)
    alone = qk_norm_rope(inputs[0][1:], *inputs[1:5], None if inputs[5] is None else inputs[5][1:], inputs[6])
    assert torch.equal(alone, got[1:])
