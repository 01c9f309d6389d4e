"""The spec against the checkpoint's own small config files, before any weight loads.

``model_index.json`` names each component's class and carries pipeline settings such as a two-expert
``boundary_ratio``; ``scheduler/scheduler_config.json`` holds the keys that decide the sigmas. A spec that
disagrees with them would run, and silently differ from what the checkpoint's authors (and diffusers) run,
so a mismatch is an error naming both values. A spec may instead *follow* the checkpoint for a value by
writing ``from_checkpoint`` (a segment bound, a flow-matching shift); ``follow_checkpoint`` resolves those.
Reading these files loads no weights and imports no torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import Problem, SpecError
from .pipeline import PipelineSpec
from .recipe import PreviousInput
from .schedule import FROM_CHECKPOINT, FlowMatchSchedule, SegmentSchedule

ESCAPE = "set model.check_checkpoint: false to run it anyway"


@dataclass
class CheckpointConfigs:
    """The checkpoint's config files that were found (absent files are simply not checked)."""

    root: str
    model_index: dict[str, Any] | None = None
    schedulers: dict[str, dict[str, Any]] = field(default_factory=dict)  # scheduler subfolder -> config

    @property
    def boundary_ratio(self) -> float | None:
        value = (self.model_index or {}).get("boundary_ratio")
        return float(value) if value is not None else None


def read_configs(spec: PipelineSpec, root: str) -> CheckpointConfigs:
    """The small config files of ``root`` (a local directory, or a Hub id from the cache or the Hub)."""
    configs = CheckpointConfigs(root)
    configs.model_index = _read_json(root, "model_index.json", spec.model.revision)
    for component in spec.model.components.values():
        if component.role == "scheduler" and component.subfolder:
            found = _read_json(root, f"{component.subfolder}/scheduler_config.json", spec.model.revision)
            if found is not None:
                configs.schedulers[component.subfolder] = found
    return configs


def _read_json(root: str, name: str, revision: str | None) -> dict[str, Any] | None:
    local = Path(root).expanduser()
    if local.is_dir():
        path = local / name
    else:
        path = _hub_file(root, name, revision)
        if path is None:
            return None
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SpecError.single(f"cannot read the checkpoint's {name}: {exc}", "model.source") from None
    return data if isinstance(data, dict) else None


def _hub_file(repo: str, name: str, revision: str | None) -> Path | None:
    """A small file of a Hub checkpoint: from the local cache, else downloaded (unless HF_HUB_OFFLINE)."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    cached = try_to_load_from_cache(repo, name, revision=revision)
    if isinstance(cached, str):
        return Path(cached)
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return None
    try:
        return Path(hf_hub_download(repo, name, revision=revision))
    except (EntryNotFoundError, LocalEntryNotFoundError):
        return None


# ---- comparison --------------------------------------------------------------------------------------------

# Keys of a FlowMatchEulerDiscreteScheduler config that a spec's flow_match schedule must reproduce, by the
# spec field that states them.
_DYNAMIC_KEYS = {"base_shift": "base_shift", "max_shift": "max_shift", "base_seq_len": "base_image_seq_len",
                 "max_seq_len": "max_image_seq_len"}
# Scheduler options that change the sigmas in ways a flow_match schedule cannot express.
_UNSUPPORTED = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas")


def checkpoint_problems(spec: PipelineSpec, configs: CheckpointConfigs) -> list[Problem]:
    """Every disagreement between the spec and the checkpoint's config files, each naming both values."""
    if not spec.model.check_checkpoint:
        return []
    problems = _class_problems(spec, configs)
    problems += _boundary_problems(spec, configs)
    problems += _schedule_problems(spec, configs)
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
        if not _same_class(ours, str(entry[1])):
            problems.append(Problem(f"model.components.{name}.class", f"the spec loads {component.class_} but the "
                                    f"checkpoint's model_index.json has {entry[0]}.{entry[1]}; {ESCAPE}"))
    return problems


def _same_class(ours: str, theirs: str) -> bool:
    """Equal names, an Auto* class on our side, or a fast/slow (``...Fast``) or PIL/torchvision (``...Pil``)
    variant of the same transformers class."""
    if ours.startswith("Auto"):
        return True

    def base(name: str) -> str:
        for suffix in ("Fast", "Pil"):
            name = name.removesuffix(suffix)
        return name

    return base(ours) == base(theirs)


def _boundary_problems(spec: PipelineSpec, configs: CheckpointConfigs) -> list[Problem]:
    ratio = configs.boundary_ratio
    problems = []
    for i, phase in enumerate(spec.recipe.phases):
        schedule = phase.schedule
        if not isinstance(schedule, SegmentSchedule):
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
        if isinstance(phase.schedule, FlowMatchSchedule) and not isinstance(phase.input, PreviousInput):
            yield f"recipe.phases.{i}.schedule", phase.schedule
    for name, shared in spec.recipe.schedules.items():
        if isinstance(shared, FlowMatchSchedule):
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
        if isinstance(schedule, SegmentSchedule) and not schedule.resolved:
            ratio = configs.boundary_ratio
            if ratio is None:
                raise SpecError.single("follows the checkpoint's boundary_ratio, but its model_index.json has none",
                                       f"recipe.phases.{i}.schedule")
            update = {b: ratio for b in ("low", "high") if getattr(schedule, b) == FROM_CHECKPOINT}
        elif isinstance(schedule, FlowMatchSchedule) and schedule.shift == FROM_CHECKPOINT:
            update = _followed_flow(spec, configs, f"recipe.phases.{i}.schedule")
        if update:
            phases[i] = phase.model_copy(update={"schedule": schedule.model_copy(update=update)})
    schedules = dict(spec.recipe.schedules)
    for name, shared in schedules.items():
        if isinstance(shared, FlowMatchSchedule) and shared.shift == FROM_CHECKPOINT:
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
    for phase in spec.recipe.phases:
        s = phase.schedule
        if isinstance(s, SegmentSchedule) and not s.resolved:
            return True
        if isinstance(s, FlowMatchSchedule) and s.shift == FROM_CHECKPOINT:
            return True
    return any(isinstance(s, FlowMatchSchedule) and s.shift == FROM_CHECKPOINT for s in spec.recipe.schedules.values())


__all__ = ["CheckpointConfigs", "checkpoint_problems", "follow_checkpoint", "read_configs", "unresolved"]
