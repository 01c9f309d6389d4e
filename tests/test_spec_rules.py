"""Each cross-field rule of the spec has a failing case whose error names the field path."""

import copy

import pytest

from omnispec.spec import SpecError, load_spec, resolve_spec_data

from conftest import SPECS

FLUX, _ = resolve_spec_data(SPECS / "flux1-dev.yaml")
WAN22, _ = resolve_spec_data(SPECS / "wan2.2-t2v-a14b.yaml")


def phase(**kw):
    base = {"name": "p", "denoiser": "transformer", "schedule": {"kind": "flow_match", "shift": 3.0}}
    return base | kw


def fails(data, path, fragment):
    with pytest.raises(SpecError) as info:
        load_spec(data)
    found = [(p.path, p.message) for p in info.value.problems]
    assert any(p == path and fragment in m for p, m in found), found


def with_(base, mutate):
    data = copy.deepcopy(base)
    mutate(data)
    return data


def test_phase_names_must_be_unique():
    data = with_(FLUX, lambda d: d["recipe"].update(phases=[phase(name="a"), phase(name="a")]))
    fails(data, "recipe.phases.1.name", "more than once")


def test_phase_denoiser_must_be_a_denoiser_component():
    fails(with_(FLUX, lambda d: d["recipe"].update(phases=[phase(denoiser="vae")])),
          "recipe.phases.0.denoiser", "role 'vae'")
    fails(with_(FLUX, lambda d: d["recipe"].update(phases=[phase(denoiser="ghost")])),
          "recipe.phases.0.denoiser", "not a component")


def test_output_phase_must_exist():
    fails(with_(FLUX, lambda d: d["recipe"].update(output={"phase": "nope"})), "recipe.output.phase", "names no phase")
    fails(with_(FLUX, lambda d: d["recipe"].update(output={"phase": 3})), "recipe.output.phase", "names no phase")


def test_first_phase_cannot_take_previous_latents():
    data = with_(FLUX, lambda d: d["recipe"].update(phases=[phase(input={"kind": "previous"})]))
    fails(data, "recipe.phases.0.input.kind", "first phase")


def test_latent_upsample_must_name_an_upsampler_component():
    up = {"kind": "previous", "transform": {"kind": "latent_upsample", "upsampler": "vae"}}
    data = with_(FLUX, lambda d: d["recipe"].update(phases=[phase(name="a"), phase(name="b", input=up)]))
    fails(data, "recipe.phases.1.input.transform.upsampler", "expected 'upsampler'")


def test_adapter_slot_must_exist():
    fails(with_(FLUX, lambda d: d["recipe"].update(phases=[phase(adapter="distilled")])),
          "recipe.phases.0.adapter", "not declared")
    data = with_(FLUX, lambda d: d["model"].update(adapters={"x": {"path": "lora", "target": "nope"}}))
    fails(data, "model.adapters.x.target", "not a component")


def test_windows_lie_in_unit_interval_and_are_ordered():
    term = {"kind": "cfg", "scale": 3.0, "window": {"start": 0.5, "end": 1.5}}
    data = with_(FLUX, lambda d: d["recipe"]["phases"][0]["guidance"].update(terms=[term]))
    fails(data, "recipe.phases.0.guidance.terms.0.window.end", "less than or equal to 1")
    term = {"kind": "cfg", "scale": 3.0, "window": {"start": 0.8, "end": 0.2}}
    data = with_(FLUX, lambda d: d["recipe"]["phases"][0]["guidance"].update(terms=[term]))
    fails(data, "recipe.phases.0.guidance.terms.0.window", "after its end")


def test_default_sizes_meet_constraints():
    fails(with_(FLUX, lambda d: d["recipe"]["defaults"].update(height=1000)), "recipe.defaults", "multiple of 16")
    fails(with_(WAN22, lambda d: d["recipe"]["defaults"].update(frames=80)), "recipe.defaults.frames", "k*4+1")


def test_parallel_degrees_are_positive():
    data = with_(FLUX, lambda d: d.update(policies={"parallel": {"ulysses": 0}}))
    fails(data, "policies.parallel.ulysses", "greater than 0")


def test_layerwise_offload_with_full_compile_is_rejected():
    data = with_(FLUX, lambda d: d.update(policies={"offload": {"strategy": "layerwise"}, "compile": {"mode": "full"}}))
    fails(data, "policies.compile.mode", "policies.offload.strategy")


@pytest.mark.parametrize("backend", ["sage", "flash4"])
def test_attention_perturbation_needs_an_sdpa_backend(backend):
    term = {"kind": "skip_layer", "scale": 2.0, "layers": [1], "skip": "attention_scores"}
    data = with_(FLUX, lambda d: (d["recipe"]["phases"][0]["guidance"].update(terms=[term]),
                                  d.update(policies={"attention": {"default": backend}})))
    fails(data, "policies.attention.default", "recipe.phases.0.guidance")


def test_quantization_keys_name_components_or_roles():
    data = with_(FLUX, lambda d: d.update(policies={"quantization": {"transfomer": {"method": "fp8_dynamic"}}}))
    fails(data, "policies.quantization.transfomer", "neither a component nor a role")


def test_quantization_granularity_is_for_fp8_dynamic_only():
    q = {"transformer": {"method": "int8_weight_only", "granularity": "row"}}
    fails(with_(FLUX, lambda d: d.update(policies={"quantization": q})), "policies.quantization.transformer",
          "granularity applies to fp8_dynamic only")


def test_one_negative_prompt_term_per_plan():
    terms = [{"kind": "cfg", "scale": 3.0}, {"kind": "apg", "scale": 3.0}]
    data = with_(FLUX, lambda d: d["recipe"]["phases"][0]["guidance"].update(terms=terms))
    fails(data, "recipe.phases.0.guidance", "at most one")


def test_segment_must_name_a_shared_schedule():
    data = with_(WAN22, lambda d: d["recipe"]["phases"][1]["schedule"].update(of="other"))
    fails(data, "recipe.phases.1.schedule.of", "not in recipe.schedules")


def test_segments_must_not_overlap():
    data = with_(WAN22, lambda d: d["recipe"]["phases"][1]["schedule"].update(high=0.9))
    fails(data, "recipe.phases.0.schedule", "overlaps")


def test_scheduler_schedule_needs_a_scheduler_component():
    data = with_(WAN22, lambda d: d["recipe"]["schedules"]["main"].update(component="vae"))
    fails(data, "recipe.schedules.main.component", "expected 'scheduler'")


def test_unknown_family_is_rejected():
    fails(with_(FLUX, lambda d: d["model"].update(family="fluxx")), "model.family", "unknown family")


def test_video_task_needs_frames():
    data = with_(FLUX, lambda d: d["recipe"].update(task="text-to-video"))
    fails(data, "recipe", "needs defaults.frames")


def test_unknown_variant_names_the_choices():
    data = with_(FLUX, lambda d: d["recipe"]["phases"][0]["schedule"].update(kind="karras"))
    fails(data, "recipe.phases.0.schedule.kind", "unknown variant 'karras'")


def test_segments_must_cover_the_whole_schedule():
    data = with_(WAN22, lambda d: d["recipe"]["phases"][1]["schedule"].update(low=0.1))
    fails(data, "recipe.phases.0.schedule", "cover [0, 1]")


def test_explicit_attention_backend_with_compile_is_rejected():
    data = with_(FLUX, lambda d: d.update(policies={"attention": {"default": "sdpa_flash"}, "compile": {"mode": "regional"}}))
    fails(data, "policies.attention.default", "policies.compile.mode")


def test_flash4_under_compile_must_be_every_roles_backend():
    """Compiled, flash4 is one redirect around the denoiser's call: it cannot serve one role and not another."""
    compiled = {"mode": "regional"}
    load_spec(with_(FLUX, lambda d: d.update(policies={"attention": {"default": "flash4"}, "compile": compiled})))
    data = with_(FLUX, lambda d: d.update(policies={"attention": {"default": "flash4", "per_role": {"single": "sdpa"}},
                                                    "compile": compiled}))
    fails(data, "policies.attention.default", "give per_role no other backend")
    data = with_(FLUX, lambda d: d.update(policies={"attention": {"per_role": {"single": "flash4"}}, "compile": compiled}))
    fails(data, "policies.attention.per_role.single", "name it as policies.attention.default")


@pytest.mark.parametrize("strategy", ["layerwise", "group"])
def test_block_offload_with_fullgraph_regional_compile_is_rejected(strategy):
    data = with_(FLUX, lambda d: d.update(policies={"offload": {"strategy": strategy}, "compile": {"mode": "regional"}}))
    fails(data, "policies.compile.fullgraph", f"{strategy} offload (policies.offload.strategy)")


@pytest.mark.parametrize("cache", [{"kind": "first_block"}, {"kind": "taylorseer"}, {"kind": "magcache", "calibrate": True}])
def test_hooked_cache_with_fullgraph_compile_is_rejected(cache):
    data = with_(FLUX, lambda d: d.update(policies={"cache": cache, "compile": {"mode": "full"}}))
    fails(data, "policies.compile.fullgraph", f"the {cache['kind']} cache (policies.cache.kind)")


def test_request_sigmas_set_the_steps_and_are_checked():
    from omnispec.spec.request import resolve_request, with_request_sigmas

    spec = load_spec(SPECS / "wan2.2-t2v-a14b.yaml")
    request = resolve_request(spec, "x", sigmas=[1.0, 0.6, 0.2])
    assert request.steps == 3
    applied = with_request_sigmas(spec, request.sigmas)  # the two experts' shared schedule, once
    assert [s.sigmas for s in applied.recipe.schedules.values()] == [[1.0, 0.6, 0.2]]
    for bad, match in (([1.0, 1.0], "decrease strictly"), ([0.5, 0.0], "above 0"), ([1.5, 0.5], "less than or equal"),
                       ([1.0, float("nan")], "finite")):
        with pytest.raises(SpecError, match=match):
            resolve_request(spec, "x", sigmas=bad)
    with pytest.raises(SpecError, match="request.steps: 2 sigmas give 2 steps, but steps is 3"):
        resolve_request(spec, "x", sigmas=[1.0, 0.5], steps=3)
    fixed = load_spec(SPECS / "digits.yaml", overrides=["recipe.phases.0.schedule.steps=4"])
    with pytest.raises(SpecError, match="request.sigmas: no phase .* takes the request's steps"):
        resolve_request(fixed, "x", sigmas=[1.0, 0.5])
    distilled = load_spec(SPECS / "ltx2.3-distilled.yaml")
    with pytest.raises(SpecError, match=r"refuses request field\(s\) \['sigmas'\]"):
        resolve_request(distilled, "x", sigmas=[1.0, 0.5])
