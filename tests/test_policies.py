"""Policies on the tiny fixtures (CPU): same output as the plain run where they must be exact, documented
tolerances where they approximate, cache scoping, and every conflict rule failing cleanly."""

import functools
import importlib.util

import numpy as np
import pytest
import torch

import omnispec
from omnispec.policies.attention import GRADIENTS_HOOK
from omnispec.spec import SpecError
from omnispec.testing import TINY_OVERRIDES

from conftest import SPECS, int8_weight


def run(ckpt, spec, family, *overrides, prompt="a cat", **request):
    pipe = omnispec.build(SPECS / spec, source=str(ckpt), overrides=[*TINY_OVERRIDES[family], *overrides])
    return pipe, pipe(prompt, seed=0, **request).array


@pytest.fixture(scope="module")
def plain_flux(flux_dir):
    return run(flux_dir, "flux1-dev.yaml", "flux")[1]


@pytest.fixture(scope="module")
def plain_sd3(sd3_dir):
    return run(sd3_dir, "sd3.5-medium.yaml", "sd3")[1]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("backend", ["sdpa", "sdpa_math", "sdpa_flash", "auto"])
def test_attention_backends_match_the_plain_run(flux_dir, plain_flux, backend, device):
    if backend == "sdpa_flash" and device == "cuda":  # the tiny model builds there, in float32
        pytest.skip("FlashAttention-2 on CUDA takes no float32 (the build refuses it); the CPU run covers it")
    plain = plain_flux if device == "cpu" else run(flux_dir, "flux1-dev.yaml", "flux", "runtime.device=cuda")[1]
    pipe, out = run(flux_dir, "flux1-dev.yaml", "flux", f"policies.attention.default={backend}",
                    f"runtime.device={device}")
    assert np.abs(out - plain).max() <= 1e-4
    assert set(pipe.explain(as_dict=True)["attention"]) == {"joint", "single"}


def test_attention_per_role_reaches_sd3_processors(sd3_dir, plain_sd3):
    pipe, out = run(sd3_dir, "sd3.5-medium.yaml", "sd3", "policies.attention.per_role={joint: sdpa_math}")
    assert np.abs(out - plain_sd3).max() <= 1e-4
    assert pipe.explain(as_dict=True)["attention"]["joint"].startswith("sdpa_math (explicit")


def test_unusable_backend_is_a_build_error_with_reason(flux_dir):
    with pytest.raises(SpecError, match=r"policies.attention.default: xformers cannot run here"):
        run(flux_dir, "flux1-dev.yaml", "flux", "policies.attention.default=xformers")


def test_a_kernel_probe_keeps_torchs_warnings_for_its_reason(monkeypatch):
    """On CUDA in float32 torch warns why each SDPA kernel cannot run: the probe's answer, which belongs in the reason
    it returns (an error or ``explain``), not on a user's terminal (``omnispec -q`` printed them on an H200)."""
    import warnings

    import torch.nn.functional as F

    from omnispec.policies import attention_kernels

    real = F.scaled_dot_product_attention

    def warning_sdpa(refuse):
        def sdpa(q, k, v, **kwargs):
            warnings.warn("Flash attention kernel not used because: (Triggered internally at sdp_utils.cpp:988.)")
            warnings.warn("Expected query, key and value to all be of dtype: {Half, BFloat16}. Got Query dtype: float "
                          "(Triggered internally at sdp_utils_cpp.h:91.)")
            if refuse:
                raise RuntimeError("No available kernel. Aborting execution.")
            return real(q, k, v, **kwargs)
        return sdpa

    refused = ("RuntimeError: No available kernel. Aborting execution. (torch: Expected query, key and value to all "
               "be of dtype: {Half, BFloat16}. Got Query dtype: float)")
    for refuse, want in ((True, refused), (False, None)):
        monkeypatch.setattr(F, "scaled_dot_product_attention", warning_sdpa(refuse))
        with warnings.catch_warnings(record=True) as escaped:
            warnings.simplefilter("always")
            assert attention_kernels.probe("sdpa_flash", torch.device("cpu"), torch.float32, 8) == want
        assert [str(w.message) for w in escaped] == []


def test_unusable_backend_falls_back_when_allowed(flux_dir, plain_flux):
    pipe, out = run(flux_dir, "flux1-dev.yaml", "flux", "policies.attention={default: flash4, allow_fallback: true}")
    assert np.abs(out - plain_flux).max() <= 1e-6
    assert "fallback" in pipe.explain(as_dict=True)["attention"]["joint"]


def _fake_flash_attn_4(monkeypatch, calls: list, head_sizes: tuple[int, ...], backward_calls: list | None = None,
                       backward_head_sizes: tuple[int, ...] | None = None) -> None:
    """A stand-in for flash-attn-4's ``flash_attn.cute`` (which needs CUDA): takes and gives [batch, tokens, heads,
    dim] like the real one, checks the layout it is handed, refuses other head sizes with ``assert`` as the real one
    does, returns (out, log-sum-exp) as its 4.0 betas do, and has the two functions omnispec calls
    (``interface._flash_attn_fwd`` and ``_flash_attn_bwd``), the backward written out from the log-sum-exp as
    FlashAttention's is."""
    import sys
    import types

    def _flash_attn_fwd(q, k, v, softmax_scale=None, return_lse=False, tile_mn=None):
        assert q.shape[-1] in head_sizes, f"head size {q.shape[-1]} is not supported"
        assert tile_mn is None  # omnispec picks a tile on Hopper only
        calls.append(tuple(q.shape))
        scale = softmax_scale or q.shape[-1] ** -0.5
        scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
        out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.float()).to(q.dtype)
        return out, scores.logsumexp(-1)

    def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None):
        assert q.shape[-1] in (backward_head_sizes or head_sizes), f"no backward for head size {q.shape[-1]}"
        (backward_calls if backward_calls is not None else []).append(tuple(q.shape))
        scale = softmax_scale or q.shape[-1] ** -0.5
        q, k, v, out, dout = (t.float() for t in (q, k, v, out, dout))
        p = (torch.einsum("bqhd,bkhd->bhqk", q, k) * scale - lse[..., None]).exp()
        dp = torch.einsum("bqhd,bkhd->bhqk", dout, v)
        ds = p * (dp - (dout * out).sum(-1).transpose(1, 2)[..., None])
        dq = torch.einsum("bhqk,bkhd->bqhd", ds, k) * scale
        dk = torch.einsum("bhqk,bqhd->bkhd", ds, q) * scale
        dv = torch.einsum("bhqk,bqhd->bkhd", p, dout)
        return dq, dk, dv

    package, cute = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.cute")
    interface = types.ModuleType("flash_attn.cute.interface")
    cute.interface, package.cute = interface, cute
    interface._flash_attn_fwd, interface._flash_attn_bwd = _flash_attn_fwd, _flash_attn_bwd
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", interface)


def _flash4_passes_the_probe(monkeypatch) -> None:
    """The real package runs on CUDA only: let the stand-in pass the build's check."""
    from omnispec.kernels import flash4
    from omnispec.policies import attention_fallback, attention_kernels

    monkeypatch.setattr(flash4, "REFUSED", {})
    probe = attention_kernels.probe
    monkeypatch.setattr(attention_kernels, "probe",
                        lambda backend, *args: None if backend == "flash4" else probe(backend, *args))
    monkeypatch.setattr(attention_kernels, "_PROBES", {})
    monkeypatch.setattr(attention_fallback, "FAILED", {})


def test_flash4_without_its_package_is_a_build_error_naming_it(flux_dir, monkeypatch):
    import sys

    from omnispec.policies import attention_kernels

    # not importable, even where it is installed and an earlier test imported it (a module already in sys.modules
    # is found there before its parent package is looked at)
    for name in ("flash_attn", "flash_attn.cute", "flash_attn.cute.interface"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setattr(attention_kernels, "_PROBES", {})
    with pytest.raises(SpecError, match=r"policies.attention.default: flash4 cannot run here: flash-attn-4 is not "):
        run(flux_dir, "flux1-dev.yaml", "flux", "policies.attention.default=flash4")


def test_flash4_runs_the_attentions_in_its_own_layout_and_a_refused_shape_falls_back(flux_dir, plain_flux,
                                                                                     monkeypatch, caplog):
    """The wiring of ``flash4`` (the real kernels need CUDA: tests/test_policies.py's CUDA test runs them): every
    plain SDPA call of the model reaches flash-attn-4's function as [batch, tokens, heads, dim], the image is the
    plain run's, and a shape the package refuses runs on SDPA instead, with one warning, not a traceback."""
    from omnispec.kernels import flash4

    calls: list = []
    _fake_flash_attn_4(monkeypatch, calls, head_sizes=(16,))
    _flash4_passes_the_probe(monkeypatch)
    pipe, out = run(flux_dir, "flux1-dev.yaml", "flux", "policies.attention.default=flash4")
    assert np.abs(out - plain_flux).max() <= 1e-5
    assert calls and all(shape[2] == 2 and shape[3] == 16 for shape in calls), calls  # tiny FLUX: 2 heads of 16
    assert pipe.explain(as_dict=True)["attention"]["joint"].startswith("flash4 (explicit")

    refused: list = []
    _fake_flash_attn_4(monkeypatch, refused, head_sizes=(128,))
    with caplog.at_level("WARNING", logger="omnispec"):
        _, again = run(flux_dir, "flux1-dev.yaml", "flux", "policies.attention.default=flash4")
    assert not refused and np.abs(again - plain_flux).max() <= 1e-5
    assert flash4.REFUSED and all("head size 16 is not supported" in why for why in flash4.REFUSED.values())
    warned = [r for r in caplog.records if "flash-attn-4 refused" in r.getMessage()]
    assert len(warned) == len(flash4.REFUSED), warned  # once per call shape, not per call


@pytest.mark.parametrize("mode", ["regional", "full"])
def test_flash4_is_compiled_into_the_denoiser_with_its_backward(flux_dir, plain_flux, monkeypatch, mode):
    """Under compile flash4 is one redirect around the denoiser's call that dynamo traces into the compiled code (an
    operator with a fake and a registered backward): the image is the plain run's, every attention call reaches the
    package, the blocks compile once (not once per block, as per-module hooks made them), and gradients through the
    compiled attention are the plain model's."""
    from torch._dynamo.utils import counters

    calls: list = []
    backward_calls: list = []
    _fake_flash_attn_4(monkeypatch, calls, head_sizes=(16,), backward_calls=backward_calls)
    _flash4_passes_the_probe(monkeypatch)
    torch._dynamo.reset()
    counters.clear()
    pipe, out = run(flux_dir, "flux1-dev.yaml", "flux", "policies.attention.default=flash4",
                    f"policies.compile={{mode: {mode}, backend: aot_eager}}")
    assert np.abs(out - plain_flux).max() <= 1e-5
    assert calls and all(shape[2:] == (2, 16) for shape in calls), calls
    assert "compiled in" in pipe.explain(as_dict=True)["attention"]["joint"]
    recompiles = sum(counters["recompiles"].values()) if "recompiles" in counters else 0
    assert counters["stats"]["unique_graphs"] <= (3 if mode == "regional" else 1) and not recompiles, dict(counters)

    transformer = pipe.components["transformer"]
    config, device = transformer.config, transformer.device
    hidden = torch.randn(1, 16, config.in_channels, device=device, requires_grad=True)
    args = dict(encoder_hidden_states=torch.randn(1, 8, config.joint_attention_dim, device=device),
                pooled_projections=torch.randn(1, config.pooled_projection_dim, device=device),
                timestep=torch.tensor([0.5], device=device), img_ids=torch.zeros(16, 3, device=device),
                txt_ids=torch.zeros(8, 3, device=device),
                guidance=torch.tensor([3.5], device=device) if config.guidance_embeds else None)
    got = transformer(hidden_states=hidden, **args).sample
    (grad,) = torch.autograd.grad(got.square().sum(), hidden)
    assert backward_calls, "the compiled backward did not reach the package's"
    torch._dynamo.reset()
    plain = omnispec.build(SPECS / "flux1-dev.yaml", source=str(flux_dir),
                           overrides=TINY_OVERRIDES["flux"]).components["transformer"]
    want = plain(hidden_states=hidden, **args).sample
    (want_grad,) = torch.autograd.grad(want.square().sum(), hidden)
    assert torch.allclose(got, want, atol=1e-5) and torch.allclose(grad, want_grad, atol=1e-4)


@pytest.mark.parametrize("refuses", ["forward", "backward"])
def test_flash4_under_compile_falls_back_to_sdpa_where_the_package_refuses(monkeypatch, caplog, refuses):
    """Compiled code has no per-call guards: a call shape the package refuses (FA4 4.0.0b15 cannot build head size
    24's backward) runs on SDPA inside omnispec's operators, forward and gradients alike, with one warning."""
    from omnispec.kernels import flash4
    from omnispec.policies.attention_kernels import redirect_mode

    calls, backward_calls = [], []
    _fake_flash_attn_4(monkeypatch, calls, head_sizes=(8,) if refuses == "forward" else (24,),
                       backward_calls=backward_calls, backward_head_sizes=(8,))
    _flash4_passes_the_probe(monkeypatch)
    q, k, v = (torch.randn(2, 3, 40, 24).requires_grad_() for _ in range(3))  # [batch, heads, tokens, dim]

    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    torch._dynamo.reset()
    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    with caplog.at_level("WARNING", logger="omnispec"):
        for _ in range(2):
            with redirect_mode("flash4", frozenset({24})):
                got = compiled(q, k, v)
            grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    want = attend(q, k, v)
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
    assert torch.allclose(got, want, atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(grads, want_grads, strict=True))
    assert bool(calls) == (refuses == "backward") and not backward_calls
    assert [key[-1] for key in flash4.REFUSED] == [refuses]
    assert len([r for r in caplog.records if "flash-attn-4 refused" in r.getMessage()]) == 1


def test_flash4_is_refused_under_sequence_parallelism_which_goes_through_sdpa():
    """It bypasses torch's SDPA like xformers and sage, so the sequence-parallel attention would not reach it (the
    skip-layer score perturbation's refusal: tests/test_spec_rules.py)."""
    from omnispec.runtime.families import family_class
    from omnispec.runtime.parallel import check_axes
    from omnispec.spec import load_spec

    spec = load_spec(SPECS / "flux1-dev.yaml", overrides=["policies.attention.default=flash4",
                                                          "policies.parallel={ulysses: 2}"])
    with pytest.raises(SpecError, match="attention backend 'flash4' cannot run under sequence parallelism"):
        check_axes(spec, family_class("flux").targets)


def _needs_flash_attn_4():
    if not torch.cuda.is_available():
        pytest.skip("flash-attn-4 needs CUDA")
    try:
        import flash_attn.cute  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed, or its compiler library does not load
        pytest.skip("flash-attn-4 is not importable")


def _count_flash4_calls(monkeypatch) -> dict:
    """Counts the real package's forward and backward calls (omnispec's operators look both up at each call), and
    keeps the forward tiles asked for."""
    import flash_attn.cute.interface

    counts: dict = {"forward": 0, "backward": 0, "tiles": set()}

    def counted(name, kind):
        real = getattr(flash_attn.cute.interface, name)

        @functools.wraps(real)  # FA4 keeps its compiled kernels in attributes of these functions
        def call(*args, **kwargs):
            counts[kind] += 1
            if kind == "forward":
                counts["tiles"].add(kwargs.get("tile_mn"))
            return real(*args, **kwargs)

        monkeypatch.setattr(flash_attn.cute.interface, name, call)

    counted("_flash_attn_fwd", "forward")
    counted("_flash_attn_bwd", "backward")
    return counts


def _assert_near_cudnn(got: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """``got``, an attention of [batch, heads, tokens, dim] ``q``, ``k``, ``v``, and its gradients: within bf16
    rounding (2e-2 relative) of cuDNN's SDPA and its gradients."""
    got_grads = torch.autograd.grad(got.float().square().sum(), (q, k, v))
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.CUDNN_ATTENTION]):
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    want_grads = torch.autograd.grad(want.float().square().sum(), (q, k, v))
    for a, b in zip((got, *got_grads), (want, *want_grads), strict=True):
        assert float((a.float() - b.float()).norm() / b.float().norm()) < 2e-2


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_flash4_on_cuda_gives_sdpa_outputs_and_gradients_at_fluxs_shape(monkeypatch, compiled):
    """The real kernels at FLUX.1 1024²'s attention (4,608 tokens, 24 heads of 128, bf16) as the hooks run them:
    forward and gradients within bf16 rounding of cuDNN's SDPA, eager through the same guards a training step uses,
    compiled through the redirect inductor traces (the operators' fake and registered backward)."""
    from omnispec.policies import attention, attention_fallback
    from omnispec.policies.attention_kernels import redirect_mode

    _needs_flash_attn_4()
    monkeypatch.setattr(attention_fallback, "FAILED", {})
    counts = _count_flash4_calls(monkeypatch)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4608, 24, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
               for _ in range(3))

    def forward(q, k, v):  # what a processor does: SDPA on [batch, heads, tokens, dim] views
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    if compiled:
        torch._dynamo.reset()
        inner = torch.compile(forward, fullgraph=True)

        def run(grad: bool) -> torch.Tensor:
            with redirect_mode("flash4", frozenset({128})), torch.set_grad_enabled(grad):
                return inner(q, k, v)
    else:
        def run(grad: bool) -> torch.Tensor:
            return attention.guarded_forward(forward, "flash4", (q, k, v), {}, grad=grad)

    got = run(True)
    _assert_near_cudnn(got, q, k, v)
    assert attention_fallback.FAILED == {}, attention_fallback.FAILED
    assert counts["forward"] and counts["backward"], counts  # FA4 ran both ways, not SDPA
    hopper = torch.cuda.get_device_capability()[0] == 9
    assert counts["tiles"] == {(128, 192) if hopper else None}, counts  # flash4.HOPPER_TILES at head size 128
    assert torch.equal(run(False), got.detach())  # a rollout's call and its replay's: the same kernel, the same bits


@pytest.mark.parametrize("tokens", [77, 333, 4097])
def test_flash4_on_cuda_gives_sdpa_outputs_at_lengths_off_its_tile(monkeypatch, tokens):
    """Lengths that are no multiple of the forward tile (``flash4.HOPPER_TILES``: 192 rows of k a step at head size
    128), a text encoder's among them: the operator's output and gradients within bf16 rounding of cuDNN's SDPA."""
    from omnispec.kernels import flash4

    _needs_flash_attn_4()
    monkeypatch.setattr(flash4, "REFUSED", {})
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 24, tokens, 128, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    _assert_near_cudnn(flash4.flash4_sdpa(q, k, v, None), q, k, v)
    assert flash4.REFUSED == {}, flash4.REFUSED


def test_flash4_on_cuda_runs_a_tiny_flux_in_bfloat16(flux_dir, monkeypatch):
    from omnispec.policies import attention_fallback

    _needs_flash_attn_4()
    monkeypatch.setattr(attention_fallback, "FAILED", {})
    counts = _count_flash4_calls(monkeypatch)

    def image(*overrides):
        pipe = omnispec.build(SPECS / "flux1-dev.yaml", source=str(flux_dir), device="cuda",
                              overrides=[*TINY_OVERRIDES["flux"], "model.dtype=bfloat16", *overrides])
        return pipe("a cat", seed=0).array

    plain = image("policies.attention.default=sdpa")
    assert not counts["forward"]
    fa4 = image("policies.attention.default=flash4")
    assert attention_fallback.FAILED == {} and counts["forward"], (attention_fallback.FAILED, counts)  # ran, none fell back
    assert np.abs(fa4.astype(np.float32) - plain.astype(np.float32)).max() <= 0.05
    for graphs in ("false", "true"):  # CUDA graphs record the calls of their warm-up runs
        torch._dynamo.reset()
        counts["forward"] = 0
        compiled = image("policies.attention.default=flash4",
                         f"policies.compile={{mode: regional, cudagraphs: {graphs}}}")
        assert counts["forward"], f"compiled with cudagraphs {graphs}: FA4 never ran"
        assert np.abs(compiled.astype(np.float32) - plain.astype(np.float32)).max() <= 0.05


def test_unknown_attention_role_is_rejected(flux_dir):
    with pytest.raises(SpecError, match="no attention role 'cross'"):
        run(flux_dir, "flux1-dev.yaml", "flux", "policies.attention.per_role={cross: sdpa}")


@pytest.mark.parametrize("offload", ["{strategy: model}", "{strategy: group, blocks_per_group: 1}",
                                     "{strategy: layerwise}"])
def test_offload_gives_the_plain_output(flux_dir, plain_flux, offload):
    _, out = run(flux_dir, "flux1-dev.yaml", "flux", f"policies.offload={offload}")
    assert np.abs(out - plain_flux).max() <= 1e-6


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")
def test_int8_weight_only_quantization_stays_close(flux_dir, plain_flux):
    pipe, out = run(flux_dir, "flux1-dev.yaml", "flux", "policies.quantization={transformer: {method: int8_weight_only}}")
    assert int8_weight(pipe.components["transformer"].transformer_blocks[0].attn.to_q.weight)
    untouched = [m.weight for m in pipe.components["text_encoder"].modules() if hasattr(m, "weight")]
    assert untouched and not any(map(int8_weight, untouched))  # only the named component is quantized
    cos = np.dot(out.ravel(), plain_flux.ravel()) / np.linalg.norm(out) / np.linalg.norm(plain_flux)
    assert cos > 0.99 and np.abs(out - plain_flux).max() < 0.1


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")
def test_in_memory_components_are_quantized_like_loaded_ones(flux_dir):
    """A component passed to build() in memory gets the same torchao config as one loaded with it."""
    from diffusers import FluxTransformer2DModel

    policy = "policies.quantization={transformer: {method: int8_weight_only, exclude: [proj_out]}}"
    loaded, out_loaded = run(flux_dir, "flux1-dev.yaml", "flux", policy)
    given = FluxTransformer2DModel.from_pretrained(flux_dir, subfolder="transformer")
    pipe = omnispec.build(SPECS / "flux1-dev.yaml", source=str(flux_dir), components={"transformer": given},
                          overrides=[*TINY_OVERRIDES["flux"], policy])
    assert int8_weight(given.transformer_blocks[0].attn.to_q.weight)
    assert not int8_weight(given.proj_out.weight)
    assert "in memory" in pipe.explain(as_dict=True)["applied"]["quantization"]
    assert np.abs(pipe("a cat", seed=0).array - out_loaded).max() <= 1e-6


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")
def test_quantizing_leaves_the_process_compiler_settings_alone(flux_dir):
    """torchao's configs turn on inductor's coordinate-descent tuning for the whole process when applied (and
    torchao 0.17 TF32 matmuls): every later compile then benchmarked each kernel at first launch (an SD3.5-size
    fp8 rollout did not finish compiling in 575 s on an H200). Loaded or in memory, quantizing changes neither.
    Inductor's own ``config.patch`` sets and restores the settings: pytest's monkeypatch deletes a config entry on
    undo (its module's attributes are not in ``__dict__``), and every later compile of the process then failed."""
    import torch
    import torch._inductor.config as inductor
    from diffusers import FluxTransformer2DModel

    precision = torch.get_float32_matmul_precision()
    policy = "policies.quantization={transformer: {method: int8_weight_only}}"
    with inductor.patch(coordinate_descent_tuning=False, coordinate_descent_check_all_directions=False):
        run(flux_dir, "flux1-dev.yaml", "flux", policy)
        given = FluxTransformer2DModel.from_pretrained(flux_dir, subfolder="transformer")
        omnispec.build(SPECS / "flux1-dev.yaml", source=str(flux_dir), components={"transformer": given},
                       overrides=[*TINY_OVERRIDES["flux"], policy])
        assert int8_weight(given.transformer_blocks[0].attn.to_q.weight)
        assert not inductor.coordinate_descent_tuning and not inductor.coordinate_descent_check_all_directions
    assert torch.get_float32_matmul_precision() == precision


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")
def test_a_second_build_over_quantized_modules_keeps_their_quantized_linears(flux_dir):
    """Two builds over the same in-memory modules, both quantizing (a trainer's second pipeline, a benchmark's next
    side): torchao cannot quantize its own tensors again (it raised from deep inside), so the second build keeps them
    and says so."""
    from diffusers import FluxTransformer2DModel

    policy = "policies.quantization={transformer: {method: int8_weight_only}}"
    given = FluxTransformer2DModel.from_pretrained(flux_dir, subfolder="transformer")
    first = omnispec.build(SPECS / "flux1-dev.yaml", source=str(flux_dir), components={"transformer": given},
                           overrides=[*TINY_OVERRIDES["flux"], policy])
    weight = given.transformer_blocks[0].attn.to_q.weight
    expected = first("a cat", seed=0).array
    second = omnispec.build(SPECS / "flux1-dev.yaml", source=str(flux_dir), components={"transformer": given},
                            overrides=[*TINY_OVERRIDES["flux"], policy])
    assert given.transformer_blocks[0].attn.to_q.weight is weight
    assert "already quantized by torchao" in second.explain(as_dict=True)["applied"]["quantization"]
    assert (second("a cat", seed=0).array == expected).all()


def test_bitsandbytes_is_refused_for_in_memory_components():
    # bitsandbytes is CUDA-only, so build() on this CPU stops earlier; the rule itself is checked here.
    import torch

    from omnispec.policies.quantization import quantize_in_memory

    spec = omnispec.load_spec(SPECS / "flux1-dev.yaml", ["policies.quantization={transformer: {method: nf4}}"])
    with pytest.raises(SpecError, match="swaps layers while a checkpoint loads"):
        quantize_in_memory(spec, "transformer", spec.model.components["transformer"], torch.nn.Linear(4, 4))


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")
def test_fp8_granularity_reaches_the_torchao_config():
    from diffusers import FluxTransformer2DModel
    from torchao.quantization import PerRow

    from omnispec.policies.quantization import load_kwargs

    spec = omnispec.load_spec(SPECS / "flux1-dev.yaml",
                              ["policies.quantization={transformer: {method: fp8_dynamic, granularity: row}}"])
    kwargs = load_kwargs(spec, "transformer", spec.model.components["transformer"], FluxTransformer2DModel)
    granularity = kwargs["quantization_config"].quant_type.granularity  # torchao keeps [activation, weight]
    assert all(isinstance(g, PerRow) for g in (granularity if isinstance(granularity, list) else [granularity]))


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")
@pytest.mark.parametrize("granularity", ["row", "tensor"])
def test_fp8_activation_scales_of_a_zero_row_stay_finite(granularity):
    """Wan zero-pads its prompt embeddings: a row of zeros quantized with the scale 0 is 0/0, and a NaN row spreads
    through the next attention to the whole prediction. The scales come from the activations exactly as torchao's
    fp8 linears take them (the config's activation settings), here on the CPU, where fp8 matmuls cannot run."""
    from torchao.quantization import Float8Tensor

    from omnispec.policies.quantization import torchao_config

    config = torchao_config("fp8_dynamic", granularity)
    rows = torch.zeros(3, 64, dtype=torch.bfloat16)
    if granularity == "row":  # one scale per row: a zero row beside real ones (a per-tensor scale: all zeros)
        rows[0] = torch.linspace(-2, 2, 64)
    activation_granularity = config.granularity[0] if isinstance(config.granularity, list) else config.granularity
    quantized = Float8Tensor.from_hp(rows, granularity=activation_granularity,
                                     hp_value_lb=config.activation_value_lb, hp_value_ub=config.activation_value_ub)
    values = quantized.dequantize()
    assert torch.isfinite(values).all()
    assert values[1:].abs().max() == 0 and torch.allclose(values[0].float(), rows[0].float(), atol=0.1)


def test_cuda_only_quantization_is_rejected_on_cpu(flux_dir):
    # runtime.device=cpu: on a machine with CUDA, "auto" would pick the GPU, where fp8 runs
    with pytest.raises(SpecError, match="policies.quantization.denoiser.method: fp8_dynamic runs only on CUDA|needs torchao"):
        run(flux_dir, "flux1-dev.yaml", "flux", "policies.quantization={denoiser: {method: fp8_dynamic}}",
            "runtime.device=cpu")


def count_rows(pipe):
    counter = {"rows": 0}
    pipe.components["transformer"].register_forward_pre_hook(
        lambda m, a, kw: counter.__setitem__("rows", counter["rows"] + kw["hidden_states"].shape[0]), with_kwargs=True)
    return counter


def test_step_mask_reuses_predictions(sd3_dir, plain_sd3):
    pipe = omnispec.build(SPECS / "sd3.5-medium.yaml", source=str(sd3_dir),
                          overrides=[*TINY_OVERRIDES["sd3"], "policies.cache={kind: step_mask, mask: [true, false, true, false]}"])
    counter = count_rows(pipe)
    out = pipe("a cat", seed=0, steps=4).array
    assert counter["rows"] == 2 * 2  # two computed steps of CFG
    assert np.isfinite(out).all()


TRUE_CFG = "recipe.phases.0.guidance.terms=[{kind: true_cfg, scale: 2.0}]"


@pytest.mark.parametrize("cache", ["{kind: first_block, threshold: 0.2}", "{kind: taylorseer, interval: 2, warmup_steps: 1}"])
def test_cache_is_reset_per_request_and_scoped_per_pass_and_sample(flux_dir, cache):
    base = [*TINY_OVERRIDES["flux"], "recipe.defaults.steps=6", TRUE_CFG]
    pipe = omnispec.build(SPECS / "flux1-dev.yaml", source=str(flux_dir), overrides=[*base, f"policies.cache={cache}"])
    a = pipe("a cat", seed=0).array
    b = pipe("a cat", seed=0).array
    assert np.array_equal(a, b)  # nothing from the first request reaches the second
    batch = pipe(["a red car in the snow", "a cat"], seed=[5, 0]).array
    assert np.abs(batch[1] - a[0]).max() <= 1e-5  # a batch-mate changes nothing
    plain = omnispec.build(SPECS / "flux1-dev.yaml", source=str(flux_dir), overrides=base)("a cat", seed=0).array
    assert np.abs(a - plain).max() < 0.25  # an approximation of the plain run, not a different image


def test_family_cache_limit_is_a_build_error(sd3_dir):
    with pytest.raises(SpecError, match="policies.cache.kind: family 'sd3' cannot run the first_block cache"):
        run(sd3_dir, "sd3.5-medium.yaml", "sd3", "policies.cache={kind: first_block}")


@pytest.mark.parametrize("mode", ["regional", "full"])
def test_compile_gives_the_plain_output(flux_dir, plain_flux, mode):
    _, out = run(flux_dir, "flux1-dev.yaml", "flux", f"policies.compile={{mode: {mode}, backend: eager}}")
    assert np.abs(out - plain_flux).max() <= 1e-5


def test_compiling_the_vae_decoder_gives_the_plain_output_and_a_rebuild_undoes_it(sd3_dir, plain_sd3):
    pipe, out = run(sd3_dir, "sd3.5-medium.yaml", "sd3", "policies.compile={mode: regional, backend: eager, vae: true}")
    assert np.abs(out - plain_sd3).max() <= 1e-5
    decoder = pipe.components["vae"].decoder
    assert decoder._compiled_call_impl is not None
    assert "VAE decoders compiled: vae" in pipe.explain(as_dict=True)["applied"]["compile"]
    omnispec.build(SPECS / "sd3.5-medium.yaml", components=dict(pipe.components), device="cpu",
                   overrides=[*TINY_OVERRIDES["sd3"], "policies.compile={mode: regional, backend: eager}"])
    assert decoder._compiled_call_impl is None


def test_inductor_picks_reductions_by_rule_unless_autotune_times_them():
    """A reduction's launch configuration sets its summation order; timed at first launch, the rollout's inference
    kernel and its replay's training kernel could add a row up differently."""
    from omnispec.policies.compile import _torch_compile_options
    from omnispec.spec import load_spec

    def options(compile_policy: str) -> dict:
        chosen = _torch_compile_options(load_spec(SPECS / "flux1-dev.yaml", [f"policies.compile={compile_policy}"])
                                        .policies.compile)
        chosen.pop("post_grad_custom_pre_pass")  # every compile's graph pass (tests/test_compile_passes.py)
        chosen.pop("post_grad_custom_post_pass", None)  # the norms' rows read once (tests/test_compile_rows.py)
        return chosen

    assert options("{mode: regional}") == {"emulate_precision_casts": True, "deterministic": True}
    assert "deterministic" not in options("{mode: regional, autotune: true}")
    assert options("{mode: regional, fixed_reductions: false, eager_rounding: false}") == {}


def test_vae_compile_needs_a_compiled_run_and_takes_any_backend():
    from omnispec.spec import load_spec

    with pytest.raises(SpecError, match="vae apply to compiled code"):
        load_spec(SPECS / "sd3.5-medium.yaml", ["policies.compile={vae: true}"])
    spec = load_spec(SPECS / "sd3.5-medium.yaml", ["policies.compile={mode: regional, backend: aot_eager, vae: true}"])
    assert spec.policies.compile.vae


def test_cudagraphs_and_autotune_are_inductor_modes_refused_where_they_cannot_hold(flux_dir, monkeypatch):
    """The two options become torch.compile's mode; a denoiser call starts a new CUDA-graph generation; what would
    read a graph's memory after the next replay (offload, hooked caches) is refused up front."""
    import torch

    from omnispec.spec import load_spec

    load = lambda *o: load_spec(SPECS / "flux1-dev.yaml", list(o))  # noqa: E731
    modes = {(False, False): None, (True, False): "reduce-overhead", (False, True): "max-autotune-no-cudagraphs",
             (True, True): "max-autotune"}
    for (graphs, tune), mode in modes.items():
        spec = load(f"policies.compile={{mode: regional, cudagraphs: {str(graphs).lower()}, "
                    f"autotune: {str(tune).lower()}}}")
        assert spec.policies.compile.inductor_mode == mode
    for overrides, message in [
        (["policies.compile={mode: none, cudagraphs: true}"], "apply to compiled code"),
        (["policies.compile={mode: regional, backend: eager, autotune: true}"], "autotune is inductor's"),
        (["policies.compile={mode: regional, autotune: true, fixed_reductions: true}"], "set one of them"),
        (["policies.compile={mode: regional, cudagraphs: true}", "policies.offload={strategy: model}"],
         "replays the addresses it recorded"),
        (["policies.compile={mode: regional, cudagraphs: true, fullgraph: false}", "policies.cache={kind: taylorseer}"],
         "which a CUDA graph's next replay overwrites"),
    ]:
        with pytest.raises(SpecError, match=message):
            load(*overrides)
    compiled, marks = [], []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compiled.append(kw))
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    pipe, _ = run(flux_dir, "flux1-dev.yaml", "flux", "policies.compile={mode: regional, cudagraphs: true, "
                  "autotune: true}", steps=2)
    import torch._inductor

    want = {**torch._inductor.list_mode_options("max-autotune"), "emulate_precision_casts": True}  # autotune: timed
    graph_passes = ("post_grad_custom_pre_pass", "post_grad_custom_post_pass")  # tests/test_compile_{passes,rows}.py
    assert compiled and all({k: v for k, v in kw["options"].items() if k not in graph_passes} == want
                            and "mode" not in kw for kw in compiled)
    assert len(marks) == 2  # one generation per denoiser call
    assert "cudagraphs, autotune" in pipe.explain()
    dit = pipe.components["transformer"]
    assert dit._forward_pre_hooks
    for block in dit.transformer_blocks:  # what compile_repeated_blocks would have left
        block._compiled_call_impl, block._omnispec_compiled = (lambda *a, **k: None), True
    mine = dit.single_transformer_blocks[0]
    mine._compiled_call_impl = marker = (lambda *a, **k: None)  # compiled by the caller, not by a build
    again = omnispec.build(SPECS / "flux1-dev.yaml", components=dict(pipe.components),
                           overrides=[*TINY_OVERRIDES["flux"]], device="cpu")
    assert not dit._forward_pre_hooks and again.components["transformer"] is dit
    assert all(b._compiled_call_impl is None for b in dit.transformer_blocks)  # the rebuild starts uncompiled
    assert mine._compiled_call_impl is marker
    mine._compiled_call_impl = None


def test_regional_graphs_keep_the_rotary_embedding_in_static_storage(flux_dir, plain_flux, monkeypatch):
    """Under regional CUDA graphs each block's graph copies the inputs computed outside the graphs before its replay;
    FLUX's rotary embedding (the family's ``shared_block_inputs``) is kept in storage marked static instead, written
    once per denoiser call. The same storage at each call without gradients, fresh tensors with gradients or for a
    second output of one shape within a call, the values unchanged, and a rebuild without graphs unhooks it."""
    import torch

    from omnispec.policies.compile import SHARED_INPUTS_HOOK

    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: None)  # the blocks eager: values exact
    pipe, image = run(flux_dir, "flux1-dev.yaml", "flux", "policies.compile={mode: regional, cudagraphs: true}")
    np.testing.assert_array_equal(image, plain_flux)
    assert "pos_embed, time_text_embed kept in place for the blocks' graphs" in pipe.explain()
    dit = pipe.components["transformer"]
    weight = next(dit.parameters())
    ids = torch.randn(24, 3, device=weight.device)
    handed = []
    monkeypatch.setattr(dit.transformer_blocks[0], "forward", lambda *a, **kw: handed.append(
        kw["image_rotary_emb"]) or (kw["encoder_hidden_states"], kw["hidden_states"]))
    at = dict(device=weight.device, dtype=weight.dtype)

    def call():
        return dit(hidden_states=torch.randn(1, 16, dit.config.in_channels, **at),
                   encoder_hidden_states=torch.randn(1, 8, dit.config.joint_attention_dim, **at),
                   pooled_projections=torch.randn(1, dit.config.pooled_projection_dim, **at),
                   timestep=torch.tensor([0.5], **at), img_ids=ids[:16], txt_ids=ids[16:],
                   guidance=torch.tensor([3.5], **at), return_dict=False)

    with torch.no_grad():
        call()
        call()
    with torch.enable_grad():
        call()
    (cos0, sin0), (cos1, sin1), (cos2, sin2) = handed
    assert cos0 is cos1 and sin0 is sin1 and cos0.data_ptr() != sin0.data_ptr()  # one storage per place, kept
    assert cos0._dynamo_static_input_type == "unguarded"
    assert cos2 is not cos0 and not hasattr(cos2, "_dynamo_static_input_type")  # with gradients: as computed
    want = type(dit.pos_embed).forward(dit.pos_embed, torch.cat([ids[16:], ids[:16]]))
    torch.testing.assert_close(cos0, want[0], rtol=0, atol=0)
    torch.testing.assert_close(sin0, want[1], rtol=0, atol=0)
    with torch.no_grad():  # a second output of one shape within a denoiser call is handed over as computed
        first, second = dit.pos_embed(ids[:20]), dit.pos_embed(ids[:20])
    assert first[0]._dynamo_static_input_type == "unguarded"
    assert second[0] is not first[0] and not hasattr(second[0], "_dynamo_static_input_type")
    again = omnispec.build(SPECS / "flux1-dev.yaml", components=dict(pipe.components),
                           overrides=[*TINY_OVERRIDES["flux"]], device=str(weight.device))
    from omnispec.bridge import hook_registry

    registry = hook_registry(again.components["transformer"].pos_embed)
    assert registry is None or registry.get_hook(SHARED_INPUTS_HOOK) is None
    assert not again.components["transformer"]._forward_pre_hooks


def test_a_whole_denoiser_graph_hands_out_copies_and_starts_a_generation_per_call(flux_dir, monkeypatch):
    """``mode: full`` with ``cudagraphs``: the whole call is compiled (not ``Module.compile``, whose hooks would run
    inside the graph); without gradients each call starts a generation and returns copies of the graph's outputs,
    which the next replay overwrites; with gradients neither; a rebuild leaves the denoiser plain."""
    import torch

    compiled, marks, handed = [], [], []

    def fake_compile(fn, **kw):
        compiled.append(kw)

        def graph_output(*args, **kwargs):  # stands for the replay: remembers the tensors it hands out
            out = fn(*args, **kwargs)
            handed.append(out[0] if isinstance(out, tuple) else out.sample)
            return out
        return graph_output

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    pipe, _ = run(flux_dir, "flux1-dev.yaml", "flux", "policies.compile={mode: full, cudagraphs: true}", steps=2)
    assert len(compiled) == 1 and compiled[0]["options"]["triton.cudagraphs"] and compiled[0]["fullgraph"]
    assert len(marks) == 2 and len(handed) == 2
    dit = pipe.components["transformer"]
    assert not dit._forward_pre_hooks  # the generation starts in the compiled call, not from a hook inside it
    weight = next(dit.parameters())
    at = dict(device=weight.device, dtype=weight.dtype)  # the build's device: CUDA where there is one
    args = dict(hidden_states=torch.randn(1, 16, dit.config.in_channels, **at),
                encoder_hidden_states=torch.randn(1, 8, dit.config.joint_attention_dim, **at),
                pooled_projections=torch.randn(1, dit.config.pooled_projection_dim, **at),
                timestep=torch.tensor([0.5], **at), img_ids=torch.zeros(16, 3, **at), txt_ids=torch.zeros(8, 3, **at),
                guidance=torch.tensor([3.5], **at), return_dict=False)
    with torch.no_grad():
        out = dit(**args)[0]
    assert len(marks) == 3 and out.data_ptr() != handed[-1].data_ptr() and torch.equal(out, handed[-1])
    with torch.enable_grad():
        out = dit(**args)[0]
    assert len(marks) == 3 and out is handed[-1]  # with gradients the graph's own output, no new generation
    again = omnispec.build(SPECS / "flux1-dev.yaml", components=dict(pipe.components),
                           overrides=[*TINY_OVERRIDES["flux"]], device="cpu")
    assert again.components["transformer"] is dit and dit._compiled_call_impl is None
    assert "full (backend inductor" in pipe.explain() and "cudagraphs" in pipe.explain()


def test_no_graph_generation_starts_while_a_forward_with_gradients_waits_for_its_backward(monkeypatch):
    """An exact RL replay runs forwards without gradients between the forwards with them of earlier steps; a new
    CUDA-graph generation there would give their saved activations' memory to the next replay (on the H200 the
    replay tests with cudagraphs failed so). Per device, as the graph trees keep it."""
    import torch
    from torch._inductor import cudagraph_trees

    from omnispec.policies.compile import start_graph_generation

    marks, asked = [], []
    pending = {0: False, 1: True}
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    monkeypatch.setattr(cudagraph_trees, "get_manager", lambda index, create_if_none_exists: asked.append(
        (index, create_if_none_exists)) or type("Manager", (), {"running_forwards_with_pending_backwards":
                                                                pending[index]})())
    start_graph_generation(torch.nn.Linear(2, 2))  # on the CPU: no graph trees to ask
    assert marks == [1] and not asked
    on = [torch.nn.Linear(2, 2) for _ in range(2)]
    for index, module in enumerate(on):  # modules on cuda:0 and cuda:1, stood in for: the trees of its own device
        weight = type("Weight", (), {"device": torch.device("cuda", index)})()
        monkeypatch.setattr(module, "parameters", lambda weight=weight: iter([weight]))
    start_graph_generation(on[0])
    start_graph_generation(on[1])
    assert asked == [(0, False), (1, False)] and marks == [1, 1]  # device 1 waits for a backward: no new generation


def test_a_whole_denoiser_graph_gives_the_eager_images_on_cuda(flux_dir):
    """On the GPU, through inductor's real CUDA-graph trees: two requests in a row, each within float32 roundings of
    eager, the first one's image not overwritten by the second's replay."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need CUDA")

    def images(*overrides):
        pipe = omnispec.build(SPECS / "flux1-dev.yaml", source=str(flux_dir), device="cuda",
                              overrides=[*TINY_OVERRIDES["flux"], *overrides])
        return [pipe(prompt, seed=0).array for prompt in ("a cat", "a dog on a skateboard")]

    eager = images()
    graphs = images("policies.compile={mode: full, cudagraphs: true}",
                    "policies.attention.fused_qk_norm_rope=true", "policies.mlp.fused_gelu=true")
    for want, got in zip(eager, graphs, strict=True):
        assert np.abs(got - want).max() <= 1e-3
    assert np.abs(graphs[0] - graphs[1]).max() > 1e-2


# The families with ``shared_block_inputs``, each as the tiny checkpoint runs.
SHARED_INPUT_CASES = {
    "flux": ("flux1-dev.yaml", "flux_dir", TINY_OVERRIDES["flux"]),
    "wan": ("wan2.1-t2v-1.3b.yaml", "wan_dir", TINY_OVERRIDES["wan"]),
    "qwen_image": ("qwen-image.yaml", "qwen_image_dir", TINY_OVERRIDES["qwen_image"]),
    "ltx2": ("ltx2-t2v.yaml", "ltx2_dir", TINY_OVERRIDES["ltx2"]),
    "hunyuan_video15": ("hunyuanvideo-1.5-t2v.yaml", "hunyuan_video15_dir", TINY_OVERRIDES["hunyuan_video15"]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(SHARED_INPUT_CASES))
def test_regional_graphs_copy_none_of_the_shared_block_inputs_on_cuda(family, request):
    """On the GPU, through inductor's real CUDA-graph trees: the blocks' graphs copy none of the tensors the family's
    ``shared_block_inputs`` hand them (without ``KeptBlockInputs`` each block copies them before every replay; the
    first block's hidden states, from the eager embedders, are still copied, as is a view the denoiser takes of a kept
    tensor, Wan's timestep projection), and two requests in a row give the eager outputs within float32 roundings."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need CUDA")
    from benchmarks.gpu_policies import graph_input_copies
    from omnispec.bridge import hook_registry
    from omnispec.policies.compile import SHARED_INPUTS_HOOK

    spec, checkpoint, overrides = SHARED_INPUT_CASES[family]
    source = request.getfixturevalue(checkpoint)
    outputs = {}
    for graphs in (False, True):
        pipe = omnispec.build(SPECS / spec, source=str(source), device="cuda", overrides=[
            *overrides, *(["policies.compile={mode: regional, cudagraphs: true}"] if graphs else [])])
        outputs[graphs] = [pipe("a cat", seed=0).array]
        with graph_input_copies() as (copied, sources):
            outputs[graphs].append(pipe("a dog on a skateboard", seed=0).array)
    registries = [hook_registry(m) for m in pipe.components["transformer"].modules()]
    kept = {(t.data_ptr(), tuple(t.shape)) for r in registries if r is not None
            and (hook := r.get_hook(SHARED_INPUTS_HOOK)) for t in hook.storage.values()}
    for want, got in zip(outputs[False], outputs[True], strict=True):
        assert np.abs(got - want).max() <= 1e-3
    assert kept and copied, f"kept {len(kept)}, copied {copied}: the counting missed the replays"
    assert not kept & sources, copied


def test_magcache_needs_ratios_or_calibration():
    with pytest.raises(SpecError, match="mag_ratios"):
        omnispec.load_spec(SPECS / "flux1-dev.yaml", ["policies.cache={kind: magcache}"])


def test_two_offload_strategies_cannot_be_declared():
    with pytest.raises(SpecError, match="unknown key 'blocks_per_group'"):
        omnispec.load_spec(SPECS / "flux1-dev.yaml", ["policies.offload={strategy: model, blocks_per_group: 2}"])


def test_redirected_attention_accepts_keyword_calls():
    import torch
    import torch.nn.functional as F

    from omnispec.policies.attention_kernels import _RedirectSDPA

    seen = []
    q = torch.randn(1, 2, 8, 4)
    with _RedirectSDPA(lambda q, k, v, scale: seen.append(scale) or q):
        F.scaled_dot_product_attention(query=q, key=q, value=q, scale=0.5)
        F.scaled_dot_product_attention(q, q, q)
        F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool))  # passes through
    assert seen == [0.5, None]


def test_auto_under_compile_resolves_to_sdpa(flux_dir, plain_flux):
    pipe, out = run(flux_dir, "flux1-dev.yaml", "flux", "policies.compile={mode: regional, backend: eager}")
    assert pipe.explain(as_dict=True)["attention"]["joint"].startswith("sdpa (auto under compile")
    assert np.abs(out - plain_flux).max() <= 1e-5


def test_rebuilding_over_the_same_modules_drops_old_attention_hooks(flux_dir):
    from omnispec.policies.attention import HOOK_NAME

    first, _ = run(flux_dir, "flux1-dev.yaml", "flux", "policies.attention.default=sdpa_math")
    modules = {n: m for n, m in first.components.items()}
    again = omnispec.build(SPECS / "flux1-dev.yaml", components=modules, overrides=[*TINY_OVERRIDES["flux"]],
                           device="cpu")
    attn = again.components["transformer"].transformer_blocks[0].attn
    hook = attn._diffusers_hook.get_hook(HOOK_NAME)
    assert hook is None or type(hook).__name__ == "AutoBackendHook"


def test_block_offload_with_regional_compile_gives_the_plain_output(flux_dir, plain_flux):
    _, out = run(flux_dir, "flux1-dev.yaml", "flux", "policies.offload={strategy: layerwise}",
                 "policies.compile={mode: regional, backend: eager, fullgraph: false}")
    assert np.abs(out - plain_flux).max() <= 1e-5


def test_removing_the_last_hook_restores_the_plain_module():
    """A hook left as an instance ``forward`` would make dynamo guard on it per module (see bridge.remove_hook)."""
    import torch
    from diffusers.hooks import HookRegistry, ModelHook

    from omnispec.bridge import remove_hook

    module = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    before = module(x)
    HookRegistry.check_if_exists_or_initialize(module).register_hook(ModelHook(), "a")
    HookRegistry.check_if_exists_or_initialize(module).register_hook(ModelHook(), "b")
    remove_hook(module, "a")
    assert module._diffusers_hook.get_hook("b") is not None  # another hook stays in place
    remove_hook(module, "b")
    assert "forward" not in module.__dict__ and not hasattr(module, "_diffusers_hook")
    assert torch.equal(module(x), before)


def test_rebuilding_without_offload_or_cache_leaves_no_hooks(flux_dir, plain_flux):
    first, _ = run(flux_dir, "flux1-dev.yaml", "flux", "policies.offload={strategy: model}",
                   "policies.cache={kind: first_block, threshold: 0.2}")
    again = omnispec.build(SPECS / "flux1-dev.yaml", components=dict(first.components), device="cpu",
                           overrides=[*TINY_OVERRIDES["flux"], "policies.attention.default=sdpa"])
    hooked = {f"{name}.{sub}": list(child._diffusers_hook.hooks) for name, m in again.components.items()
              if hasattr(m, "named_modules") for sub, child in m.named_modules() if hasattr(child, "_diffusers_hook")}
    assert hooked == {"transformer.": [GRADIENTS_HOOK]}  # the one every build puts on a denoiser: attention's
    assert np.abs(again("a cat", seed=0).array - plain_flux).max() <= 1e-6


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")
def test_per_row_fp8_on_float32_weights_is_refused_before_loading(flux_dir):
    """torchao asserts on it mid-load; the policy check names the field instead."""
    with pytest.raises(SpecError, match="granularity: torchao's per-row fp8 scales take bfloat16 weights only"):
        run(flux_dir, "flux1-dev.yaml", "flux", "policies.quantization={transformer: {method: fp8_dynamic, "
            "granularity: row}}")


def test_fused_qk_norm_rope_gives_the_plain_output_and_a_rebuild_undoes_it(flux_dir, plain_flux):
    pipe, out = run(flux_dir, "flux1-dev.yaml", "flux", "policies.attention.fused_qk_norm_rope=true")
    assert np.array_equal(out, plain_flux)  # off CUDA the operator runs the model's own operations
    processors = {type(p).__name__ for p in pipe.components["transformer"].attn_processors.values()}
    assert processors == {"FusedQKNormRopeProcessor"}
    assert pipe.explain(as_dict=True)["attention"]["single q/k norm + RoPE"].startswith("fused in")
    again = _rebuilt_plain(pipe)
    assert {type(p).__name__ for p in again.components["transformer"].attn_processors.values()} == {
        "FluxAttnProcessor"}
    assert np.abs(_compiled_flux(flux_dir, "policies.attention.fused_qk_norm_rope=true") - plain_flux).max() <= 1e-5


def _rebuilt_plain(pipe):
    """A FLUX pipeline built over ``pipe``'s modules with no policy set."""
    return omnispec.build(SPECS / "flux1-dev.yaml", components=dict(pipe.components),
                          overrides=[*TINY_OVERRIDES["flux"]], device="cpu")


def _compiled_flux(flux_dir, *overrides):
    compile_policy = "policies.compile={mode: regional, backend: aot_eager}"
    return run(flux_dir, "flux1-dev.yaml", "flux", *overrides, compile_policy)[1]


def test_fused_qk_norm_rope_is_refused_where_the_family_has_none(sd3_dir):
    with pytest.raises(SpecError, match=r"policies.attention.fused_qk_norm_rope: family 'sd3' has no fused"):
        run(sd3_dir, "sd3.5-medium.yaml", "sd3", "policies.attention.fused_qk_norm_rope=true")


def test_fused_gelu_gives_the_plain_output_and_a_rebuild_undoes_it(flux_dir, plain_flux):
    pipe, out = run(flux_dir, "flux1-dev.yaml", "flux", "policies.mlp.fused_gelu=true")
    assert np.array_equal(out, plain_flux)  # off CUDA the operators run the model's own operations
    transformer = pipe.components["transformer"]

    def hooked(model):
        return [name for name, m in model.named_modules() if type(m).__name__ == "FusedGelu" or (
            getattr(m, "_diffusers_hook", None) is not None and m._diffusers_hook.get_hook("omnispec_fused_gelu"))]

    singles, doubles = len(transformer.single_transformer_blocks), len(transformer.transformer_blocks)
    assert len(hooked(transformer)) == singles + 2 * doubles  # each single block; each double block's two feed-forwards
    assert pipe.explain(as_dict=True)["applied"]["mlp"].startswith(
        f"transformer: bias + GELU in the matmul for {2 * doubles} feed-forward projections, {singles} parallel")
    assert hooked(_rebuilt_plain(pipe).components["transformer"]) == []
    assert np.abs(_compiled_flux(flux_dir, "policies.mlp.fused_gelu=true") - plain_flux).max() <= 1e-5


def test_fused_gelu_runs_under_a_block_cache_as_the_cache_alone(flux_dir):
    """The first-block cache hooks the blocks the MLP policy hooks too: the hooks chain, and reused steps skip both."""
    cache = ["recipe.defaults.steps=6", "policies.cache={kind: first_block, threshold: 0.2}"]
    _, alone = run(flux_dir, "flux1-dev.yaml", "flux", *cache)
    _, fused = run(flux_dir, "flux1-dev.yaml", "flux", *cache, "policies.mlp.fused_gelu=true")
    assert np.array_equal(fused, alone)


def test_fused_gelu_is_refused_where_the_denoiser_has_no_tanh_gelu(z_image_dir):
    with pytest.raises(SpecError, match=r"policies.mlp.fused_gelu: family 'z_image' has no tanh-GELU .*: transformer"):
        run(z_image_dir, "z-image-turbo.yaml", "z_image", "policies.mlp.fused_gelu=true")


@pytest.mark.parametrize("dynamic", [None, False])
def test_a_mix_of_request_shapes_keeps_a_bounded_number_of_block_graphs(dynamic):
    """A server's or a trainer's mix of requests under regional compile: batch sizes, generation, rollouts and
    replays with gradients. With ``dynamic: false`` every batch size is a graph of each block's code of its own, and
    a mix of more shapes than dynamo's recompile limit stops a fullgraph block (``FailOnRecompileLimitHit``, the
    H100 soak's failure, BENCHMARKS.md, "GPU soak under regional compile"); the default, torch's automatic
    dynamic shapes, makes a size that changes symbolic, so more batch sizes add no graph."""
    from peft import LoraConfig
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    pipe = omnispec.build(SPECS / "digits.yaml", overrides=[
        "runtime.progress=false", "recipe.defaults.steps=2", "policies.compile={mode: regional, backend: eager}",
        *([] if dynamic is None else [f"policies.compile.dynamic={str(dynamic).lower()}"])])
    torch.manual_seed(0)
    pipe.components["transformer"].add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q"]))
    graphs = []
    for batch in (1, 2, 3, 4, 5):
        pipe(["seven"] * batch, seed=0)
        ro = pipe.rollout(["two"] * batch, group_size=1, seed=0, sampler={"kind": "sde", "noise_level": 0.7})
        pipe.log_prob(ro, grad=True)
        graphs.append(counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    if dynamic is None:
        assert graphs[-1] == graphs[2], f"graphs after each batch size: {graphs}"
    else:  # the case the default is for: a graph per batch size
        assert graphs[-1] > graphs[2], f"graphs after each batch size: {graphs}"


def _recorded_graphs() -> int:
    """How many CUDA graphs inductor's graph trees on this device have recorded (each recording adds a node)."""
    from omnispec.kernels.torch_internals import get_manager

    manager = get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    nodes = [n for roots in (manager.roots.values() if manager is not None else ()) for n in roots]
    count = 0
    while nodes:
        node = nodes.pop()
        count += 1
        nodes.extend(child for children in node.children.values() for child in children)
    return count


@pytest.mark.gpu
def test_a_compiled_pipelines_graphs_replay_after_another_pipelines_request(flux_dir):
    """A process that alternates pipelines (a trainer's compiled rollouts beside an eager evaluation; a benchmark's
    interleaved sides): the compiled pipeline's CUDA graphs replay after the other's request, as they do after its
    own, and record nothing again. Timed interleaved, the first request after another pipeline's was 0.5-1.1 s
    longer (BENCHMARKS.md, "Presets interleaved with eager pipelines"): this says whether recording is why."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need CUDA")
    torch._dynamo.reset()
    cuda = [*TINY_OVERRIDES["flux"], "runtime.device=cuda", "model.dtype=bfloat16"]
    compiled = omnispec.build(SPECS / "flux1-dev.yaml", source=str(flux_dir), overrides=[
        *cuda, "policies.compile={mode: regional, cudagraphs: true}"])
    eager = omnispec.build(SPECS / "flux1-dev.yaml", source=str(flux_dir), overrides=cuda)
    for steps in (2, 3, 2, 3):  # warm-up, then recording, at both lengths
        compiled("a cat", seed=0, steps=steps)
    recorded = _recorded_graphs()
    assert recorded > 0
    for steps in (2, 3):
        compiled("a cat", seed=0, steps=steps)
    assert _recorded_graphs() == recorded  # a row of its own requests replays
    for steps in (2, 3):
        eager("a cat", seed=0, steps=steps)
        compiled("a cat", seed=0, steps=steps)
    assert _recorded_graphs() == recorded  # so does a request after another pipeline's
