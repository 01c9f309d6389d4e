"""``build(spec)``: validate, check the checkpoint, load components, apply policies, return a Pipeline."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..log import harmless_messages_demoted
from ..policies import apply_policies, check_policies, quantization, resolve_device
from ..policies.presets import preset_here
from ..records import checkpoint_record
from ..spec import PipelineSpec, SpecError, SpecTypeError, spec_with_overrides
from ..spec.checkpoint import (
    ESCAPE,
    INDEX_FILES,
    CheckpointConfigs,
    checkpoint_problems,
    follow_checkpoint,
    index_data,
    read_configs,
    unresolved,
)
from ..spec.devices import check_device_name
from ..spec.errors import Problem, quoted
from ..spec.explain import describe_weights
from ..spec.files import path_kind, read_json_file, user_path
from ..spec.model import BUILTIN_FAMILIES
from .components import check_source, load_components
from .families import checkpoint_pipelines, family_class
from .lora import adapter_files, load_adapter_slots
from .parallel import check_axes, distribute_axes, enable_axes
from .parallel import setup as setup_parallel
from .pipeline import Pipeline
from .threads import set_cpu_threads


def build(
    spec_or_path: PipelineSpec | str | Path | dict,
    source: str | None = None,
    overrides: Iterable[str] = (),
    device: str | torch.device | None = None,
    *,
    components: Mapping[str, Any] | None = None,
    process_group: Any = None,
    trust_code: bool = False,
    pipeline_class: type[Pipeline] = Pipeline,
) -> Pipeline:
    """Build a runnable pipeline.

    ``source`` replaces ``model.source`` (a local directory or Hub id); ``overrides`` are dotted
    ``key=value`` strings as for ``load_spec``; ``device`` replaces ``runtime.device``. Everything that
    can be checked without weights (family needs, policies against the device, the checkpoint's
    presence) is checked before the first weight loads. ``components`` supplies already-built modules
    by name (an RL trainer's, or random weights for a benchmark); only the others are loaded. With
    ``policies.parallel`` degrees above 1, the pipeline joins the initialised default process group (or
    ``process_group``), or initialises one from torchrun's environment. ``pipeline_class`` is what to
    return (``omnispec.build`` asks for the ``RLPipeline``, which adds rollouts).

    Arguments are checked first: ``spec_or_path`` a ``PipelineSpec``, path or mapping; ``source`` a path or
    None; ``overrides`` an iterable of ``"key=value"`` strings (not one string); ``device`` ``auto``, ``cpu``,
    ``mps``, ``cuda`` or ``cuda:N`` (a string or ``torch.device``) that exists here; ``components`` a mapping
    of component names; ``trust_code`` a bool. A wrong type raises ``SpecTypeError`` (a ``TypeError``), a
    wrong value ``SpecError`` (a ``ValueError``), naming the argument.
    """
    with harmless_messages_demoted():  # libraries imported on first load say what optional parts they lack
        return _build(spec_or_path, source, overrides, device, components, process_group, trust_code, pipeline_class)


def _build(spec_or_path: Any, source: Any, overrides: Any, device: Any, components: Any, process_group: Any,
           trust_code: bool, pipeline_class: type[Pipeline]) -> Pipeline:
    overrides = _check_arguments(spec_or_path, source, overrides, components, trust_code)
    if device is not None:
        check_device(device)
    spec = spec_with_overrides(spec_or_path, overrides, trust_code=trust_code)
    family_cls = family_class(spec.model.family)
    family_cls.check_spec(spec)
    if device is None:
        check_device(spec.runtime.device, "runtime.device")
    target = resolve_device(device or spec.runtime.device)
    if target.type == "cpu":
        set_cpu_threads(spec.runtime.threads)
    spec, preset = preset_here(spec, family_cls.targets, target)
    check_policies(spec, family_cls.targets, target)
    check_axes(spec, family_cls.targets)
    parallel = setup_parallel(spec, target, process_group)
    if parallel is not None and target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    given = dict(components or {})
    unknown = sorted(set(given) - set(spec.model.components))
    if unknown:
        raise SpecError.single(f"components {unknown} are not in the spec's profile", "components")
    missing = {n: c for n, c in spec.model.components.items() if n not in given}
    root = _checked_source(spec, source, missing, trust_code) if missing else None
    spec, configs = _against_checkpoint(spec, root, trust_code)
    loras = adapter_files(spec, trusted=trust_code)  # found and header-checked before any weight loads
    loaded = load_components(spec, root, only=missing, trusted=trust_code) if root is not None else {}
    modules = {name: given.get(name, loaded.get(name)) for name in spec.model.components}
    quantized = [note for name in given if (note := quantization.quantize_in_memory(
        spec, name, spec.model.components[name], given[name], target))]
    quantization.keep_input_gradients(modules)
    load_adapter_slots(spec, modules, family_cls.pipeline_class, loras)
    distribute_axes(parallel, spec, family_cls.targets, modules, target)
    applied = apply_policies(spec, family_cls.targets, modules, target)
    if quantized:
        applied.notes["quantization"] = "; ".join(quantized)
    if preset.name != "none":
        applied.notes["preset"] = preset.note()
    applied.preset = preset
    enable_axes(parallel, spec, family_cls.targets, modules)
    family = family_cls(spec, modules, target)
    pipe = pipeline_class(spec, family, modules, target, applied, parallel)
    pipe.checkpoint = checkpoint_record(spec, root, given, loras)  # what outputs record as their checkpoint
    pipe.weights = describe_weights(spec, configs, root, only=missing)
    return pipe


def _check_arguments(spec_or_path: Any, source: Any, overrides: Any, components: Any, trust_code: Any) -> list[str]:
    if not isinstance(spec_or_path, (PipelineSpec, str, os.PathLike, Mapping)):
        raise SpecTypeError.single(f"expected a PipelineSpec, a spec file path or a mapping, got "
                                   f"{type(spec_or_path).__name__}", "spec_or_path")
    if source is not None and not isinstance(source, (str, os.PathLike)):
        raise SpecTypeError.single(f"expected a checkpoint directory or Hub id, got {type(source).__name__}", "source")
    if isinstance(overrides, (str, bytes)) or not isinstance(overrides, Iterable):
        wrap = f" {quoted(overrides)} (wrap one override in a list)" if isinstance(overrides, str) else ""
        raise SpecTypeError.single(f"expected a list of 'key=value' strings, got {type(overrides).__name__}{wrap}",
                                   "overrides")
    overrides = list(overrides)
    for i, item in enumerate(overrides):
        if not isinstance(item, str):
            raise SpecTypeError.single(f"expected a 'key=value' string, got {type(item).__name__}", f"overrides.{i}")
    if components is not None:
        if not isinstance(components, Mapping):
            raise SpecTypeError.single(f"expected a mapping of component name to module, got "
                                       f"{type(components).__name__}", "components")
        for name in components:
            if not isinstance(name, str):
                raise SpecTypeError.single(f"component names are strings, got {type(name).__name__}", "components")
    if not isinstance(trust_code, bool):
        raise SpecTypeError.single(f"expected True or False, got {type(trust_code).__name__}", "trust_code")
    return overrides


def check_device(device: Any, where: str = "device") -> None:
    """``device`` names a device this machine has: ``auto``, ``cpu``, ``mps``, ``cuda`` or ``cuda:N`` (a string or a
    ``torch.device``)."""
    if isinstance(device, torch.device):
        device = f"cuda:{device.index}" if device.type == "cuda" and device.index is not None else device.type
    if not isinstance(device, str):
        raise SpecTypeError.single(f"expected a device name or torch.device, got {type(device).__name__}", where)
    check_device_name(device, where)


def _checked_source(spec: PipelineSpec, source: str | None, missing: Mapping[str, Any], trusted: bool) -> str:
    """``check_source``; where a local checkpoint fails it (a component folder the spec names is not there) and its
    pipeline index names a pipeline that another family runs, the refusal names that family."""
    try:
        return check_source(spec, source, missing, trusted=trusted)
    except SpecError as exc:
        hint = _other_family(spec, source or spec.model.source)
        if hint is None:
            raise
        raise SpecError([Problem(p.path, f"{p.message}; {hint}", p.file) for p in exc.problems]) from None


def _other_family(spec: PipelineSpec, root: str | None) -> str | None:
    """"its model_index.json names P, which family F runs", where P is no pipeline of the spec's family."""
    local = user_path(root) if root else None
    path = next((local / f for f in INDEX_FILES if path_kind(local / f) == "file"), None) if local else None
    if path is None:
        return None
    try:
        pipeline = index_data(read_json_file(path, where="model.source"), str(path)).get("_class_name")
    except SpecError:
        return None  # the checks that follow say what is wrong with it
    runs = [name for name in BUILTIN_FAMILIES if pipeline in checkpoint_pipelines(family_class(name))]
    if not runs or spec.model.family in runs:
        return None
    return (f"its {path.name} names {pipeline}, which family {runs[0]!r} runs, not {spec.model.family!r} (omnispec "
            "init drafts a spec for it)")


def _against_checkpoint(spec: PipelineSpec, root: str | None,
                        trusted: bool) -> tuple[PipelineSpec, CheckpointConfigs | None]:
    """Refuse a spec that disagrees with the checkpoint's config files, or whose components' configs name code for
    their loaders (unless ``trusted``); resolve its ``from_checkpoint`` values."""
    if root is None:
        if unresolved(spec):
            raise SpecError.single("the spec follows the checkpoint for some values (from_checkpoint), but every "
                                   "component was given in memory: there is no checkpoint to read them from",
                                   "model.source")
        return spec, None
    configs = read_configs(spec, root, trusted)
    foreign = family_class(spec.model.family).checkpoints.foreign_components
    problems = checkpoint_problems(spec, configs, foreign) + _model_index_problems(spec, configs)
    if problems:
        raise SpecError(problems)
    return follow_checkpoint(spec, configs), configs


def _model_index_problems(spec: PipelineSpec, configs: CheckpointConfigs) -> list[Problem]:
    """Pipeline settings of the checkpoint that change how its model runs, against what the family runs."""
    index = configs.model_index
    if index is None or not spec.model.check_checkpoint:
        return []
    return [Problem(where, f"{message}; {ESCAPE}") for where, message in
            family_class(spec.model.family).index_problems(spec, index)]
