"""``omnispec init SOURCE``: draft a spec from a checkpoint's own files.

The family comes from the pipeline class in ``model_index.json`` (or ``--family``); the components, their classes
and folders from the same file, with roles; the recipe from the bundled spec of that family whose components match
the checkpoint best, with the checkpoint's scheduler (``shift: from_checkpoint``, a two-expert boundary from
``boundary_ratio``, or the scheduler itself when it is not a flow-matching Euler one) and diffusers' defaults (the
pipeline's own ``__call__`` defaults: steps, sizes, frames, sequence length, guidance scale). A checkpoint folder
without ``model_index.json`` (the embedded digits model) is matched by its denoiser's class instead.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

import yaml

from .spec import SpecError, load_spec, resolve_spec_data
from .spec.catalog import bundled_names, bundled_path
from .spec.checkpoint import is_number_list
from .spec.files import path_kind, user_path
from .spec.model import BUILTIN_FAMILIES

FLOW_MATCH_SCHEDULER = "FlowMatchEulerDiscreteScheduler"
# Roles of components a template does not name, by the start of the component's name.
_ROLE_BY_NAME = (("transformer", "denoiser"), ("unet", "denoiser"), ("text_encoder", "encoder"),
                 ("image_encoder", "encoder"), ("connectors", "encoder"), ("tokenizer", "tokenizer"),
                 ("vae", "vae"), ("audio_vae", "vae"), ("vocoder", "vae"), ("scheduler", "scheduler"),
                 ("image_processor", "processor"), ("feature_extractor", "processor"), ("processor", "processor"),
                 ("latent_upsampler", "upsampler"))
# diffusers' __call__ argument -> the recipe default it sets.
_DEFAULTS = {"num_inference_steps": "steps", "height": "height", "width": "width", "num_frames": "frames",
             "max_sequence_length": "max_sequence_length", "frame_rate": "fps", "fps": "fps"}


def draft_spec(source: str, family: str | None = None, name: str | None = None) -> str:
    """The drafted spec as YAML text (validated), with a header saying where each part came from."""
    index = read_model_index(source)
    family = family or _family_of(source, index)
    if family not in BUILTIN_FAMILIES:
        raise SpecError.single(f"unknown family {family!r}; built in: {', '.join(BUILTIN_FAMILIES)}", "--family")
    template_name, template = _template(family, index, source)
    data, notes = _draft(source, family, index, template, name)
    load_spec(data, trust_code=True)  # validated as written (a class outside the trusted packages needs the flag)
    found = "its model_index.json" if index is not None else "the bundled spec's, for the folders it has"
    header = [f"# Drafted by `omnispec init {source}` from the bundled spec {template_name!r} (family {family}).",
              f"# Components and classes: {found}; schedule: its scheduler config; defaults: diffusers'",
              "# pipeline defaults. Check them against the model card before relying on them.",
              *[f"# {note}" for note in notes]]
    body = yaml.safe_dump({"omnispec": 1, **{k: v for k, v in data.items() if k != "omnispec"}}, sort_keys=False,
                          default_flow_style=None, width=120)
    return "\n".join(header) + "\n" + body


# diffusers' detected model type -> the bundled spec a file of that type is drafted from.
_BUNDLED_FOR_TYPE = {"flux-dev": "flux1-dev", "flux-schnell": "flux1-schnell", "sd3": "sd3.5-medium",
                     "sd35_medium": "sd3.5-medium", "sd35_large": "sd3.5-medium", "wan-t2v-1.3B": "wan2.1-t2v-1.3b",
                     "wan-t2v-14B": "wan2.1-t2v-1.3b", "wan-t2v": "wan2.1-t2v-1.3b", "wan-i2v-14B": "wan2.1-i2v-14b-480p",
                     "z-image-turbo": "z-image-turbo", "ltx2-dev": "ltx2-t2v", "qwen-image": "qwen-image"}


def is_weights_file(source: str) -> bool:
    from .spec.weights_file import file_format

    return path_kind(user_path(source)) == "file" and file_format(source) is not None


def draft_from_file(file: str, family: str | None = None, name: str | None = None, source: str | None = None) -> str:
    """The drafted spec (YAML text, validated) for a single weights file: the model recognised from its keys and
    shapes as diffusers' single-file detection does, the bundled spec of that model as the template, the file as its
    denoiser's ``file``, and ``source`` (default: the model's diffusers checkpoint) for the other components and the
    denoiser's config."""
    from diffusers.loaders.single_file_utils import DIFFUSERS_DEFAULT_PIPELINE_PATHS

    from .runtime.single_file import detect, refuse_scaled
    from .spec.weights_file import read_weights_file

    path = user_path(file).resolve()
    weights = read_weights_file(path, "FILE")
    refuse_scaled(weights, "FILE")
    detected = detect(weights)
    template_name = _BUNDLED_FOR_TYPE.get(detected.model_type or "")
    if family is not None:
        template_name, _ = _template(family, None, "")
    if template_name is None:
        raise SpecError.single(f"{path.name} is {detected.describe()} (by its keys and shapes); no bundled spec runs "
                               f"that model (single files are drafted for: {', '.join(sorted(_BUNDLED_FOR_TYPE))}); "
                               "pass --family to choose one", "FILE")
    data, _ = resolve_spec_data(bundled_path(template_name))
    data = json.loads(json.dumps(data))
    model = data["model"]
    default = DIFFUSERS_DEFAULT_PIPELINE_PATHS.get(detected.model_type or "", {}).get("pretrained_model_name_or_path")
    if source is not None:
        local = user_path(source)
        model["source"] = str(local.resolve()) if path_kind(local) == "dir" else source
    elif default and model["family"] in detected.families and _BUNDLED_FOR_TYPE[detected.model_type] == template_name:
        model["source"] = default if template_name.startswith(("wan2.1-t2v", "sd3.5")) else model["source"]
    denoiser = next(n for n, c in model["components"].items() if c["role"] == "denoiser")
    model["components"][denoiser]["file"] = str(path)
    data["name"] = name or path.stem.lower()
    load_spec(data)
    header = [f"# Drafted by `omnispec init {file}` from the bundled spec {template_name!r}.",
              f"# {path.name}: {detected.describe()} by its keys and shapes; {weights.describe()}.",
              f"# The {denoiser}'s config and the other components come from {model['source']}.",
              "# Check the recipe against the model card before relying on it."]
    body = yaml.safe_dump({"omnispec": 1, **{k: v for k, v in data.items() if k != "omnispec"}}, sort_keys=False,
                          default_flow_style=None, width=120)
    return "\n".join(header) + "\n" + body


def read_model_index(source: str) -> dict[str, Any] | None:
    """The checkpoint's ``model_index.json`` (a local folder, or a Hub id through the cache or the Hub), or the
    ``modular_model_index.json`` a modular pipeline saves, read within bounds and type-checked like every checkpoint
    config file."""
    from .spec.checkpoint import INDEX_FILES, index_data
    from .spec.files import read_json_file
    from .spec.hub import check_reachable, hub_file, is_hub_id

    local = user_path(source)
    if path_kind(local) == "dir":
        path = next((local / f for f in INDEX_FILES if path_kind(local / f) is not None), None)
        if path is None:
            return None
    elif not is_hub_id(source):
        raise SpecError.single(f"{source!r} is neither a checkpoint folder nor a Hub id (owner/name)", "SOURCE")
    else:
        check_reachable(source, "SOURCE")
        path = next((found for f in INDEX_FILES if (found := hub_file(source, f, None)) is not None), None)
        if path is None:
            raise SpecError.single(f"Hub checkpoint {source!r} has no {' or '.join(INDEX_FILES)} (or it is not in "
                                   "the cache)", "SOURCE")
    return index_data(read_json_file(path, where="SOURCE"), str(path))


def _family_of(source: str, index: dict[str, Any] | None) -> str:
    from .runtime.families import checkpoint_pipelines, family_class

    if index is None:
        return _family_by_denoiser(source)
    pipeline = str(index.get("_class_name", ""))
    by_pipeline: dict[str, list[str]] = {}
    for name in BUILTIN_FAMILIES:
        for runs in checkpoint_pipelines(family_class(name)):
            by_pipeline.setdefault(runs, []).append(name)
    if pipeline not in by_pipeline:
        raise SpecError.single(f"model_index.json names pipeline {pipeline!r}, which no built-in family runs (they run "
                               f"{', '.join(sorted(by_pipeline))}); pass --family to choose one", "SOURCE")
    # among the families of that pipeline, the first whose model_index settings this checkpoint has (Wan2.2 TI2V's
    # expand_timesteps: the same WanPipeline, another family), the one that checks the most settings first (LTX-2.5's
    # diffusion_decoder: the same LTX2Pipeline as LTX-2, whose family checks none)
    fitting = sorted((name for name in by_pipeline[pipeline] if all(
        index.get(key) in accepted for key, accepted in family_class(name).checkpoints.model_index_values.items())),
        key=lambda name: -len(family_class(name).checkpoints.model_index_values))
    return (fitting or by_pipeline[pipeline])[0]


def _family_by_denoiser(source: str) -> str:
    """A folder without model_index.json: the bundled spec whose denoiser class its ``transformer`` folder holds."""
    from .spec.files import read_json_file

    config = user_path(source) / "transformer" / "config.json"
    data = read_json_file(config, where="SOURCE") if path_kind(config) is not None else {}
    theirs = data.get("_class_name") if isinstance(data, dict) else None
    for name in bundled_names():
        data, _ = resolve_spec_data(bundled_path(name))
        for component in data["model"]["components"].values():
            if component.get("role") == "denoiser" and _class_tail(component["class"]) == theirs:
                return data["model"]["family"]
    raise SpecError.single(f"{source} has no model_index.json and no transformer/config.json whose class a bundled "
                           "spec uses; pass --family", "SOURCE")


def _template(family: str, index: dict[str, Any] | None, source: str) -> tuple[str, dict[str, Any]]:
    """The bundled spec of ``family`` whose components best match the checkpoint's; ties go to the plainest (no
    adapters, fewest phases, a text-to-X task), then by name."""
    have = _checkpoint_components(index, source)
    candidates = []
    for name in bundled_names():
        data, _ = resolve_spec_data(bundled_path(name))
        if data["model"]["family"] != family:
            continue
        theirs = set(data["model"]["components"])
        overlap = len(have & theirs) / max(1, len(have | theirs))
        phases = data["recipe"]["phases"]
        plain = (bool(data["model"].get("adapters")), len(phases), not data["recipe"]["task"].startswith("text"))
        candidates.append((-overlap, plain, name, data))
    if not candidates:
        raise SpecError.single(f"no bundled spec of family {family!r} to draft from", "--family")
    _, _, name, data = min(candidates, key=lambda c: c[:3])
    return name, data


def _checkpoint_components(index: dict[str, Any] | None, source: str) -> set[str]:
    if index is not None:
        return {k for k, v in index.items()
                if not k.startswith("_") and isinstance(v, list) and not is_number_list(v) and v[-1] is not None}
    local = user_path(source)
    return {p.name for p in local.iterdir() if p.is_dir()} if path_kind(local) == "dir" else set()


def _draft(source: str, family: str, index: dict[str, Any] | None, template: dict[str, Any], name: str | None
           ) -> tuple[dict[str, Any], list[str]]:
    notes: list[str] = []
    data = json.loads(json.dumps(template))  # a deep copy of plain data
    local = user_path(source)
    here = path_kind(local) == "dir"
    data["name"] = name or (local.resolve().name if here else source.split("/")[-1]).lower()
    data["model"]["family"] = family
    data["model"]["source"] = str(local.resolve()) if here else source
    data["model"]["components"], dropped = _components(index, template["model"]["components"], source)
    if dropped:
        notes.append(f"left out (no role omnispec gives them): {', '.join(dropped)}")
    from .runtime.families import family_class

    for component, what in family_class(family).checkpoints.foreign_components.items():
        if data["model"]["components"].pop(component, None) is not None:
            notes.append(f"left out: {component}, {what}")
    components = data["model"]["components"]
    scheduler = next((n for n, c in components.items() if c["role"] == "scheduler"), None)
    scheduler_class = _class_tail(components[scheduler]["class"]) if scheduler else None
    if scheduler_class in _family_flow_match_schedulers(family):
        scheduler_class = FLOW_MATCH_SCHEDULER
    two_experts = index is not None and index.get("boundary_ratio") is not None
    recipe = data["recipe"]
    for phase in recipe["phases"]:
        phase["schedule"] = _schedule(phase["schedule"], scheduler, scheduler_class, two_experts)
    for key, shared in list(recipe.get("schedules", {}).items()):
        recipe["schedules"][key] = _schedule(shared, scheduler, scheduler_class, two_experts)
    data["recipe"]["phases"] = [p for p in recipe["phases"] if p["denoiser"] in components]
    pipeline_cls = _pipeline_class(family, index)
    if pipeline_cls is not None:
        notes += _diffusers_defaults(data, pipeline_cls)
    return data, notes


def _components(index: dict[str, Any] | None, template: dict[str, Any], source: str
                ) -> tuple[dict[str, Any], list[str]]:
    """Each component of the checkpoint with its role and class; the template's entry where the class agrees (it may
    name a module path, a dtype)."""
    if index is None:  # no model_index.json: the template's components whose folders are there
        local = user_path(source)
        return {n: c for n, c in template.items() if path_kind(local / (c.get("subfolder") or n)) == "dir"}, []
    out, dropped = {}, []
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list) or len(entry) != 2 or entry[1] is None:
            continue
        library, cls = entry
        ours = template.get(name)
        if ours is not None and _same_class(ours["class"], cls):
            out[name] = {**ours, "subfolder": name}
            continue
        role = ours["role"] if ours is not None else _role(name)
        if role is None:
            dropped.append(f"{name} ({library}.{cls})")
            continue
        ref = f"{library}.{cls}" if library in ("diffusers", "transformers") else f"diffusers.pipelines.{library}:{cls}"
        out[name] = {"role": role, "class": ref, "subfolder": name}
    return out, dropped


def _same_class(ref: str, theirs: str) -> bool:
    """The comparison the checkpoint check makes at build (exact, Fast/Pil variants, an Auto class of ours by what
    it loads), so a drafted spec is never one its own checkpoint refuses."""
    from .spec.checkpoint import same_class

    return same_class(_class_tail(ref), theirs)


def _class_tail(ref: str) -> str:
    return ref.replace(":", ".").split(".")[-1]


def _role(name: str) -> str | None:
    for start, role in _ROLE_BY_NAME:
        if name.startswith(start):
            return role
    return None


def _schedule(schedule: dict[str, Any], scheduler: str | None, scheduler_class: str | None, two_experts: bool
              ) -> dict[str, Any]:
    """The template's schedule following the checkpoint: flow matching with the scheduler's shift, the scheduler
    itself when it is another kind, a segment split at the checkpoint's boundary."""
    kind = schedule.get("kind", "flow_match")
    if kind == "flow_match" and schedule.get("shift") == "empirical":
        return schedule  # FLUX.2's pipelines compute mu themselves; the scheduler config's range is not theirs
    if kind == "segment":
        out = dict(schedule)
        for bound in ("low", "high"):
            if two_experts and out.get(bound) not in (0, 0.0, 1, 1.0, None):
                out[bound] = "from_checkpoint"
        return out
    if kind == "flow_match" and schedule.get("sigmas") is None:
        if scheduler_class == FLOW_MATCH_SCHEDULER:
            return {"kind": "flow_match", "shift": "from_checkpoint",
                    **{k: v for k, v in schedule.items() if k in ("steps",)}}
        if scheduler is not None:
            return {"kind": "scheduler", "component": scheduler}
    if kind == "scheduler" and scheduler is not None:
        return {**schedule, "component": scheduler}
    return schedule


def _family_flow_match_schedulers(family: str) -> tuple[str, ...]:
    """The scheduler classes the family declares a flow_match schedule reproduces (its
    ``checkpoints.flow_match_schedulers``)."""
    from .runtime.families import family_class

    return family_class(family).checkpoints.flow_match_schedulers


def _pipeline_class(family: str, index: dict[str, Any] | None) -> type | None:
    import diffusers

    from .runtime.families import family_class

    named = getattr(diffusers, str((index or {}).get("_class_name", "")), None)
    return named if isinstance(named, type) else family_class(family).pipeline_class


def _diffusers_defaults(data: dict[str, Any], pipeline_cls: type) -> list[str]:
    """The recipe's defaults and primary guidance scale from the pipeline's ``__call__`` defaults (those it gives
    as numbers; a size it derives from the checkpoint keeps the template's), except fields the recipe refuses."""
    parameters = inspect.signature(pipeline_cls.__call__).parameters
    recipe = data["recipe"]
    refused = set((recipe.get("constraints") or {}).get("refuse", []))
    defaults = recipe.setdefault("defaults", {})
    taken = []
    for argument, field in _DEFAULTS.items():
        value = parameters[argument].default if argument in parameters else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and field not in refused:
            defaults[field] = int(value)
            taken.append(f"{field} {int(value)}")
    for phase in recipe["phases"]:
        guidance = phase.setdefault("guidance", {})
        scale, argument = _primary_scale(guidance, parameters)
        if scale is not None:
            _set_primary(guidance, scale)
            taken.append(f"{argument} {scale:g} ({phase['name']})")
    return [f"from {pipeline_cls.__name__}'s defaults: {', '.join(taken)}"] if taken else []


def _primary_scale(guidance: dict[str, Any], parameters: Any) -> tuple[float | None, str]:
    """diffusers' default for what a request's guidance_scale sets in this phase (embedded guidance or CFG:
    ``guidance_scale``; true CFG: ``true_cfg_scale``), when it is one number for every stream."""
    if guidance.get("embedded") is not None:
        argument = "guidance_scale"
    else:
        term = next((t for t in guidance.get("terms", []) if t.get("kind") in ("cfg", "true_cfg")), None)
        if term is None or isinstance(term.get("scale"), dict):
            return None, ""
        argument = "true_cfg_scale" if term["kind"] == "true_cfg" else "guidance_scale"
    value = parameters[argument].default if argument in parameters else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value), argument
    return None, argument


def _set_primary(guidance: dict[str, Any], scale: float) -> None:
    if guidance.get("embedded") is not None:
        guidance["embedded"] = scale
        return
    for term in guidance.get("terms", []):
        if term.get("kind") in ("cfg", "true_cfg"):
            term["scale"] = scale
            return


__all__ = ["draft_spec", "read_model_index"]
