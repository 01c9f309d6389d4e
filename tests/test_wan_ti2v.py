"""Wan2.2 TI2V-5B (family ``wan_ti2v``): text-to-video and image-to-video from one checkpoint, equal to diffusers'
WanPipeline / WanImageToVideoPipeline with ``expand_timesteps`` on the same tiny checkpoint and seeds; the checkpoint
check tells it from Wan2.1/2.2's other models; rollouts replay exactly."""

import sys

import numpy as np
import pytest
import torch
from PIL import Image

import omnispec
from omnispec.spec import SpecError
from omnispec.testing import TINY_OVERRIDES

import preloaded
from conftest import ROOT, SPECS, reference

TOL = 1e-4
OVERRIDES = [*TINY_OVERRIDES["wan"], "recipe.defaults.width=64"]
CALL = dict(height=32, width=64, num_frames=5, num_inference_steps=4, max_sequence_length=16, output_type="np",
            guidance_scale=5.0)
@pytest.fixture(scope="module")
def picture():
    return Image.fromarray((np.random.RandomState(0).rand(40, 72, 3) * 255).astype(np.uint8))



def gen(*seeds):
    return [torch.Generator("cpu").manual_seed(s) for s in seeds]


def test_text_to_video_equals_diffusers(wan_ti2v_dir):
    from diffusers import WanPipeline

    pipe = omnispec.build(SPECS / "wan2.2-ti2v-5b.yaml", source=str(wan_ti2v_dir), overrides=OVERRIDES)
    ours = pipe(["a cat", "a red car in the snow"], seed=[0, 1], negative_prompt="blurry")
    ref = reference(WanPipeline, wan_ti2v_dir)(["a cat", "a red car in the snow"], negative_prompt=["blurry"] * 2,
                                               generator=gen(0, 1), **CALL).frames
    assert ours.array.shape == (2, 5, 32, 64, 3)
    assert np.abs(ours.array - ref).max() <= TOL


def test_image_to_video_equals_diffusers(wan_ti2v_dir, picture):
    """The image (40x72, resized to the request's 32x64 as diffusers resizes it) is the first latent frame."""
    from diffusers import WanImageToVideoPipeline

    pipe = omnispec.build(SPECS / "wan2.2-ti2v-5b-i2v.yaml", source=str(wan_ti2v_dir), overrides=OVERRIDES)
    ours = pipe("a cat", seed=3, image=picture, negative_prompt="blurry", height=32, width=64)
    ref = reference(WanImageToVideoPipeline, wan_ti2v_dir)(image=picture, prompt="a cat", negative_prompt="blurry",
                                                           generator=gen(3), **CALL).frames
    assert np.abs(ours.array - ref).max() <= TOL
    t2v = omnispec.build(SPECS / "wan2.2-ti2v-5b.yaml", source=str(wan_ti2v_dir), overrides=OVERRIDES)
    assert np.abs(t2v("a cat", seed=3, negative_prompt="blurry").array - ours.array).max() > 1e-3  # the image acts


def test_image_to_video_through_the_cli(wan_ti2v_dir, picture, tmp_path):
    image, out = tmp_path / "first.png", tmp_path / "cat.mp4"
    picture.save(image)
    done = preloaded.python_m([sys.executable, "-m", "omnispec", "run", str(SPECS / "wan2.2-ti2v-5b-i2v.yaml"),
                               "--source", str(wan_ti2v_dir), *[a for o in OVERRIDES for a in ("--set", o)],
                               "--prompt", "a cat", "--image", str(image), "--seed", "3", "--output", str(out), "-q"],
                              capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert omnispec.records.read(out).spec["model"]["family"] == "wan_ti2v"


def test_the_checkpoint_check_tells_ti2v_from_the_other_wan_models(wan_ti2v_dir, wan_dir):
    """A Wan2.1 spec (one timestep per sample) on the TI2V checkpoint would run, wrongly: refused by the
    checkpoint's expand_timesteps; and the TI2V spec on a Wan2.1 checkpoint likewise."""
    with pytest.raises(SpecError, match="expand_timesteps: true, which family 'wan' does not run"):
        omnispec.build(SPECS / "wan2.1-t2v-1.3b.yaml", source=str(wan_ti2v_dir), overrides=TINY_OVERRIDES["wan"])
    with pytest.raises(SpecError, match="expand_timesteps: false, which family 'wan_ti2v' does not run"):
        omnispec.build(SPECS / "wan2.2-ti2v-5b.yaml", source=str(wan_dir), overrides=OVERRIDES)


@pytest.mark.parametrize("spec", ["wan2.2-ti2v-5b", "wan2.2-ti2v-5b-i2v"])
def test_rollouts_replay_exactly(wan_ti2v_dir, picture, spec):
    """SDE rollouts on the checkpoint's UniPC sigmas (Euler steps: UniPC is multistep) replay with ratio 1; for
    image-to-video the first frame is put back after every step in rollout and replay alike."""
    pipe = omnispec.build(SPECS / f"{spec}.yaml", source=str(wan_ti2v_dir), overrides=OVERRIDES)
    image = {"image": picture} if spec.endswith("i2v") else {}
    ro = pipe.rollout("a cat", group_size=2, seed=5, sampler={"kind": "sde", "multistep": "euler"}, **image)
    replay = pipe.log_prob(ro, grad=False)
    assert torch.equal(replay.log_probs.cpu(), ro.log_probs)
    assert ((replay.log_probs.cpu() - ro.log_probs).exp() - 1).abs().max().item() == 0.0
