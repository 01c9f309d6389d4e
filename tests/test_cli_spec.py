"""The spec-side CLI (validate, schema, explain) and its error contract, plus random spec mutations."""

import copy
import json
import subprocess
import sys

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnispec.cli import main
from omnispec.spec import SpecError, load_spec, resolve_spec_data

from conftest import SPECS, spec_paths


def cli(*args):
    return subprocess.run([sys.executable, "-m", "omnispec", *args], capture_output=True, text=True)


def test_validate_accepts_every_bundled_spec(capsys):
    assert main(["validate", *map(str, sorted(SPECS.glob("*.yaml")))]) == 0
    assert "ok" in capsys.readouterr().out


def test_schema_is_json_schema_of_the_spec(capsys):
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["type"] == "object" and {"model", "recipe", "policies"} <= set(schema["properties"])
    assert schema.get("additionalProperties") is False


def test_explain_json_has_the_contract_keys(capsys):
    assert main(["explain", str(SPECS / "wan2.2-t2v-a14b.yaml"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {"name", "components", "phases", "policies"} <= set(info)
    assert info["components"]["transformer_2"] == "denoiser"
    assert [(p["name"], p["denoiser"], p["passes"]) for p in info["phases"]] == [
        ("high_noise", "transformer", ["cond", "uncond"]), ("low_noise", "transformer_2", ["cond", "uncond"])]
    # how the checkpoint's scheduler splits the shared steps is unknown without --source
    assert all(p["steps"] is None and p["shared_steps"] == 40 for p in info["phases"])


def test_explain_text_compresses_repeated_steps(capsys):
    assert main(["explain", str(SPECS / "sd3.5-medium.yaml"), "--set", "recipe.phases.0.guidance.terms.1.scale=2.8"]) == 0
    out = capsys.readouterr().out
    assert "steps 1-7" in out and "skip_layer x2.8" in out


def test_explain_text_names_the_fused_kernels_and_compile_options(capsys):
    sets = ["policies.attention.fused_qk_norm_rope=true", "policies.mlp.fused_gelu=true",
            "policies.compile={mode: regional, cudagraphs: true}"]
    assert main(["explain", str(SPECS / "flux1-dev.yaml"), *[a for s in sets for a in ("--set", s)]]) == 0
    out = capsys.readouterr().out
    assert "per role -, q/k norms + RoPE in one kernel" in out and "  mlp          bias + GELU in the matmul" in out
    assert "  compile      regional (cudagraphs)" in out
    assert main(["explain", str(SPECS / "flux1-dev.yaml")]) == 0
    out = capsys.readouterr().out
    assert "mlp" not in out and "RoPE" not in out and "  compile      none\n" in out


@pytest.mark.parametrize("args, fragment", [
    (["validate", "missing.yaml"], "no such spec file"),
    (["validate", str(SPECS / "flux1-dev.yaml"), "--set", "recipe.defaults.stepz=2"], "recipe.defaults.stepz"),
    (["validate", str(SPECS / "flux1-dev.yaml"), "--set", "recipe.defaults.steps=lots"], "recipe.defaults.steps"),
    (["validate", str(SPECS / "flux1-dev.yaml"), "--set", "recipe.phases.9.name=x"], "not an index"),
    (["explain", str(SPECS / "flux1-dev.yaml"), "--set", "recipe.phases.0.denoiser=vae"], "recipe.phases.0.denoiser"),
])
def test_bad_input_exits_2_with_a_line_naming_file_and_field(args, fragment):
    res = cli(*args)
    assert res.returncode == 2, res.stderr
    assert fragment in res.stderr
    assert "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) <= 5


def test_cyclic_extends_exits_2(tmp_path):
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    res = cli("validate", str(tmp_path / "a.yaml"))
    assert res.returncode == 2 and "cyclic extends" in res.stderr and "Traceback" not in res.stderr


# ---- property-based: random mutations only ever produce SpecError --------------------------------

BASES = [resolve_spec_data(p)[0] for p in sorted(SPECS.glob("*.yaml"))]


def _mutate(data, path, action, junk):
    if not path:
        return junk if action == "retype" else data
    parent = data
    for p in path[:-1]:
        parent = parent[p]
    key = path[-1]
    if action == "drop":
        if isinstance(parent, dict):
            parent.pop(key)
        else:
            parent.pop(key)
    elif action == "rename" and isinstance(parent, dict):
        parent[str(key) + "_x"] = parent.pop(key)
    else:
        parent[key] = junk
    return data


JUNK = st.one_of(st.none(), st.integers(-3, 3), st.floats(allow_nan=True), st.text(max_size=5),
                 st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(base=st.sampled_from(range(len(BASES))), pick=st.integers(0, 10_000),
       action=st.sampled_from(["drop", "rename", "retype"]), junk=JUNK)
def test_random_mutations_fail_only_with_spec_error(base, pick, action, junk):
    data = copy.deepcopy(BASES[base])
    paths = list(spec_paths(data))
    data = _mutate(data, paths[pick % len(paths)], action, junk)
    try:
        load_spec(data)
    except SpecError as exc:
        assert exc.problems and all(str(p) for p in exc.problems)
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"{type(exc).__name__}: {exc}")


@settings(max_examples=40, deadline=None)
@given(pick=st.integers(0, 10_000), junk=st.sampled_from(["7", "x", "[1, 2]", "{a: 1}", "null", "-1"]))
def test_random_overrides_fail_cleanly(pick, junk, tmp_path_factory):
    data = BASES[0]
    paths = [p for p in spec_paths(data) if p]
    key = ".".join(map(str, paths[pick % len(paths)]))
    try:
        load_spec(SPECS / "flux1-dev.yaml", [f"{key}={junk}"])
    except SpecError:
        pass


def test_non_mapping_top_level_is_a_spec_error(tmp_path):
    (tmp_path / "list.yaml").write_text(yaml.safe_dump([1, 2]))
    with pytest.raises(SpecError, match="mapping"):
        load_spec(tmp_path / "list.yaml")
