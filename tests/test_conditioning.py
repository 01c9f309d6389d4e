"""Image conditioning: image-to-image, editing and image-to-video equal their diffusers pipelines on the same tiny
checkpoint, image and seed; requests carry images from Python and the CLI and are checked against the task."""

import numpy as np
import pytest
import torch
from PIL import Image

import omnispec
from omnispec.cli import main
from omnispec.spec import SpecError
from omnispec.testing import TINY_OVERRIDES

from conftest import SPECS, reference

TOL = 1e-4
KONTEXT = [*TINY_OVERRIDES["flux"], "recipe.defaults.height=48", "model.options={max_area: 1536, auto_resize: false}"]



def gen(seed):
    return torch.Generator("cpu").manual_seed(seed)


@pytest.mark.parametrize("strength", [0.6, 1.0])
def test_flux_img2img_matches_diffusers(flux_dir, photo, strength):
    from diffusers import FluxImg2ImgPipeline

    pipe = omnispec.build(SPECS / "flux1-dev-img2img.yaml", source=str(flux_dir),
                          overrides=[*TINY_OVERRIDES["flux"], "recipe.defaults.steps=5"])
    image = Image.open(photo)
    ours = pipe("a cat", seed=3, image=image, strength=strength)
    ref = reference(FluxImg2ImgPipeline, flux_dir)(
        image=image, prompt="a cat", strength=strength, height=32, width=32, num_inference_steps=5,
        guidance_scale=7.0, max_sequence_length=16, generator=gen(3), output_type="np").images
    assert np.abs(ours.array - ref).max() <= TOL


def test_flux_kontext_edit_matches_diffusers(flux_dir, photo):
    from diffusers import FluxKontextPipeline

    pipe = omnispec.build(SPECS / "flux1-kontext-dev.yaml", source=str(flux_dir), overrides=KONTEXT)
    image = Image.open(photo)
    ours = pipe("make it blue", seed=4, image=image)
    ref = reference(FluxKontextPipeline, flux_dir)(
        image=image, prompt="make it blue", height=48, width=32, num_inference_steps=3, guidance_scale=2.5,
        max_sequence_length=16, max_area=1536, _auto_resize=False, generator=gen(4), output_type="np").images
    assert ours.array.shape == ref.shape == (1, 48, 32, 3)
    assert np.abs(ours.array - ref).max() <= TOL


def test_a_kontext_reference_larger_than_max_area_is_fitted_with_a_warning(flux_dir, caplog):
    """Its tokens join every forward: a reference past max_area is shrunk to it (aspect kept), as if the user had
    resized it first."""
    pipe = omnispec.build(SPECS / "flux1-kontext-dev.yaml", source=str(flux_dir), overrides=KONTEXT)
    big = Image.fromarray((np.random.RandomState(1).rand(64, 64, 3) * 255).astype(np.uint8))
    with caplog.at_level("WARNING", logger="omnispec"):
        ours = pipe("make it blue", seed=4, image=big)
    assert any("larger than max_area" in r.getMessage() for r in caplog.records)
    helper = pipe.family.helper
    multiple = helper.vae_scale_factor * 2
    side = int(64 * (1536 / 64**2) ** 0.5) // multiple * multiple  # 39 pixels, floored to the packing multiple
    fitted = helper.image_processor.resize(big, side, side)
    assert np.array_equal(ours.array, pipe("make it blue", seed=4, image=fitted).array)


def test_wan21_i2v_with_clip_image_tokens_matches_diffusers(wan_i2v_dir, photo):
    from diffusers import WanImageToVideoPipeline

    pipe = omnispec.build(SPECS / "wan2.1-i2v-14b-480p.yaml", source=str(wan_i2v_dir),
                          overrides=TINY_OVERRIDES["wan_i2v"])
    image = Image.open(photo)
    ours = pipe("a cat", seed=5, image=image, negative_prompt="blurry")
    ref = reference(WanImageToVideoPipeline, wan_i2v_dir)(
        image=image, prompt="a cat", negative_prompt="blurry", height=32, width=32, num_frames=5,
        num_inference_steps=4, guidance_scale=5.0, max_sequence_length=512, generator=gen(5), output_type="np").frames
    assert np.abs(ours.array - ref).max() <= TOL


def test_wan22_i2v_two_experts_match_diffusers(wan22_i2v_dir, photo):
    from diffusers import WanImageToVideoPipeline

    pipe = omnispec.build(SPECS / "wan2.2-i2v-a14b.yaml", source=str(wan22_i2v_dir),
                          overrides=[*TINY_OVERRIDES["wan22_i2v"], "recipe.defaults.steps=8"])
    image = Image.open(photo)
    ours = pipe("a cat", seed=6, image=image)
    ref = reference(WanImageToVideoPipeline, wan22_i2v_dir)(
        image=image, prompt="a cat", height=32, width=32, num_frames=5, num_inference_steps=8, guidance_scale=3.5,
        max_sequence_length=16, generator=gen(6), output_type="np").frames
    assert np.abs(ours.array - ref).max() <= TOL


CLI_CASES = {
    "flux1-dev-img2img.yaml": ("flux_dir", TINY_OVERRIDES["flux"], (1, 32, 32, 3)),
    "flux1-kontext-dev.yaml": ("flux_dir", KONTEXT, (1, 48, 32, 3)),
    "wan2.1-i2v-14b-480p.yaml": ("wan_i2v_dir", TINY_OVERRIDES["wan_i2v"], (1, 5, 32, 32, 3)),
    "wan2.2-i2v-a14b.yaml": ("wan22_i2v_dir", TINY_OVERRIDES["wan22_i2v"], (1, 5, 32, 32, 3)),
}


@pytest.mark.parametrize("spec", list(CLI_CASES))
def test_cli_runs_each_conditioned_spec_from_an_image_file(spec, photo, tmp_path, request, capsys):
    fixture, overrides, shape = CLI_CASES[spec]
    source = request.getfixturevalue(fixture)
    sets = [x for o in [*overrides, "recipe.defaults.steps=2"] for x in ("--set", o)]
    out = tmp_path / "out.npy"
    code = main(["run", str(SPECS / spec), "--source", str(source), "--image", str(photo), "--prompt", "a cat",
                 *sets, "--output", str(out)])
    assert code == 0, capsys.readouterr().err
    assert np.load(out).shape == shape


def test_image_tasks_need_an_image_and_text_tasks_refuse_one(flux_dir, photo, capsys):
    sets = [x for o in TINY_OVERRIDES["flux"] for x in ("--set", o)]
    assert main(["run", str(SPECS / "flux1-kontext-dev.yaml"), "--source", str(flux_dir), *sets, "--prompt", "x",
                 "--output", "unused.png"]) == 2
    assert "needs an image" in capsys.readouterr().err
    assert main(["run", str(SPECS / "flux1-dev.yaml"), "--source", str(flux_dir), *sets, "--prompt", "x",
                 "--image", str(photo), "--output", "unused.png"]) == 2
    assert "takes no image" in capsys.readouterr().err


def test_strength_is_refused_by_recipes_that_start_from_noise():
    spec = omnispec.load_spec(SPECS / "flux1-dev.yaml")
    with pytest.raises(SpecError, match="request.strength: .* starts from noise"):
        omnispec.spec.request.resolve_request(spec, "x", strength=0.5)


def test_images_arrive_as_pil_numpy_tensor_or_path_with_one_digest(photo):
    spec = omnispec.load_spec(SPECS / "flux1-kontext-dev.yaml")
    resolve = omnispec.spec.request.resolve_request
    image = Image.open(photo).convert("RGB")
    pixels = np.asarray(image)
    digests = {resolve(spec, "x", image=form).images[0].digest for form in (image, photo, str(photo), pixels)}
    assert len(digests) == 1
    tensor = resolve(spec, "x", image=torch.from_numpy(pixels.copy()).permute(2, 0, 1).float() / 255)
    assert tensor.images[0].digest and resolve(spec, "x", image=pixels[::-1]).images[0].digest not in digests
    with pytest.raises(SpecError, match="no such image file"):
        resolve(spec, "x", image="/nonexistent.png")
    with pytest.raises(SpecError, match="either image"):
        resolve(spec, "x", image=image, conditions=[{"image": image, "frame": 0}])


def test_video_conditions_name_frames_inside_the_video():
    spec = omnispec.load_spec(SPECS / "wan2.2-i2v-a14b.yaml")
    image = np.zeros((8, 8, 3), np.uint8)
    req = omnispec.spec.request.resolve_request(spec, "x", conditions=[{"image": image, "frame": 0},
                                                                       {"image": image, "frame": -1}])
    assert [c.frame for c in req.images] == [0, -1]
    with pytest.raises(SpecError, match="frame 81 is outside the 81-frame video"):
        omnispec.spec.request.resolve_request(spec, "x", conditions=[{"image": image, "frame": 81}])


def test_prompt_encoding_cache_is_keyed_by_the_images(flux_dir, photo):
    pipe = omnispec.build(SPECS / "flux1-kontext-dev.yaml", source=str(flux_dir), overrides=KONTEXT)
    image = Image.open(photo).convert("RGB")
    flipped = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    for im in (image, flipped, image):
        pipe("a cat", seed=0, steps=1, image=im)
    assert len(pipe._encodings) == 2


def test_family_refuses_more_images_than_it_takes(flux_dir, photo):
    pipe = omnispec.build(SPECS / "flux1-kontext-dev.yaml", source=str(flux_dir), overrides=KONTEXT)
    with pytest.raises(SpecError, match="at most 1 image"):
        pipe("x", conditions=[{"image": photo, "frame": 0}, {"image": photo, "frame": 0}])
