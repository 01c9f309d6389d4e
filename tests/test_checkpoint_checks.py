"""The spec against the checkpoint's own config files, before any weight loads: a mismatch names the field and
both values; ``from_checkpoint`` follows the checkpoint; explain reads the files with ``--source``."""

import json
import shutil

import numpy as np
import pytest
import torch

import omnispec
from omnispec.cli import main
from omnispec.spec import SpecError
from omnispec.testing import TINY_OVERRIDES

from conftest import SPECS

FOLLOW = ["recipe.phases.0.schedule.low=from_checkpoint", "recipe.phases.1.schedule.high=from_checkpoint"]


@pytest.fixture(scope="module")
def wan22_boundary_06(wan22_dir, tmp_path_factory):
    """The two-expert fixture, its model_index.json saying boundary_ratio 0.6."""
    root = tmp_path_factory.mktemp("wan22_06") / "ckpt"
    shutil.copytree(wan22_dir, root)
    index = json.loads((root / "model_index.json").read_text())
    (root / "model_index.json").write_text(json.dumps({**index, "boundary_ratio": 0.6}))
    return root


def test_boundary_mismatch_is_refused_before_loading(wan22_boundary_06, monkeypatch):
    import diffusers

    monkeypatch.setattr(diffusers.WanTransformer3DModel, "from_pretrained", None)  # any load would fail loudly
    with pytest.raises(SpecError) as info:
        omnispec.build(SPECS / "wan2.2-t2v-a14b.yaml", source=str(wan22_boundary_06), overrides=TINY_OVERRIDES["wan"])
    text = str(info.value)
    assert "recipe.phases.0.schedule.low" in text and "0.875" in text and "boundary_ratio 0.6" in text


def test_following_the_checkpoint_boundary_matches_diffusers(wan22_boundary_06):
    from diffusers import WanPipeline

    pipe = omnispec.build(SPECS / "wan2.2-t2v-a14b.yaml", source=str(wan22_boundary_06),
                          overrides=[*TINY_OVERRIDES["wan"], "recipe.defaults.steps=8", *FOLLOW])
    assert pipe.spec.recipe.phases[0].schedule.low == 0.6
    ours = pipe("a red car", seed=2)
    ref = WanPipeline.from_pretrained(str(wan22_boundary_06), dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    out = ref("a red car", height=32, width=32, num_frames=5, num_inference_steps=8, guidance_scale=4.0,
              guidance_scale_2=3.0, max_sequence_length=16, generator=torch.Generator("cpu").manual_seed(2),
              output_type="np").frames
    assert np.abs(ours.array - out).max() <= 1e-4


def test_explain_with_source_resolves_the_boundary_and_each_segments_steps(wan22_boundary_06, capsys):
    args = ["explain", str(SPECS / "wan2.2-t2v-a14b.yaml"), "--source", str(wan22_boundary_06), "--json",
            "--set", "recipe.defaults.steps=8", *[x for f in FOLLOW for x in ("--set", f)]]
    assert main(args) == 0
    phases = json.loads(capsys.readouterr().out)["phases"]
    high, low = phases
    assert high["schedule"].startswith("segment [0.6, 1]") and low["schedule"].startswith("segment [0, 0.6)")
    assert high["steps"] + low["steps"] == 8 and high["steps"] >= 1 and low["steps"] >= 1
    assert high["sigma_range"][1] >= 0.6 > low["sigma_range"][0]


def test_explain_without_source_says_the_split_is_unknown(capsys):
    assert main(["explain", str(SPECS / "wan2.2-t2v-a14b.yaml"), "--set", "recipe.defaults.steps=8", "--json"]) == 0
    phases = json.loads(capsys.readouterr().out)["phases"]
    assert [p["steps"] for p in phases] == [None, None]
    assert all(p["shared_steps"] == 8 and "unknown" in p["split"] for p in phases)


def test_component_class_mismatch_names_both_classes(flux_dir):
    with pytest.raises(SpecError, match=r"model.components.transformer.class: the spec loads "
                                        r"diffusers.SD3Transformer2DModel but .* diffusers.FluxTransformer2DModel"):
        omnispec.build(SPECS / "flux1-dev.yaml", source=str(flux_dir), overrides=[
            *TINY_OVERRIDES["flux"], "model.components.transformer.class=diffusers.SD3Transformer2DModel"])


def test_schedule_key_mismatch_names_the_field_and_both_values(flux_dir, capsys):
    sets = [x for o in [*TINY_OVERRIDES["flux"], "recipe.phases.0.schedule.max_shift=1.3"] for x in ("--set", o)]
    assert main(["run", str(SPECS / "flux1-dev.yaml"), "--source", str(flux_dir), *sets, "--prompt", "x",
                 "--output", "unused.png"]) == 2
    err = capsys.readouterr().err
    assert "recipe.phases.0.schedule.max_shift" in err and "1.3" in err and "1.15" in err and "Traceback" not in err


def test_shift_from_checkpoint_follows_the_scheduler_config(flux_dir):
    pipe = omnispec.build(SPECS / "flux1-dev.yaml", source=str(flux_dir),
                          overrides=[*TINY_OVERRIDES["flux"], "recipe.phases.0.schedule={kind: flow_match, "
                                     "shift: from_checkpoint}"])
    schedule = pipe.spec.recipe.phases[0].schedule
    assert (schedule.shift, schedule.max_shift, schedule.max_seq_len) == ("dynamic", 1.15, 4096)


def test_checks_can_be_switched_off_for_a_deliberate_difference(flux_dir):
    pipe = omnispec.build(SPECS / "flux1-dev.yaml", source=str(flux_dir), overrides=[
        *TINY_OVERRIDES["flux"], "recipe.phases.0.schedule.max_shift=1.3", "model.check_checkpoint=false"])
    assert pipe.spec.recipe.phases[0].schedule.max_shift == 1.3


def test_from_checkpoint_with_every_component_in_memory_is_refused(flux_dir):
    built = omnispec.build(SPECS / "flux1-dev.yaml", source=str(flux_dir), overrides=TINY_OVERRIDES["flux"])
    with pytest.raises(SpecError, match="no checkpoint to read them from"):
        omnispec.build(SPECS / "flux1-dev.yaml", components=built.components, overrides=[
            *TINY_OVERRIDES["flux"], "recipe.phases.0.schedule.shift=from_checkpoint"])
