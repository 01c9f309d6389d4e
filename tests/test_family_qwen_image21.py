"""Qwen-Image-2.1 (QwenImage21Pipeline) and its Turbo (QwenImage21TurboModularPipeline) equal diffusers on tiny
checkpoints (float32, CPU, same seeds), text-to-image and with condition images, through build and the CLI;
rollouts replay exactly; each policy works or is refused with the reason; a checkpoint whose sigma grid the spec does
not walk is refused before loading."""

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

import omnispec
from omnispec.cli import main
from omnispec.spec import SpecError
from omnispec.testing import TINY_OVERRIDES, qwen21_processor

from conftest import SPECS, generators

TOL = 1e-4
T2I, EDIT = TINY_OVERRIDES["qwen_image21"], TINY_OVERRIDES["qwen_image21_edit"]
CFG = "recipe.phases.0.guidance.terms=[{kind: true_cfg, scale: 3.0}]"
SIZE = dict(height=32, width=64)


@pytest.fixture(scope="module")
def pictures():
    """Two non-square pictures of different aspects (the output takes the last one's)."""
    rng = np.random.RandomState(0)
    return [Image.fromarray((rng.rand(48, 80, 3) * 255).astype(np.uint8)),
            Image.fromarray((rng.rand(64, 40, 3) * 255).astype(np.uint8))]


@pytest.fixture(scope="module")
def diffusers_base(qwen_image21_dir):
    from diffusers import QwenImage21Pipeline

    pipe = QwenImage21Pipeline.from_pretrained(qwen_image21_dir, processor=qwen21_processor(
        qwen_image21_dir / "processor"), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def diffusers_turbo(qwen_image21_turbo_dir, diffusers_base):
    """The Turbo's modular pipeline on the Turbo checkpoint (its sample_sigmas from model_index.json)."""
    from diffusers import QwenImage21Pipeline
    from diffusers.modular_pipelines import QwenImage21TurboAutoBlocks

    loaded = QwenImage21Pipeline.from_pretrained(qwen_image21_turbo_dir, processor=diffusers_base.processor,
                                                 dtype=torch.float32)
    pipe = QwenImage21TurboAutoBlocks().init_pipeline(str(qwen_image21_turbo_dir))
    pipe.update_components(**{name: getattr(loaded, name) for name in
                              ("transformer", "vae", "text_encoder", "processor", "scheduler")})
    return pipe


@pytest.fixture(scope="module")
def base(qwen_image21_dir):
    return omnispec.build(SPECS / "qwen-image-2.1.yaml", source=str(qwen_image21_dir), overrides=T2I)


@pytest.fixture(scope="module")
def edit(qwen_image21_dir):
    return omnispec.build(SPECS / "qwen-image-2.1-edit.yaml", source=str(qwen_image21_dir), overrides=EDIT)


# ---- parity ------------------------------------------------------------------------------------------------------

def test_text_to_image_with_a_batch_of_prompts_matches_diffusers(base, diffusers_base):
    prompts = ["a cat", "a red car in the snow on a cold day"]
    ours = base(prompts, seed=[3, 4])
    ref = diffusers_base(prompts, **SIZE, num_inference_steps=3, generator=generators(3, 4), output_type="np").images
    assert ours.array.shape == ref.shape == (2, 32, 64, 4)  # the VAE decodes RGBA
    assert np.abs(ours.array - ref).max() <= TOL


def test_true_cfg_runs_each_prompt_at_its_own_length_and_matches_diffusers(qwen_image21_dir, diffusers_base):
    pipe = omnispec.build(SPECS / "qwen-image-2.1.yaml", source=str(qwen_image21_dir), overrides=[*T2I, CFG])
    ours = pipe("a red car in the snow on a cold day", seed=5, negative_prompt="blurry")
    ref = diffusers_base("a red car in the snow on a cold day", negative_prompt="blurry", true_cfg_scale=3.0, **SIZE,
                         num_inference_steps=3, generator=generators(5), output_type="np").images
    assert np.abs(ours.array - ref).max() <= TOL


@pytest.mark.parametrize("count", [1, 2])
def test_condition_images_match_diffusers(edit, diffusers_base, pictures, count):
    images = pictures[:count]
    ours = edit("make it blue", seed=2, conditions=images)
    ref = diffusers_base("make it blue", image=images, output_resolution=64, num_inference_steps=3,
                         generator=generators(2), output_type="np").images
    assert ours.array.shape == ref.shape == ((1, 64, 96, 4) if count == 1 else (1, 96, 64, 4))  # the last's aspect
    assert np.abs(ours.array - ref).max() <= TOL


@pytest.mark.parametrize("spec, images", [("qwen-image-2.1-turbo.yaml", 0), ("qwen-image-2.1-turbo-edit.yaml", 2)])
def test_turbo_matches_the_modular_pipeline(qwen_image21_turbo_dir, diffusers_turbo, pictures, spec, images):
    overrides = EDIT if images else T2I
    pipe = omnispec.build(SPECS / spec, source=str(qwen_image21_turbo_dir), overrides=overrides)
    walk = pipe.explain(as_dict=True)["phases"][0]  # the checkpoint's grid, whatever steps says
    assert walk["steps"] == 8 and walk["sigma_range"] == pytest.approx([1.0, 0.414568])
    kwargs = dict(image=pictures[:images], output_resolution=64) if images else SIZE
    ours = pipe("a cat", seed=6, conditions=pictures[:images])
    ref = diffusers_turbo(prompt="a cat", generator=generators(6), output_type="np", **kwargs).get("images")
    assert np.abs(ours.array - np.asarray(ref)).max() <= TOL


@pytest.mark.parametrize("image", [False, True])
def test_cli_matches_diffusers(qwen_image21_dir, diffusers_base, pictures, image, tmp_path, capsys):
    spec, overrides = ("qwen-image-2.1-edit.yaml", EDIT) if image else ("qwen-image-2.1.yaml", T2I)
    source = tmp_path / "in.png"
    pictures[0].save(source)
    out = tmp_path / "out.npy"
    code = main(["run", str(SPECS / spec), "--source", str(qwen_image21_dir), "--prompt", "a cat", "--seed", "7",
                 *(["--image", str(source)] if image else []), *[x for o in overrides for x in ("--set", o)],
                 "--output", str(out)])
    assert code == 0, capsys.readouterr().err
    kwargs = dict(image=Image.open(source), output_resolution=64) if image else SIZE
    ref = diffusers_base("a cat", num_inference_steps=3, generator=generators(7), output_type="np", **kwargs).images
    assert np.abs(np.load(out) - ref).max() <= TOL


# ---- RL ----------------------------------------------------------------------------------------------------------

def test_rollouts_replay_exactly_with_condition_images_and_ragged_cfg(qwen_image21_dir, pictures):
    pipe = omnispec.build(SPECS / "qwen-image-2.1-edit.yaml", source=str(qwen_image21_dir), overrides=[*EDIT, CFG])
    ro = pipe.rollout(["a cat", "a red car in the snow on a cold day"], group_size=2, seed=1, negative_prompt="blurry",
                      conditions=pictures[:1], sampler={"kind": "sde", "window": {"kind": "fixed", "start": 0,
                                                                                  "length": 2}})
    assert torch.equal(pipe.log_prob(ro, grad=False).log_probs.cpu(), ro.log_probs)
    ratio = (pipe.log_prob(ro, grad=False, micro_batch=1).log_probs.cpu() - ro.log_probs).exp()
    assert (ratio - 1).abs().max().item() <= 1e-5


# ---- policies ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain(base):
    return base(["a cat", "a red car in the snow"], seed=0).array


def policy_run(source, *overrides):
    pipe = omnispec.build(SPECS / "qwen-image-2.1.yaml", source=str(source), overrides=[*T2I, *overrides])
    return pipe, pipe(["a cat", "a red car in the snow"], seed=0).array


@pytest.mark.parametrize("policy", ["policies.attention={default: sdpa_math}",
                                    "policies.compile={mode: regional, backend: eager}",
                                    "policies.offload={strategy: model}"])
def test_exact_policies_give_the_plain_output(qwen_image21_dir, plain, policy):
    pipe, out = policy_run(qwen_image21_dir, policy)
    assert np.abs(out - plain).max() <= 1e-5
    if "attention" in policy:  # the declared role reaches every block's attention
        roles = pipe.family.targets.attention.modules(pipe.components["transformer"].named_modules())
        assert [len(m) for m in roles.values()] == [2]


def test_a_cache_runs_and_the_block_hook_caches_are_refused(qwen_image21_dir, plain):
    _, out = policy_run(qwen_image21_dir, "policies.cache={kind: taylorseer, interval: 2, warmup_steps: 1}")
    assert out.shape == plain.shape and np.abs(out - plain).max() < 0.5
    for cache in ("{kind: first_block, threshold: 0.2}", "{kind: magcache, calibrate: true}"):
        with pytest.raises(SpecError, match="registers no QwenImage21TransformerBlock"):
            policy_run(qwen_image21_dir, f"policies.cache={cache}")


@pytest.mark.parametrize("overrides, reason", [
    (["recipe.phases.0.guidance.terms=[{kind: skip_layer, scale: 2.0, layers: [1]}]"],
     "family 'qwen_image21' cannot run skip_layer guidance"),
    (["policies.parallel={ulysses: 2}"], "cannot run ulysses/ring: .* no diffusers context-parallel plan"),
    (["recipe.constraints.refuse=[]", "recipe.defaults.max_sequence_length=64"], None),
])
def test_what_the_model_cannot_take_is_refused_with_the_reason(qwen_image21_dir, overrides, reason):
    if reason is None:  # the prompt length is refused at the request (the whole template is encoded)
        pipe = omnispec.build(SPECS / "qwen-image-2.1.yaml", source=str(qwen_image21_dir), overrides=T2I)
        with pytest.raises(SpecError, match="encodes the whole templated prompt"):
            pipe("a cat", seed=0, max_sequence_length=64)
        return
    with pytest.raises(SpecError, match=reason):
        policy_run(qwen_image21_dir, *overrides)


# ---- the checkpoint's sigma grid ---------------------------------------------------------------------------------

def test_a_checkpoint_whose_sample_sigmas_the_spec_does_not_walk_is_refused(qwen_image21_turbo_dir, tmp_path,
                                                                            monkeypatch):
    import diffusers

    monkeypatch.setattr(diffusers.QwenImage21Transformer2DModel, "from_pretrained", None)  # refused before loading
    with pytest.raises(SpecError) as info:  # the base spec (linspace steps) on the Turbo checkpoint
        omnispec.build(SPECS / "qwen-image-2.1.yaml", source=str(qwen_image21_turbo_dir), overrides=T2I)
    text = str(info.value)
    assert "recipe.phases.0.schedule.sigmas" in text and "sample_sigmas [1.0, 0.978453" in text
    changed = tmp_path / "ckpt"
    shutil.copytree(qwen_image21_turbo_dir, changed)
    index = json.loads((changed / "model_index.json").read_text())
    (changed / "model_index.json").write_text(json.dumps({**index, "sample_sigmas": [1.0, 0.5]}))
    with pytest.raises(SpecError, match=r"sample_sigmas \[1.0, 0.5\]"):
        omnispec.build(SPECS / "qwen-image-2.1-turbo.yaml", source=str(changed), overrides=T2I)
    (changed / "model_index.json").write_text(json.dumps({**index, "sample_sigmas": "fast"}))
    with pytest.raises(SpecError, match="sets sample_sigmas 'fast', not a list of numbers"):
        omnispec.build(SPECS / "qwen-image-2.1-turbo.yaml", source=str(changed), overrides=T2I)


def test_init_recognises_the_checkpoint(qwen_image21_dir, tmp_path):
    out = tmp_path / "drafted.yaml"
    assert main(["init", str(qwen_image21_dir), "-o", str(out)]) == 0
    assert "family: qwen_image21" in out.read_text()
