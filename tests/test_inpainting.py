"""Inpainting with a mask (tasks ``inpainting``): FLUX.1 Fill (family ``flux_fill``) and Qwen-Image inpaint
(``qwen_image_inpaint``) equal to diffusers' FluxFillPipeline / QwenImageInpaintPipeline on the same tiny
checkpoints, inputs and seeds (one diffusers call per seed: diffusers draws a batch's image posteriors from its
first generator); the mask's rules (white repaints, size of the image, modes) as one clear error each; the mask in
the record, the replay and the encoding-cache key; rollouts replay exactly."""

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
# without a size the output takes the image's (32x64 here)
FILL = [o for o in TINY_OVERRIDES["flux"] if ".height" not in o and ".width" not in o]
QWEN = [o for o in TINY_OVERRIDES["qwen_image"] if ".height" not in o and ".width" not in o]


def gen(seed):
    return torch.Generator("cpu").manual_seed(seed)


@pytest.fixture(scope="module")
def picture():
    return Image.fromarray((np.random.RandomState(3).rand(32, 64, 3) * 255).astype(np.uint8))


@pytest.fixture(scope="module")
def mask():
    """Repaint the right half and a grey band around 0.5 (the binarisation threshold) in the middle."""
    values = np.zeros((32, 64), np.uint8)
    values[:, 32:] = 255
    values[8:24, 24:40] = np.linspace(100, 160, 16).astype(np.uint8)[None, :]
    return Image.fromarray(values, "L")




# spec -> (checkpoint fixture, overrides, diffusers pipeline, its guidance arguments): each spec's own defaults
PARITY = {
    "flux1-fill-dev": ("flux_fill_dir", FILL, "FluxFillPipeline", dict(guidance_scale=30.0, max_sequence_length=16)),
    "qwen-image-inpaint": ("qwen_image_dir", QWEN, "QwenImageInpaintPipeline",
                           dict(negative_prompt=" ", true_cfg_scale=4.0, max_sequence_length=512)),
}


@pytest.mark.parametrize("spec,strength", [("flux1-fill-dev", 1.0), ("flux1-fill-dev", 0.7),
                                           ("qwen-image-inpaint", 0.6), ("qwen-image-inpaint", 1.0)])
def test_inpainting_equals_diffusers(request, picture, mask, spec, strength):
    """Two prompts batched here against one diffusers call per seed."""
    fixture, overrides, pipeline, guidance = PARITY[spec]
    root = request.getfixturevalue(fixture)
    pipe = omnispec.build(SPECS / f"{spec}.yaml", source=str(root), overrides=overrides)
    prompts = ["a red door", "a blue sky"]
    ours = pipe(prompts, seed=[0, 1], image=picture, mask=mask, strength=strength, height=32, width=64)
    ref = reference(pipeline, root)
    for i, (prompt, seed) in enumerate(zip(prompts, (0, 1))):
        theirs = ref(prompt=prompt, image=picture, mask_image=mask, height=32, width=64, strength=strength,
                     num_inference_steps=3, generator=gen(seed), output_type="np", **guidance).images[0]
        assert np.abs(ours.array[i] - theirs).max() <= TOL


def test_a_blurred_mask_equals_diffusers_blur_then_fill(flux_fill_dir, picture, mask):
    """``mask_blur`` is diffusers' own ``mask_processor.blur`` applied before the call, as its docs do by hand."""
    pipe = omnispec.build(SPECS / "flux1-fill-dev.yaml", source=str(flux_fill_dir), overrides=FILL)
    ours = pipe("a red door", seed=4, image=picture, mask=mask, mask_blur=6).array[0]
    ref = reference("FluxFillPipeline", flux_fill_dir)
    blurred = ref.mask_processor.blur(mask, blur_factor=6)
    theirs = ref(prompt="a red door", image=picture, mask_image=blurred, height=32, width=64, num_inference_steps=3,
                 guidance_scale=30.0, max_sequence_length=16, generator=gen(4), output_type="np").images[0]
    assert np.abs(ours - theirs).max() <= TOL
    plain = pipe("a red door", seed=4, image=picture, mask=mask).array[0]
    assert np.abs(plain - ours).max() > 1e-4  # the blur moved the binarised edge


def test_mask_rules_are_one_clear_error_each(flux_fill_dir, flux_dir, picture, mask, tmp_path):
    fill = omnispec.build(SPECS / "flux1-fill-dev.yaml", source=str(flux_fill_dir), overrides=FILL)
    cases = [
        (dict(image=picture), "needs a mask"),
        (dict(image=picture, mask=mask.resize((32, 16))), "the mask is 32x16 and the image 64x32"),
        (dict(image=picture, mask=Image.new("LA", (64, 32))), "the mask has transparency"),
        (dict(image=picture, mask=np.zeros((32, 64, 3), np.float32)), "a mask array is"),
        (dict(image=picture, mask=np.full((32, 64), 1.5, np.float32)), r"values lie in \[0, 1\]"),
        (dict(image=picture, mask=torch.zeros(3, 32, 64)), "a mask tensor is"),
        (dict(image=picture, mask=np.zeros((32, 64), np.float32), mask_blur=4),
         "blur a float array or tensor yourself"),
        (dict(image=picture, mask=str(tmp_path / "missing.png")), "missing.png"),
        (dict(mask=mask), "needs an image"),
        (dict(image=picture, mask=[mask]), "a mask is a PIL image, a numpy array, a torch tensor or a path, got list"),
        (dict(image=picture, mask=""), "an empty path where a mask file was expected"),
    ]
    for fields, message in cases:
        with pytest.raises(SpecError, match=message):
            fill("x", seed=0, **fields)
    plain = omnispec.build(SPECS / "flux1-dev-img2img.yaml", source=str(flux_dir), overrides=FILL)
    with pytest.raises(SpecError, match="takes no mask"):
        plain("x", seed=0, image=picture, mask=mask)
    with pytest.raises(SpecError, match="mask_blur blurs a mask, and the request has none"):
        plain("x", seed=0, image=picture, mask_blur=3)
    # arrays and tensors of one channel are masks too, and mean the same as the picture
    as_array = fill("x", seed=0, image=picture, mask=np.asarray(mask, np.float32) / 255).array
    as_tensor = fill("x", seed=0, image=picture, mask=torch.from_numpy(np.asarray(mask, np.float32) / 255)).array
    as_picture = fill("x", seed=0, image=picture, mask=mask).array
    assert np.abs(as_array - as_tensor).max() == 0 and np.abs(as_array - as_picture).max() <= TOL


def test_the_mask_is_in_the_encoding_key_the_record_and_the_replay(flux_fill_dir, picture, mask, tmp_path):
    from omnispec.spec import load_spec
    from omnispec.spec.request import resolve_request

    spec = load_spec(SPECS / "flux1-fill-dev.yaml", FILL)
    keys = {resolve_request(spec, "x", 0, image=picture, mask=m, mask_blur=b).condition_digests
            for m, b in ((mask, None), (mask.transpose(Image.Transpose.FLIP_LEFT_RIGHT), None), (mask, 2))}
    assert len(keys) == 3
    image, held, out = tmp_path / "photo.png", tmp_path / "mask.png", tmp_path / "filled.png"
    picture.save(image)
    mask.save(held)
    sets = [a for o in FILL for a in ("--set", o)]
    run = [sys.executable, "-m", "omnispec", "run"]
    done = preloaded.python_m([*run, str(SPECS / "flux1-fill-dev.yaml"), "--source", str(flux_fill_dir), *sets,
                               "--prompt", "a red door", "--image", str(image), "--mask", str(held), "--mask-blur", "2",
                               "--seed", "3", "--output", str(out), "-q"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    record = omnispec.records.read(out)
    assert record.request.mask.path == str(held.resolve()) and record.request.mask_blur == 2
    assert record.request.mask.digest == resolve_request(spec, "x", 0, image=picture, mask=str(held)).mask.digest
    from omnispec.replaying import request_arguments

    assert request_arguments(record, spec)[2]["mask"] == str(held.resolve())
    assert "mask" not in request_arguments(record, spec, mask=False)[2]  # the caller gives another
    again = tmp_path / "again.png"
    done = preloaded.python_m([*run, "--from", str(out), "--output", str(again), "-q"], capture_output=True, text=True,
                              cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert np.array_equal(np.asarray(Image.open(out)), np.asarray(Image.open(again)))
    mask.transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(held)  # the mask file changed since
    done = preloaded.python_m([*run, "--from", str(out), "--output", str(tmp_path / "x.png"), "-q"],
                              capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and "error: request.mask" in done.stderr and "has changed since" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("spec", ["flux1-fill-dev", "qwen-image-inpaint"])
def test_rollouts_replay_exactly(flux_fill_dir, qwen_image_dir, picture, mask, spec):
    """Replay conditions the walk without starting it: the masked image's posterior (FLUX Fill) and the start's
    clean latents and noise (Qwen-Image's keep-unmasked blend) are drawn again from the seeds, equal bit for bit."""
    root, overrides = (flux_fill_dir, FILL) if spec == "flux1-fill-dev" else (qwen_image_dir, QWEN)
    pipe = omnispec.build(SPECS / f"{spec}.yaml", source=str(root), overrides=overrides)
    ro = pipe.rollout(["a red door", "a cat"], group_size=2, seed=5, sampler={"kind": "sde"}, image=picture,
                      mask=mask, strength=1.0)
    replay = pipe.log_prob(ro, grad=False)
    assert torch.equal(replay.log_probs.cpu(), ro.log_probs)
    # another micro-batch: exact on the GPU in bf16 (BENCHMARKS.md), within CPU GEMM blocking noise here
    ratio = (pipe.log_prob(ro, grad=False, micro_batch=1).log_probs.cpu() - ro.log_probs).exp()
    assert (ratio - 1).abs().max().item() <= 1e-5


def test_a_later_walk_replays_exactly(qwen_image_dir, picture, mask):
    """A second walk starts from the first's latents re-noised: its first state gets the kept region at the start
    (as every later state does), so replay, which sets it on every stored state, scores the same first step."""
    phase = ("{name: %s, denoiser: transformer, input: %s, schedule: {kind: flow_match, shift: %s}, "
             "guidance: {terms: [{kind: true_cfg, scale: 4.0}], renorm: {over: token}}}")
    phases = (f"recipe.phases=[{phase % ('generate', '{kind: image}', 'from_checkpoint')}, "
              f"{phase % ('refine', '{kind: previous, renoise: 0.8}', '1.0')}]")
    pipe = omnispec.build(SPECS / "qwen-image-inpaint.yaml", source=str(qwen_image_dir), overrides=[*QWEN, phases])
    ro = pipe.rollout(["a red door"], group_size=2, seed=5, image=picture, mask=mask, strength=0.9,
                      sampler={"kind": "sde", "window": {"kind": "fixed", "start": 4, "length": 1}})
    assert ro.step_indices.tolist() == [[4], [4]]  # the window is the second walk's first step
    assert torch.equal(pipe.log_prob(ro, grad=False).log_probs.cpu(), ro.log_probs)


def test_families_and_checkpoints_that_do_not_inpaint_are_refused_before_loading(flux_dir, flux_fill_dir, picture,
                                                                                 mask, tmp_path):
    from omnispec.spec import load_spec

    with pytest.raises(SpecError, match="family 'flux' does not inpaint"):
        omnispec.build(SPECS / "flux1-dev-img2img.yaml", source=str(flux_dir), overrides=[*FILL, "recipe.task=inpainting"])
    with pytest.raises(SpecError, match="family 'flux_fill' runs the task inpainting only"):
        omnispec.build(SPECS / "flux1-fill-dev.yaml", source=str(flux_fill_dir),
                       overrides=[*FILL, "recipe.task=image-to-image"])
    with pytest.raises(SpecError, match="names 'FluxPipeline', not FluxFillPipeline"):
        omnispec.build(SPECS / "flux1-fill-dev.yaml", source=str(flux_dir), overrides=FILL)
    with pytest.raises(SpecError, match="the checkpoint is FLUX.1 Fill's"):
        omnispec.build(SPECS / "flux1-dev.yaml", source=str(flux_fill_dir), overrides=FILL)
    trns = tmp_path / "trns.png"
    mask.save(trns, transparency=0)  # a tRNS colour: transparency without an alpha channel
    from omnispec.spec.request import resolve_request

    with pytest.raises(SpecError, match="the mask has transparency"):
        resolve_request(load_spec(SPECS / "flux1-fill-dev.yaml", FILL), "x", 0, image=picture, mask=str(trns))


def test_policies_run_or_are_refused_with_the_reason(flux_fill_dir, qwen_image_dir, picture, mask):
    """Each family with its caches, quantization, offload and skip-layer guidance: they run, finite, the size of
    the plain output; what cannot run is refused before loading."""
    for spec, root, overrides in (("flux1-fill-dev", flux_fill_dir, FILL), ("qwen-image-inpaint", qwen_image_dir, QWEN)):
        plain = omnispec.build(SPECS / f"{spec}.yaml", source=str(root), overrides=overrides)
        base = plain("a cat", seed=0, image=picture, mask=mask).array
        for extra in (["policies.cache={kind: taylorseer}"], ["policies.cache={kind: first_block, threshold: 0.05}"],
                      ["policies.cache={kind: step_mask, mask: [true, false, true]}"],
                      ["policies.quantization={transformer: {method: int8_weight_only}}"],
                      ["policies.offload={strategy: layerwise}"], ["policies.vae={tiling: true}"]):
            out = omnispec.build(SPECS / f"{spec}.yaml", source=str(root), overrides=[*overrides, *extra])(
                "a cat", seed=0, image=picture, mask=mask).array
            assert out.shape == base.shape and np.isfinite(out).all(), (spec, extra)
