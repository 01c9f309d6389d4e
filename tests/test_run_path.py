"""The one execution path: generate, rollout and replay share the run's setup, pass batching and step body;
caches start each request clean and sized to its steps; latent streams combine guidance each on its own."""

import ast
from pathlib import Path

import pytest
import torch

import omnispec
from omnispec.runtime.guidance import GuidanceState, combine
from omnispec.spec import GuidanceSpec, SpecError, compile_plan

from conftest import SPECS

DIGITS = ["runtime.progress=false", "recipe.defaults.steps=6"]


def test_no_runtime_module_imports_the_rl_package():
    runtime = Path(omnispec.__file__).parent / "runtime"
    offenders = []
    for path in runtime.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            offenders += [f"{path.name}: {n}" for n in names if n.startswith(("omnispec.rl", "..rl", "...rl"))]
    assert offenders == []


def test_cached_rollout_with_a_step_mask_replays_exactly():
    pipe = omnispec.build(SPECS / "digits.yaml", overrides=[
        *DIGITS, "policies.cache={kind: step_mask, mask: [true, false, true, true, false, true]}"])
    sampler = {"kind": "sde", "window": {"kind": "fixed", "start": 2, "length": 2}}
    ro = pipe.rollout(["seven", "two"], group_size=2, seed=1, sampler=sampler)
    assert torch.equal(pipe.log_prob(ro, grad=False).log_probs.cpu(), ro.log_probs)  # same batching: bit for bit
    ratio = (pipe.log_prob(ro, grad=False, micro_batch=3).log_probs.cpu() - ro.log_probs).exp()
    assert (ratio - 1).abs().max().item() <= 1e-6


def test_a_step_mask_that_reuses_a_stochastic_step_is_refused():
    pipe = omnispec.build(SPECS / "digits.yaml", overrides=[
        *DIGITS, "policies.cache={kind: step_mask, mask: [true, false, true, true, false, true]}"])
    with pytest.raises(SpecError, match=r"reuses stochastic step\(s\) \[1\]"):
        pipe.rollout("seven", sampler={"kind": "sde", "window": {"kind": "fixed", "start": 0, "length": 2}})


@pytest.mark.parametrize("cache", ["{kind: first_block}", "{kind: taylorseer}"])
def test_rollouts_with_a_hooked_cache_are_refused_with_the_reason(cache):
    pipe = omnispec.build(SPECS / "digits.yaml", overrides=[*DIGITS, f"policies.cache={cache}"])
    with pytest.raises(SpecError, match="replay cannot rebuild"):
        pipe.rollout("seven", sampler={"kind": "sde"})
    with pytest.raises(SpecError, match="recipe.phases.0.sampler.kind: .*replay cannot rebuild"):
        omnispec.load_spec(SPECS / "digits.yaml", [f"policies.cache={cache}", "recipe.phases.0.sampler={kind: sde}"])


def test_magcache_is_sized_to_each_requests_steps():
    from diffusers.hooks.mag_cache import MagCacheHeadHook

    pipe = omnispec.build(SPECS / "digits.yaml", overrides=[
        *DIGITS, "policies.cache={kind: magcache, mag_ratios: [1.0, 0.98, 0.97, 0.96]}"])

    def sized():
        hooks = [h for m in pipe.components["transformer"].modules()
                 for h in getattr(getattr(m, "_diffusers_hook", None), "hooks", {}).values()
                 if isinstance(h, MagCacheHeadHook)]
        return {h.config.num_inference_steps for h in hooks}

    pipe("seven", seed=0, steps=5)
    assert sized() == {5}
    pipe("seven", seed=0, steps=9)
    assert sized() == {9}


def test_generate_and_a_rollouts_deterministic_steps_share_one_step_body():
    """A rollout whose window is empty of noise (tiny eta) walks the same states as generate."""
    pipe = omnispec.build(SPECS / "digits.yaml", overrides=DIGITS)
    plain = pipe("three", seed=4).latents["latents"]
    ro = pipe.rollout("three", seed=4, sampler={"kind": "dance_sde", "eta": 1e-12, "include_last": True,
                                                  "window": {"kind": "fixed", "start": 5, "length": 1}})
    assert torch.allclose(ro.latents[0, 1], plain[0].float(), atol=1e-5)


def test_per_stream_scales_guide_only_the_streams_they_name():
    guidance = GuidanceSpec.model_validate({"terms": [{"kind": "cfg", "scale": {"video": 3.0, "audio": 7.0}},
                                                      {"kind": "skip_layer", "scale": {"video": 1.0}, "layers": [1]}],
                                            "rescale": {"audio": 0.0}})
    (plan,) = compile_plan(guidance, 1)
    assert plan.passes == ("cond", "uncond", "skip_layer")
    assert plan.coefficients == {"uncond": {"video": 2.0, "audio": 6.0}, "skip_layer": {"video": 1.0}}
    cond = {"video": torch.ones(1, 4), "audio": torch.ones(1, 4)}
    uncond = {"video": torch.zeros(1, 4), "audio": torch.zeros(1, 4)}
    skipped = {"video": torch.full((1, 4), 0.5), "audio": torch.full((1, 4), 0.5)}
    out = combine(plan, {"cond": cond, "uncond": uncond, "skip_layer": skipped}, guidance, GuidanceState())
    assert torch.allclose(out["video"], torch.full((1, 4), 1 + 2 + 0.5))
    assert torch.allclose(out["audio"], torch.full((1, 4), 7.0))  # no skip-layer term for audio


@pytest.mark.parametrize("term", [{"kind": "cfg_zero_star", "scale": 4.0}, {"kind": "apg", "scale": 4.0, "eta": 0.0},
                                  {"kind": "cfg", "scale": 4.0}])
def test_norm_based_rules_never_mix_streams(term):
    guidance = GuidanceSpec.model_validate({"terms": [term], "rescale": 0.7})
    (plan,) = compile_plan(guidance, 1)
    g = torch.Generator().manual_seed(0)
    a = {"cond": torch.randn(2, 8, generator=g), "uncond": torch.randn(2, 8, generator=g)}
    b = {"cond": torch.randn(2, 3, generator=g), "uncond": torch.randn(2, 3, generator=g)}
    both = combine(plan, {n: {"a": a[n], "b": b[n]} for n in a}, guidance, GuidanceState())
    alone = combine(plan, {n: {"a": a[n]} for n in a}, guidance, GuidanceState())
    assert torch.equal(both["a"], alone["a"])


def test_explain_counts_steps_per_phase_of_a_static_shared_flow_schedule():
    spec = omnispec.load_spec(SPECS / "wan2.2-t2v-a14b.yaml", [
        "recipe.schedules.main={kind: flow_match, shift: 3.0}", "recipe.defaults.steps=10"])
    info = omnispec.spec.explain_spec(spec)
    high, low = info["phases"]
    assert high["steps"] + low["steps"] == 10 and high["sigma_range"][1] >= 0.875 > low["sigma_range"][0]
