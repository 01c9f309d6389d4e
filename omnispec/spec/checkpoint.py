"""The spec against the checkpoint's own small config files, before any weight loads.

``model_index.json`` names each component's class and carries pipeline settings such as a two-expert
``boundary_ratio``; ``scheduler/scheduler_config.json`` holds the keys that decide the sigmas. A spec that
disagrees with them would run, and silently differ from what the checkpoint's authors (and diffusers) run,
so a mismatch is an error naming both values. A spec may instead *follow* the checkpoint for a value by
writing ``from_checkpoint`` (a segment bound, a flow-matching shift); ``follow_checkpoint`` resolves those.
Reading these files loads no weights and imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .bounded import CONFIG
from .errors import Problem, SpecError, quoted
from .files import path_kind, read_json_file, user_path
from .hub import hub_file, is_hub_id
from .loader_fields import code_problems, quantization_problem
from .model import WEIGHTLESS_ROLES
from .pipeline import PipelineSpec
from .prequantized import PreQuantized, prequantized
from .recipe import PreviousInput
from .schedule import FROM_CHECKPOINT

ESCAPE = "set model.check_checkpoint: false to run it anyway"
# A checkpoint's pipeline index: diffusers' pipelines save the first, its modular pipelines the second.
INDEX_FILES = ("model_index.json", "modular_model_index.json")
# transformers' Auto classes a spec may name, with what each loads (class names end so, after a Fast/Pil suffix).
# Pipeline components that are denoisers, by the names diffusers gives them.
DENOISER_NAMES = ("transformer", "unet")
AUTO_LOADS = {"AutoTokenizer": ("Tokenizer",), "AutoProcessor": ("Processor",),
              "AutoImageProcessor": ("ImageProcessor",), "AutoFeatureExtractor": ("FeatureExtractor",)}


@dataclass
class CheckpointConfigs:
    """The checkpoint's config files that were found (absent files are simply not checked)."""

    root: str
    model_index: dict[str, Any] | None = None
    schedulers: dict[str, dict[str, Any]] = field(default_factory=dict)  # scheduler subfolder -> config
    components: dict[str, dict[str, Any]] = field(default_factory=dict)  # component with overrides -> config.json
    prequantized: dict[str, PreQuantized] = field(default_factory=dict)  # component -> its quantization_config

    @property
    def boundary_ratio(self) -> float | None:
        value = (self.model_index or {}).get("boundary_ratio")
        return float(value) if value is not None else None


def read_configs(spec: PipelineSpec, root: str, trusted: bool = False) -> CheckpointConfigs:
    """The small config files of ``root`` (a local directory, or a Hub id from the cache or the Hub), each read within
    bounds and its keys that omnispec reads type-checked (an error names the file and the key). A component's
    ``config.json`` is refused where its ``quantization_config`` is malformed, and, unless ``trusted``, where it
    names code for its loader to fetch or import (``loader_fields``)."""
    configs = CheckpointConfigs(root)
    for file in INDEX_FILES:  # a modular pipeline saves only the second
        index = _read_json(root, file, spec.model.revision)
        if index is not None:
            configs.model_index = index_data(index, str(Path(root) / file))
            break
    for name, component in spec.model.components.items():
        if component.role == "scheduler" and component.subfolder:
            file = f"{component.subfolder}/scheduler_config.json"
            found = _read_json(root, file, spec.model.revision)
            if found is not None:
                configs.schedulers[component.subfolder] = _typed(found, _SchedulerConfig, root, file)
        if component.role not in WEIGHTLESS_ROLES and component.file is None and (component.subfolder
                                                                                   or component.config
                                                                                   or component.source):
            home = component.source or root
            file = f"{component.subfolder}/config.json" if component.subfolder else "config.json"
            found = _read_json(home, file, spec.model.revision)
            if found is None:
                continue
            _check_loader_fields(found, f"model.components.{name}", str(Path(home) / file), trusted)
            if component.config:
                configs.components[name] = found
            quantized = prequantized(found)
            if quantized is not None:
                configs.prequantized[name] = quantized
    return configs


def _check_loader_fields(config: dict[str, Any], where: str, file: str, trusted: bool) -> None:
    """A component's ``config.json`` as its loader would act on it: its ``quantization_config`` of the shape the
    libraries assume, and no code for the loader to fetch unless ``trusted``."""
    problems = []
    if "quantization_config" in config and (problem := quantization_problem(config["quantization_config"])):
        problems.append(Problem(where, problem, file))
    if not trusted:
        problems += code_problems(config, where, file)
    if problems:
        raise SpecError(problems)


def _read_json(root: str, name: str, revision: str | None) -> dict[str, Any] | None:
    local = user_path(root)
    if path_kind(local) == "dir":
        path = local / name
    elif not is_hub_id(root):
        raise SpecError.single(f"checkpoint {quoted(root)} is neither a local directory nor a Hub id (owner/name)",
                               "model.source")
    else:
        path = hub_file(root, name, revision)
        if path is None:
            return None
    if path_kind(path) is None:
        return None
    data = read_json_file(path, CONFIG, "model.source")
    if not isinstance(data, dict):
        raise SpecError.single(f"expected a JSON object, got {type(data).__name__}", "model.source", str(path))
    return data


class _ModelIndex(BaseModel):
    """The keys of ``model_index.json`` omnispec reads: component entries ``[library, class]`` and the two-expert
    boundary (finite). Other keys are the pipeline's and pass as they are, lists of numbers among them (a
    pipeline's sigma grid: Qwen-Image-2.1-Turbo's ``sample_sigmas``)."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    class_name: str | None = Field(default=None, alias="_class_name")
    boundary_ratio: float | int | None = None

    @model_validator(mode="after")
    def _entries(self) -> _ModelIndex:
        for key, entry in (self.model_extra or {}).items():
            if key.startswith("_") or not isinstance(entry, list) or is_number_list(entry):
                continue
            if len(entry) != 2 or not all(e is None or isinstance(e, str) for e in entry):
                raise ValueError(f"{key}: a component entry is [library, class], got {entry!r:.80}")
        return self


# Training timesteps of a scheduler: 1,000 in every real one; the scheduler allocates arrays of this length when it is
# built, so a few bytes of JSON could otherwise ask for terabytes.
MAX_TRAIN_TIMESTEPS = 100_000
_SeqLen = Annotated[int, Field(ge=1, le=1 << 30)]


class _SchedulerConfig(BaseModel):
    """The keys of a scheduler config that decide the sigmas omnispec compares and follows, finite and within
    bounds (``num_train_timesteps`` sizes the arrays the scheduler allocates)."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    use_dynamic_shifting: bool = False
    shift: float | int = 1.0
    base_shift: float | int | None = None
    max_shift: float | int | None = None
    base_image_seq_len: _SeqLen | None = None
    max_image_seq_len: _SeqLen | None = None
    shift_terminal: float | int | None = None
    use_karras_sigmas: bool | None = None
    use_exponential_sigmas: bool | None = None
    use_beta_sigmas: bool | None = None
    invert_sigmas: bool | None = None
    num_train_timesteps: Annotated[int, Field(ge=1, le=MAX_TRAIN_TIMESTEPS)] | None = None


def is_number_list(entry: Any) -> bool:
    """A non-empty list of finite numbers in ``model_index.json`` is a pipeline setting (Krea 2's
    ``text_encoder_select_layers``, Qwen-Image-2.1-Turbo's ``sample_sigmas``), not a component entry
    ``[library, class]``."""
    return isinstance(entry, list) and bool(entry) and all(
        isinstance(e, (int, float)) and not isinstance(e, bool) and math.isfinite(e) for e in entry)


def model_index_data(data: Any, file: str) -> dict[str, Any]:
    """A parsed ``model_index.json``, checked: an object whose pipeline class, component entries and boundary have
    their types."""
    if not isinstance(data, dict):
        raise SpecError.single(f"expected a JSON object, got {type(data).__name__}", "model.source", file)
    return _typed(data, _ModelIndex, str(Path(file).parent), Path(file).name)


def index_data(data: Any, file: str) -> dict[str, Any]:
    """A parsed pipeline index (``INDEX_FILES``), checked as ``model_index_data``. A modular pipeline's entries
    ``[library, class, loading spec]`` are read as ``[library, class]``: omnispec loads each component from the spec's
    own source and subfolder."""
    if Path(file).name == INDEX_FILES[1] and isinstance(data, dict):
        data = {k: v[:2] if not k.startswith("_") and isinstance(v, list) and len(v) == 3 and isinstance(v[2], dict)
                else v for k, v in data.items()}
    return model_index_data(data, file)


def _typed(data: dict[str, Any], model: type[BaseModel], root: str, file: str) -> dict[str, Any]:
    """``data`` unchanged when the keys ``model`` declares have their types; else ``SpecError`` naming the file and
    the first wrong key."""
    try:
        model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        message = err["msg"].removeprefix("Value error, ")
        if err["loc"]:  # the top-level key (a union's branch names follow it)
            message = f"{err['loc'][0]}: {message} (got {err['input']!r:.60})"
        raise SpecError.single(message, "model.source", str(Path(root) / file)) from None
    return data


# ---- comparison --------------------------------------------------------------------------------------------

# Keys of a FlowMatchEulerDiscreteScheduler config that a spec's flow_match schedule must reproduce, by the
# spec field that states them.
_DYNAMIC_KEYS = {"base_shift": "base_shift", "max_shift": "max_shift", "base_seq_len": "base_image_seq_len",
                 "max_seq_len": "max_image_seq_len"}
# Scheduler options that change the sigmas in ways a flow_match schedule cannot express.
_UNSUPPORTED = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas")


def checkpoint_problems(spec: PipelineSpec, configs: CheckpointConfigs, foreign: Collection[str] = ()
                        ) -> list[Problem]:
    """Every disagreement between the spec and the checkpoint's config files, each naming both values. ``foreign``:
    components of the checkpoint another family runs (its family's ``checkpoints.foreign_components``), left
    unloaded."""
    problems = _config_key_problems(spec, configs) + _prequantized_problems(spec, configs)
    if not spec.model.check_checkpoint:
        return problems
    problems += _class_problems(spec, configs)
    problems += _denoiser_problems(spec, configs, foreign)
    problems += _boundary_problems(spec, configs)
    problems += _schedule_problems(spec, configs)
    return problems


def _config_key_problems(spec: PipelineSpec, configs: CheckpointConfigs) -> list[Problem]:
    """A component's ``config`` may replace only entries its config file has: any other name would reach
    ``from_pretrained`` as a loader keyword, or be ignored."""
    problems = []
    for name, found in configs.components.items():
        unknown = sorted(set(spec.model.components[name].config) - set(found))
        if unknown:
            entries = ", ".join(sorted(k for k in found if not k.startswith("_"))[:12])
            problems.append(Problem(f"model.components.{name}.config", f"{', '.join(map(repr, unknown))}: not an entry "
                                    f"of the component's config.json, so there is nothing to replace (its entries: "
                                    f"{entries} ...)"))
    return problems


def _prequantized_problems(spec: PipelineSpec, configs: CheckpointConfigs) -> list[Problem]:
    """A component the checkpoint already quantized loads as it is: quantizing it again is refused, and so are the
    parallel policies that split plain weights."""
    problems = []
    for name, quantized in configs.prequantized.items():
        component = spec.model.components[name]
        for key in (name, component.role):
            if key in spec.policies.quantization:
                problems.append(Problem(f"policies.quantization.{key}", f"component {name!r} is already quantized by "
                                        f"its checkpoint ({quantized.describe()}) and loads as it is: remove this "
                                        "entry"))
        par = spec.policies.parallel
        if component.role == "denoiser" and (par.tensor > 1 or par.shard > 1):
            axis = "tensor" if par.tensor > 1 else "shard"
            problems.append(Problem(f"policies.parallel.{axis}", f"{axis} splits the denoiser's plain weights over "
                                    f"ranks; {name!r} is pre-quantized by its checkpoint ({quantized.describe()})"))
    return problems


def _class_problems(spec: PipelineSpec, configs: CheckpointConfigs) -> list[Problem]:

    index = configs.model_index
    if index is None:
        return []
    problems = []
    for name, component in spec.model.components.items():
        entry = index.get(component.subfolder or name)
        if entry is None:
            continue  # not a pipeline component of this checkpoint (the folder check reports missing folders)
        if not isinstance(entry, list) or len(entry) != 2 or entry[1] is None:
            problems.append(Problem(f"model.components.{name}", f"the checkpoint's model_index.json has no "
                                                                f"{component.subfolder or name!r} component ({entry})"))
            continue
        ours = component.class_.replace(":", ".").split(".")[-1]
        if not same_class(ours, str(entry[1])):
            problems.append(Problem(f"model.components.{name}.class", f"the spec loads {component.class_} but the "
                                    f"checkpoint's model_index.json has {entry[0]}.{entry[1]}; {ESCAPE}"))
    return problems


def _denoiser_problems(spec: PipelineSpec, configs: CheckpointConfigs, foreign: Collection[str]) -> list[Problem]:
    """A checkpoint's denoisers that the spec never loads (a one-expert spec on Wan2.2's two experts would run
    the whole schedule on one of them)."""
    index = configs.model_index or {}
    loaded = {c.subfolder or name for name, c in spec.model.components.items()} | set(foreign)
    unused = [f"{name} ({entry[1]})" for name, entry in index.items()
              if name.startswith(DENOISER_NAMES) and isinstance(entry, list) and len(entry) == 2 and entry[1]
              and name not in loaded]
    if not unused:
        return []
    experts = (f"; it is a two-expert checkpoint (boundary_ratio {configs.boundary_ratio:g}): use a spec that runs "
               "both experts, as the bundled wan2.2-* specs do" if configs.boundary_ratio is not None else "")
    return [Problem("model.components", f"the checkpoint's model_index.json has denoiser(s) {', '.join(unused)} "
                    f"that this spec does not load{experts}; or {ESCAPE}")]


def same_class(ours: str, theirs: str) -> bool:
    """Equal names, a fast/slow (``...Fast``) or PIL/torchvision (``...Pil``) variant of the same transformers class,
    or one of the classes an Auto class of ours loads (``AUTO_LOADS``). Nothing else matches: ``AutoencoderTiny``
    is not ``AutoencoderKL``."""

    def base(name: str) -> str:
        for suffix in ("Fast", "Pil"):
            name = name.removesuffix(suffix)
        return name

    if ours in AUTO_LOADS:
        return base(theirs).endswith(AUTO_LOADS[ours])
    return base(ours) == base(theirs)


def _boundary_problems(spec: PipelineSpec, configs: CheckpointConfigs) -> list[Problem]:
    ratio = configs.boundary_ratio
    problems = []
    for i, phase in enumerate(spec.recipe.phases):
        schedule = phase.schedule
        if schedule.segment_of is None:
            continue
        for bound in ("low", "high"):
            value = getattr(schedule, bound)
            where = f"recipe.phases.{i}.schedule.{bound}"
            if value == FROM_CHECKPOINT:
                if ratio is None:
                    problems.append(Problem(where, "follows the checkpoint's boundary_ratio, but its "
                                                   "model_index.json has none"))
            elif ratio is not None and value not in (0.0, 1.0) and abs(value - ratio) > 1e-9:
                problems.append(Problem(where, f"the spec splits the experts at {value:g} but the checkpoint's "
                                               f"model_index.json has boundary_ratio {ratio:g}; write "
                                               f"{FROM_CHECKPOINT} to follow it, or {ESCAPE}"))
    return problems


def _schedule_problems(spec: PipelineSpec, configs: CheckpointConfigs) -> list[Problem]:
    config = _scheduler_config(spec, configs)
    if config is None:
        return []
    problems = []
    for where, schedule in _flow_schedules(spec):
        if schedule.sigmas is not None or schedule.shift == FROM_CHECKPOINT:
            continue  # explicit sigmas are the spec's own; from_checkpoint follows
        if schedule.shift == "empirical" and config.get("use_dynamic_shifting") and \
                config.get("time_shift_type", "exponential") == "exponential":
            continue  # FLUX.2's pipelines compute mu themselves: the config's dynamic range is not used
        for key in _UNSUPPORTED:
            if config.get(key):
                problems.append(Problem(where, f"the checkpoint's scheduler sets {key}, which a flow_match schedule "
                                               f"does not reproduce; use schedule kind scheduler"))
        expected = _flow_from_config(config)
        for key, theirs in expected.items():
            ours = getattr(schedule, key)
            if ours != theirs and not (isinstance(ours, float) and isinstance(theirs, float)
                                       and abs(ours - theirs) <= 1e-9):
                problems.append(Problem(f"{where}.{key}", f"the spec has {ours!r} but the checkpoint's scheduler "
                                                          f"config gives {theirs!r}; write shift: {FROM_CHECKPOINT} "
                                                          f"to follow it, or {ESCAPE}"))
    return problems


def _scheduler_config(spec: PipelineSpec, configs: CheckpointConfigs) -> dict[str, Any] | None:
    for component in spec.model.components.values():
        if component.role == "scheduler" and component.subfolder in configs.schedulers:
            return configs.schedulers[component.subfolder]
    return None


def _flow_schedules(spec: PipelineSpec):
    """The flow-matching schedules a generation starts with: a phase refining a previous one walks a schedule
    of the recipe's own choosing (a draft's refinement, LTX-2's stage 2), which is not compared."""
    for i, phase in enumerate(spec.recipe.phases):
        if phase.schedule.checked_against_checkpoint and not isinstance(phase.input, PreviousInput):
            yield f"recipe.phases.{i}.schedule", phase.schedule
    for name, shared in spec.recipe.schedules.items():
        if shared.checked_against_checkpoint:
            yield f"recipe.schedules.{name}", shared


def _flow_from_config(config: dict[str, Any]) -> dict[str, Any]:
    """The flow_match fields that reproduce a FlowMatchEulerDiscreteScheduler config's sigmas."""
    out: dict[str, Any] = {}
    if config.get("use_dynamic_shifting"):
        out["shift"] = "dynamic"
        for ours, theirs in _DYNAMIC_KEYS.items():
            if theirs in config:
                out[ours] = float(config[theirs]) if "shift" in ours else int(config[theirs])
    else:
        out["shift"] = float(config.get("shift", 1.0))
    terminal = config.get("shift_terminal")
    out["shift_terminal"] = float(terminal) if terminal else None
    return out


def follow_checkpoint(spec: PipelineSpec, configs: CheckpointConfigs) -> PipelineSpec:
    """The spec with every ``from_checkpoint`` value replaced by the checkpoint's (call after the checks)."""
    phases = list(spec.recipe.phases)
    for i, phase in enumerate(phases):
        schedule = phase.schedule
        update: dict[str, Any] = {}
        if schedule.unresolved and schedule.segment_of is not None:
            ratio = configs.boundary_ratio
            if ratio is None:
                raise SpecError.single("follows the checkpoint's boundary_ratio, but its model_index.json has none",
                                       f"recipe.phases.{i}.schedule")
            update = {b: ratio for b in ("low", "high") if getattr(schedule, b) == FROM_CHECKPOINT}
        elif schedule.unresolved:  # a flow_match shift from the checkpoint
            update = _followed_flow(spec, configs, f"recipe.phases.{i}.schedule")
        if update:
            phases[i] = phase.model_copy(update={"schedule": schedule.model_copy(update=update)})
    schedules = dict(spec.recipe.schedules)
    for name, shared in schedules.items():
        if shared.unresolved:
            schedules[name] = shared.model_copy(update=_followed_flow(spec, configs, f"recipe.schedules.{name}"))
    recipe = spec.recipe.model_copy(update={"phases": phases, "schedules": schedules})
    return spec.model_copy(update={"recipe": recipe})


def _followed_flow(spec: PipelineSpec, configs: CheckpointConfigs, where: str) -> dict[str, Any]:
    config = _scheduler_config(spec, configs)
    if config is None:
        raise SpecError.single(f"shift: {FROM_CHECKPOINT} needs the checkpoint's scheduler config, and none was "
                               "found (no scheduler component, or no scheduler_config.json)", where)
    return _flow_from_config(config)


def unresolved(spec: PipelineSpec) -> bool:
    """Whether the spec still has ``from_checkpoint`` values (explain without ``--source`` shows them as such)."""
    return any(p.schedule.unresolved for p in spec.recipe.phases) or any(
        s.unresolved for s in spec.recipe.schedules.values())


__all__ = ["INDEX_FILES", "CheckpointConfigs", "checkpoint_problems", "follow_checkpoint", "index_data", "read_configs",
           "same_class", "unresolved"]
