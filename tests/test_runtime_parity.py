"""omnispec's output equals the diffusers pipeline's on the same tiny checkpoint, prompt and seed."""

import numpy as np
import torch

import omnispec
from omnispec.testing import TINY_OVERRIDES

from conftest import SPECS, reference

TOL = 1e-4



def gen(seed):
    return torch.Generator("cpu").manual_seed(seed)


def test_flux_dev_matches_diffusers(flux_dir):
    from diffusers import FluxPipeline

    pipe = omnispec.build(SPECS / "flux1-dev.yaml", source=str(flux_dir), overrides=TINY_OVERRIDES["flux"])
    ours = pipe("a photo of a cat", seed=7, guidance_scale=4.0)
    ref = reference(FluxPipeline, flux_dir)("a photo of a cat", height=32, width=32, num_inference_steps=3,
                                             guidance_scale=4.0, max_sequence_length=16, generator=gen(7),
                                             output_type="np").images
    assert np.abs(ours.array - ref).max() <= TOL


def test_flux_true_cfg_matches_diffusers(flux_dir):
    from diffusers import FluxPipeline

    pipe = omnispec.build(SPECS / "flux1-dev.yaml", source=str(flux_dir),
                          overrides=[*TINY_OVERRIDES["flux"], "recipe.phases.0.guidance.terms=[{kind: true_cfg, scale: 2.5}]"])
    ours = pipe("a photo of a cat", seed=1, negative_prompt="blurry")
    ref = reference(FluxPipeline, flux_dir)("a photo of a cat", negative_prompt="blurry", true_cfg_scale=2.5,
                                             height=32, width=32, num_inference_steps=3, guidance_scale=3.5,
                                             max_sequence_length=16, generator=gen(1), output_type="np").images
    assert np.abs(ours.array - ref).max() <= TOL


def test_request_sigmas_match_diffusers_sigmas_on_a_flow_match_and_a_scheduler_schedule(flux_dir, sd3_dir):
    """A request's ``sigmas`` are diffusers' ``sigmas=``: the walk starts from them and shifts them as its schedule
    says (FLUX: omnispec's flow_match with dynamic shift; SD3: the checkpoint's scheduler component)."""
    from diffusers import FluxPipeline, StableDiffusion3Pipeline

    sigmas = [1.0, 0.8, 0.45, 0.2]
    flux = omnispec.build(SPECS / "flux1-dev.yaml", source=str(flux_dir), overrides=TINY_OVERRIDES["flux"])
    ours = flux("a photo of a cat", seed=7, sigmas=sigmas)
    ref = reference(FluxPipeline, flux_dir)("a photo of a cat", height=32, width=32, sigmas=sigmas,
                                             num_inference_steps=len(sigmas), max_sequence_length=16,
                                             generator=gen(7), output_type="np").images
    assert np.abs(ours.array - ref).max() <= TOL
    assert np.abs(ours.array - flux("a photo of a cat", seed=7, steps=4).array).max() > 1e-3  # the sigmas count

    sd3 = omnispec.build(SPECS / "sd3.5-medium.yaml", source=str(sd3_dir), overrides=TINY_OVERRIDES["sd3"])
    ours = sd3("a painting of a dog", seed=3, negative_prompt="blurry", sigmas=sigmas)
    ref = reference(StableDiffusion3Pipeline, sd3_dir)(
        "a painting of a dog", negative_prompt="blurry", height=32, width=32, sigmas=sigmas,
        num_inference_steps=len(sigmas), guidance_scale=4.5, max_sequence_length=16, generator=gen(3),
        output_type="np", skip_guidance_layers=None).images
    assert np.abs(ours.array - ref).max() <= TOL
    assert np.abs(ours.array - sd3("a painting of a dog", seed=3, negative_prompt="blurry", steps=4).array).max() > 1e-3


def test_sd3_cfg_and_skip_layer_guidance_match_diffusers(sd3_dir):
    from diffusers import StableDiffusion3Pipeline

    pipe = omnispec.build(SPECS / "sd3.5-medium.yaml", source=str(sd3_dir), overrides=[
        *TINY_OVERRIDES["sd3"], "recipe.defaults.steps=5", "recipe.phases.0.guidance.terms.1.scale=2.8",
        "recipe.phases.0.guidance.terms.1.layers=[1, 2]", "recipe.phases.0.guidance.terms.1.window.end=0.8"])
    ours = pipe("a painting of a dog", seed=3, negative_prompt="blurry")
    # diffusers' SLG window is i > n*start and i < n*stop: steps 1..3 of 5, as omnispec's [0.01, 0.8).
    ref = reference(StableDiffusion3Pipeline, sd3_dir)(
        "a painting of a dog", negative_prompt="blurry", height=32, width=32, num_inference_steps=5, guidance_scale=4.5,
        max_sequence_length=16, generator=gen(3), output_type="np", skip_guidance_layers=[1, 2],
        skip_layer_guidance_scale=2.8, skip_layer_guidance_start=0.01, skip_layer_guidance_stop=0.8).images
    assert np.abs(ours.array - ref).max() <= TOL


def test_wan21_matches_diffusers_with_unipc(wan_dir):
    from diffusers import WanPipeline

    pipe = omnispec.build(SPECS / "wan2.1-t2v-1.3b.yaml", source=str(wan_dir), overrides=TINY_OVERRIDES["wan"])
    ours = pipe("a red car in the snow", seed=5, negative_prompt="low quality")
    assert type(pipe.components["scheduler"]).__name__ == "UniPCMultistepScheduler"
    ref = reference(WanPipeline, wan_dir)("a red car in the snow", negative_prompt="low quality", height=32, width=32,
                                          num_frames=5, num_inference_steps=4, guidance_scale=5.0,
                                          max_sequence_length=16, generator=gen(5), output_type="np").frames
    assert ours.array.shape == ref.shape == (1, 5, 32, 32, 3)
    assert np.abs(ours.array - ref).max() <= TOL


def test_wan22_two_experts_match_diffusers(wan22_dir):
    from diffusers import WanPipeline

    pipe = omnispec.build(SPECS / "wan2.2-t2v-a14b.yaml", source=str(wan22_dir),
                          overrides=[*TINY_OVERRIDES["wan"], "recipe.defaults.steps=8"])
    ours = pipe("a red car in the snow", seed=2)
    ref = reference(WanPipeline, wan22_dir)("a red car in the snow", height=32, width=32, num_frames=5,
                                            num_inference_steps=8, guidance_scale=4.0, guidance_scale_2=3.0,
                                            max_sequence_length=16, generator=gen(2), output_type="np").frames
    assert np.abs(ours.array - ref).max() <= TOL


def test_wan22_switches_to_transformer_2_at_boundary(wan22_dir):
    pipe = omnispec.build(SPECS / "wan2.2-t2v-a14b.yaml", source=str(wan22_dir),
                          overrides=[*TINY_OVERRIDES["wan"], "recipe.defaults.steps=8"])
    calls = []
    for name in ("transformer", "transformer_2"):
        pipe.components[name].register_forward_pre_hook(lambda m, a, kw, n=name: calls.append((n, float(kw["timestep"][0]))),
                                                        with_kwargs=True)
    pipe("a cat", seed=0)
    assert [n for n, _ in calls][:2] == ["transformer"] * 2
    assert all((n == "transformer") == (t >= 875) for n, t in calls)
    assert {n for n, _ in calls} == {"transformer", "transformer_2"}
