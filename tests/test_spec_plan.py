"""compile_plan against hand-computed pass lists and coefficients."""

import pytest

from omnispec.spec import GuidanceSpec, compile_plan, flow_match_sigmas
from omnispec.spec.schedule import FlowMatchSchedule


def g(**kw):
    return GuidanceSpec.model_validate(kw)


def test_positive_only_runs_cond_alone():
    plans = compile_plan(g(), 4)
    assert [p.passes for p in plans] == [("cond",)] * 4
    assert all(p.coefficients == {} for p in plans)


def test_cfg_coefficient_is_scale_minus_one():
    plans = compile_plan(g(terms=[{"kind": "cfg", "scale": 7.0}]), 3)
    assert [p.passes for p in plans] == [("cond", "uncond")] * 3
    assert plans[0].coefficients == {"uncond": 6.0}


def test_cfg_scale_one_adds_no_pass():
    assert compile_plan(g(terms=[{"kind": "cfg", "scale": 1.0}]), 2)[0].passes == ("cond",)


def test_cfg_stg_modality_order_and_coefficients():
    plans = compile_plan(g(terms=[
        {"kind": "cfg", "scale": 3.0},
        {"kind": "skip_layer", "scale": 1.5, "layers": [5]},
        {"kind": "modality", "scale": 2.0, "modality": "audio"},
    ]), 2)
    assert plans[0].passes == ("cond", "uncond", "skip_layer", "modality.audio")
    assert plans[0].coefficients == {"uncond": 2.0, "skip_layer": 1.5, "modality.audio": 1.0}


def test_step_window_drops_the_pass_outside_it():
    plans = compile_plan(g(terms=[{"kind": "cfg", "scale": 5.0, "window": {"start": 0.0, "end": 0.5}}]), 4)
    assert [p.passes for p in plans] == [("cond", "uncond"), ("cond", "uncond"), ("cond",), ("cond",)]


def test_sd3_style_skip_layer_window():
    # SD3's 0.01..0.2 window over 28 steps covers steps 1..5, as in diffusers.
    term = {"kind": "skip_layer", "scale": 2.8, "layers": [7], "window": {"start": 0.01, "end": 0.2}}
    plans = compile_plan(g(terms=[term]), 28)
    assert [p.step for p in plans if "skip_layer" in p.passes] == [1, 2, 3, 4, 5]


def test_sigma_window_and_sigma_schedule():
    sigmas = [1.0, 0.75, 0.5, 0.25]
    plans = compile_plan(g(terms=[{
        "kind": "cfg",
        "scale": {"by": "sigma", "points": [[1.0, 6.0], [0.5, 2.0]]},
        "window": {"by": "sigma", "start": 0.4, "end": 1.0},
    }]), 4, sigmas)
    assert [p.coefficients.get("uncond") for p in plans] == [5.0, 3.0, 1.0, None]
    with pytest.raises(ValueError, match="sigma"):
        compile_plan(g(terms=[{"kind": "cfg", "scale": {"by": "sigma", "points": [[1.0, 2.0]]}}]), 4)


def test_step_schedule_interpolates_linearly():
    plans = compile_plan(g(terms=[{"kind": "cfg", "scale": {"by": "step", "points": [[0.0, 5.0], [0.5, 1.0]]}}]), 4)
    assert [p.coefficients.get("uncond") for p in plans] == [4.0, 2.0, None, None]


def test_embedded_and_rescale_per_step():
    plans = compile_plan(g(embedded=3.5, rescale=0.7, terms=[{"kind": "true_cfg", "scale": 2.0}]), 2)
    assert plans[0].embedded == 3.5 and plans[0].rescale == 0.7
    assert plans[0].terms[0].kind == "true_cfg" and plans[0].coefficients == {"uncond": 1.0}
    assert compile_plan(g(embedded=3.5, rescale=0.7), 1)[0].rescale == 0.0  # nothing to rescale


def test_cfg_zero_star_zero_init_steps_run_no_pass():
    plans = compile_plan(g(terms=[{"kind": "cfg_zero_star", "scale": 4.0, "zero_init_steps": 1}]), 3)
    assert plans[0].zero and plans[0].passes == ()
    assert plans[1].passes == ("cond", "uncond") and plans[1].terms[0].kind == "cfg_zero_star"


def test_apg_uses_its_own_rule():
    plans = compile_plan(g(terms=[{"kind": "apg", "scale": 5.0, "eta": 0.0}]), 1)
    assert plans[0].terms[0].kind == "apg" and plans[0].coefficients == {"uncond": 4.0}


def test_flux_dynamic_sigmas_match_diffusers_formula():
    import math

    sched = FlowMatchSchedule(kind="flow_match", shift="dynamic")
    sigmas = flow_match_sigmas(sched, 4, seq_len=4096)
    mu = 1.15
    expected = [math.exp(mu) / (math.exp(mu) + (1 / s - 1)) for s in (1.0, 0.75, 0.5, 0.25)] + [0.0]
    assert sigmas == pytest.approx(expected)


def test_static_shift_and_terminal_stretch():
    sched = FlowMatchSchedule(kind="flow_match", shift=3.0, shift_terminal=0.1)
    sigmas = flow_match_sigmas(sched, 5)
    assert sigmas[0] == pytest.approx(1.0) and sigmas[-2] == pytest.approx(0.1) and sigmas[-1] == 0.0
