"""Property-based (hypothesis, derandomized): over spec files, requests, CLI arguments and API calls, the only
exceptions are the documented ones (``SpecError``, a ``ValueError``; ``SpecTypeError``, also a ``TypeError``) and
the CLI answers bad input with exit 2 and one line per problem, never a traceback."""

import contextlib
import copy
import io
import json
import math
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import omnispec
from omnispec.cli import main
from omnispec.rl import scale_lora, set_lora, update_weights
from omnispec.spec import SpecError, SpecTypeError, load_spec, resolve_spec_data
from omnispec.spec.base import MAX_SIZE, MAX_STEPS, SEED_MAX, SEED_MIN
from omnispec.spec.request import Request

from conftest import SPECS, spec_paths

DIGITS = SPECS / "digits.yaml"
PROFILE = dict(derandomize=True, database=None, deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
BASES = [resolve_spec_data(p)[0] for p in sorted(SPECS.glob("*.yaml"))]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The digits model is tiny: one thread is as fast as two, and far faster when the cores are shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("properties")


@pytest.fixture(scope="module")
def pipe():
    return omnispec.build(DIGITS, overrides=["runtime.progress=false", "recipe.defaults.steps=1"])


def only_spec_errors(call):
    """Run ``call``; a ``TypeError`` must be our ``SpecTypeError``, any other exception but ``SpecError`` fails."""
    try:
        return call()
    except SpecError as exc:
        assert exc.problems and all(str(p).strip() and "\n" not in p.message for p in exc.problems), exc
        if isinstance(exc, TypeError):
            assert isinstance(exc, SpecTypeError)
        return exc


# ---- values that break things: non-finite, huge, wrong types, deep ---------------------------------------

NUMBERS = st.one_of(
    st.integers(-3, 3), st.integers(), st.sampled_from([0, -1, MAX_STEPS, MAX_STEPS + 1, MAX_SIZE + 1, 2**63, 2**64,
                                                         2**70, -(2**70)]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -0.0]),
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, st.text(max_size=6))
JUNK = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)), max_leaves=12)


def _set(data, path, value):
    if not path:
        return value
    node = data
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return data


def _deep(depth, kind):
    text = "[" * depth + "]" * depth if kind == "list" else "{a: " * depth + "1" + "}" * depth
    return text


# ---- specs -------------------------------------------------------------------------------------------

@settings(max_examples=250, **PROFILE)
@given(base=st.sampled_from(range(len(BASES))), pick=st.integers(0, 10_000), junk=JUNK,
       fmt=st.sampled_from(["yaml", "json"]))
def test_spec_files_with_any_value_anywhere_fail_only_with_spec_errors(work, base, pick, junk, fmt):
    data = copy.deepcopy(BASES[base])
    data.pop("extends", None)
    paths = list(spec_paths(data))
    data = _set(data, paths[pick % len(paths)], junk)
    path = work / f"spec.{fmt}"
    if fmt == "json":
        path.write_text(json.dumps(data, allow_nan=True))
    else:
        path.write_text(yaml.safe_dump(data, allow_unicode=True))
    result = only_spec_errors(lambda: load_spec(path))
    event(type(result).__name__)
    if not isinstance(result, SpecError):
        for value in _floats(result.model_dump()):
            assert math.isfinite(value)


def _floats(node):
    if isinstance(node, float):
        yield node
    elif isinstance(node, dict):
        for v in node.values():
            yield from _floats(v)
    elif isinstance(node, (list, tuple)):
        for v in node:
            yield from _floats(v)


# Pieces of YAML text, good and bad: anchors and aliases, deep nesting, tags, odd scalars, broken syntax.
YAML_PIECES = st.sampled_from([
    "a: &x [1, 2]\n", "b: *x\n", "c: [*x, *x, *x]\n", "d: &y [*x, *x, *x, *x]\n", "e: [*y, *y, *y, *y, *y]\n",
    "f: &r [*r]\n", "g: !!python/object:os.system x\n", "h: !!binary aGVsbG8=\n", "i: .nan\n", "j: -.inf\n",
    "k: 1e999\n", "l: 0x7fffffffffffffffffff\n", "m: " + _deep(40, "list") + "\n", "n: " + _deep(40, "map") + "\n",
    "o: [\n", "p: {a: 1\n", "- 1\n", "q: 'unterminated\n", "r: \t\n", "s: \x00\n", "<<: *x\n", "t: {<<: *x}\n",
    "omnispec: 1\n", "name: x\n", "recipe: {phases: *y}\n", "model: *x\n", "---\n", "...\n", "%YAML 1.1\n",
    "u: @\n", "v: `\n", "w: |\n  text\n", "x: >-\n  folded\n", "? [complex, key]\n: 1\n", "y: !!set {a, b}\n",
    "z: 2001-12-14t21:59:43.10-05:00\n",
])


@settings(max_examples=200, **PROFILE)
@given(pieces=st.lists(YAML_PIECES, min_size=1, max_size=8), raw=st.binary(max_size=20))
def test_any_yaml_text_or_bytes_fails_only_with_spec_errors(work, pieces, raw):
    path = work / "text.yaml"
    path.write_bytes("".join(pieces).encode() + raw)
    only_spec_errors(lambda: load_spec(path))
    only_spec_errors(lambda: load_spec(DIGITS, [f"recipe.phases.0.guidance={''.join(pieces)}"]))


# ---- requests ------------------------------------------------------------------------------------------

# Each strategy below draws a valid value about half the time, so that valid requests run too.
VALID_PROMPTS = st.one_of(st.text(max_size=12), st.lists(st.text(max_size=8), min_size=1, max_size=3),
                          st.sampled_from(["seven", "the digit 4", "", ("one", "two")]))
PROMPTS = st.one_of(VALID_PROMPTS, VALID_PROMPTS, st.none(), st.integers(), st.just([]),
                    st.lists(st.one_of(st.integers(), st.text(max_size=3)), max_size=2))
SEEDS = st.one_of(st.none(), st.integers(0, 2**32), st.integers(SEED_MIN - 2, SEED_MAX + 2),
                  st.sampled_from([SEED_MAX, SEED_MAX - 1, SEED_MIN, 2**63, 2**70, -(2**70)]), st.floats(),
                  st.text(max_size=3), st.booleans(), st.lists(st.integers(-5, 5), max_size=3),
                  st.lists(st.one_of(st.integers(), st.text()), max_size=3))
VALID_FIELDS = st.fixed_dictionaries({}, optional={
    "height": st.just(32), "width": st.just(32), "steps": st.integers(1, 2), "max_sequence_length": st.integers(1, 8),
    "guidance_scale": st.floats(-10, 10), "negative_prompt": st.text(max_size=6)})
FIELD_VALUES = st.one_of(NUMBERS, st.booleans(), st.text(max_size=4), st.none(), st.lists(st.integers(), max_size=2),
                         st.sampled_from([32, 1, 2, 8, 0.5, 3.0, 64]))
BAD_FIELDS = st.dictionaries(st.sampled_from(["height", "width", "frames", "fps", "steps", "guidance_scale",
                                              "max_sequence_length", "strength", "negative_prompt", "image",
                                              "conditions", "stepz", "seed_"]), FIELD_VALUES, max_size=3)
FIELDS = st.one_of(VALID_FIELDS, VALID_FIELDS, BAD_FIELDS)


@settings(max_examples=300, **PROFILE)
@given(prompt=PROMPTS, seed=SEEDS, fields=FIELDS)
def test_requests_fail_only_with_documented_errors_and_valid_ones_run(pipe, prompt, seed, fields):
    fields = {k: (min(v, 2) if k == "steps" and isinstance(v, int) and not isinstance(v, bool) else v)
              for k, v in fields.items()}
    result = only_spec_errors(lambda: pipe.request(prompt, seed, **fields))
    event(type(result).__name__)
    if isinstance(result, Request):
        assert all(SEED_MIN <= s <= SEED_MAX for s in result.seeds)
        assert result.guidance_scale is None or math.isfinite(result.guidance_scale)
        out = pipe.generate(result)
        assert out.array.shape[0] == len(result.prompts) and np.isfinite(out.array).all()


# ---- CLI arguments ---------------------------------------------------------------------------------------

def _values(valid, invalid):
    """Valid values drawn about as often as invalid ones."""
    return st.one_of(st.sampled_from(valid), st.sampled_from(invalid))


OPTION_VALUES = {
    "--prompt": _values(["seven", "", "the digit 4", "x" * 300, "@"], ["--"]),
    "--negative-prompt": _values(["blurry", ""], ["--"]),
    "--height": _values(["32"], ["64", "0", "-32", "x", "1e3", str(2**70)]),
    "--width": _values(["32"], ["33", "nan"]),
    "--frames": st.sampled_from(["1", "0"]),
    "--fps": st.sampled_from(["16", "0", "inf"]),
    "--steps": _values(["1", "2"], ["0", "-1", "100000", "x", "2.5"]),
    "--guidance-scale": _values(["3", "1", "0", "-2.5"], ["nan", "inf", "-inf", "1e400", "x"]),
    "--max-sequence-length": _values(["8", "1"], ["0", "9", "-3", str(2**70)]),
    "--strength": st.sampled_from(["0.5", "nan"]),
    "--seed": _values(["0", "-1", str(SEED_MAX), str(SEED_MIN), "12345"], [str(SEED_MAX + 1), str(2**70),
                                                                           str(SEED_MIN - 1), "x", "1.0"]),
    "--device": _values(["cpu", "auto"], ["tpu", "cpu:x", "cuda", "cuda:3", "", "CPU", "mps"]),
    "--image": st.sampled_from(["missing.png", "in.png@3", "@"]),
    "--set": _values(["runtime.seed=3", "runtime.encoding_cache_bytes=0", "recipe.phases.0.guidance.terms=[]"],
                     ["recipe.defaults.steps=.nan", "recipe.defaults.steps=1000000000",
                      "recipe.phases.0.guidance.terms.0.scale=.inf", "x", "=", "a.b=[[[[", "runtime=1",
                      "recipe.phases.9.name=x"]),
    "--source": st.sampled_from(["missing-dir", "/"]),
}
VALID_OPTIONS = ["--prompt", "--negative-prompt", "--height", "--width", "--steps", "--guidance-scale",
                 "--max-sequence-length", "--seed", "--device", "--set"]
OUTPUTS = _values(["o.png", "o.npy", "o.jpg", "sub/o.png", "existing.png"],
                  ["o.gif", "o.txt", "o", "dir.png", "file/o.png"])


@settings(max_examples=200, **PROFILE)
@given(options=st.lists(st.one_of(st.sampled_from(VALID_OPTIONS), st.sampled_from(VALID_OPTIONS),
                                  st.sampled_from(sorted(OPTION_VALUES))).flatmap(
    lambda o: st.tuples(st.just(o), OPTION_VALUES[o])), max_size=4), output=OUTPUTS, overwrite=st.booleans(),
    flags=st.sampled_from([[], [], [], ["--trust-code"], ["--bogus"], ["--json"]]))
def test_cli_run_answers_every_argument_list_without_a_traceback(work, options, output, overwrite, flags):
    folder = Path(tempfile.mkdtemp(dir=work))
    (folder / "dir.png").mkdir()
    (folder / "file").write_text("x")
    (folder / "existing.png").write_bytes(b"precious")
    argv = ["run", str(DIGITS), "--set", "runtime.progress=false", "--steps", "1", "--prompt", "one"]
    for option, value in options:
        argv += [option, value] if value else [option]
    argv += ["--output", str(folder / output)] + (["--overwrite"] if overwrite else []) + flags
    code, err = _main(argv)
    event(f"exit {code}")
    assert "Traceback" not in err
    assert code in (0, 2), (code, err)
    if code == 2:
        assert err.strip() and (err.startswith("usage:") or all(line.startswith("error: ")
                                                               for line in err.strip().splitlines())), err
    if not overwrite or code != 0:
        assert (folder / "existing.png").read_bytes() == b"precious"
    assert not list(folder.rglob(".*.tmp*"))  # no temporary file left behind


@settings(max_examples=120, **PROFILE)
@given(command=st.sampled_from(["validate", "explain"]), sets=st.lists(OPTION_VALUES["--set"], max_size=3),
       junk=st.lists(st.tuples(st.sampled_from(["recipe.defaults.steps", "recipe.phases.0.schedule.shift",
                                                "recipe.phases.0.guidance.terms", "policies.cache", "runtime.seed",
                                                "model.options.x", "recipe"]),
                               st.sampled_from([".nan", "1e999", "[[[[[[]]]]]]", "&a [*a]", "!!python/name:os.system",
                                                "{kind: cfg, scale: .inf}", "10001", "-1", "'", "~"])), max_size=2),
       as_json=st.booleans())
def test_cli_validate_and_explain_answer_every_override_without_a_traceback(command, sets, junk, as_json):
    argv = [command, str(DIGITS)]
    for item in sets:
        argv += ["--set", item]
    for key, value in junk:
        argv += ["--set", f"{key}={value}"]
    if as_json and command == "explain":
        argv.append("--json")
    code, err = _main(argv)
    assert "Traceback" not in err and code in (0, 2), (code, err)


def _main(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse: usage line, exit 2
            code = exc.code
    return code, err.getvalue()


# ---- API calls -----------------------------------------------------------------------------------------

BUILD_ARGS = st.fixed_dictionaries({}, optional={
    "spec_or_path": st.sampled_from([str(DIGITS), DIGITS, 5, None, "missing.yaml", b"x", {"omnispec": 1},
                                     [str(DIGITS)], "a\0b", "", "/dev/null", str(SPECS)]),
    "source": st.sampled_from([None, 3, str(SPECS.parent / "src_models/digits/weights"), "missing-dir"]),
    "overrides": st.sampled_from([(), "runtime.seed=1", ["runtime.seed=1"], [3], None, ["runtime.device=tpu"],
                                  ["recipe.defaults.steps=.nan"], ("runtime.progress=false",)]),
    "device": st.sampled_from([None, "cpu", "tpu", 0, torch.device("cpu"), "cuda:1", "auto", ""]),
    "components": st.sampled_from([None, {}, ["transformer"], {3: None}, {"nope": None}]),
    "trust_code": st.sampled_from([False, True, "yes", None]),
})


@settings(max_examples=100, **PROFILE)
@given(kwargs=BUILD_ARGS)
def test_build_fails_only_with_documented_errors(kwargs):
    kwargs.setdefault("spec_or_path", DIGITS)
    result = only_spec_errors(lambda: omnispec.build(**kwargs))
    event(type(result).__name__)
    if not isinstance(result, SpecError):  # built: on the CPU, unless a CUDA device this machine has was named
        assert result.device.type == ("cuda" if str(kwargs.get("device")).startswith("cuda") else "cpu")


WEIGHT_CALLS = st.sampled_from(["update_weights", "set_lora", "scale_lora"])
TENSORISH = st.sampled_from(["param", "zeros", "wrong-shape", 1.0, None, "text"])
SCALES = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([True, "1", None, 0, 1]))


@settings(max_examples=120, **PROFILE)
@given(call=WEIGHT_CALLS, name=st.sampled_from(["param", "nope", "", 3, None]), value=TENSORISH,
       container=st.sampled_from(["pairs", "dict", "str", "tensor", "none", "triples"]), scale=SCALES,
       component=st.sampled_from([None, "transformer", "tokenizer", "nope", 1]))
def test_weight_sync_fails_only_with_documented_errors(pipe, call, name, value, container, scale, component):
    params = dict(pipe.components["transformer"].named_parameters())
    first = next(iter(params))
    key = first if name == "param" else name
    tensor = {"param": params[first].detach().clone(), "zeros": torch.zeros_like(params[first]),
              "wrong-shape": torch.zeros(3, 1, 7)}.get(value, value) if isinstance(value, str) else value
    named = {"pairs": [(key, tensor)], "dict": {key: tensor}, "str": "abc", "tensor": torch.zeros(2), "none": None,
             "triples": [(key, tensor, 1)]}[container]
    before = params[first].detach().clone()  # the one parameter a call here can change
    try:
        if call == "update_weights":
            only_spec_errors(lambda: update_weights(pipe, named, component=component))
        elif call == "set_lora":
            only_spec_errors(lambda: set_lora(pipe, key, named, scale=scale, component=component))
        else:
            only_spec_errors(lambda: scale_lora(pipe, key, scale, component=component))
    finally:
        dit = pipe.components["transformer"]
        for adapter in list(getattr(dit, "peft_config", {})):
            dit.delete_adapters(adapter)
        with torch.no_grad():
            params[first].copy_(before)
