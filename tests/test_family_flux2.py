"""FLUX.2 [dev] (family ``flux2``): text-to-image with embedded guidance and editing from reference images, equal to
diffusers' Flux2Pipeline on the same tiny checkpoint and seeds, through ``omnispec.build`` and the CLI; rollouts
replay exactly; the memory policies users run it with (model offload, fp8 weights) are accepted by validate and
explain; a klein checkpoint is refused by the dev spec and the reverse."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

import omnispec
from omnispec.spec import SpecError, explain_spec, load_spec, render_explain
from omnispec.testing import TINY_OVERRIDES

from conftest import ROOT, SPECS, generators, reference

TOL = 1e-4
OVERRIDES = TINY_OVERRIDES["flux2"]
EDIT = [o for o in OVERRIDES if ".height" not in o and ".width" not in o]
PROMPTS = ["a photo of a cat", "a red car in the snow"]


@pytest.fixture(scope="module")
def pictures():
    """Two reference images of different sizes and aspects (each side >= 64 px, as the pipeline requires)."""
    return [Image.fromarray((np.random.RandomState(i).rand(h, w, 3) * 255).astype(np.uint8))
            for i, (h, w) in enumerate([(64, 80), (72, 64)])]


@pytest.fixture(scope="module")
def diffusers_flux2(flux2_dir):
    return reference("Flux2Pipeline", flux2_dir)


@pytest.mark.parametrize("guidance", [None, 2.5])
def test_text_to_image_equals_diffusers(flux2_dir, diffusers_flux2, guidance):
    """The spec's embedded 4.0 (the pipeline's default) and a request's guidance scale (its docstring's 2.5)."""
    pipe = omnispec.build(SPECS / "flux2-dev.yaml", source=str(flux2_dir), overrides=OVERRIDES)
    ours = pipe(PROMPTS, seed=[0, 1], guidance_scale=guidance)
    ref = diffusers_flux2(prompt=PROMPTS, height=32, width=48, num_inference_steps=3,
                          guidance_scale=4.0 if guidance is None else guidance, max_sequence_length=64,
                          generator=generators(0, 1), output_type="np").images
    assert ours.array.shape == (2, 32, 48, 3)
    assert np.abs(ours.array - ref).max() <= TOL
    assert np.abs(ours.array[0] - ours.array[1]).max() > 1e-3  # the prompts act


def test_editing_from_two_references_equals_diffusers(flux2_dir, diffusers_flux2, pictures):
    """Without a size the output takes the first reference's (64x80); each reference keeps its own tokens."""
    pipe = omnispec.build(SPECS / "flux2-dev-edit.yaml", source=str(flux2_dir), overrides=EDIT)
    ours = pipe("make it blue", seed=2, conditions=pictures)
    ref = diffusers_flux2(image=pictures, prompt="make it blue", num_inference_steps=3, max_sequence_length=64,
                          generator=generators(2), output_type="np").images
    assert ours.array.shape == (1, 64, 80, 3)
    assert np.abs(ours.array - ref).max() <= TOL
    alone = pipe("make it blue", seed=2, image=pictures[0]).array
    assert np.abs(alone - ours.array).max() > 1e-3  # the second reference acts


@pytest.mark.parametrize("edit", [False, True], ids=["text", "edit"])
def test_the_cli_equals_diffusers(flux2_dir, diffusers_flux2, pictures, edit, tmp_path, capsys):
    """``omnispec run SPEC --source DIR ... --output out.npy`` (the CLI's entry point, in this process)."""
    from omnispec.cli import main

    first, out = tmp_path / "ref.png", tmp_path / "out.npy"
    pictures[0].save(first)
    spec, overrides = ("flux2-dev-edit", EDIT) if edit else ("flux2-dev", OVERRIDES)
    code = main(["run", str(SPECS / f"{spec}.yaml"), "--source", str(flux2_dir),
                 *[a for o in overrides for a in ("--set", o)], "--prompt", "a cat",
                 *(["--image", str(first)] if edit else []), "--seed", "3", "--guidance-scale", "2.5",
                 "--output", str(out), "-q"])
    assert code == 0, capsys.readouterr().err
    size = {} if edit else {"height": 32, "width": 48}
    ref = diffusers_flux2(prompt="a cat", **({"image": [Image.open(first)]} if edit else size), guidance_scale=2.5,
                          num_inference_steps=3, max_sequence_length=64, generator=generators(3),
                          output_type="np").images
    ours = np.load(out)
    assert ours.shape == ref.shape and np.abs(ours - ref).max() <= TOL


@pytest.mark.parametrize("spec", ["flux2-dev", "flux2-dev-edit"])
def test_rollouts_replay_exactly(flux2_dir, pictures, spec):
    edit = spec.endswith("edit")
    pipe = omnispec.build(SPECS / f"{spec}.yaml", source=str(flux2_dir), overrides=EDIT if edit else OVERRIDES)
    ro = pipe.rollout("a cat", group_size=2, seed=5, sampler={"kind": "sde"},
                      **({"image": pictures[0]} if edit else {}))
    replay = pipe.log_prob(ro, grad=False)
    assert torch.equal(replay.log_probs.cpu(), ro.log_probs)


# ---- policies ------------------------------------------------------------------------------------------------------

MEMORY = ["policies.offload={strategy: model}",
          "policies.quantization={transformer: {method: fp8_weight_only}, text_encoder: {method: fp8_weight_only}}"]


def test_offload_and_fp8_weights_are_accepted_by_validate_and_explain():
    text = render_explain(explain_spec(load_spec("flux2-dev", MEMORY)))
    assert "offload      model" in text and text.count("fp8_weight_only") == 2
    for spec in ("flux2-dev", "flux2-dev-edit"):
        done = subprocess.run([sys.executable, "-m", "omnispec", "validate", spec, *[a for o in MEMORY
                                                                                     for a in ("--set", o)]],
                              capture_output=True, text=True, cwd=ROOT)
        assert done.returncode == 0, done.stderr


def test_fp8_on_a_cpu_is_refused_at_build_with_the_reason(flux2_dir):
    with pytest.raises(SpecError, match="fp8_weight_only runs only on CUDA"):
        omnispec.build(SPECS / "flux2-dev.yaml", source=str(flux2_dir), overrides=[*OVERRIDES, *MEMORY])


def test_policies_run_or_are_refused_with_the_reason(flux2_dir):
    """Model offload, an attention backend per role and regional compile give the plain output; TaylorSeer and
    step_mask caches run; the first-block cache is refused before loading, naming why; ulysses is refused."""
    def run(*extra):
        pipe = omnispec.build(SPECS / "flux2-dev.yaml", source=str(flux2_dir), overrides=[*OVERRIDES, *extra])
        return pipe, pipe("a cat", seed=0).array

    pipe, plain = run()
    target = pipe.family.targets.attention
    roles = target.modules(pipe.components["transformer"].named_modules())
    assert set(roles) == {"joint", "single"} and all(roles.values())
    for exact in ("policies.offload={strategy: model}", "policies.attention={per_role: {single: sdpa_math}}",
                  "policies.compile={mode: regional, backend: eager}"):
        assert np.abs(run(exact)[1] - plain).max() <= 1e-5, exact
    for approximate in ("policies.cache={kind: taylorseer, interval: 2, warmup_steps: 1}",
                        "policies.cache={kind: step_mask, mask: [true, false, true]}"):
        out = run(approximate)[1]
        assert out.shape == plain.shape and np.isfinite(out).all()
    with pytest.raises(SpecError, match="first-block cache hook cannot read FLUX.2"):
        run("policies.cache={kind: first_block, threshold: 0.05}")
    with pytest.raises(SpecError, match="has not been checked against one process"):
        run("policies.parallel.ulysses=2")


# ---- checkpoint checks ---------------------------------------------------------------------------------------------

def test_a_klein_checkpoint_is_refused_by_the_dev_spec_and_the_reverse(flux2_dir, flux2_klein_dir):
    with pytest.raises(SpecError) as dev_on_klein:
        omnispec.build(SPECS / "flux2-dev.yaml", source=str(flux2_klein_dir), overrides=OVERRIDES)
    message = str(dev_on_klein.value)
    assert "Mistral3ForConditionalGeneration" in message and "Qwen3ForCausalLM" in message
    assert "family flux2_klein" in message
    with pytest.raises(SpecError, match="Qwen3ForCausalLM.*Mistral3ForConditionalGeneration"):
        omnispec.build(SPECS / "flux2-klein-4b.yaml", source=str(flux2_dir), overrides=TINY_OVERRIDES["flux2_klein"])

