"""The architecture holds: every kind of every concept has its implementation, a kind added from outside the
package (here, from a test) joins the spec and runs end to end, and imports point only the ways
docs/architecture.md draws them."""

from __future__ import annotations

import ast
import fnmatch
import json
import re
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
import pytest

import omnispec
from omnispec.runtime.families.digits import DigitsFamily
from omnispec.spec import SpecError
from omnispec.spec.guidance import GUIDANCE, Term, TermSpec
from omnispec.spec.guidance.base import StreamScale
from omnispec.spec.policies import CACHES, KERNEL_POLICIES, OFFLOADS, CacheSpec, KernelPolicySpec
from omnispec.spec.recipe import SAMPLERS, StochasticWindow
from omnispec.spec.schedule import SCHEDULES, SHARED_SCHEDULES

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "omnispec"
DIGITS = ROOT / "specs" / "digits.yaml"
REGISTRIES = (GUIDANCE, CACHES, OFFLOADS, SAMPLERS, SCHEDULES, SHARED_SCHEDULES)  # KERNEL_POLICIES: plugins' only


@pytest.mark.parametrize("registry", REGISTRIES, ids=lambda r: r.concept)
def test_every_kind_has_its_implementation(registry):
    assert registry.kinds, registry.concept
    for kind in registry.kinds:
        assert registry.implementation(kind) is not None, (registry.concept, kind)


def test_every_parallel_degree_is_an_axis_with_its_implementation():
    from omnispec.runtime.parallel.base import Axis
    from omnispec.spec.policies import PARALLEL_AXES, ParallelPolicy

    assert set(PARALLEL_AXES.names) == set(ParallelPolicy.model_fields)
    assert all(isinstance(PARALLEL_AXES.implementation(n), Axis) for n in PARALLEL_AXES.names)


def test_an_unknown_kind_is_an_error_naming_it_not_a_fallback():
    with pytest.raises(LookupError, match="guidance term kind 'nope' has no implementation"):
        GUIDANCE.implementation("nope")
    with pytest.raises(SpecError, match="cache"):
        omnispec.load_spec(DIGITS, ["policies.cache={kind: nope}"])


def test_every_stochastic_window_kind_has_a_mask():
    from omnispec.runtime.samplers import stochastic

    kinds = {get_args(cls.model_fields["kind"].annotation)[0] for cls in get_args(get_args(StochasticWindow)[0])}
    assert kinds == set(stochastic._WINDOW_FILLS)


# ---- kinds registered from outside the package ---------------------------------------------------------------

class DoubledCFG(TermSpec):
    """A test's guidance term: CFG whose delta counts twice, so scale s equals CFG at 2s - 1."""

    kind: Literal["doubled_cfg"]
    scale: StreamScale = 2.0


class DoubledDelta(Term):
    default_pass = "uncond"
    negative = True
    primary = True

    def coefficient(self, term: Any, value: float) -> float:
        return 2 * (value - 1)


class EveryOtherStep(CacheSpec):
    """A test's cache: computes even steps, reuses the last prediction on odd ones."""

    kind: Literal["every_other"]


@pytest.fixture
def registered():
    from omnispec.policies.caches.base import Cache

    class EveryOther(Cache):
        scoped = False

        def computes(self, policy: Any, step: int) -> bool:
            return step % 2 == 0

    GUIDANCE.register(DoubledCFG, DoubledDelta())
    CACHES.register(EveryOtherStep, EveryOther())
    yield
    GUIDANCE.unregister("doubled_cfg")
    CACHES.unregister("every_other")


def _digits(*overrides: str) -> Any:
    return omnispec.build(DIGITS, overrides=["recipe.defaults.steps=6", *overrides])("seven", seed=3).array


def test_a_guidance_term_and_a_cache_registered_by_a_test_run_end_to_end(registered):
    term = _digits("recipe.phases.0.guidance.terms=[{kind: doubled_cfg, scale: 2.0}]")
    assert np.array_equal(term, _digits("recipe.phases.0.guidance.terms=[{kind: cfg, scale: 3.0}]"))
    assert not np.array_equal(term, _digits("recipe.phases.0.guidance.terms=[{kind: cfg, scale: 2.0}]"))
    every_other = _digits("policies.cache={kind: every_other}")
    assert np.array_equal(every_other, _digits("policies.cache={kind: step_mask, mask: [true, false, true, false, "
                                               "true, false]}"))
    schema = json.dumps(omnispec.spec.PipelineSpec.model_json_schema())
    assert "doubled_cfg" in schema and "every_other" in schema


def test_unregistering_takes_a_kind_out_of_the_spec(registered):
    omnispec.load_spec(DIGITS, ["policies.cache={kind: every_other}"])
    CACHES.unregister("every_other")
    try:
        with pytest.raises(SpecError):
            omnispec.load_spec(DIGITS, ["policies.cache={kind: every_other}"])
    finally:
        CACHES.register(EveryOtherStep, CACHES.implementation("none"))  # the fixture takes it out again


# ---- a kernel policy registered from outside the package ------------------------------------------------------
# Adding a policy touches its spec field (a kind of ``KERNEL_POLICIES``), its policy object, its target dataclass and
# the families that support it (here a digits family with the target), nothing else of omnispec.

@dataclass(frozen=True)
class ScaledOutputTarget:
    """What the toy policy needs from a model: the linears whose outputs it scales."""

    linears: tuple[str, ...]


class ScaledOutput(KernelPolicySpec):
    """A test's kernel policy: scale the outputs of the linears its target names."""

    kind: Literal["scaled_output"]
    factor: float = 1.0


class ScaledOutputPolicy:
    def refusal(self, policy: ScaledOutput, targets: Any) -> str | None:
        return None if targets.find("scaled_output") is not None else targets.missing("scaled_output")

    def apply(self, policy: ScaledOutput, targets: Any, denoisers: dict) -> str:
        target = targets.find("scaled_output")
        hooked = [module.register_forward_hook(lambda m, args, out: out * policy.factor)
                  for denoiser in denoisers.values() for name, module in denoiser.named_modules()
                  if any(fnmatch.fnmatchcase(name, p) for p in target.linears)]
        return f"{len(hooked)} linears' outputs scaled by {policy.factor}"


class ScaledDigits(DigitsFamily):
    name = "scaled_digits"
    targets = replace(DigitsFamily.targets, extra={"scaled_output": ScaledOutputTarget(("blocks.*.attn.to_out.0",))})


@pytest.fixture
def scaled_output():
    KERNEL_POLICIES.register(ScaledOutput, ScaledOutputPolicy())
    yield
    KERNEL_POLICIES.unregister("scaled_output")


def _scaled(family: str, *kernels: str) -> Any:
    overrides = [f"model.family={family}", "recipe.defaults.steps=2", f"policies.kernels=[{', '.join(kernels)}]"]
    return omnispec.build(DIGITS, overrides=overrides, trust_code=True)


def test_a_kernel_policy_registered_by_a_test_runs_on_a_family_with_its_target(scaled_output):
    plain = _scaled("digits")("seven", seed=3).array
    same = _scaled("test_architecture:ScaledDigits", "{kind: scaled_output, factor: 1.0}")
    assert np.array_equal(same("seven", seed=3).array, plain)
    assert same.explain(as_dict=True)["applied"]["scaled_output"] == "5 linears' outputs scaled by 1.0"
    scaled = _scaled("test_architecture:ScaledDigits", "{kind: scaled_output, factor: 0.5}")
    assert not np.array_equal(scaled("seven", seed=3).array, plain)


def test_a_kernel_policy_on_a_family_without_its_target_is_the_one_refusal(scaled_output):
    with pytest.raises(SpecError, match=r"policies.kernels.0: family 'digits' has no scaled_output"):
        _scaled("digits", "{kind: scaled_output}")


def test_a_kind_registers_once():
    class Again(TermSpec):
        kind: Literal["cfg"]

    with pytest.raises(ValueError, match="registered already"):
        GUIDANCE.register(Again, DoubledDelta())


# ---- import arrows --------------------------------------------------------------------------------------------

# Which parts each part may import (a part: a top-level module or subpackage of omnispec; runtime's families/ is a
# part of its own). docs/architecture.md draws the same table; a new arrow is a design change made in both.
ALLOWED = {
    "spec": set(),
    "version": set(),
    "log": set(),
    "bridge": set(),
    "src_models": set(),
    "targets": set(),
    "kernels": {"spec", "log"},
    "records": {"spec", "version"},
    "families": {"spec", "bridge", "log", "targets"},
    "policies": {"spec", "bridge", "log", "targets", "kernels"},
    "runtime": {"spec", "families", "policies", "records", "bridge", "log", "targets", "kernels"},
    "estimate": {"spec", "families", "runtime", "policies", "log", "targets", "kernels"},  # what a policy keeps
    "rl": {"spec", "families", "runtime", "log"},
    "replaying": {"spec", "records", "runtime"},
    "draft": {"spec", "families", "runtime"},  # a weights file is recognised as loading recognises it
    "testing": {"spec"},
    "run_command": {"spec", "families", "runtime", "records", "replaying", "log"},
    "cli": {"spec", "families", "runtime", "policies", "records", "estimate", "draft", "run_command", "log",
            "version"},
    "__main__": {"cli"},
    "omnispec": {"spec", "runtime", "rl", "replaying", "version"},  # the package's own __init__: the public API
}


def part_of(module: str) -> str | None:
    names = module.split(".")
    if names[0] != "omnispec":
        return None
    if len(names) == 1:
        return "omnispec"
    if names[1] == "runtime" and len(names) > 2 and names[2] == "families":
        return "families"
    return names[1]


def module_name(path: Path) -> tuple[str, str]:
    """(module, the package its relative imports start from)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        name = ".".join(parts[:-1])
        return name, name
    name = ".".join(parts)
    return name, name.rsplit(".", 1)[0]


def imported(path: Path) -> set[str]:
    """Every omnispec module ``path`` imports (at any depth of its code, deferred imports included)."""
    _, package = module_name(path)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            if node.module:
                found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return {m for m in found if m.split(".")[0] == "omnispec"}


def sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_imports_point_only_the_drawn_ways():
    wrong = []
    for path in sources():
        here = part_of(module_name(path)[0])
        assert here in ALLOWED, f"{path.relative_to(ROOT)} is in no part of ALLOWED and docs/architecture.md"
        for target in sorted(imported(path)):
            there = part_of(target)
            if there not in (here, None) and there not in ALLOWED[here]:
                wrong.append(f"{path.relative_to(ROOT)} imports {target} ({here} -> {there})")
    assert not wrong, "\n".join(wrong)


def test_the_layers_below_import_nothing_heavy_when_imported():
    """What the text check cannot see: a package __init__ pulling a layer in. The spec layer never imports torch
    (a config tool, a CI linter reading specs), records read without the runtime, and the bridge reads nothing
    of ours."""
    probe = (
        "import sys, importlib; importlib.import_module(sys.argv[1]); "
        "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in ('omnispec', 'torch', 'diffusers'))))"
    )

    def loaded(module: str) -> set[str]:
        out = subprocess.run([sys.executable, "-c", probe, module], capture_output=True, text=True, check=True,
                             cwd=ROOT)
        return set(out.stdout.split())

    spec = loaded("omnispec.spec")
    assert "torch" not in spec and "diffusers" not in spec
    assert not {m for m in spec if m.startswith(("omnispec.runtime", "omnispec.policies", "omnispec.rl"))}
    records = loaded("omnispec.records")
    assert "torch" not in records and not {m for m in records if m.startswith("omnispec.runtime")}
    bridge = loaded("omnispec.bridge")
    assert {part_of(m) for m in bridge if m.startswith("omnispec")} <= {"omnispec", "bridge", "spec", "version",
                                                                        "src_models"}


# ---- what the kinds registries and the targets replaced -------------------------------------------------------
# Scanned in the syntax tree, not the text: a comment or a docstring naming these passes, code that does them fails.

def _class_names(node: ast.expr) -> list[str]:
    """The class names an ``isinstance`` second argument names (one class, or a tuple of them)."""
    classes = node.elts if isinstance(node, ast.Tuple) else [node]
    return [c.id if isinstance(c, ast.Name) else c.attr if isinstance(c, ast.Attribute) else "" for c in classes]


def schedule_isinstance_calls(tree: ast.AST) -> list[int]:
    """Lines of ``isinstance``/``issubclass`` calls that test for a schedule class (a name ending in ``Schedule``)."""
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2
            and any(name.endswith("Schedule") for name in _class_names(node.args[1]))]


def family_any_parameters(tree: ast.AST) -> list[int]:
    """Lines of parameters named ``family`` annotated ``Any`` (``typing.Any`` or the string ``"Any"``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
                if arg is None or arg.arg != "family" or arg.annotation is None:
                    continue
                note = arg.annotation
                if (isinstance(note, ast.Name) and note.id == "Any"
                        or isinstance(note, ast.Attribute) and note.attr == "Any"
                        or isinstance(note, ast.Constant) and note.value == "Any"):
                    found.append(arg.lineno)
    return found


def test_no_schedule_is_dispatched_by_isinstance():
    """A schedule answers through its kind (``ScheduleSpec``'s properties, the ``SCHEDULES`` registry), as every
    other kind does: no caller asks which schedule class it holds."""
    assert schedule_isinstance_calls(ast.parse("if isinstance(s, (int, spec.SchedulerSchedule)): pass")) == [1]
    found = [f"{p.relative_to(ROOT)}:{line}" for p in sources() for line in schedule_isinstance_calls(
        ast.parse(p.read_text()))]
    assert not found, "isinstance on a schedule class: " + ", ".join(found)


def test_no_parameter_takes_the_family_as_any():
    """A policy, axis or estimate takes the typed target it reads (``omnispec.targets``), never ``family: Any``."""
    assert family_any_parameters(ast.parse("def f(x, *, family: typing.Any = None): pass")) == [1]
    found = [f"{p.relative_to(ROOT)}:{line}" for p in sources() for line in family_any_parameters(
        ast.parse(p.read_text()))]
    assert not found, "family: Any at " + ", ".join(found)


def test_the_step_body_imports_no_policy():
    """``runtime/run.py`` consults its step policies through one protocol (``AppliedPolicies.steps``), never a
    policy module by name."""
    policies = sorted(m for m in imported(PACKAGE / "runtime" / "run.py") if part_of(m) == "policies")
    assert not policies, "runtime/run.py imports " + ", ".join(policies)


def test_architecture_page_places_every_file_and_draws_the_same_arrows():
    page = (ROOT / "docs" / "architecture.md").read_text()
    missing = [str(p.relative_to(ROOT)) for p in sources() if str(p.relative_to(ROOT)) not in page]
    assert not missing, "docs/architecture.md does not place: " + ", ".join(missing)
    table = page.split("<!-- arrows -->")[1]
    drawn = {}
    for line in table.splitlines():
        m = re.match(r"\| `(\w+)` \| (.*) \|$", line.strip())
        if m:
            drawn[m.group(1)] = set(re.findall(r"`(\w+)`", m.group(2)))
    assert drawn == ALLOWED
