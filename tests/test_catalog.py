"""Specs by name (bundled in the package), ``omnispec list``, and ``omnispec init`` drafting a spec that validates and
runs from each family's tiny checkpoint."""

import json
import os

import numpy as np
import pytest
import yaml
from PIL import Image

import omnispec
from omnispec.cli import main
from omnispec.spec import BUILTIN_FAMILIES, SpecError, load_spec
from omnispec.spec.catalog import bundled_dir, bundled_names
from omnispec.testing import TINY_OVERRIDES

from conftest import ROOT, SPECS


def test_bundled_specs_are_the_repository_specs_folder():
    assert bundled_dir() == SPECS
    assert set(bundled_names()) == {p.stem for p in SPECS.glob("*.yaml")}


@pytest.mark.parametrize("ref", ["flux1-dev", "flux1-dev.yaml"])
def test_a_bundled_spec_loads_by_name(ref):
    assert load_spec(ref) == load_spec(SPECS / "flux1-dev.yaml")


def test_an_existing_path_wins_over_a_bundled_name(tmp_path, monkeypatch):
    mine = yaml.safe_load((SPECS / "digits.yaml").read_text())
    mine["name"] = "my-digits"
    mine["model"]["source"] = str(SPECS.parent / "src_models/digits/weights")
    (tmp_path / "flux1-dev").write_text(yaml.safe_dump(mine))
    monkeypatch.chdir(tmp_path)
    assert load_spec("flux1-dev").name == "my-digits"


def test_extends_names_a_bundled_spec_from_a_file_and_from_a_dict(tmp_path):
    (tmp_path / "mine.yaml").write_text("extends: flux1-schnell\nname: mine\nrecipe: {defaults: {steps: 2}}\n")
    spec = load_spec(tmp_path / "mine.yaml")
    assert (spec.name, spec.model.source, spec.recipe.defaults.steps) == ("mine", "black-forest-labs/FLUX.1-schnell", 2)
    spec = load_spec({"extends": "digits", "name": "d", "recipe": {"defaults": {"steps": 3}}})
    assert spec.model.family == "digits" and spec.recipe.defaults.steps == 3
    with pytest.raises(SpecError, match="bundled spec"):
        load_spec({"extends": "no-such-spec", "name": "x"})


def test_an_unknown_name_names_the_nearest_bundled_specs_and_where_all_are_listed():
    with pytest.raises(SpecError) as found:
        load_spec("flux1dev")
    message = str(found.value)
    assert message.startswith("no such spec file 'flux1dev' and no bundled spec named 'flux1dev'; did you mean "
                              "'flux1-dev'"), message
    assert message.endswith("(omnispec list names the bundled specs)") and "qwen-image" not in message, message


def test_build_takes_a_bundled_name():
    pipe = omnispec.build("digits", overrides=["runtime.progress=false", "recipe.defaults.steps=2"])
    assert pipe("seven", seed=0).array.shape == (1, 32, 32, 1)


def test_list_shows_every_bundled_spec_with_family_task_and_source(capsys):
    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["name", "family", "task", "source"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:]}
    assert set(rows) == set(bundled_names())
    assert rows["flux1-dev"] == ["flux", "text-to-image", "black-forest-labs/FLUX.1-dev"]
    assert rows["digits"][:2] == ["digits", "text-to-image"]


def test_the_embedded_model_is_omnispec_src_models_and_only_our_packages_are_trusted():
    from omnispec.spec.model import TRUSTED_PACKAGES

    assert TRUSTED_PACKAGES == ("diffusers", "transformers", "omnispec")
    spec = load_spec("digits")
    assert spec.model.components["transformer"].class_ == "omnispec.src_models.digits.model:DigitsDiT"
    with pytest.raises(SpecError, match="--trust-code"):
        load_spec("digits", ["model.components.transformer.class=src_models.digits.model:DigitsDiT"])


# ---- omnispec init ------------------------------------------------------------------------------------------------

def _relabelled(fixture_dir, tmp_path, pipeline_class):
    """A view of a tiny checkpoint whose model_index.json names another pipeline class (as real Kontext ones do)."""
    view = tmp_path / "view"
    view.mkdir()
    for entry in fixture_dir.iterdir():
        if entry.name != "model_index.json":
            os.symlink(entry, view / entry.name)
    index = json.loads((fixture_dir / "model_index.json").read_text())
    (view / "model_index.json").write_text(json.dumps({**index, "_class_name": pipeline_class}))
    return view


def _qwen_processor(qwen_edit_dir):
    from omnispec.testing import qwen_vl_processor

    # transformers loads a Qwen2VLProcessor only with torchvision: handed in memory, as the family tests do.
    return {"processor": qwen_vl_processor(qwen_edit_dir / "processor")}


def _minimax_h3_processor(minimax_h3_dir):
    from omnispec.testing import minimax_h3_processor

    # transformers loads a Qwen3VLProcessor only with torchvision: handed in memory, as the family tests do.
    return {"processor": minimax_h3_processor(minimax_h3_dir / "processor")}


def _flux3_processor(flux3_dir):
    from omnispec.testing import flux3_processor

    # the tokenizer folder holds a Qwen3VLProcessor, which transformers loads only with torchvision: handed in memory
    return {"tokenizer": flux3_processor(flux3_dir / "tokenizer")}


FEW = ["recipe.defaults.steps=2"]
KONTEXT = [*TINY_OVERRIDES["flux"], "recipe.defaults.height=48", "model.options={max_area: 1536, auto_resize: false}"]
# family -> (fixture, pipeline class to relabel to or None, --family or None, overrides, request, components)
INIT_CASES = {
    "flux": ("flux_dir", None, None, TINY_OVERRIDES["flux"], {}, None),
    "flux_kontext": ("flux_dir", "FluxKontextPipeline", None, KONTEXT, {"image": "photo"}, None),
    "sd3": ("sd3_dir", None, None, TINY_OVERRIDES["sd3"], {}, None),
    "wan": ("wan22_dir", None, None, TINY_OVERRIDES["wan"], {}, None),
    "wan_i2v": ("wan_i2v_dir", None, None, TINY_OVERRIDES["wan_i2v"], {"image": "photo"}, None),
    # the same WanPipeline as wan's checkpoints: told apart by model_index.json's expand_timesteps
    "wan_ti2v": ("wan_ti2v_dir", None, None, [*TINY_OVERRIDES["wan"], "recipe.defaults.width=64"], {}, None),
    "flux_fill": ("flux_fill_dir", None, None, TINY_OVERRIDES["flux"], {"image": "photo", "mask": "mask"}, None),
    "flux2_klein": ("flux2_klein_dir", None, None, TINY_OVERRIDES["flux2_klein"], {}, None),
    # the plainest VACE template is the text-to-video one (references optional): no image
    "wan_vace": ("wan_vace_dir", None, None, TINY_OVERRIDES["wan"], {}, None),
    "ltx2": ("ltx2_dir", None, None, TINY_OVERRIDES["ltx2"], {}, None),
    "ltx2_condition": ("ltx2_dir", None, "ltx2_condition", TINY_OVERRIDES["ltx2"], {"image": "photo"}, None),
    "digits": (None, None, None, ["runtime.progress=false"], {}, None),
    "qwen_image": ("qwen_image_dir", None, None, TINY_OVERRIDES["qwen_image"], {}, None),
    "qwen_image_edit": ("qwen_edit_dir", None, None, TINY_OVERRIDES["qwen_image_edit"], {"image": "photo"},
                        _qwen_processor),
    "qwen_image_edit_plus": ("qwen_edit_dir", "QwenImageEditPlusPipeline", None, TINY_OVERRIDES["qwen_image_edit"],
                             {"image": "photo"}, _qwen_processor),
    # a text-to-image checkpoint (QwenImagePipeline): init drafts qwen_image unless told
    "qwen_image_inpaint": ("qwen_image_dir", None, "qwen_image_inpaint", TINY_OVERRIDES["qwen_image"],
                           {"image": "photo", "mask": "mask"}, None),
    "z_image": ("z_image_dir", None, None, TINY_OVERRIDES["z_image"], {}, None),
    "hunyuan_video15": ("hunyuan_video15_dir", None, None, TINY_OVERRIDES["hunyuan_video15"], {}, None),
    "hunyuan_video15_i2v": ("hunyuan_video15_i2v_dir", None, None, TINY_OVERRIDES["hunyuan_video15_i2v"],
                            {"image": "photo"}, None),
    "flux2": ("flux2_dir", None, None, TINY_OVERRIDES["flux2"], {}, None),
    "kandinsky6": ("kandinsky6_dir", None, None, TINY_OVERRIDES["kandinsky6"], {}, None),
    # the same LTX2Pipeline as LTX-2's checkpoints: told apart by model_index.json's diffusion_decoder
    "ltx25": ("ltx25_dir", None, None, TINY_OVERRIDES["ltx2"], {}, None),
    "ltx25_condition": ("ltx25_dir", None, "ltx25_condition", TINY_OVERRIDES["ltx2"], {"image": "photo"}, None),
    "ltx25_ic": ("ltx25_dir", None, "ltx25_ic", TINY_OVERRIDES["ltx2"], {"references": "reference_clip"}, None),
    "krea2": ("krea2_dir", None, None, TINY_OVERRIDES["krea2"], {}, None),
    # the tiny processor loads without torchvision through the class its overrides name
    "qwen_image21": ("qwen_image21_dir", None, None, TINY_OVERRIDES["qwen_image21"], {}, None),
    "minimax_h3": ("minimax_h3_dir", None, None, TINY_OVERRIDES["minimax_h3"], {}, _minimax_h3_processor),
    # checkpoints saved by the modular pipelines (modular_model_index.json), told apart by their pipeline class
    "flux3": ("flux3_dir", None, None, TINY_OVERRIDES["flux3"], {}, _flux3_processor),
    "flux3_distilled": ("flux3_distilled_dir", None, None, TINY_OVERRIDES["flux3"], {}, _flux3_processor),
    # the same checkpoint (both partitions): init drafts its t2va spec unless told
    "minimax_h3_ref2va": ("minimax_h3_dir", None, "minimax_h3_ref2va", TINY_OVERRIDES["minimax_h3_ref2va"],
                          {"references": "photo"}, _minimax_h3_processor),
    "kandinsky6_sr": ("kandinsky6_sr_dir", None, None, TINY_OVERRIDES["kandinsky6_sr"], {"video": "clip"}, None),
}


def test_every_family_has_an_init_case():
    assert set(INIT_CASES) == set(BUILTIN_FAMILIES)


@pytest.mark.parametrize("family", list(INIT_CASES))
def test_init_drafts_a_spec_that_validates_and_runs(family, request, tmp_path, photo, capsys):
    fixture, relabel, forced, overrides, fields, components = INIT_CASES[family]
    source = request.getfixturevalue(fixture) if fixture else ROOT / "src_models" / "digits" / "weights"
    if relabel:
        source = _relabelled(source, tmp_path, relabel)
    out = tmp_path / "drafted.yaml"
    assert main(["init", str(source), "-o", str(out), *(["--family", forced] if forced else [])]) == 0
    spec = load_spec(out, [*overrides, *FEW])
    assert spec.model.family == family
    assert spec.model.source == str(source.resolve())
    made = {"photo": Image.open(photo)}
    made["mask"] = Image.new("L", made["photo"].size, 255)  # repaint everything
    made["clip"] = [made["photo"].convert("RGB")] * 5  # a still video
    made["reference_clip"] = [{"video": made["clip"]}]  # a reference video of the request's length
    pipe = omnispec.build(spec, components=components(source) if components else None)
    result = pipe("a cat", seed=0, **{k: made[v] for k, v in fields.items()})
    assert result.array.size and np.isfinite(result.array).all()


def test_init_prints_the_draft_and_refuses_an_unknown_pipeline(flux_dir, tmp_path, capsys):
    assert main(["init", str(flux_dir)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# Drafted by `omnispec init") and "shift: from_checkpoint" in text
    assert "steps: 28" in text and "embedded: 3.5" in text  # FluxPipeline's own defaults
    view = _relabelled(flux_dir, tmp_path, "SomeOtherPipeline")
    assert main(["init", str(view)]) == 2
    assert "pass --family" in capsys.readouterr().err


def test_init_output_is_not_replaced_without_overwrite(flux_dir, tmp_path, capsys):
    out = tmp_path / "spec.yaml"
    out.write_text("mine")
    assert main(["init", str(flux_dir), "-o", str(out)]) == 2
    assert out.read_text() == "mine"
    assert main(["init", str(flux_dir), "-o", str(out), "--overwrite"]) == 0
    assert load_spec(out).model.family == "flux"
