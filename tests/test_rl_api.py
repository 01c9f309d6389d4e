"""RL API arguments: ``rollout`` and ``log_prob`` refuse what does not fit, naming the argument, before any forward."""

import dataclasses

import pytest
import torch

import omnispec
from omnispec.spec import SpecError

from conftest import SPECS

OVERRIDES = ["runtime.progress=false", "recipe.defaults.steps=4"]


class ForwardRan(Exception):
    """Raised by a hook when a module runs: the check should have come first."""


@pytest.fixture(scope="module")
def pipe():
    return omnispec.build(SPECS / "digits.yaml", overrides=OVERRIDES)


@pytest.fixture(scope="module")
def ro(pipe):
    return pipe.rollout(["one", "two"], group_size=2, seed=1, sampler={"kind": "sde"})


@pytest.fixture
def no_forward(pipe):
    """Any forward of the denoiser or the text encoder fails the test."""

    def refuse(*_):
        raise ForwardRan

    handles = [pipe.components[n].register_forward_pre_hook(refuse) for n in ("transformer", "text_encoder")]
    yield
    for h in handles:
        h.remove()


@pytest.mark.parametrize("kwargs, error, where", [
    ({"group_size": 0}, ValueError, "group_size"),
    ({"group_size": -1}, ValueError, "group_size"),
    ({"group_size": 2.0}, TypeError, "group_size"),
    ({"group_size": True}, TypeError, "group_size"),
    ({"prompts": 123}, TypeError, "prompts"),
    ({"prompts": []}, ValueError, "prompts"),
    ({"prompts": ["one", 3]}, TypeError, "prompts"),
    ({"seed": "abc"}, TypeError, "seed"),
    ({"seed": 2**64}, ValueError, "seed"),
    ({"sampler": "sde"}, TypeError, "sampler"),
    ({"sampler": {"kind": "sde", "noise_level": -1}}, SpecError, "sampler.noise_level"),
    ({"sampler": {"kind": "nope"}}, SpecError, "sampler.kind"),
    ({"sampler": {"kind": "sde", "bogus": 1}}, SpecError, "sampler.bogus"),
    ({"sampler": {"kind": "sde", "window": {"kind": "fixed"}}}, SpecError, "sampler.window.length"),
    ({"sampler": {"kind": "ode"}}, SpecError, "sampler"),
    ({"shared_noise": "yes"}, TypeError, "shared_noise"),
    ({"sample_offset": 3}, ValueError, "sample_offset"),
    ({"sample_offset": -2}, ValueError, "sample_offset"),
    ({"sample_offset": 1.5}, TypeError, "sample_offset"),
], ids=lambda v: str(v)[:40])
def test_rollout_refuses_bad_arguments_before_any_forward(pipe, no_forward, kwargs, error, where):
    args = {"prompts": "one", "group_size": 2, "sampler": {"kind": "sde"}} | kwargs
    with pytest.raises(error, match=rf"^{where}: ") as info:
        omnispec.rl.rollout(pipe, **args)
    assert not isinstance(info.value, ForwardRan)


@pytest.mark.parametrize("granularity", ["", ", granularity: tensor"])
def test_rollout_refuses_per_tensor_fp8_whose_scale_couples_the_batch(pipe, no_forward, monkeypatch, granularity):
    """One activation scale over a forward's rows: a sample's log-probs would depend on its batch-mates."""
    spec = omnispec.load_spec(SPECS / "digits.yaml", [
        *OVERRIDES, f"policies.quantization={{denoiser: {{method: fp8_dynamic{granularity}}}}}"])
    monkeypatch.setattr(pipe, "spec", spec)  # the check reads the spec; the weights need not be fp8 on this CPU
    with pytest.raises(SpecError, match=r"^policies.quantization.denoiser.granularity: fp8_dynamic with per-tensor"):
        omnispec.rl.rollout(pipe, "one", group_size=2, sampler={"kind": "sde"})


def test_rollout_refuses_a_window_that_does_not_fit_before_the_denoiser_runs(pipe):
    def refuse(*_):
        raise ForwardRan

    handle = pipe.components["transformer"].register_forward_pre_hook(refuse)
    try:
        with pytest.raises(SpecError, match="sampler.window: .*does not fit"):
            pipe.rollout("one", sampler={"kind": "sde", "window": {"kind": "fixed", "start": 3, "length": 1}})
    finally:
        handle.remove()


def tampered(ro, **fields):
    return dataclasses.replace(ro, **fields)


def _cases(ro):
    lat = ro.latents
    yield "dict", {"states": ro.states}, TypeError, "rollout"
    yield "none", None, TypeError, "rollout"
    yield "spatial shape", tampered(ro, states={"latents": lat[..., :16]}), ValueError, r"rollout\.states\.latents"
    yield "window + 2 states", tampered(ro, states={"latents": torch.cat([lat, lat[:, :1]], 1)}), ValueError, \
        r"rollout\.states\.latents"
    yield "float64 states", tampered(ro, states={"latents": lat.double()}), ValueError, r"rollout\.states\.latents"
    yield "stream names", tampered(ro, states={"video": lat}), ValueError, r"rollout\.states"
    yield "batch of log-probs", tampered(ro, log_probs=ro.log_probs[:3]), ValueError, r"rollout\.log_probs"
    yield "1-d log-probs", tampered(ro, log_probs=ro.log_probs[0]), ValueError, r"rollout\.log_probs"
    yield "batch of states", tampered(ro, states={"latents": lat[:3]}), ValueError, r"rollout\.states\.latents"
    yield "prompts", tampered(ro, prompts=ro.prompts[:3]), ValueError, r"rollout"
    yield "group ids", tampered(ro, group_ids=ro.group_ids[:2]), ValueError, r"rollout"
    yield "steps past the walk", tampered(ro, step_indices=ro.step_indices + 10), ValueError, r"rollout\.step_indices"
    yield "steps not consecutive", tampered(ro, step_indices=ro.step_indices.flip(1)), ValueError, \
        r"rollout\.step_indices"
    yield "float steps", tampered(ro, step_indices=ro.step_indices.float()), ValueError, r"rollout\.step_indices"
    yield "sigmas", tampered(ro, sigmas=ro.sigmas * 0.5), ValueError, r"rollout\.sigmas"
    yield "forward batch", tampered(ro, forward_batch=ro.forward_batch[:2]), ValueError, r"rollout\.forward_batch"
    yield "forward batch 0", tampered(ro, forward_batch=ro.forward_batch * 0), ValueError, r"rollout\.forward_batch"
    yield "sampler", tampered(ro, sampler={"kind": "sde"}), TypeError, r"rollout\.sampler"
    yield "steps window", (ro, {"steps": [ro.window]}), ValueError, "steps"
    yield "steps type", (ro, {"steps": "0"}), TypeError, "steps"
    yield "steps empty", (ro, {"steps": []}), ValueError, "steps"
    yield "steps float", (ro, {"steps": [0.5]}), TypeError, "steps"
    yield "micro_batch 0", (ro, {"micro_batch": 0}), ValueError, "micro_batch"
    yield "micro_batch str", (ro, {"micro_batch": "2"}), TypeError, "micro_batch"
    yield "grad", (ro, {"grad": "yes"}), TypeError, "grad"
    yield "exact", (ro, {"exact": 1}), TypeError, "exact"


@pytest.mark.parametrize("case", range(26))
def test_log_prob_refuses_a_rollout_that_does_not_fit_before_any_forward(pipe, ro, no_forward, case):
    name, value, error, where = list(_cases(ro))[case]
    arg, kwargs = value if isinstance(value, tuple) else (value, {})
    with pytest.raises(error, match=rf"^{where}(\.\w+)*: ") as info:
        pipe.log_prob(arg, **kwargs)
    assert not isinstance(info.value, ForwardRan), name


def test_log_prob_refuses_a_rollout_of_another_schedule(ro):
    other = omnispec.build(SPECS / "digits.yaml", overrides=[*OVERRIDES, "recipe.phases.0.schedule.shift=3.0"])
    with pytest.raises(SpecError, match=r"rollout\.sigmas: .*another schedule"):
        other.log_prob(ro)


def test_an_intact_rollout_still_replays(pipe, ro):
    replay = pipe.log_prob(ro, steps=[0, 2], grad=False, micro_batch=3)
    ratio = (replay.log_probs.cpu() - ro.log_probs[:, [0, 2]]).exp()
    assert (ratio - 1).abs().max().item() <= 1e-6
