"""The fused q/k norm + RoPE operator (``policies.attention.fused_qk_norm_rope``): its gradients; its Triton kernel
under Triton's interpreter where triton is installed (on the CPU, in float32); on CUDA its Triton kernel against the
model's own operations."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from omnispec.kernels.qk_norm_rope import kernel_refusal, launch, qk_norm_rope, reference


def _inputs(tokens: int, text_tokens: int, dtype: torch.dtype, device: str = "cpu", heads: int = 3,
            head_dim: int = 8, batch: int = 2):
    """The operator's arguments: query, key, their weights, eps, cos, sin, then the text stream's four (or None)."""
    g = torch.Generator(device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dtype)

    def weight():
        return 1 + 0.1 * rand(head_dim)

    angles = torch.rand(tokens + text_tokens, head_dim // 2, generator=g, device=device) * 6.3
    cos, sin = (f(angles).repeat_interleave(2, dim=1) for f in (torch.cos, torch.sin))
    texts = ((rand(batch, text_tokens, heads, head_dim) * 3, rand(batch, text_tokens, heads, head_dim) * 3,
              weight(), weight()) if text_tokens else (None,) * 4)
    return (rand(batch, tokens, heads, head_dim) * 3, rand(batch, tokens, heads, head_dim) * 2, weight(), weight(),
            1e-6, cos, sin, *texts)


TENSOR_INPUTS = (0, 1, 2, 3, 7, 8, 9, 10)  # the arguments a gradient flows to
ACTIVATIONS = (0, 1, 7, 8)  # the arguments with a batch: queries, keys and the text stream's


def _second_sample(inputs) -> tuple:
    """The arguments for the batch's second sample alone."""
    return tuple(x[1:] if i in ACTIVATIONS and x is not None else x for i, x in enumerate(inputs))


@pytest.mark.parametrize("text_tokens", [0, 3])
def test_gradients_are_the_model_operations_gradients(text_tokens):
    inputs = list(_inputs(5, text_tokens, torch.float64))
    wanted = [i for i in TENSOR_INPUTS if inputs[i] is not None]
    for i in wanted:
        inputs[i].requires_grad_()
    grads = [torch.randn(2, 5 + text_tokens, 3, 8, dtype=torch.float64) for _ in range(2)]
    expected = torch.autograd.grad(reference(*inputs), [inputs[i] for i in wanted], grads)
    got = torch.autograd.grad(qk_norm_rope(*inputs), [inputs[i] for i in wanted], grads)
    for e, g in zip(expected, got, strict=True):
        # the model's RoPE multiplies in float32 (apply_rotary_emb's x.float()), so float32's precision
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_the_operator_compiles_with_its_gradient():
    inputs = list(_inputs(6, 2, torch.float32))
    for i in TENSOR_INPUTS:
        inputs[i].requires_grad_()

    def loss(*args):
        query, key = qk_norm_rope(*args)
        return query.square().sum() + (query * key).sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(*inputs), [inputs[i] for i in TENSOR_INPUTS])
    expected = torch.autograd.grad(loss(*inputs), [inputs[i] for i in TENSOR_INPUTS])
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(g, e)


def test_off_cuda_the_operator_is_the_model_operations():
    inputs = _inputs(5, 3, torch.bfloat16)
    assert kernel_refusal(inputs[0], inputs[1], inputs[5], inputs[7], inputs[8]) == "not on CUDA"
    for got, expected in zip(qk_norm_rope(*inputs), reference(*inputs), strict=True):
        assert torch.equal(got, expected)


def _strided(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values in a view whose tokens and heads are strided, as in a slice of a fused projection."""
    wide = torch.zeros(x.shape[0], x.shape[1], x.shape[2] + 2, x.shape[3] * 2, dtype=x.dtype)
    wide[:, :, 1:-1, : x.shape[3]] = x
    return wide[:, :, 1:-1, : x.shape[3]]


def _interpreted_checks() -> None:
    """The kernel against the model's operations, paired and one launch a tensor, a row alone against its batch.
    Run as this file's main under ``TRITON_INTERPRET=1``: triton's own functions take the interpreter only when it is
    set before triton is first imported."""
    for text_tokens in (0, 5):
        # 37 tokens (not a multiple of the 16 a program takes), 6 heads (taken 3 at a time with 4 asked for), a
        # batch of 2, and strided views: the kernel's masks, head groups and strides
        inputs = list(_inputs(37, text_tokens, torch.float32, heads=6, head_dim=16))
        for i in ACTIVATIONS:
            if inputs[i] is not None:
                inputs[i] = _strided(inputs[i])
        paired = launch(*inputs)
        for got, want in zip(paired, reference(*inputs), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for apart, together in zip(launch(*inputs, paired=False), paired, strict=True):
            assert torch.equal(apart, together), text_tokens
        alone = launch(*_second_sample(inputs))
        for one, batch in zip(alone, paired, strict=True):
            assert torch.equal(one, batch[1:]), text_tokens


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_the_kernel_under_the_interpreter_is_the_model_operations():
    # float32: the interpreter rounds bfloat16 its own way (on CUDA the test below checks bfloat16)
    done = subprocess.run([sys.executable, __file__], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("paired", [True, False])
def test_the_kernel_moves_its_rows_16_bytes_an_instruction_on_hopper(paired):
    # compiled for sm_90 as a launch at FLUX's shapes specializes it, without a GPU: a form of the kernel that hides
    # its rows' contiguity from Triton loads them 2 bytes at a time (its first form, under triton 3.9)
    from benchmarks.triton_ptx import compile_kernel

    row = compile_kernel(90, tokens=16, heads=4, warps=4, paired=paired)
    tensors = 2 if paired else 1
    by_width = row["global_memory_instructions"]
    narrow_loads = sum(n for kind, n in by_width.items() if kind.startswith("ld ") and kind != "ld v4.b32")
    assert narrow_loads <= 2 * tensors, row  # the norms' weights, 256 bytes a tensor
    assert set(by_width) - {"ld v4.b32", "st v4.b32"} <= {"ld b16", "ld b32", "ld v2.b32"}, row
    assert by_width.get("st v4.b32", 0) >= 4 * tensors, row  # 4 heads of 16 x 128 bf16 over 128 threads, each 32 B
    assert row.get("spilled_bytes", 0) == 0, row


@pytest.mark.gpu  # the Triton kernel
@pytest.mark.parametrize("text_tokens", [0, 512])
def test_the_kernel_matches_the_model_operations_and_ignores_batch_mates(text_tokens):
    inputs = _inputs(4096 if text_tokens else 4608, text_tokens, torch.bfloat16, "cuda", heads=24, head_dim=128)
    assert kernel_refusal(inputs[0], inputs[1], inputs[5], inputs[7], inputs[8]) is None
    got, expected = qk_norm_rope(*inputs), reference(*inputs)
    for g, e in zip(got, expected, strict=True):
        share = (g != e).float().mean().item()
        worst = (g.float() - e.float()).abs().max().item()
        # Where the sum of squares adds up in another order a normed value (of order 1) can round one bf16 step the
        # other way; the rotation moves the output by at most that step (1/32 for values in [4, 8)).
        assert share < 1e-4 and worst <= 2 ** -5, (share, worst)
    alone = qk_norm_rope(*_second_sample(inputs))
    for one, batch in zip(alone, got, strict=True):
        assert torch.equal(one, batch[1:])
    for apart, together in zip(launch(*inputs, paired=False), got, strict=True):
        assert torch.equal(apart, together)


if __name__ == "__main__":
    _interpreted_checks()
