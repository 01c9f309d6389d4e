"""Krea 2 Raw (``Krea2Pipeline``) equals its diffusers pipeline on a tiny checkpoint (float32, CPU, same seeds): CFG in
Krea's formulation and without guidance, through ``omnispec.build`` and the CLI; rollouts replay exactly; each
policy kind runs or is refused with the reason; the checkpoint check refuses the variants the family does not run."""

import json
import re
import shutil

import numpy as np
import pytest
import torch

import omnispec
from omnispec.spec import SpecError
from omnispec.testing import TINY_OVERRIDES

from conftest import SPECS, generators, reference

TOL = 1e-4
SPEC = SPECS / "krea2-raw.yaml"
TINY = TINY_OVERRIDES["krea2"]
PROMPTS = ["a cat", "a red car in the snow"]


@pytest.fixture(scope="module")
def krea2(krea2_dir):
    return omnispec.build(SPEC, source=str(krea2_dir), overrides=TINY)


@pytest.fixture(scope="module")
def diffusers_krea2(krea2_dir):
    return reference("Krea2Pipeline", krea2_dir)


def diffusers_images(pipe, prompts, seed, max_sequence_length=16, **kwargs):
    return pipe(prompts, height=32, width=64, num_inference_steps=3, max_sequence_length=max_sequence_length,
                generator=generators(*range(seed, seed + len(prompts))), output_type="np", **kwargs).images


@pytest.mark.parametrize("guidance", [4.5, 2.0, 0.0])
def test_krea2_matches_diffusers(krea2, diffusers_krea2, guidance):
    """The bundled CFG (its scale as the pipeline's guidance_scale), another scale, and none (the pipeline then runs
    one pass); the default negative prompt is the pipeline's empty prompt."""
    ours = krea2(PROMPTS, seed=3, guidance_scale=guidance)
    ref = diffusers_images(diffusers_krea2, PROMPTS, 3, guidance_scale=guidance)
    assert ours.array.shape == ref.shape == (2, 32, 64, 3)
    assert np.abs(ours.array - ref).max() <= TOL


def test_krea2_negative_prompt_matches_diffusers(krea2, diffusers_krea2):
    ours = krea2(PROMPTS, seed=5, negative_prompt="blurry")
    ref = diffusers_images(diffusers_krea2, PROMPTS, 5, negative_prompt="blurry", guidance_scale=4.5)
    assert np.abs(ours.array - ref).max() <= TOL


def test_krea2_with_padded_prompts_matches_diffusers(krea2, diffusers_krea2):
    """Prompts shorter than the template (16 tokens above fill it): diffusers masks the padding, omnispec drops it."""
    ours = krea2(PROMPTS, seed=6, max_sequence_length=64)
    ref = diffusers_images(diffusers_krea2, PROMPTS, 6, max_sequence_length=64, guidance_scale=4.5)
    assert np.abs(ours.array - ref).max() <= TOL


def test_krea2_cli_matches_diffusers(krea2_dir, diffusers_krea2, tmp_path, capsys):
    from omnispec.cli import main

    sets = [x for o in TINY for x in ("--set", o)]
    out = tmp_path / "out.npy"
    code = main(["run", str(SPEC), "--source", str(krea2_dir), "--prompt", "a cat", "--seed", "7", *sets,
                 "--output", str(out)])
    assert code == 0, capsys.readouterr().err
    ref = diffusers_images(diffusers_krea2, ["a cat"], 7, guidance_scale=4.5)
    assert np.abs(np.load(out) - ref).max() <= TOL


def test_forwards_take_each_prompts_valid_tokens_without_a_mask(krea2):
    """What keeps Krea 2's attention on the flash-class kernels: each forward's rows share a count of valid prompt
    tokens and get those alone (rows with other counts in forwards apart), and no forward is handed a mask."""
    seen = []
    handle = krea2.components["transformer"].register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((kwargs["encoder_hidden_states"].shape[:2],
                                                  kwargs["encoder_attention_mask"])), with_kwargs=True)
    try:
        krea2(PROMPTS, seed=0, steps=1, max_sequence_length=64)
    finally:
        handle.remove()
    assert all(mask is None for _, mask in seen)
    shapes = sorted(tuple(shape) for shape, _ in seen)
    template = krea2.family.helper.encode_prompt(["a cat"], device="cpu", max_sequence_length=64)[0].shape[1]
    # the two prompts alone, the empty negative prompt's two rows together; each at fewer tokens than the template
    assert sorted(batch for batch, _ in shapes) == [1, 1, 2] and len({tokens for _, tokens in shapes}) == 3
    assert max(tokens for _, tokens in shapes) < template


def test_krea2_rollouts_replay_exactly(krea2):
    ro = krea2.rollout(PROMPTS, group_size=2, seed=1,
                       sampler={"kind": "sde", "window": {"kind": "fixed", "start": 0, "length": 2}})
    assert torch.equal(krea2.log_prob(ro, grad=False).log_probs.cpu(), ro.log_probs)
    ratio = (krea2.log_prob(ro, grad=False, micro_batch=1).log_probs.cpu() - ro.log_probs).exp()
    assert (ratio - 1).abs().max().item() <= 1e-5


# ---- policies ----------------------------------------------------------------------------------------------------

def run(krea2_dir, *overrides):
    pipe = omnispec.build(SPEC, source=str(krea2_dir), overrides=[*TINY, *overrides])
    return pipe, pipe(PROMPTS, seed=0).array


@pytest.fixture(scope="module")
def plain(krea2):
    return krea2(PROMPTS, seed=0).array


@pytest.mark.parametrize("policy", ["policies.attention={default: sdpa, per_role: {text: sdpa_math}}",
                                    "policies.compile={mode: regional, backend: eager}",
                                    "policies.offload={strategy: layerwise}"])
def test_exact_policies_give_the_plain_output(krea2_dir, plain, policy):
    pipe, out = run(krea2_dir, policy)
    assert np.abs(out - plain).max() <= 1e-5
    target = pipe.family.targets.attention  # every declared role reaches attention modules
    roles = target.modules(pipe.components["transformer"].named_modules())
    assert set(roles) == set(target.roles) and all(roles.values())


@pytest.mark.parametrize("policy", ["policies.cache={kind: taylorseer, interval: 2, warmup_steps: 1}",
                                    "policies.cache={kind: step_mask, mask: [true, false, true]}",
                                    "policies.quantization={transformer: {method: int8_weight_only}}"])
def test_approximate_policies_run(krea2_dir, plain, policy):
    _, out = run(krea2_dir, policy)
    assert out.shape == plain.shape and np.abs(out - plain).max() < 0.5


@pytest.mark.parametrize("policy, reason", [
    ("policies.cache={kind: first_block, threshold: 0.2}", "not in their TransformerBlockRegistry"),
    ("policies.cache={kind: magcache, calibrate: true}", "not in their TransformerBlockRegistry"),
    ("recipe.phases.0.guidance.terms=[{kind: skip_layer, scale: 2.0, layers: [1]}]",
     "family 'krea2' cannot run skip_layer guidance"),
    ("policies.parallel={ulysses: 2}", "no diffusers context-parallel plan"),
    ("policies.parallel={tensor: 2}", "no tensor-parallel plan"),
])
def test_policies_the_model_cannot_take_are_refused_with_the_reason(krea2_dir, policy, reason):
    with pytest.raises(SpecError, match=reason):
        run(krea2_dir, policy)


# ---- checkpoint checks -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key, value, message", [
    ("is_distilled", True, "is Krea 2's few-step distilled model (is_distilled: true in model_index.json)"),
    ("text_encoder_select_layers", [1, 2, 3], "has text_encoder_select_layers: [1, 2, 3], which family 'krea2'"),
    ("patch_size", 1, "has patch_size: 1, which family 'krea2' does not run"),
])
def test_a_checkpoint_the_family_does_not_run_is_refused_before_loading(krea2_dir, tmp_path, monkeypatch, key,
                                                                        value, message):
    import diffusers

    root = tmp_path / "ckpt"
    shutil.copytree(krea2_dir, root)
    index = json.loads((root / "model_index.json").read_text())
    (root / "model_index.json").write_text(json.dumps({**index, key: value}))
    monkeypatch.setattr(diffusers.Krea2Transformer2DModel, "from_pretrained", None)  # any load would fail loudly
    with pytest.raises(SpecError, match=re.escape(message)):
        omnispec.build(SPEC, source=str(root), overrides=TINY)


def test_a_scheduler_with_another_shift_range_is_refused(krea2_dir, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(krea2_dir, root)
    config = root / "scheduler" / "scheduler_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "max_image_seq_len": 4096}))
    with pytest.raises(SpecError, match="6400") as info:
        omnispec.build(SPEC, source=str(root), overrides=TINY)
    assert "4096" in str(info.value)
