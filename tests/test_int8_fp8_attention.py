"""The ``int8_fp8`` attention backend (``kernels/int8_quantized.py``): its plain-torch reference is close to exact
attention, its Triton kernel computes the reference's arithmetic (under Triton's interpreter) and compiles for Hopper to
8-bit tensor-core instructions without spills, its backward is exact attention's, and it serves rollouts and replays with
gradients at a log-prob ratio of exactly 1, eager and compiled; refused with the reason where it cannot run."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from test_sage_attention import check_quantized_rollout_replays_exactly

from omnispec.cli import main
from omnispec.kernels import int8_fp8 as quantized

from conftest import SPECS

DIGITS = SPECS / "digits.yaml"
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


def _inputs(batch, heads, q_tokens, k_tokens, dim, dtype=torch.float32, seed=0, device="cpu"):
    """q, k, v in the model's layout ([batch, tokens, heads, dim] seen as [batch, heads, tokens, dim]), K with an
    offset per channel as real models' keys have."""
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, tokens, heads, dim, generator=generator).transpose(1, 2)
               for tokens in (q_tokens, k_tokens, k_tokens))
    k = k + torch.randn(dim, generator=generator)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)]


@pytest.mark.parametrize("shape, dtype", [((1, 2, 77, 90, 64), torch.float32), ((2, 3, 300, 200, 32), torch.bfloat16),
                                          ((1, 2, 1000, 1000, 128), torch.bfloat16)])
def test_the_reference_is_within_a_cosine_of_0_999_of_exact_attention_but_not_exact(shape, dtype):
    q, k, v = _inputs(*shape, dtype=dtype)
    out = quantized.int8_fp8_reference(q, k, v)
    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert out.dtype == dtype and out.shape == q.shape
    assert _cosine(out, exact) >= 0.999
    assert not torch.allclose(out.float(), exact, atol=1e-4)  # quantized: not exact attention rounded


def test_smoothing_k_keeps_a_per_channel_offset_from_setting_the_scales():
    """A large offset per channel of K, shared by every token, leaves attention as it is (softmax cancels it); without
    the mean subtracted, each block's scale would follow the offset and the other channels would lose their bits."""
    q, k, v = _inputs(1, 2, 256, 256, 64)
    shifted = k + 50 * torch.randn(64, generator=torch.Generator().manual_seed(1))
    exact = F.scaled_dot_product_attention(q, k, v)
    assert _cosine(quantized.int8_fp8_reference(q, shifted, v), exact) >= 0.999
    _, scales = quantized.int8_blocks(shifted - shifted.mean(dim=-2, keepdim=True))
    _, unsmoothed_scales = quantized.int8_blocks(shifted)
    assert unsmoothed_scales.max() > 10 * scales.max()  # without smoothing the offset would set the scales


def test_int8_blocks_hold_int8_values_with_one_scale_per_block_rounded_half_away_from_zero():
    x = torch.randn(1, 1, 300, 8) * torch.linspace(0.1, 10, 300)[:, None]
    values, scales = quantized.int8_blocks(x)
    assert values.abs().max() == 127 and torch.equal(values, values.round())
    assert [len(scales[0, 0, b:b + 128].unique()) for b in (0, 128, 256)] == [1, 1, 1]
    assert torch.allclose(values * scales, x, atol=scales.max().item() / 2 + 1e-6)
    halves = torch.tensor([[[[127.0, 2.5, -2.5, 0.5, -0.5, 1.49]]]]).transpose(-2, -1)
    assert quantized.int8_blocks(halves)[0].flatten().tolist() == [127, 3, -3, 1, -1, 1]


def test_small_probabilities_keep_a_value_through_p_scaled_by_2_to_the_8():
    """Diffuse attention over many keys: each probability near 1/keys, below e4m3's least value (2^-9) at 1,000 keys
    and more; scaled by 2^8 before rounding, they keep about e4m3's precision."""
    q, k, v = _inputs(1, 1, 128, 4096, 64)
    out = quantized.int8_fp8_reference(q * 0.01, k, v)
    assert _cosine(out, F.scaled_dot_product_attention(q * 0.01, k, v)) >= 0.99


def _interpreted_checks() -> None:
    """The Triton kernels against the reference, Q and K in int8 and P and V in float32 (Triton's interpreter does not
    round float8 as GPUs do): partial blocks of queries and keys, a single partial key block, head sizes 64 and 128, a
    batch, strided inputs; the output a view of [batch, tokens, heads, dim] memory; tiles through pointers and through
    tensor descriptors. Run as this file's main under ``TRITON_INTERPRET=1``, which triton reads when first
    imported."""
    launches = [quantized.Launch.parse(text)
                for text in ("128x128x8x3", "64x128x4x3", "128x64x4x3+tma", "128x128x8x2+tma")]
    for shape in ((2, 3, 300, 200, 64), (1, 2, 128, 77, 128)):
        q, k, v = _inputs(*shape)
        want = quantized.int8_fp8_reference(q, k, v, pv_rounding=lambda x: x)
        for launch in launches:
            got = quantized.int8_fp8_kernel(q, k, v, pv_storage=torch.float32, launch=launch)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m, launch=launch: f"{launch}: {m}")
            assert got.transpose(1, 2).is_contiguous(), got.stride()
        scaled = quantized.int8_fp8_kernel(q, k, v, scale=0.3, pv_storage=torch.float32)
        want = quantized.int8_fp8_reference(q, k, v, 0.3, pv_rounding=lambda x: x)
        torch.testing.assert_close(scaled, want, rtol=1e-5, atol=1e-5)


@needs_triton
def test_the_kernel_under_the_interpreter_computes_the_references_arithmetic():
    done = subprocess.run([sys.executable, __file__], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]


@needs_triton
@pytest.mark.parametrize("dim, tma", [(64, False), (128, False), (128, True)], ids=["64", "128", "128_tma"])
def test_the_kernel_compiles_for_hopper_to_8_bit_tensor_core_instructions_without_spills(dim, tma):
    """Compiled for sm_90 as a launch specializes it, without a GPU: Q·K on int8 wgmma, P·V on e4m3 wgmma, P rounded
    to nearest even (saturating), the int32 scores made float without a conversion instruction, no registers spilled
    at the default tiles; with ``+tma`` the tiles come by TMA copies."""
    from benchmarks.triton_ptx import compile_int8_fp8

    facts = compile_int8_fp8(90, quantized.Launch(**{**vars(quantized.LAUNCHES[dim]), "tma": tma}), dim)
    assert facts.get("spilled_bytes") == 0, facts
    assert any(re.fullmatch(r"m64n\d+k32\.s32\.s8\.s8", i) for i in facts["tensor_core"]), facts
    assert any(re.fullmatch(r"m64n\d+k32\.f32\.e4m3\.e4m3", i) for i in facts["tensor_core"]), facts
    assert facts["p_rounding"] == ["cvt.rn.satfinite.e4m3x2.f32"] and facts["int32_to_float"] == 0, facts
    assert (facts["tma_copies"] > 0) == tma, facts


def test_a_launch_is_read_from_its_text_and_a_bad_one_refused():
    assert quantized.Launch.parse("128x64x4x3+tma") == quantized.Launch(128, 64, 4, 3, tma=True)
    assert str(quantized.Launch.parse("64x128x4x2")) == "64x128x4x2"
    for bad in ("96x128x4x3", "128x128x8", "128x128x8x3+ws", "axbxcxd", "0x128x4x3"):
        with pytest.raises(ValueError, match="not a launch of the int8_fp8 kernel"):
            quantized.Launch.parse(bad)


def test_gradients_are_exact_attentions_at_the_same_inputs_and_the_forward_is_unchanged():
    q, k, v = (t.requires_grad_(True) for t in _inputs(2, 2, 200, 150, 32))
    out = quantized.int8_fp8_attention(q, k, v)
    assert out.transpose(1, 2).is_contiguous()  # the layout the model's output projection reads
    with torch.no_grad():
        assert torch.equal(out, quantized.int8_fp8_attention(q, k, v))
        assert torch.equal(out, quantized.int8_fp8_reference(q, k, v))
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    exact = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v), (q, k, v), grad_out)
    for got, want in zip(grads, exact):
        assert torch.isfinite(got).all() and torch.allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_an_int8_fp8_rollout_replays_with_gradients_at_a_ratio_of_exactly_one(monkeypatch, compiled):
    check_quantized_rollout_replays_exactly(monkeypatch, quantized, "int8_fp8_reference", "int8_fp8", compiled)


def test_int8_fp8_is_refused_with_the_reason_where_it_cannot_run(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(quantized.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert "float16 or bfloat16 inputs on CUDA, not float32" in quantized.refusal(cuda, torch.float32, 128)
    assert "head sizes 64, 128, not 80" in quantized.refusal(cuda, torch.bfloat16, 80)
    assert quantized.refusal(cuda, torch.bfloat16, 128) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "(compute capability 8.9 and up), this GPU has 8.0" in quantized.refusal(cuda, torch.bfloat16, 128)
    assert "not mps" in quantized.refusal(torch.device("mps"), torch.float16, 64)
    monkeypatch.setattr(quantized.importlib.util, "find_spec", lambda name: None)
    assert "triton is not installed" in quantized.refusal(cuda, torch.bfloat16, 128)
    assert quantized.refusal(torch.device("cpu"), torch.float32, 24) is None  # the reference runs on the CPU


def test_explain_says_int8_fp8_is_approximate_and_what_its_backward_is(capsys):
    assert main(["explain", str(DIGITS), "--set", "policies.attention.default=int8_fp8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "approximate: Q and K" in out["attention"]["default"] and "float8 e4m3" in out["attention"]["default"]
    assert "backward is exact attention's at the same q, k and v (straight-through)" in (
        out["attention_with_gradients"]["default"])


def test_flop_counters_count_the_int8_fp8_operator_as_the_attention_it_replaces():
    from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

    q, k, v = (t.requires_grad_(True) for t in _inputs(2, 3, 96, 80, 32))
    counter = FlopCounterMode(display=False)
    with counter:
        quantized.int8_fp8_attention(q, k, v).sum().backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert counts.get("omnispec.int8_fp8_attention") == sdpa_flop_count(q.shape, k.shape, v.shape)
    grads = sdpa_backward_flop_count(q.shape, q.shape, k.shape, v.shape)
    assert counts.get("omnispec.int8_fp8_attention_backward") == grads


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dim, launch", [(64, None), (128, None), (128, "128x128x8x3+tma"), (128, "128x64x4x3")])
def test_the_cuda_kernel_is_the_reference_to_fp8_rounding_of_p(dim, launch):
    """On the GPU: the Triton kernel against the reference (the kernel rounds P against the running maximum, the
    reference against the row's: not bit for bit), both against exact attention, bf16, two partial blocks."""
    q, k, v = _inputs(2, 4, 1000, 700, dim, dtype=torch.bfloat16, device="cuda")
    got = quantized.int8_fp8_kernel(q, k, v, launch=quantized.Launch.parse(launch) if launch else None)
    want = quantized.int8_fp8_reference(q, k, v)
    exact = F.scaled_dot_product_attention(q, k, v)
    assert _cosine(got, want) >= 0.999 and _cosine(got, exact) >= 0.998, (_cosine(got, want), _cosine(got, exact))
    assert quantized.refusal(q.device, q.dtype, dim) is None


if __name__ == "__main__":
    _interpreted_checks()
