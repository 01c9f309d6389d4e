"""Wan VACE (family ``wan_vace``) for keyframes: images at frames of the video built into the control video and
mask as diffusers' VACE example builds them, equal to WanVACEPipeline on the same tiny checkpoint and seed (one call
per seed: the pipeline takes one prompt and one generator); conditioning scales; rollouts replay exactly."""

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
OVERRIDES = [*TINY_OVERRIDES["wan"], "recipe.defaults.frames=9"]


@pytest.fixture(scope="module")
def frames():
    return [Image.fromarray((np.random.RandomState(i).rand(24, 40, 3) * 255).astype(np.uint8)) for i in (1, 2)]



def example_video_and_mask(images_at: dict[int, Image.Image], height: int, width: int, frames: int):
    """diffusers' VACE docstring example (prepare_video_and_mask), for any frames."""
    video = [Image.new("RGB", (width, height), (128, 128, 128)) for _ in range(frames)]
    mask = [Image.new("L", (width, height), 255) for _ in range(frames)]
    for at, image in images_at.items():
        video[at] = image.resize((width, height))
        mask[at] = Image.new("L", (width, height), 0)
    return video, mask


@pytest.mark.parametrize("case", ["first-last", "middle", "scale"])
def test_keyframes_equal_diffusers(wan_vace_dir, frames, case):
    extra = ["model.options.conditioning_scale=0.5"] if case == "scale" else []
    pipe = omnispec.build(SPECS / "wan2.1-vace-1.3b.yaml", source=str(wan_vace_dir), overrides=[*OVERRIDES, *extra])
    placed = {0: frames[0], 8: frames[1]} if case != "middle" else {4: frames[0]}
    conditions = [{"image": image, "frame": at - 9 if at == 8 else at} for at, image in placed.items()]
    prompts = ["a bird takes off", "a boat at sea"]
    ours = pipe(prompts, seed=[3, 4], conditions=conditions, negative_prompt="blurry")
    ref = reference("WanVACEPipeline", wan_vace_dir)
    video, mask = example_video_and_mask(placed, 32, 32, 9)
    for i, (prompt, seed) in enumerate(zip(prompts, (3, 4))):
        theirs = ref(prompt=prompt, negative_prompt="blurry", video=video, mask=mask, height=32, width=32,
                     num_frames=9, num_inference_steps=4, guidance_scale=5.0, max_sequence_length=16,
                     conditioning_scale=0.5 if case == "scale" else 1.0,
                     generator=torch.Generator("cpu").manual_seed(seed), output_type="np").frames[0]
        assert ours.array[i].shape == theirs.shape
        assert np.abs(ours.array[i] - theirs).max() <= TOL


@pytest.mark.parametrize("case", ["references", "references-and-keyframes"])
def test_reference_images_equal_diffusers(wan_vace_dir, frames, case):
    """Two references of another aspect (fitted onto white canvases) prepend two latent frames, which the output
    drops; with keyframes the two combine."""
    spec = "wan2.1-vace-1.3b-r2v" if case == "references" else "wan2.1-vace-1.3b"
    pipe = omnispec.build(SPECS / f"{spec}.yaml", source=str(wan_vace_dir), overrides=OVERRIDES)
    placed = {} if case == "references" else {0: frames[0]}
    extra = {"conditions": [{"image": frames[0], "frame": 0}]} if placed else {}
    ours = pipe("a bird", seed=6, references=frames, negative_prompt="blurry", **extra)
    video, mask = example_video_and_mask(placed, 32, 32, 9) if placed else (None, None)
    theirs = reference("WanVACEPipeline", wan_vace_dir)(prompt="a bird", negative_prompt="blurry", video=video, mask=mask,
                                     reference_images=frames, height=32, width=32, num_frames=9, num_inference_steps=4,
                                     guidance_scale=5.0, max_sequence_length=16,
                                     generator=torch.Generator("cpu").manual_seed(6), output_type="np").frames[0]
    assert ours.array[0].shape == theirs.shape == (9, 32, 32, 3)
    assert np.abs(ours.array[0] - theirs).max() <= TOL
    alone = pipe("a bird", seed=6, negative_prompt="blurry", **extra) if placed else None
    assert alone is None or np.abs(alone.array - ours.array).max() > 1e-3  # the references act


def test_references_are_refused_by_families_without_them_and_recorded(flux_dir, wan_vace_dir, frames, tmp_path):
    with pytest.raises(SpecError, match="family 'flux' takes no reference image"):
        omnispec.build(SPECS / "flux1-dev.yaml", source=str(flux_dir), overrides=TINY_OVERRIDES["flux"])(
            "x", seed=0, references=frames[0])
    ref, out = tmp_path / "subject.png", tmp_path / "clip.npy"
    frames[1].save(ref)
    sets = [a for o in OVERRIDES for a in ("--set", o)]
    run = [sys.executable, "-m", "omnispec", "run"]
    done = preloaded.python_m([*run, str(SPECS / "wan2.1-vace-1.3b-r2v.yaml"), "--source", str(wan_vace_dir), *sets,
                               "--prompt", "a bird", "--reference", str(ref), "--output", str(out), "-q"],
                              capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    record = omnispec.records.read(out)
    assert [r.path for r in record.request.references] == [str(ref.resolve())]
    again = tmp_path / "again.npy"
    done = preloaded.python_m([*run, "--from", str(out), "--output", str(again), "-q"], capture_output=True, text=True,
                              cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert np.array_equal(np.load(out), np.load(again))
    frames[0].save(ref)  # the reference changed since
    done = preloaded.python_m([*run, "--from", str(out), "--output", str(tmp_path / "x.npy"), "-q"],
                              capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and "error: request.references.0" in done.stderr and "Traceback" not in done.stderr


def test_through_the_cli_and_refusals(wan_vace_dir, frames, tmp_path):
    first, out = tmp_path / "first.png", tmp_path / "clip.npy"
    frames[0].save(first)
    sets = [a for o in OVERRIDES for a in ("--set", o)]
    done = preloaded.python_m([sys.executable, "-m", "omnispec", "run", str(SPECS / "wan2.1-vace-1.3b.yaml"),
                               "--source", str(wan_vace_dir), *sets, "--prompt", "a bird", "--image", f"{first}@0",
                               "--image", f"{first}@-1", "--output", str(out), "-q"], capture_output=True, text=True,
                              cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert np.load(out).shape == (1, 9, 32, 32, 3)
    with pytest.raises(SpecError, match="conditioning_scale is a number"):
        omnispec.build(SPECS / "wan2.1-vace-1.3b.yaml", source=str(wan_vace_dir),
                       overrides=[*OVERRIDES, "model.options.conditioning_scale=high"])
    with pytest.raises(SpecError, match="not checked against the VACE hints"):
        omnispec.build(SPECS / "wan2.1-vace-1.3b.yaml", source=str(wan_vace_dir),
                       overrides=[*OVERRIDES, "policies.cache={kind: taylorseer}"])
    with pytest.raises(SpecError, match="no context-parallel plan"):
        omnispec.load_spec(SPECS / "wan2.1-vace-1.3b.yaml", ["policies.parallel.ulysses=2"])
        omnispec.build(SPECS / "wan2.1-vace-1.3b.yaml", source=str(wan_vace_dir),
                       overrides=[*OVERRIDES, "policies.parallel.ulysses=2"])


def test_rollouts_replay_exactly(wan_vace_dir, frames):
    pipe = omnispec.build(SPECS / "wan2.1-vace-1.3b.yaml", source=str(wan_vace_dir), overrides=OVERRIDES)
    ro = pipe.rollout("a bird", group_size=2, seed=5, sampler={"kind": "sde", "multistep": "euler"},
                      conditions=[{"image": frames[0], "frame": 0}, {"image": frames[1], "frame": -1}],
                      references=frames[1])
    assert torch.equal(pipe.log_prob(ro, grad=False).log_probs.cpu(), ro.log_probs)


# ---- video-to-video: a control video, with or without masks ---------------------------------------------------

@pytest.fixture(scope="module")
def clip():
    """A 9-frame 32x32 video and a random mask per frame."""
    video = [Image.fromarray((np.random.RandomState(20 + i).rand(32, 32, 3) * 255).astype(np.uint8)) for i in range(9)]
    masks = [Image.fromarray(((np.random.RandomState(40 + i).rand(32, 32) > 0.5) * 255).astype(np.uint8), "L")
             for i in range(9)]
    return video, masks


@pytest.mark.parametrize("case", ["control", "mask-per-frame", "one-mask", "mask-and-references"])
def test_video_equals_diffusers(wan_vace_dir, clip, frames, case):
    video, masks = clip
    mask = {"control": None, "one-mask": masks[0]}.get(case, masks)
    references = frames if case == "mask-and-references" else None
    pipe = omnispec.build(SPECS / "wan2.1-vace-1.3b-v2v.yaml", source=str(wan_vace_dir), overrides=OVERRIDES)
    ours = pipe(["a bird", "a boat"], seed=[3, 4], video=video, mask=mask, references=references,
                negative_prompt="blurry")
    theirs_mask = [mask] * 9 if case == "one-mask" else mask
    ref = reference("WanVACEPipeline", wan_vace_dir)
    for i, (prompt, seed) in enumerate(zip(["a bird", "a boat"], (3, 4))):
        theirs = ref(prompt=prompt, negative_prompt="blurry", video=video, mask=theirs_mask,
                     reference_images=references, height=32, width=32, num_frames=9, num_inference_steps=4,
                     guidance_scale=5.0, max_sequence_length=16, generator=torch.Generator("cpu").manual_seed(seed),
                     output_type="np").frames[0]
        assert ours.array[i].shape == theirs.shape == (9, 32, 32, 3)
        assert np.abs(ours.array[i] - theirs).max() <= TOL
    if case == "mask-per-frame":  # the mask acts: all white (the default) is another output
        white = pipe(["a bird", "a boat"], seed=[3, 4], video=video, negative_prompt="blurry")
        assert np.abs(white.array - ours.array).max() > 1e-3


def test_video_through_the_cli_records_and_replays(wan_vace_dir, clip, tmp_path):
    video, masks = clip
    clip_file, mask_file, out = tmp_path / "clip.webp", tmp_path / "mask.png", tmp_path / "out.npy"
    video[0].save(clip_file, save_all=True, append_images=video[1:], lossless=True)
    masks[0].save(mask_file, save_all=True, append_images=masks[1:])  # an APNG: a mask per frame
    sets = [a for o in OVERRIDES for a in ("--set", o)]
    run = [sys.executable, "-m", "omnispec", "run"]
    done = preloaded.python_m([*run, str(SPECS / "wan2.1-vace-1.3b-v2v.yaml"), "--source", str(wan_vace_dir), *sets,
                               "--prompt", "a bird", "--video", str(clip_file), "--mask", str(mask_file),
                               "--output", str(out), "-q"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    pipe = omnispec.build(SPECS / "wan2.1-vace-1.3b-v2v.yaml", source=str(wan_vace_dir), overrides=OVERRIDES)
    same = pipe("a bird", seed=0, video=video, mask=masks)  # the files hold these very frames (lossless)
    assert np.abs(np.load(out) - same.array).max() <= TOL
    record = omnispec.records.read(out)
    assert record.request.video.frames == 9 and record.request.video.path == str(clip_file.resolve())
    assert record.request.mask.frames == 9 and record.request.frames == 9
    shown = preloaded.python_m([sys.executable, "-m", "omnispec", "explain", str(out)], capture_output=True,
                               text=True, cwd=ROOT)
    assert "video: " in shown.stdout and "9 frames" in shown.stdout, shown.stdout + shown.stderr
    again = tmp_path / "again.npy"
    done = preloaded.python_m([*run, "--from", str(out), "--output", str(again), "-q"], capture_output=True, text=True,
                              cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert np.array_equal(np.load(out), np.load(again))
    masks[1].save(mask_file, save_all=True, append_images=masks[2:] + masks[:1])  # the mask changed since
    done = preloaded.python_m([*run, "--from", str(out), "--output", str(tmp_path / "x.npy"), "-q"],
                              capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and "error: request.mask" in done.stderr and "has changed" in done.stderr
    assert "Traceback" not in done.stderr
    (tmp_path / "broken.mp4").write_bytes(b"\0\0\0\x18ftypisom" + bytes(64))
    done = preloaded.python_m([*run, str(SPECS / "wan2.1-vace-1.3b-v2v.yaml"), "--source", str(wan_vace_dir), *sets,
                               "--prompt", "a bird", "--video", str(tmp_path / "broken.mp4"), "--output",
                               str(tmp_path / "y.npy"), "-q"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and done.stderr.startswith("error: request.video:"), done.stderr
    assert "Traceback" not in done.stderr


def test_video_rollouts_replay_exactly(wan_vace_dir, clip):
    video, masks = clip
    pipe = omnispec.build(SPECS / "wan2.1-vace-1.3b-v2v.yaml", source=str(wan_vace_dir), overrides=OVERRIDES)
    ro = pipe.rollout("a bird", group_size=2, seed=5, sampler={"kind": "sde", "multistep": "euler"}, video=video,
                      mask=masks[0])
    assert torch.equal(pipe.log_prob(ro, grad=False).log_probs.cpu(), ro.log_probs)
