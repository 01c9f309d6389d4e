"""``policies.preset``: what fast and fastest turn on per family and device, what they leave and why, explicit fields
kept, and what explain and an output's record say."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from omnispec.policies.presets import DeviceFacts, resolve_preset
from omnispec.spec import load_spec
from omnispec.spec.explain import explain_spec, render_explain

import preloaded
from conftest import SPECS

HOPPER = DeviceFacts(cuda=True, capability=(9, 0), flash4_refusal=None, torchao=True)
AMPERE = DeviceFacts(cuda=True, capability=(8, 0), flash4_refusal="FA4 needs Hopper or Blackwell", torchao=True)


def resolved(name: str, *overrides: str, facts: DeviceFacts = HOPPER, preset: str = "fastest"):
    from omnispec.runtime.families import family_class

    spec = load_spec(name, [f"policies.preset={preset}", *overrides])
    return resolve_preset(spec, family_class(spec.model.family).targets, facts, lambda _: [])


def test_fastest_on_flux_and_a_hopper_turns_on_every_speed_up_and_marks_fp8_approximate():
    spec, outcome = resolved("flux1-dev")
    p = spec.policies
    assert p.preset == "none"  # the spec as run carries the fields, not the preset
    assert (p.compile.mode, p.compile.cudagraphs, p.attention.default) == ("regional", True, "flash4")
    assert p.attention.fused_qk_norm_rope and p.mlp.fused_gelu and p.mlp.precomputed_modulation
    assert p.quantization["denoiser"].method == "fp8_dynamic" and p.quantization["denoiser"].granularity == "row"
    assert outcome.approximate == ["fp8 matmuls in the denoisers (torchao, a scale per row)"]
    assert not outcome.left_out and not outcome.kept
    record = outcome.record()
    assert record["turned_on"]["policies.compile.mode"] == "regional" and record["approximate"]


def test_fast_turns_on_no_approximate_technique():
    spec, outcome = resolved("flux1-dev", preset="fast")
    assert not spec.policies.quantization and outcome.approximate == []
    assert spec.policies.compile.mode == "regional"


def test_fields_the_spec_sets_keep_their_values_and_what_then_cannot_run_is_left_out_with_the_reason():
    spec, outcome = resolved("flux1-dev", "policies.compile.mode=none", "policies.quantization.transformer.method=int8_weight_only")
    assert spec.policies.compile.mode == "none" and spec.policies.quantization["transformer"].method == "int8_weight_only"
    assert "denoiser" not in spec.policies.quantization
    kept = {f.path: value for f, value in outcome.kept}
    assert kept[("compile", "mode")] == "none" and ("quantization", "denoiser") in kept
    left = {f.path: why for f, why in outcome.left_out}
    assert "cudagraphs apply to compiled code" in left[("compile", "cudagraphs")]
    assert "kept policies.compile.mode = 'none' (set by the spec)" in outcome.note()


def test_what_the_family_lacks_is_left_out_naming_its_target():
    spec, outcome = resolved("sd3.5-medium")
    left = {f.path: why for f, why in outcome.left_out}
    assert left[("attention", "fused_qk_norm_rope")] == "family 'sd3' has no fused q/k norm + RoPE processor"
    assert left[("mlp", "precomputed_modulation")] == "family 'sd3' has no modulation table"
    assert spec.policies.mlp.fused_gelu  # SD3's feed-forwards are tanh-GELU


def test_attention_perturbing_guidance_keeps_an_sdpa_backend():
    spec, outcome = resolved("ltx2-t2v")
    left = {f.path: why for f, why in outcome.left_out}
    assert spec.policies.attention.default == "auto"
    assert "bypasses the attention perturbation" in left[("attention", "default")]
    assert spec.policies.compile.mode == "regional"


def test_offload_leaves_out_cuda_graphs_and_the_modulation_table():
    import torch

    from omnispec.policies.apply import policy_problems
    from omnispec.runtime.families import family_class

    targets = family_class("flux").targets
    spec = load_spec("flux1-dev", ["policies.preset=fast", "policies.offload.strategy=model"])
    spec, outcome = resolve_preset(spec, targets, HOPPER,
                                   lambda candidate: policy_problems(candidate, targets, torch.device("cpu")))
    left = {f.path: why for f, why in outcome.left_out}
    assert "CUDA graph replays the addresses" in left[("compile", "cudagraphs")]
    assert "which offload 'model' keeps off it" in left[("mlp", "precomputed_modulation")]
    assert spec.policies.compile.mode == "regional" and not spec.policies.compile.cudagraphs


def test_the_device_decides_flash4_and_fp8():
    spec, outcome = resolved("flux1-dev", facts=AMPERE)
    left = {f.path: why for f, why in outcome.left_out}
    assert "FA4 needs Hopper or Blackwell" in left[("attention", "default")]
    assert "compute capability 8.9" in left[("quantization", "denoiser")]
    no_torchao = DeviceFacts(cuda=True, capability=(9, 0), flash4_refusal=None, torchao=False)
    _, outcome = resolved("flux1-dev", facts=no_torchao)
    assert "torchao is not installed" in dict((f.path, w) for f, w in outcome.left_out)[("quantization", "denoiser")]


def test_a_field_that_would_add_a_problem_here_is_left_out_with_that_problem():
    from omnispec.runtime.families import family_class
    from omnispec.spec.errors import Problem

    spec = load_spec("flux1-dev", ["policies.preset=fast"])

    def problems(candidate):
        if candidate.policies.attention.default == "flash4":
            return [Problem("policies.attention.default", "flash4 cannot run here: no kernel image")]
        return []

    out, outcome = resolve_preset(spec, family_class("flux").targets, HOPPER, problems)
    assert out.policies.attention.default == "auto"
    assert ("FlashAttention-4 for every attention", "flash4 cannot run here: no kernel image") in [
        (f.label, why) for f, why in outcome.left_out]


def test_explain_lists_what_a_preset_asks_for_and_marks_approximate_ones_without_torch():
    code = ("import sys; from omnispec.cli import main; rc = main(['explain', 'flux1-dev', '--set', "
            "'policies.preset=fastest']); assert 'torch' not in sys.modules, 'explain imported torch'; sys.exit(rc)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "preset       fastest" in res.stdout
    fp8 = next(line for line in res.stdout.splitlines() if "policies.quantization.denoiser" in line)
    assert fp8.endswith("[approximate]")
    assert "[approximate]" not in next(line for line in res.stdout.splitlines() if "compile.mode" in line)


def test_explain_json_carries_the_preset():
    info = explain_spec(load_spec("wan2.1-t2v-1.3b", ["policies.preset=fast"]))
    assert info["preset"]["name"] == "fast" and all(not item["approximate"] for item in info["preset"]["asks"])
    assert "preset       fast" in render_explain(info)


def test_a_cpu_build_says_what_the_preset_left_out_and_the_record_says_so(tmp_path):
    import omnispec
    from omnispec.records.reading import read as read_record

    pipe = omnispec.build("digits", overrides=["policies.preset=fast", "recipe.defaults.steps=2"])
    assert pipe.spec.policies.preset == "none" and pipe.spec.policies.compile.mode == "none"
    note = pipe.explain().split("applied here:")[1]
    assert "preset       fast: nothing turned on" in note and "(CUDA devices only)" in note
    path = tmp_path / "seven.png"
    pipe("seven", seed=1).save(path)
    record = read_record(path)
    assert record.preset is not None and record.preset.name == "fast" and record.preset.turned_on == {}
    assert "CUDA devices only" in record.preset.left_out["policies.compile.mode"]


def test_the_cli_run_writes_the_preset_into_the_record(tmp_path):
    out = tmp_path / "seven.png"
    res = preloaded.python_m([sys.executable, "-m", "omnispec", "run", "digits", "--prompt", "seven", "--steps", "2",
                              "--set", "policies.preset=fast", "--output", str(out)], capture_output=True, text=True,
                             timeout=300)
    assert res.returncode == 0, res.stderr
    shown = preloaded.python_m([sys.executable, "-m", "omnispec", "explain", str(out)], capture_output=True, text=True,
                               timeout=120)
    assert "preset fast: turned on nothing" in shown.stdout, shown.stdout + shown.stderr


def _tanh_gelus(model) -> int:
    from diffusers.models.activations import GELU

    return sum(isinstance(m, GELU) and m.approximate == "tanh" for m in model.modules())


@pytest.mark.parametrize("family, denoiser", [
    ("wan", lambda: __import__("omnispec.testing.fixtures", fromlist=["x"])._wan_transformer()),
    ("qwen_image", lambda: __import__("omnispec.testing.fixtures", fromlist=["x"]).qwen_image_components()[
        "transformer"]),
    ("hunyuan_video15", lambda: __import__("omnispec.testing.fixtures", fromlist=["x"]).hunyuan_video15_components()[
        "transformer"]),
    ("ltx2", lambda: __import__("omnispec.testing.ltx2_fixtures", fromlist=["x"]).ltx2_components()["transformer"]),
    ("z_image", lambda: __import__("omnispec.testing.fixtures", fromlist=["x"]).z_image_components()["transformer"]),
])
def test_a_family_declares_the_mlp_target_exactly_when_its_feed_forwards_are_tanh_gelu(family, denoiser):
    from omnispec.runtime.families import family_class

    declared = family_class(family).targets.mlp is not None
    assert declared == (_tanh_gelus(denoiser()) > 0)


def test_bundled_specs_resolve_under_both_presets_on_a_hopper():
    from omnispec.spec.catalog import bundled_names

    for name in bundled_names():
        for preset in ("fast", "fastest"):
            spec, outcome = resolved(name, preset=preset)
            assert outcome.turned_on, f"{name} {preset}: {outcome.note()}"
            json.dumps(outcome.record())


# the fields of ``fastest`` a CPU build applies as on a GPU (compile, flash4 and fp8 need CUDA; int8 weight-only stands
# in for fp8 as a denoiser quantized at load, with the exclude the preset gives it: the layers the other fields meet)
CPU_APPLIED = {("attention", "fused_qk_norm_rope"), ("mlp", "fused_gelu"), ("mlp", "precomputed_modulation")}


@pytest.mark.parametrize("fixture, spec_name, family", [
    ("flux_dir", "flux1-dev", "flux"), ("sd3_dir", "sd3.5-medium", "sd3"), ("wan_dir", "wan2.1-t2v-1.3b", "wan"),
    ("qwen_image_dir", "qwen-image", "qwen_image")], ids=["flux", "sd3", "wan", "qwen_image"])
def test_what_fastest_turns_on_builds_together_over_a_quantized_denoiser(request, fixture, spec_name, family):
    """``fastest`` on a Hopper sets its fused kernels beside fp8 matmuls, which each policy then meets at build as
    quantized layers (fused_gelu and the modulation table once refused the spec there). Built on the CPU with those
    fields and the denoiser quantized at load as the preset quantizes it, the run is the quantized run without them
    (off CUDA the fused operators run the model's own operations; the table rounds its float32 matmul apart)."""
    import numpy as np

    import omnispec
    from omnispec.runtime.families import family_class
    from omnispec.testing import TINY_OVERRIDES

    spec, outcome = resolved(spec_name)
    fields = [f for f in outcome.turned_on if f.path in CPU_APPLIED]
    assert fields and any(f.approximate for f in outcome.turned_on)
    exclude = spec.policies.quantization["denoiser"].exclude
    modulation = family_class(family).targets.modulation
    assert exclude == (modulation.leaves() if modulation is not None else [])  # the table's linears stay bf16
    int8 = f"policies.quantization={{denoiser: {{method: int8_weight_only, exclude: {json.dumps(exclude)}}}}}"

    def run(*overrides):
        pipe = omnispec.build(SPECS / f"{spec_name}.yaml", source=str(request.getfixturevalue(fixture)),
                              device="cpu", overrides=[*TINY_OVERRIDES[family], int8, *overrides])
        return pipe, pipe("a cat", seed=0, steps=2).array

    pipe, fastest = run(*(f"policies.{'.'.join(f.path)}={str(f.value).lower()}" for f in fields))
    applied = pipe.explain(as_dict=True)["applied"]
    assert applied.get("mlp") if any(f.path[0] == "mlp" and f.path[1] == "fused_gelu" for f in fields) else True
    if modulation is not None:
        assert "modulation linears from a table" in applied["modulation"]
    # equal but for the table's matmul over every (step, row) at once, which rounds float32 in another order
    assert np.allclose(fastest, run()[1], rtol=0, atol=1e-5)


def test_a_quantization_the_spec_sets_over_the_modulation_linears_leaves_the_table_out_with_the_reason():
    import torch

    from omnispec.policies.apply import policy_problems
    from omnispec.runtime.families import family_class

    spec = load_spec("flux1-dev", ["policies.preset=fast",
                                   "policies.quantization={transformer: {method: int8_weight_only}}"])
    targets = family_class("flux").targets
    _, outcome = resolve_preset(spec, targets, HOPPER,
                                lambda candidate: policy_problems(candidate, targets, torch.device("cpu")))
    why = {f.path: reason for f, reason in outcome.left_out}[("mlp", "precomputed_modulation")]
    assert why.startswith("policies.quantization.transformer quantizes the modulation linears")
    assert "exclude: [norm1.linear, norm1_context.linear, norm.linear, norm_out.linear]" in why
    kept_plain = ("policies.quantization={transformer: {method: int8_weight_only, exclude: [norm1.linear, "
                  "norm1_context.linear, norm.linear, norm_out.linear]}}")
    excluded = load_spec("flux1-dev", ["policies.preset=fast", kept_plain])
    _, outcome = resolve_preset(excluded, targets, HOPPER,
                                lambda candidate: policy_problems(candidate, targets, torch.device("cpu")))
    assert ("mlp", "precomputed_modulation") in [f.path for f in outcome.turned_on]
