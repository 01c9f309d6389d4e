import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from omnispec.spec import SpecError, dump_spec, load_spec, resolve_spec_data

from conftest import SPECS

BUNDLED = sorted(SPECS.glob("*.yaml"))


def test_bundled_specs_exist():
    names = {p.name for p in BUNDLED}
    for expected in ("flux1-dev.yaml", "flux1-schnell.yaml", "sd3.5-medium.yaml", "wan2.1-t2v-1.3b.yaml",
                     "wan2.2-t2v-a14b.yaml"):
        assert expected in names


@pytest.mark.parametrize("path", BUNDLED, ids=lambda p: p.name)
@pytest.mark.parametrize("fmt", ["yaml", "json"])
def test_bundled_spec_round_trips(path, fmt, tmp_path):
    spec = load_spec(path)
    out = tmp_path / f"spec.{fmt}"
    out.write_text(dump_spec(spec, fmt))
    assert load_spec(out) == spec


def test_importing_spec_layer_does_not_import_torch():
    code = "import sys, omnispec.spec, omnispec; omnispec.load_spec; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_extends_merges_mappings_and_replaces_lists(tmp_path):
    base = yaml.safe_load((SPECS / "wan2.1-t2v-1.3b.yaml").read_text())
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    (tmp_path / "child.yaml").write_text(yaml.safe_dump({
        "extends": "base.yaml", "name": "child", "recipe": {"defaults": {"steps": 7}}}))
    spec = load_spec(tmp_path / "child.yaml")
    assert spec.name == "child"
    assert spec.recipe.defaults.steps == 7
    assert spec.recipe.defaults.height == 480  # kept from the base


def test_extends_is_recursive_and_relative_to_each_file(tmp_path):
    (tmp_path / "a").mkdir()
    base = yaml.safe_load((SPECS / "flux1-dev.yaml").read_text())
    (tmp_path / "a" / "root.yaml").write_text(yaml.safe_dump(base))
    (tmp_path / "a" / "mid.yaml").write_text(yaml.safe_dump({"extends": "root.yaml", "name": "mid"}))
    (tmp_path / "leaf.yaml").write_text(yaml.safe_dump({"extends": "a/mid.yaml", "recipe": {"defaults": {"steps": 3}}}))
    spec = load_spec(tmp_path / "leaf.yaml")
    assert (spec.name, spec.recipe.defaults.steps) == ("mid", 3)


def test_cyclic_extends_is_rejected(tmp_path):
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(SpecError, match="cyclic extends"):
        load_spec(tmp_path / "a.yaml")


def test_missing_file_and_missing_base_name_the_file(tmp_path):
    with pytest.raises(SpecError, match="no such spec file"):
        load_spec(tmp_path / "nope.yaml")
    (tmp_path / "c.yaml").write_text("extends: gone.yaml\n")
    with pytest.raises(SpecError, match="gone.yaml"):
        load_spec(tmp_path / "c.yaml")


def test_overrides_parse_yaml_values_and_index_lists():
    spec = load_spec(SPECS / "sd3.5-medium.yaml", [
        "recipe.phases.0.schedule.steps=8",
        "recipe.phases.0.guidance.terms.1.layers=[3, 4]",
        "runtime.device=cpu",
    ])
    assert spec.recipe.phases[0].schedule.steps == 8
    assert spec.recipe.phases[0].guidance.terms[1].layers == [3, 4]
    assert spec.runtime.device == "cpu"


@pytest.mark.parametrize("override, fragment", [
    ("recipe.phases.5.name=x", "not an index"),
    ("recipe.phases.x.name=x", "not an index"),
    ("name.sub=1", "cannot descend"),
    ("noequals", "dotted.path=value"),
    ("recipe.defaults.stepz=3", "unknown key 'stepz'"),
    ("recipe.defaults.steps=many", "recipe.defaults.steps"),
])
def test_bad_override_is_a_spec_error(override, fragment):
    with pytest.raises(SpecError, match=fragment):
        load_spec(SPECS / "flux1-dev.yaml", [override])


def test_errors_name_the_field_path_without_union_tags():
    data, _ = resolve_spec_data(SPECS / "flux1-dev.yaml")
    data["recipe"]["phases"][0]["schedule"]["stepz"] = 3
    with pytest.raises(SpecError) as info:
        load_spec(data)
    assert [p.path for p in info.value.problems] == ["recipe.phases.0.schedule.stepz"]


def test_json_spec_is_read(tmp_path):
    data, _ = resolve_spec_data(SPECS / "flux1-dev.yaml")
    (tmp_path / "s.json").write_text(json.dumps(data))
    assert load_spec(tmp_path / "s.json").name == "flux1-dev"


def test_yaml_is_read_with_a_safe_loader(tmp_path):
    (tmp_path / "evil.yaml").write_text("name: !!python/object/apply:os.system ['echo hi']\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(tmp_path / "evil.yaml")


def test_untrusted_class_reference_needs_trust_code():
    data, _ = resolve_spec_data(SPECS / "flux1-dev.yaml")
    data["model"]["components"]["vae"]["class"] = "mypkg.models:MyVAE"
    with pytest.raises(SpecError, match="trust-code"):
        load_spec(data)
    assert load_spec(data, trust_code=True).model.components["vae"].class_ == "mypkg.models:MyVAE"
    data["model"]["family"] = "evil.fam:Family"
    with pytest.raises(SpecError, match="family"):
        load_spec(data)


def test_dump_of_a_dict_spec_round_trips():
    spec = load_spec(SPECS / "wan2.2-t2v-a14b.yaml")
    assert load_spec(yaml.safe_load(dump_spec(spec))) == spec
    assert Path  # keep import used
