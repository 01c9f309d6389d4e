"""FLUX.3 [klein] (families ``flux3`` and ``flux3_distilled``, modular pipelines only) against diffusers'
Flux3ModularPipeline and Flux3DistilledModularPipeline (their prompt upsampler popped) on tiny checkpoints in the
modular pipeline's saved layout: text-to-image and generation from reference images through ``omnispec.build`` and
the CLI, rollouts that replay exactly, policies run or refused, checkpoints of the other FLUX models refused naming
the family that runs them, and ``omnispec init`` drafting each family."""

from __future__ import annotations

import diffusers
import numpy as np
import pytest
import torch
import transformers
from diffusers.modular_pipelines import Flux3AutoBlocks, Flux3DistilledAutoBlocks
from PIL import Image

import omnispec
from omnispec.cli import main
from omnispec.spec import SpecError
from omnispec.testing import TINY_OVERRIDES, flux3_processor, tiny_checkpoint

from conftest import SPECS, generators

TOL = 1e-4
PROMPT = "a cat holding a sign"
# Longer than one 80-token window after the chat template: its window is 160 tokens, the short prompt's 80.
LONG = " ".join(["a red car in the snow, dance monkey, make it blue"] * 12)
EDIT = TINY_OVERRIDES["flux3_edit"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("flux3")
    return {spec: tiny_checkpoint(spec, folder)[0] for spec in ("flux3-klein", "flux3-klein-base")}


@pytest.fixture(scope="module")
def processor(checkpoints):
    return flux3_processor(checkpoints["flux3-klein"] / "tokenizer")


def _build(spec: str, root, processor, *extra: str, overrides=None):
    overrides = TINY_OVERRIDES["flux3"] if overrides is None else overrides
    return omnispec.build(SPECS / f"{spec}.yaml", source=str(root), overrides=[*overrides, *extra],
                          components={"tokenizer": processor})


@pytest.fixture(scope="module")
def pipes(checkpoints, processor):
    return {"distilled": _build("flux3-klein", checkpoints["flux3-klein"], processor),
            "base": _build("flux3-klein-base", checkpoints["flux3-klein-base"], processor)}


@pytest.fixture(scope="module")
def references(checkpoints, processor):
    """diffusers' modular pipelines on the same files, the prompt upsampler popped (the prompt encoded as given)."""
    out = {}
    for kind, blocks, spec in (("distilled", Flux3DistilledAutoBlocks, "flux3-klein"),
                               ("base", Flux3AutoBlocks, "flux3-klein-base")):
        root = checkpoints[spec]
        pipeline = blocks()
        pipeline.sub_blocks.pop("prompt_upsampler")
        ref = pipeline.init_pipeline()
        ref.update_components(
            tokenizer=processor, vae=diffusers.AutoencoderKLFlux2.from_pretrained(root / "vae"),
            transformer=diffusers.Flux3Transformer2DModel.from_pretrained(root / "transformer"),
            text_encoder=transformers.Qwen3VLForConditionalGeneration.from_pretrained(root / "text_encoder"))
        ref.set_progress_bar_config(disable=True)
        out[kind] = ref
    return out


def expected(ref, prompt: str, seed: int, **kwargs) -> np.ndarray:
    size = {} if "image" in kwargs else {"height": 32, "width": 32}
    return ref(prompt=prompt, num_inference_steps=2, generator=generators(seed)[0], output_type="np",
               output="images", **{**size, **kwargs})


@pytest.fixture(scope="module")
def pictures():
    """Two references of different sizes and aspects: one alone is padded to a 64x64 canvas and cropped back."""
    return [Image.fromarray((np.random.RandomState(i).rand(h, w, 3) * 255).astype(np.uint8))
            for i, (h, w) in enumerate([(40, 56), (72, 48)])]


# ---- parity ---------------------------------------------------------------------------------------------------------

def test_distilled_text_to_image_equals_diffusers_prompt_by_prompt(pipes, references):
    """Two prompts whose windows differ (80 and 160 tokens) in one request: each row equals the blocks' output for
    that prompt and seed alone."""
    ours = pipes["distilled"]([PROMPT, LONG], seed=[0, 1]).array
    for k, prompt in enumerate((PROMPT, LONG)):
        assert np.abs(ours[k] - expected(references["distilled"], prompt, k)[0]).max() <= TOL
    assert np.abs(ours[0] - ours[1]).max() > 1e-3


@pytest.mark.parametrize("negative", [None, LONG], ids=["empty", "longer"])
def test_base_text_to_image_with_cfg_equals_diffusers(pipes, references, negative):
    """CFG 3.5 against the empty prompt (the guider's default) or a negative prompt in a longer window."""
    ours = pipes["base"](PROMPT, seed=2, **({"negative_prompt": negative} if negative else {})).array
    ref = expected(references["base"], PROMPT, 2, **({"negative_prompt": negative} if negative else {}))
    assert ours.shape == ref.shape == (1, 32, 32, 3)
    assert np.abs(ours - ref).max() <= TOL


@pytest.mark.parametrize("case", ["one", "two", "sized"])
def test_distilled_generation_from_references_equals_diffusers(checkpoints, processor, references, pictures, case):
    """One reference: the output takes its padded canvas and is cropped back to it; two: the first one's size, no
    crop; a requested size: used as is."""
    images = pictures[:1] if case != "two" else pictures
    size = {"height": 32, "width": 48} if case == "sized" else {}
    pipe = _build("flux3-klein-edit", checkpoints["flux3-klein"], processor, overrides=EDIT)
    ours = pipe(PROMPT, seed=4, conditions=images, **size).array
    ref = expected(references["distilled"], PROMPT, 4, image=images if case == "two" else images[0], **size)
    shape = {"one": (1, 40, 56, 3), "two": (1, 32, 48, 3), "sized": (1, 32, 48, 3)}[case]
    assert ours.shape == ref.shape == shape
    assert np.abs(ours - ref).max() <= TOL


def test_base_generation_from_a_reference_with_cfg_equals_diffusers(checkpoints, processor, references, pictures):
    pipe = _build("flux3-klein-base", checkpoints["flux3-klein-base"], processor, "recipe.task=image-to-image",
                  "recipe.defaults.height=null", "recipe.defaults.width=null", overrides=EDIT)
    ours = pipe(PROMPT, seed=5, image=pictures[1]).array
    ref = expected(references["base"], PROMPT, 5, image=pictures[1])
    assert ours.shape == ref.shape and np.abs(ours - ref).max() <= TOL


@pytest.mark.parametrize("spec", ["flux3-klein", "flux3-klein-edit", "flux3-klein-base"])
def test_the_cli_equals_diffusers(checkpoints, references, pictures, spec, tmp_path, capsys):
    """``omnispec run`` as a user runs it: without torchvision ``AutoProcessor`` loads the tokenizer folder's
    tokenizer alone, which is all the prompt path reads."""
    edit = spec.endswith("edit")
    root = checkpoints["flux3-klein-base" if spec.endswith("base") else "flux3-klein"]
    overrides = EDIT if edit else TINY_OVERRIDES["flux3"]
    first, out = tmp_path / "ref.png", tmp_path / "out.npy"
    pictures[0].save(first)
    code = main(["run", str(SPECS / f"{spec}.yaml"), "--source", str(root), *[a for o in overrides for a in
                                                                              ("--set", o)],
                 "--prompt", PROMPT, *(["--image", str(first)] if edit else []), "--seed", "6", "--output", str(out),
                 "-q"])
    assert code == 0, capsys.readouterr().err
    ref = expected(references["base" if spec.endswith("base") else "distilled"], PROMPT, 6,
                   **({"image": Image.open(first)} if edit else {}))
    ours = np.load(out)
    assert ours.shape == ref.shape and np.abs(ours - ref).max() <= TOL


def test_the_estimate_counts_both_families_and_prints_no_error_of_their_decode_on_meta(checkpoints, capfd):
    """The modular decode block fails on the meta device when it converts pixels on the host (the estimate expects
    it) and would log that as an error with its traceback."""
    for spec in ("flux3-klein", "flux3-klein-base"):
        code = main(["explain", str(SPECS / f"{spec}.yaml"), "--source", str(checkpoints[spec]), "--estimate",
                     *[a for o in TINY_OVERRIDES["flux3"] for a in ("--set", o)]])
        out, err = capfd.readouterr()
        assert code == 0 and "time per step" in out, err
        assert "Error in block" not in out + err and "Traceback" not in out + err, err


# ---- the flow map ---------------------------------------------------------------------------------------------------

def test_the_distilled_transformer_gets_the_timestep_each_step_lands_on(pipes):
    seen = []
    denoiser = pipes["distilled"].components["transformer"]
    hook = denoiser.register_forward_pre_hook(
        lambda module, args, kwargs: seen.extend([kwargs["timestep"].item(), kwargs["target_timestep"].item()]),
        with_kwargs=True)
    try:
        pipes["distilled"](PROMPT, seed=0)
    finally:
        hook.remove()
    shift = 6.93
    sigmas = [shift * s / (1 + (shift - 1) * s) for s in (1.0, 0.5)]
    assert seen == pytest.approx([sigmas[0], sigmas[1], sigmas[1], 0.0], abs=1e-6)  # (from, to) per step


# ---- RL -------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["distilled", "base"])
def test_rollouts_replay_exactly(pipes, kind):
    pipe = pipes[kind]
    ro = pipe.rollout(PROMPT, group_size=2, seed=5, sampler={"kind": "sde"})
    replay = pipe.log_prob(ro, grad=False)
    assert torch.equal(replay.log_probs.cpu(), ro.log_probs)
    assert ((replay.log_probs.cpu() - ro.log_probs).exp() == 1).all()


# ---- policies -------------------------------------------------------------------------------------------------------

def test_policies_run_or_are_refused_with_the_reason(checkpoints, processor, pipes):
    """Model and layerwise offload, an attention backend per role and regional compile give the plain output;
    TaylorSeer and step_mask caches and int8 weights run; block-hook caches, skip-layer guidance and a sequence split
    are refused, naming why."""
    root = checkpoints["flux3-klein"]
    plain = pipes["distilled"](PROMPT, seed=0).array
    roles = pipes["distilled"].family.targets.attention.modules(
        pipes["distilled"].components["transformer"].named_modules())
    assert set(roles) == {"mode", "single"} and all(roles.values())
    for exact in ("policies.offload={strategy: model}", "policies.offload={strategy: layerwise}",
                  "policies.attention={per_role: {single: sdpa_math}}",
                  "policies.compile={mode: regional, backend: eager}"):
        out = _build("flux3-klein", root, processor, exact)(PROMPT, seed=0).array
        assert np.abs(out - plain).max() <= 1e-5, exact
    for approximate in ("policies.cache={kind: taylorseer, interval: 2, warmup_steps: 1}",
                        "policies.cache={kind: step_mask, mask: [true, false]}",
                        "policies.quantization={transformer: {method: int8_weight_only}}"):
        out = _build("flux3-klein", root, processor, approximate)(PROMPT, seed=0).array
        assert out.shape == plain.shape and np.isfinite(out).all()
    for refused, reason in (("policies.cache={kind: first_block, threshold: 0.05}", "no FLUX.3 transformer block"),
                            ("policies.parallel.ulysses=2", "no diffusers context-parallel plan"),
                            ("recipe.phases.0.guidance.terms=[{kind: skip_layer, scale: 2.0, layers: [0]}]",
                             "no FLUX.3 transformer block")):
        with pytest.raises(SpecError, match=reason):
            omnispec.build(SPECS / "flux3-klein-base.yaml", overrides=[refused])


def test_the_distilled_model_refuses_cfg_and_negative_prompts(checkpoints, capsys):
    with pytest.raises(SpecError, match="flow map sampled without CFG"):
        omnispec.build(SPECS / "flux3-klein.yaml", overrides=["recipe.phases.0.guidance.terms=[{kind: cfg, scale: 3}]"])
    root = checkpoints["flux3-klein"]
    assert main(["run", str(SPECS / "flux3-klein.yaml"), "--source", str(root), "--prompt", "x",
                 "--negative-prompt", "blurry", "--output", "unused.npy"]) == 2
    err = capsys.readouterr().err
    assert "negative_prompt" in err and "without CFG" in err and "Traceback" not in err


# ---- checkpoints ----------------------------------------------------------------------------------------------------

def test_a_checkpoint_of_the_other_flux3_model_is_refused_naming_its_family(checkpoints):
    with pytest.raises(SpecError, match="Flux3DistilledModularPipeline.*family flux3_distilled"):
        omnispec.build(SPECS / "flux3-klein-base.yaml", source=str(checkpoints["flux3-klein"]),
                       overrides=TINY_OVERRIDES["flux3"])
    with pytest.raises(SpecError, match="Flux3ModularPipeline, which family 'flux3_distilled'.*family flux3\\b"):
        omnispec.build(SPECS / "flux3-klein.yaml", source=str(checkpoints["flux3-klein-base"]),
                       overrides=TINY_OVERRIDES["flux3"])


def test_a_flow_map_transformer_is_refused_by_the_base_family_even_unchecked(checkpoints, processor):
    with pytest.raises(SpecError, match="flow map .*run it with family flux3_distilled"):
        _build("flux3-klein-base", checkpoints["flux3-klein"], processor, "model.check_checkpoint=false")


def test_a_flux2_checkpoint_is_refused_naming_its_family(flux2_klein_dir):
    with pytest.raises(SpecError) as refused:
        omnispec.build(SPECS / "flux3-klein.yaml", source=str(flux2_klein_dir), overrides=TINY_OVERRIDES["flux3"])
    message = str(refused.value)
    assert "Flux2Transformer2DModel" in message and "family flux2_klein" in message


@pytest.mark.parametrize("spec, family", [("flux3-klein", "flux3_distilled"), ("flux3-klein-base", "flux3")])
def test_omnispec_init_drafts_each_family_from_its_modular_index(checkpoints, spec, family):
    import yaml

    from omnispec.draft import draft_spec

    data = yaml.safe_load(draft_spec(str(checkpoints[spec])))
    assert data["model"]["family"] == family
    assert set(data["model"]["components"]) == {"transformer", "text_encoder", "tokenizer", "vae"}


def test_a_malformed_modular_index_is_refused_naming_the_file(checkpoints, tmp_path):
    import json
    import os

    root = checkpoints["flux3-klein"]
    view = tmp_path / "view"
    view.mkdir()
    for entry in root.iterdir():
        if entry.name != "modular_model_index.json":
            os.symlink(entry, view / entry.name)
    index = json.loads((root / "modular_model_index.json").read_text())
    (view / "modular_model_index.json").write_text(json.dumps({**index, "vae": ["diffusers", 5, {}]}))
    with pytest.raises(SpecError, match="modular_model_index.json.*a component entry is \\[library, class\\]"):
        omnispec.build(SPECS / "flux3-klein.yaml", source=str(view), overrides=TINY_OVERRIDES["flux3"])
