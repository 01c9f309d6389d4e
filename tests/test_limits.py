"""Issue 17: bad input is a clear error (spec files, CLI, Python API), nothing is overwritten, the prompt-encoding
cache is bounded in bytes."""

import json
import math
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import omnispec
from omnispec.cli import main
from omnispec.rl import scale_lora, set_lora, update_weights
from omnispec.runtime.media import write_files
from omnispec.runtime.pipeline import EncodingCache, default_cache_bytes
from omnispec.spec import SpecError, load_spec
from omnispec.spec.base import MAX_EXTENDS, MAX_SPEC_BYTES, MAX_STEPS, SEED_MAX, SEED_MIN

from conftest import SPECS

DIGITS = SPECS / "digits.yaml"


@pytest.fixture(scope="module")
def pipe():
    return omnispec.build(DIGITS, overrides=["runtime.progress=false", "recipe.defaults.steps=2"])


def digits_text(tmp_path, **replace):
    """The digits spec as text, with its weights found from ``tmp_path`` and ``replace``'s substitutions."""
    text = DIGITS.read_text().replace("../src_models", str(SPECS.parent / "src_models"))
    for old, new in replace.items():
        assert old in text
        text = text.replace(old, new)
    return text


def refused(path_or_data, *fragments, overrides=()):
    with pytest.raises(SpecError) as info:
        load_spec(path_or_data, overrides)
    text = str(info.value)
    for fragment in fragments:
        assert fragment in text, text
    return info.value


# ---- spec files: bounded reading -----------------------------------------------------------------------

def alias_bomb(levels=9, width=9, inside="recipe.phases"):
    """A billion-laughs document whose last anchor sits in ``recipe.phases`` of an otherwise valid spec."""
    lines = ["    - &l0 {name: x, denoiser: transformer, schedule: {kind: flow_match}}"]
    lines += [f"    - &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels + 1)]
    assert inside == "recipe.phases"
    return ("omnispec: 1\nname: bomb\nmodel: {family: digits, components: {transformer: {role: denoiser, "
            "class: diffusers.X, subfolder: t}}}\nrecipe:\n  phases:\n" + "\n".join(lines) + "\n")


def test_alias_bomb_in_a_typed_field_is_refused_in_under_a_second_and_100_mb(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb())
    tracemalloc.start()
    start = time.perf_counter()
    refused(path, "bomb.yaml", "more than 100,000 values", "the limit")
    elapsed = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert elapsed < 1.0 and peak < 100 * 2**20, (elapsed, peak)


def test_alias_bomb_exits_2_from_the_cli_without_a_traceback(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb())
    res = subprocess.run([sys.executable, "-m", "omnispec", "validate", str(path)], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2 and "bomb.yaml" in res.stderr and "Traceback" not in res.stderr


def test_small_shared_aliases_still_load(tmp_path):
    text = digits_text(tmp_path, **{"terms: [{kind: cfg, scale: 3.0}]": "terms: [&t {kind: cfg, scale: 3.0}]"})
    text += "\n"
    path = tmp_path / "anchors.yaml"
    path.write_text(text)
    assert load_spec(path).recipe.phases[0].guidance.terms[0].scale == 3.0


@pytest.mark.parametrize("body", [
    "a: " + "[" * 10_000 + "]" * 10_000,
    "a: " + "{a: " * 10_000 + "1" + "}" * 10_000,
    "a:\n" + "".join("  " * i + "- \n" for i in range(1, 200)),
    "a: &a [*a]",
], ids=["lists", "maps", "block-lists", "recursive-alias"])
def test_deep_or_recursive_yaml_is_a_spec_error(tmp_path, body):
    path = tmp_path / "deep.yaml"
    path.write_text(body + "\n")
    refused(path, "deep.yaml", "not read")


def test_deep_json_is_a_spec_error(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    refused(path, "deep.json", "nested deeper than")


def test_brackets_inside_json_strings_do_not_count_as_nesting(tmp_path):
    spec = yaml.safe_load(digits_text(tmp_path))
    spec["name"] = "[[[[" * 20 + '\\"{' * 20
    path = tmp_path / "s.json"
    path.write_text(json.dumps(spec))
    assert load_spec(path).name == spec["name"]


def test_deep_python_mapping_is_a_spec_error():
    data: dict = {}
    node = data
    for _ in range(10_000):
        node["a"] = {}
        node = node["a"]
    refused(data, "nested deeper than")


def test_file_over_the_size_limit_is_refused_without_reading_it(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_bytes(b"# " + b"x" * MAX_SPEC_BYTES + b"\n")
    start = time.perf_counter()
    refused(path, "big.yaml", f"{MAX_SPEC_BYTES:,} bytes")
    assert time.perf_counter() - start < 1.0


def test_non_utf8_file_names_the_file(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: caf\xe9\n".encode("latin-1"))
    refused(path, "latin1.yaml", "not UTF-8", "0xe9")


@pytest.mark.parametrize("path, fragment", [
    (".", "not a regular file"), ("/dev/null", "not a regular file"), ("a\0b.yaml", "NUL"),
    ("x" * 5000 + ".yaml", "spec file"),
], ids=["folder", "device", "nul", "long"])
def test_odd_paths_are_spec_errors(path, fragment):
    refused(path, fragment)


def test_an_extends_chain_is_bounded(tmp_path):
    for i in range(MAX_EXTENDS + 2):
        (tmp_path / f"s{i}.yaml").write_text(f"extends: s{i + 1}.yaml\n")
    (tmp_path / f"s{MAX_EXTENDS + 2}.yaml").write_text(digits_text(tmp_path))
    refused(tmp_path / "s0.yaml", "extends chain")


def test_an_override_value_is_read_within_the_limits():
    bomb = "[" + ", ".join(["&a [x, x, x, x, x, x, x, x, x, x]"] + ["*a"] * 20) + "]"
    nested = "[" * 100 + "]" * 100
    for value in (nested,):
        with pytest.raises(SpecError, match="nested deeper"):
            load_spec(DIGITS, [f"recipe.phases.0.guidance.terms={value}"])
    with pytest.raises(SpecError):
        load_spec(DIGITS, [f"recipe.phases={bomb}"])


@pytest.mark.parametrize("override, path", [
    ("recipe.phases.0.guidance.terms.0.scale=.nan", "recipe.phases.0.guidance.terms.0.scale"),
    ("recipe.phases.0.guidance.terms.0.scale=.inf", "recipe.phases.0.guidance.terms.0.scale"),
    ("recipe.phases.0.guidance.terms.0.scale={latents: .nan}", "recipe.phases.0.guidance.terms.0.scale"),
    ("recipe.phases.0.guidance.terms.0.scale={by: step, points: [[0, 2.0], [1, -.inf]]}",
     "recipe.phases.0.guidance.terms.0.scale"),
    ("recipe.phases.0.guidance.embedded=.nan", "recipe.phases.0.guidance.embedded"),
    ("recipe.phases.0.guidance.rescale=.nan", "recipe.phases.0.guidance.rescale"),
    ("recipe.phases.0.schedule.shift=.nan", "recipe.phases.0.schedule.shift"),
    ("recipe.phases.0.schedule.base_shift=-.inf", "recipe.phases.0.schedule.base_shift"),
    ("recipe.phases.0.sampler={kind: sde, noise_level: .nan}", "recipe.phases.0.sampler.noise_level"),
    ("recipe.defaults.strength=.nan", "recipe.defaults.strength"),
    ("model.options={x: .nan}", "model.options.x"),
])
def test_non_finite_numbers_are_refused_in_every_float_field(override, path):
    error = refused(DIGITS, path, overrides=[override])
    assert any(p.path.startswith(path) and ("finite" in p.message or "nan" in p.message or "inf" in p.message)
               for p in error.problems), error


@pytest.mark.parametrize("override", [
    "recipe.defaults.steps=1000000000", "recipe.phases.0.schedule.steps=1000000000",
    "recipe.defaults.height=1000000", "recipe.constraints.max_size=1000000", "recipe.defaults.max_sequence_length=0",
    "runtime.seed=18446744073709551616", "runtime.device=tpu",
])
def test_steps_sizes_and_seeds_have_bounds(override):
    start = time.perf_counter()
    with pytest.raises(SpecError, match=override.split("=")[0]):
        load_spec(DIGITS, [override])
    assert time.perf_counter() - start < 1.0


def test_explain_at_the_step_limit_is_quick(capsys):
    start = time.perf_counter()
    assert main(["explain", str(DIGITS), "--set", f"recipe.defaults.steps={MAX_STEPS}", "--set",
                 "recipe.phases.0.guidance.terms.0.window={start: 0.0, end: 0.5}"]) == 0
    assert time.perf_counter() - start < 5.0
    assert f"steps 0-{MAX_STEPS // 2 - 1}" in capsys.readouterr().out


# ---- the CLI: arguments checked before any weight loads, outputs atomic and never replaced -----------------

@pytest.fixture
def no_build(monkeypatch):
    """Fail the test if the run gets as far as building (loading weights)."""
    import omnispec.runtime

    def refuse(*args, **kwargs):
        raise AssertionError("build was called: an argument check came too late")

    monkeypatch.setattr(omnispec.runtime, "build", refuse)


def run_cli(capsys, *args):
    code = main(["run", str(DIGITS), "--set", "runtime.progress=false", "--steps", "2", *args])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


@pytest.mark.parametrize("args, fragment", [
    (["--seed", str(2**70)], "seed"),
    (["--seed", str(2**64 - 1), "--prompt", "two"], "prompt 1 gets seed + 1"),
    (["--seed", str(-(2**63) - 1)], "seed"),
    (["--device", "tpu"], "--device"),
    (["--device", "cpu:x"], "--device"),
    (["--device", "cuda:99"], "--device"),
    (["--guidance-scale", "nan"], "guidance_scale"),
    (["--guidance-scale", "inf"], "guidance_scale"),
    (["--max-sequence-length", "0"], "max_sequence_length"),
    (["--steps", "100000"], "steps"),
    (["--height", "64"], "height 64"),
])
def test_bad_run_arguments_exit_2_before_any_weight_loads(capsys, tmp_path, no_build, args, fragment):
    code, err = run_cli(capsys, "--prompt", "one", "--output", str(tmp_path / "o.png"), *args)
    assert code == 2 and fragment in err, err
    assert not (tmp_path / "o.png").exists()


def test_every_problem_is_reported_at_once(capsys, tmp_path, no_build):
    code, err = run_cli(capsys, "--prompt", "one", "--guidance-scale", "nan", "--device", "tpu",
                        "--output", str(tmp_path / "o.txt"))
    assert code == 2 and len(err.strip().splitlines()) == 3, err


def test_an_existing_output_is_not_replaced_without_overwrite(capsys, tmp_path, no_build):
    out = tmp_path / "o.png"
    out.write_bytes(b"precious")
    code, err = run_cli(capsys, "--prompt", "one", "--output", str(out))
    assert code == 2 and "--overwrite" in err and out.read_bytes() == b"precious"


def test_each_output_of_a_batch_is_checked(capsys, tmp_path, no_build):
    (tmp_path / "o-1.png").write_bytes(b"precious")
    code, err = run_cli(capsys, "--prompt", "one", "--prompt", "two", "--output", str(tmp_path / "o.png"))
    assert code == 2 and "o-1.png exists" in err


def test_overwrite_replaces_an_existing_output(capsys, tmp_path):
    out = tmp_path / "o.png"
    out.write_bytes(b"old")
    code, err = run_cli(capsys, "--prompt", "one", "--output", str(out), "--overwrite")
    assert code == 0, err
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["o.png"]  # no temporary file left


@pytest.mark.parametrize("make, name, fragment", [
    (lambda d: (d / "out.png").mkdir(), "out.png", "is a directory"),
    (lambda d: (d / "file").write_text("x"), "file/sub/out.png", "is a file"),
])
def test_an_output_path_that_cannot_be_written_exits_2_before_the_run(capsys, tmp_path, no_build, make, name, fragment):
    make(tmp_path)
    code, err = run_cli(capsys, "--prompt", "one", "--output", str(tmp_path / name))
    assert code == 2 and fragment in err, err


def test_a_read_only_folder_exits_2(capsys, tmp_path, no_build):
    import os

    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        if os.access(folder, os.W_OK) and os.geteuid() == 0:
            (folder / "probe").touch()  # root writes anyway: nothing to test
            pytest.skip("root ignores folder permissions")
        code, err = run_cli(capsys, "--prompt", "one", "--output", str(folder / "o.png"))
        assert code == 2 and "cannot create files" in err
    finally:
        folder.chmod(0o700)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_folder_where_even_root_cannot_create_files_exits_2(capsys, no_build):
    code, err = run_cli(capsys, "--prompt", "one", "--output", "/proc/omnispec/o.png")
    assert code == 2 and "cannot create files in /proc" in err, err


def test_an_interrupted_write_leaves_no_file(tmp_path):
    target = tmp_path / "o.npy"

    def half_then_interrupt(path):
        path.write_bytes(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_files([(target, lambda p: p.write_bytes(b"done")), (tmp_path / "p.npy", half_then_interrupt)])
    assert list(tmp_path.iterdir()) == []


def test_a_file_that_appears_during_the_run_is_not_replaced(tmp_path):
    target = tmp_path / "o.npy"

    def racing_writer(path):
        target.write_bytes(b"someone else's")
        path.write_bytes(b"ours")

    with pytest.raises(SpecError, match="not replaced"):
        write_files([(target, racing_writer)])
    assert target.read_bytes() == b"someone else's" and list(tmp_path.iterdir()) == [target]


def test_output_save_refuses_to_replace_unless_asked(pipe, tmp_path):
    out = pipe("one", seed=0)
    (path,) = out.save(tmp_path / "a.npy")
    with pytest.raises(SpecError, match="overwrite=True"):
        out.save(path)
    assert out.save(path, overwrite=True) == [path]
    assert np.array_equal(np.load(path), out.array)


# ---- the Python API: arguments named in every error ---------------------------------------------------

@pytest.mark.parametrize("call, error, fragment", [
    (lambda p: p(123), TypeError, "prompt"),
    (lambda p: p(None), TypeError, "prompt"),
    (lambda p: p([]), ValueError, "prompt"),
    (lambda p: p(["one", 2]), TypeError, "prompt.1"),
    (lambda p: p("one", seed="abc"), TypeError, "seed"),
    (lambda p: p("one", seed=1.5), TypeError, "seed"),
    (lambda p: p("one", seed=True), TypeError, "seed"),
    (lambda p: p("one", seed=2**70), ValueError, "seed"),
    (lambda p: p(["one", "two"], seed=SEED_MAX), ValueError, "prompt 1 gets seed + 1"),
    (lambda p: p(["one", "two"], seed=[1]), ValueError, "seed"),
    (lambda p: p(["one", "two"], seed=[1, "x"]), TypeError, "seed.1"),
    (lambda p: p("one", guidance_scale=math.nan), ValueError, "guidance_scale"),
    (lambda p: p("one", guidance_scale=math.inf), ValueError, "guidance_scale"),
    (lambda p: p("one", guidance_scale="3"), ValueError, "guidance_scale"),
    (lambda p: p("one", steps=0), ValueError, "steps"),
    (lambda p: p("one", steps=True), ValueError, "steps"),
    (lambda p: p("one", steps=MAX_STEPS + 1), ValueError, "steps"),
    (lambda p: p("one", max_sequence_length=0), ValueError, "max_sequence_length"),
    (lambda p: p("one", stepz=3), TypeError, "stepz"),
    (lambda p: p("one", conditions=5), TypeError, "conditions"),
    (lambda p: p.generate({"prompt": "one"}), TypeError, "request"),
    (lambda p: p.generate(p.request("one"), decode="yes"), TypeError, "decode"),
    (lambda p: p.generate(p.request("one").model_copy(update={"height": 64})), ValueError, "height 64"),
])
def test_api_errors_name_the_argument(pipe, call, error, fragment):
    with pytest.raises(error) as info:
        call(pipe)
    assert isinstance(info.value, SpecError) and fragment in str(info.value), str(info.value)


def test_seed_bounds_are_torchs():
    generator = torch.Generator()
    for seed in (SEED_MIN, SEED_MAX):
        generator.manual_seed(seed)
    for seed in (SEED_MIN - 1, SEED_MAX + 1):
        with pytest.raises((RuntimeError, ValueError)):
            generator.manual_seed(seed)


def test_numpy_integers_are_seeds(pipe):
    assert np.array_equal(pipe("one", seed=np.int64(3)).array, pipe("one", seed=3).array)


@pytest.mark.parametrize("kwargs, error, fragment", [
    ({"spec_or_path": 123}, TypeError, "spec_or_path"),
    ({"overrides": "runtime.seed=1"}, TypeError, "wrap one override in a list"),
    ({"overrides": [1]}, TypeError, "overrides.0"),
    ({"device": "tpu"}, ValueError, "device"),
    ({"device": 0}, TypeError, "device"),
    ({"device": "cuda:3"}, ValueError, "device"),
    ({"source": 5}, TypeError, "source"),
    ({"components": ["transformer"]}, TypeError, "components"),
    ({"trust_code": "yes"}, TypeError, "trust_code"),
])
def test_build_checks_its_arguments(kwargs, error, fragment):
    kwargs = {"spec_or_path": DIGITS, **kwargs}
    with pytest.raises(error, match=fragment):
        omnispec.build(**kwargs)


def test_build_accepts_a_torch_device():
    assert omnispec.build(DIGITS, device=torch.device("cpu")).device.type == "cpu"


@pytest.mark.parametrize("call, error, fragment", [
    (lambda p, w: update_weights(object(), []), TypeError, "pipe"),
    (lambda p, w: update_weights(p, "abc"), TypeError, "named"),
    (lambda p, w: update_weights(p, [("x",)]), TypeError, "named.0"),
    (lambda p, w: update_weights(p, [(w, 1.0)]), TypeError, "named.0"),
    (lambda p, w: update_weights(p, {"nope": torch.zeros(1)}), ValueError, "no parameter"),
    (lambda p, w: update_weights(p, [], component=3), TypeError, "component"),
    (lambda p, w: update_weights(p, [], component="tokenizer"), ValueError, "no weights"),
    (lambda p, w: update_weights(p, [], component="vae"), ValueError, "no component"),
    (lambda p, w: set_lora(p, "", {}), ValueError, "name"),
    (lambda p, w: set_lora(p, 3, {}), TypeError, "name"),
    (lambda p, w: set_lora(p, "a", {}, scale=math.nan), ValueError, "scale"),
    (lambda p, w: set_lora(p, "a", [1]), TypeError, "state_dict"),
    (lambda p, w: set_lora(p, "a", {}), ValueError, "state_dict"),
    (lambda p, w: set_lora(p, "a", {"x.lora_A.weight": torch.zeros(2, 2)}), ValueError, "state_dict"),
    (lambda p, w: set_lora(p, "a", {"x": torch.zeros(1)}, metadata=[1]), TypeError, "metadata"),
    (lambda p, w: scale_lora(p, "missing", 1.0), ValueError, "name"),
    (lambda p, w: scale_lora(p, "missing", "1"), TypeError, "scale"),
])
def test_weight_sync_checks_its_arguments(pipe, call, error, fragment):
    name = next(iter(dict(pipe.components["transformer"].named_parameters())))
    version = pipe.weight_version
    with pytest.raises(error) as info:
        call(pipe, name)
    assert isinstance(info.value, SpecError) and fragment in str(info.value), str(info.value)
    assert not getattr(pipe.components["transformer"], "peft_config", {})
    assert pipe.weight_version >= version


def test_update_weights_copies_nothing_unless_every_tensor_fits(pipe):
    params = dict(pipe.components["transformer"].named_parameters())
    (first, p1), (second, _) = list(params.items())[:2]
    before = p1.detach().clone()
    with pytest.raises(SpecError, match="shape"):
        update_weights(pipe, [(first, p1 + 1), (second, torch.zeros(1, 2, 3))])
    assert torch.equal(params[first], before)


def test_update_weights_takes_a_state_dict(pipe):
    name, param = next(iter(pipe.components["transformer"].named_parameters()))
    assert update_weights(pipe, {name: param.detach().clone()}) == 1


# ---- the prompt-encoding cache is bounded in bytes ------------------------------------------------------

def fake_encoding(nbytes):
    from omnispec.runtime.families import Conditioning

    return Conditioning({"x": torch.zeros(nbytes // 4, dtype=torch.float32)})


def test_encoding_cache_holds_at_most_its_bytes_least_recently_used_first():
    cache = EncodingCache(1000)
    for key in "abc":
        cache.put(key, fake_encoding(400))
    assert len(cache) == 2 and cache.nbytes == 800 and cache.get("a") is None
    cache.get("b")
    cache.put("d", fake_encoding(400))
    assert cache.get("c") is None and cache.get("b") is not None
    cache.put("huge", fake_encoding(4000))
    assert cache.get("huge") is None and cache.nbytes <= 1000


def test_default_cache_bound_is_a_small_fraction_of_memory():
    import os

    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert default_cache_bytes(torch.device("cpu")) == host // 100


def test_cache_bound_comes_from_the_spec_and_zero_caches_nothing():
    off = omnispec.build(DIGITS, overrides=["runtime.progress=false", "runtime.encoding_cache_bytes=0"])
    on = omnispec.build(DIGITS, overrides=["runtime.progress=false", "runtime.encoding_cache_bytes=4096"])
    assert on._encodings.max_bytes == 4096
    a = off(["one", "two"], seed=0, steps=2).array
    assert len(off._encodings) == 0
    assert np.array_equal(a, on(["one", "two"], seed=0, steps=2).array) and 0 < on._encodings.nbytes <= 4096


def test_a_weight_change_empties_the_cache(pipe):
    pipe(["one", "two"], seed=0)
    assert len(pipe._encodings) > 0
    name, param = next(iter(pipe.components["transformer"].named_parameters()))
    update_weights(pipe, [(name, param.detach().clone())])
    pipe("one", seed=0)
    assert len(pipe._encodings) == 2  # this request's positive and negative prompts only
