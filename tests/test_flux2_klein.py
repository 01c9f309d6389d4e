"""FLUX.2 [klein] (family ``flux2_klein``): text-to-image with and without CFG and editing from reference images,
equal to diffusers' Flux2KleinPipeline on the same tiny checkpoint and seeds; FLUX.2's empirical shift; the
distilled checkpoint refuses a CFG recipe; rollouts replay exactly."""

import sys

import numpy as np
import pytest
import torch
from PIL import Image

import omnispec
from omnispec.spec import SpecError, load_spec
from omnispec.testing import TINY_OVERRIDES

import preloaded
from conftest import ROOT, SPECS, generators, reference

TOL = 1e-4
OVERRIDES = TINY_OVERRIDES["flux2_klein"]
EDIT = [o for o in OVERRIDES if ".height" not in o and ".width" not in o]
CFG = ["recipe.phases.0.guidance.terms=[{kind: cfg, scale: 4.0}]"]




@pytest.fixture(scope="module")
def pictures():
    """Two reference images of different sizes and aspects (each side >= 64 px, as the pipeline requires)."""
    return [Image.fromarray((np.random.RandomState(i).rand(h, w, 3) * 255).astype(np.uint8))
            for i, (h, w) in enumerate([(64, 80), (72, 64)])]


def test_empirical_shift_is_flux2_s():
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

    from omnispec.spec.schedule import empirical_mu

    for seq_len in (16, 96, 1024, 4096, 4300, 4301, 16384):
        for steps in (1, 4, 28, 50, 200):
            assert abs(empirical_mu(seq_len, steps) - compute_empirical_mu(seq_len, steps)) <= 1e-12


@pytest.mark.parametrize("case", ["base-cfg", "distilled"])
def test_text_to_image_equals_diffusers(flux2_klein_dir, case):
    """The base model's CFG against the empty prompt, and the distilled recipe (no guidance; diffusers skips CFG
    for a guidance scale of 1)."""
    spec = "flux2-klein-base-4b" if case == "base-cfg" else "flux2-klein-4b"
    pipe = omnispec.build(SPECS / f"{spec}.yaml", source=str(flux2_klein_dir), overrides=OVERRIDES)
    prompts = ["a photo of a cat", "a red car in the snow"]
    ours = pipe(prompts, seed=[0, 1])
    ref = reference("Flux2KleinPipeline", flux2_klein_dir)(prompt=prompts, height=32, width=48, num_inference_steps=3,
                                     guidance_scale=4.0 if case == "base-cfg" else 1.0, max_sequence_length=64,
                                     generator=generators(0, 1), output_type="np").images
    assert ours.array.shape == (2, 32, 48, 3)
    assert np.abs(ours.array - ref).max() <= TOL


def test_editing_from_two_references_equals_diffusers(flux2_klein_dir, pictures):
    """Without a size the output takes the first reference's (64x80); each reference keeps its own tokens."""
    pipe = omnispec.build(SPECS / "flux2-klein-4b-edit.yaml", source=str(flux2_klein_dir), overrides=[*EDIT, *CFG])
    ours = pipe("make it blue", seed=2, conditions=pictures)
    ref = reference("Flux2KleinPipeline", flux2_klein_dir)(image=pictures, prompt="make it blue", num_inference_steps=3, guidance_scale=4.0,
                                     max_sequence_length=64, generator=generators(2), output_type="np").images
    assert ours.array.shape == (1, 64, 80, 3)
    assert np.abs(ours.array - ref).max() <= TOL
    alone = pipe("make it blue", seed=2, image=pictures[0]).array
    assert np.abs(alone - ours.array).max() > 1e-3  # the second reference acts


def test_editing_through_the_cli(flux2_klein_dir, pictures, tmp_path):
    first, out = tmp_path / "ref.png", tmp_path / "blue.png"
    pictures[0].save(first)
    done = preloaded.python_m([sys.executable, "-m", "omnispec", "run", str(SPECS / "flux2-klein-4b-edit.yaml"),
                               "--source", str(flux2_klein_dir), *[a for o in EDIT for a in ("--set", o)],
                               "--prompt", "make it blue", "--image", str(first), "--seed", "2", "--output", str(out),
                               "-q"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    record = omnispec.records.read(out)
    assert record.spec["model"]["family"] == "flux2_klein" and Image.open(out).size == (80, 64)


def test_a_reference_under_64_px_is_one_clear_error(flux2_klein_dir):
    pipe = omnispec.build(SPECS / "flux2-klein-4b-edit.yaml", source=str(flux2_klein_dir), overrides=EDIT)
    small = Image.new("RGB", (48, 80), (128, 128, 128))
    with pytest.raises(SpecError, match="FLUX.2 reference image"):
        pipe("x", seed=0, image=small, height=32, width=48)


def test_the_distilled_checkpoint_refuses_a_cfg_recipe(tmp_path):
    from omnispec.testing import tiny_flux2_klein

    root = tiny_flux2_klein(tmp_path / "distilled", distilled=True)
    with pytest.raises(SpecError, match="step-distilled"):
        omnispec.build(SPECS / "flux2-klein-base-4b.yaml", source=str(root), overrides=OVERRIDES)
    omnispec.build(SPECS / "flux2-klein-4b.yaml", source=str(root), overrides=OVERRIDES)  # its own recipe runs


def test_explain_names_the_empirical_shift():
    from omnispec.spec import explain_spec, render_explain

    text = render_explain(explain_spec(load_spec("flux2-klein-4b")))
    assert "flow_match (empirical shift)" in text


@pytest.mark.parametrize("spec", ["flux2-klein-base-4b", "flux2-klein-4b-edit"])
def test_rollouts_replay_exactly(flux2_klein_dir, pictures, spec):
    edit = spec.endswith("edit")
    pipe = omnispec.build(SPECS / f"{spec}.yaml", source=str(flux2_klein_dir), overrides=EDIT if edit else OVERRIDES)
    ro = pipe.rollout("a cat", group_size=2, seed=5, sampler={"kind": "sde"},
                      **({"image": pictures[0]} if edit else {}))
    replay = pipe.log_prob(ro, grad=False)
    assert torch.equal(replay.log_probs.cpu(), ro.log_probs)


def test_policies_run_or_are_refused_with_the_reason(flux2_klein_dir):
    """Caches TaylorSeer, MagCache (calibrated) and step_mask run; the first-block cache is refused before
    loading, naming why; skip-layer guidance and torchao int8 run (checked against the plain output)."""
    plain = omnispec.build(SPECS / "flux2-klein-base-4b.yaml", source=str(flux2_klein_dir), overrides=OVERRIDES)
    base = plain("a cat", seed=0).array
    for extra in (["policies.cache={kind: taylorseer}"], ["policies.cache={kind: magcache, calibrate: true}"],
                  ["policies.cache={kind: step_mask, mask: [true, false, true]}"],
                  ["recipe.phases.0.guidance.terms=[{kind: cfg, scale: 4.0}, {kind: skip_layer, scale: 1.0, "
                   "layers: [0]}]"]):
        out = omnispec.build(SPECS / "flux2-klein-base-4b.yaml", source=str(flux2_klein_dir),
                             overrides=[*OVERRIDES, *extra])("a cat", seed=0).array
        assert out.shape == base.shape and np.isfinite(out).all()
    with pytest.raises(SpecError, match="first-block cache hook cannot read FLUX.2"):
        omnispec.build(SPECS / "flux2-klein-base-4b.yaml", source=str(flux2_klein_dir),
                       overrides=[*OVERRIDES, "policies.cache={kind: first_block, threshold: 0.05}"])
    with pytest.raises(SpecError, match="has not been checked against one process"):
        load_spec(SPECS / "flux2-klein-base-4b.yaml", ["policies.parallel.ulysses=2"])
        omnispec.build(SPECS / "flux2-klein-base-4b.yaml", source=str(flux2_klein_dir),
                       overrides=[*OVERRIDES, "policies.parallel.ulysses=2"])
