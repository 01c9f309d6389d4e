"""What made an output, written into it, and how to make it again.

Every file ``Output.save`` writes records the resolved spec, the request (prompts, seeds, sizes, the digests and
paths of conditioning images), which of the request's samples the file holds, the versions of omnispec,
diffusers, transformers and torch, and the checkpoint (its Hub revision when it came from the Hub cache; its path
and the SHA-256 of its config files when local). Where it goes: a PNG ``omnispec`` text chunk (and A1111's
``parameters`` line), the JPEG/GIF comment, the MP4 container's ``comment`` tag, and a ``<file>.json`` beside a
``.npy``, ``.wav`` or ``.webp``.

``replay`` reads it back and runs the same request on the same spec and checkpoint; since a sample never depends
on its batch-mates, a file holding sample ``i`` could be regenerated from that sample's prompt and seed alone, but
kernels sum in an order that depends on the batch (5e-7 apart in float32 on a CPU), so the whole request runs
again and sample ``i`` is taken from it: the regenerated array is then identical.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .spec import Problem, SpecError, load_spec
from .spec.explain import explain_spec, render_explain
from .spec.loader import parse_json

if TYPE_CHECKING:
    from .runtime.pipeline import Output, Pipeline
    from .spec import PipelineSpec
    from .spec.request import Request

FORMAT = 1
KEY = "omnispec"  # the PNG text chunk's key; the JSON's top-level marker
SIDECAR_SUFFIXES = (".npy", ".wav", ".webp")  # formats without a place for text: a <file>.json beside them
_CONFIG_LIMIT = 64 << 20  # config files hashed for a local checkpoint (tokenizer.json may be tens of MB)


# ---- recording ---------------------------------------------------------------------------------------------

def versions() -> dict[str, str | None]:
    from . import __version__

    found: dict[str, str | None] = {"omnispec": __version__}
    for package in ("diffusers", "transformers", "torch"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return found


def checkpoint_record(spec: PipelineSpec, root: str | None, in_memory: Iterable[str] = ()) -> dict[str, Any]:
    """The checkpoint a pipeline loaded from (taken at build): per checkpoint root, a local path with the SHA-256
    of its config files, or a Hub id with the revision found in the cache; and the components handed in memory."""
    given = sorted(in_memory)
    roots: dict[str, list[str]] = {}
    for name, component in spec.model.components.items():
        if name in given:
            continue
        home = component.source or root
        if home is not None:
            roots.setdefault(home, []).append(component.subfolder or "")
    record: dict[str, Any] = {"source": root, "in_memory": given}
    record["roots"] = {home: _describe_root(home, folders, spec.model.revision) for home, folders in roots.items()}
    record["adapters"] = {name: _describe_adapter(slot.path, slot.weight_name)
                          for name, slot in spec.model.adapters.items()}
    return record


def _describe_adapter(path: str, weight_name: str | None) -> dict[str, Any]:
    """A LoRA's weights: a local file (or ``weight_name`` in a local folder) with its SHA-256, else a Hub id."""
    local = Path(path).expanduser()
    weights = local / weight_name if local.is_dir() and weight_name else local
    if weights.is_file():
        return {"kind": "local", "path": str(weights.resolve()), "sha256": _file_sha256(weights)}
    return {"kind": "hub", "repo": path, "weight_name": weight_name}


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def recorded_source(made_by: Mapping[str, Any]) -> str | None:
    """The checkpoint root to build from again: the resolved directory of a local one (so a replay works from
    any working directory), the Hub id of a Hub one."""
    checkpoint = made_by.get("checkpoint") or {}
    source = checkpoint.get("source")
    described = (checkpoint.get("roots") or {}).get(source or "", {})
    return described.get("path", source) if described.get("kind") == "local" else source


def _describe_root(root: str, folders: list[str], revision: str | None) -> dict[str, Any]:
    local = Path(root).expanduser()
    if local.is_dir():
        return {"kind": "local", "path": str(local.resolve()), "config_sha256": config_hashes(local, folders)}
    return {"kind": "hub", "repo": root, "revision": hub_revision(root, folders, revision)}


def config_hashes(root: Path, folders: Iterable[str]) -> dict[str, str]:
    """SHA-256 of the checkpoint's small files: ``*.json`` at its root and in each component's folder."""
    out: dict[str, str] = {}
    for folder in sorted(set(folders) | {""}):
        where = root / folder
        if not where.is_dir():
            continue
        for path in sorted(where.glob("*.json")):
            if path.is_file() and path.stat().st_size <= _CONFIG_LIMIT:
                out[str(path.relative_to(root))] = _file_sha256(path)
    return out


def hub_revision(repo: str, folders: Iterable[str], revision: str | None) -> str | None:
    """The commit of a Hub checkpoint's snapshot in the local cache (None when nothing of it is cached)."""
    from huggingface_hub import try_to_load_from_cache

    probes = ["model_index.json", *(f"{f}/config.json" for f in folders if f)]
    for probe in probes:
        found = try_to_load_from_cache(repo, probe, revision=revision)
        if isinstance(found, str):
            parts = Path(found).parts
            if "snapshots" in parts:
                return parts[parts.index("snapshots") + 1]
    return revision


def spec_data(spec: PipelineSpec) -> dict[str, Any]:
    return spec.model_dump(mode="json", by_alias=True, exclude_defaults=True)


def request_data(request: Request) -> dict[str, Any]:
    data = request.model_dump(mode="json", exclude={"images"}, exclude_none=True)
    data["images"] = [{"frame": c.frame, "digest": c.digest, **({"path": str(Path(c.path).resolve())} if c.path
                                                                 else {})} for c in request.images]
    return data


def record(pipe: Pipeline, request: Request) -> dict[str, Any]:
    """What made this request's outputs (``sample`` is filled per file when written)."""
    cached = getattr(pipe, "_provenance_spec", None)
    if cached is None or cached[0] is not pipe.spec:
        cached = (pipe.spec, spec_data(pipe.spec))
        pipe._provenance_spec = cached  # type: ignore[attr-defined]
    out: dict[str, Any] = {
        KEY: FORMAT,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "versions": versions(),
        "device": str(pipe.device),
        "spec": cached[1],
        "request": request_data(request),
        "sample": None,
        "checkpoint": getattr(pipe, "checkpoint", None) or {"source": None, "in_memory": [], "roots": {}},
    }
    if pipe.weight_version:
        out["weights_changed"] = pipe.weight_version  # in-memory updates (RL sync, set_lora) since build
    return out


def for_sample(made_by: Mapping[str, Any], sample: int | None) -> dict[str, Any]:
    return {**made_by, "sample": sample}


def to_text(made_by: Mapping[str, Any]) -> str:
    return json.dumps(made_by, separators=(",", ":"), ensure_ascii=False)


def a1111_parameters(made_by: Mapping[str, Any]) -> str:
    """The ``parameters`` text A1111/ComfyUI readers show: prompt, negative prompt, then the settings line."""
    request = made_by["request"]
    sample = made_by.get("sample") or 0
    prompt = request["prompts"][sample]
    settings = [f"Steps: {request['steps']}", f"Seed: {request['seeds'][sample]}"]
    if request.get("width") and request.get("height"):
        settings.append(f"Size: {request['width']}x{request['height']}")
    if request.get("guidance_scale") is not None:
        settings.append(f"CFG scale: {request['guidance_scale']:g}")
    settings.append(f"Model: {made_by['spec'].get('name')}")
    settings.append(f"Version: omnispec {made_by['versions'].get('omnispec')}")
    negative = request.get("negative_prompt")
    lines = [prompt, *([f"Negative prompt: {negative}"] if negative else []), ", ".join(settings)]
    return "\n".join(lines)


# ---- reading -----------------------------------------------------------------------------------------------

def sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def is_output(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a file that can carry a record (as opposed to a spec)."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix in (".yaml", ".yml"):
        return False
    if suffix == ".json":
        return p.name.endswith(tuple(f"{s}.json" for s in SIDECAR_SUFFIXES)) or _json_is_record(p)
    return suffix in (".png", ".jpg", ".jpeg", ".webp", ".gif", ".mp4", ".npy", ".wav")


def _json_is_record(path: Path) -> bool:
    """A ``.json`` written as a record (not a spec written as JSON): it has a record's keys."""
    try:
        if path.stat().st_size > 16 << 20:
            return False
        data = parse_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # SpecError is a ValueError: too deep or not JSON, so read as a spec
        return False
    return isinstance(data, dict) and {KEY, "spec", "request", "versions"} <= set(data)


def read(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The record of an output file (or of its ``.json`` sidecar); ``SpecError`` when it has none."""
    path = Path(path)
    if not path.is_file():
        raise SpecError.single(f"no such file: {path}", file=str(path))
    text = _record_text(path)
    if text is None:
        raise SpecError.single("records nothing about how it was made (not written by omnispec, or its metadata "
                               "was stripped)", file=str(path))
    try:
        data = parse_json(text)
    except SpecError as exc:
        raise SpecError.single(f"its omnispec record was not read: {exc.problems[0].message}", file=str(path)) from None
    if not isinstance(data, dict) or data.get(KEY) != FORMAT:
        raise SpecError.single(f"its record is not an omnispec record of format {FORMAT}", file=str(path))
    return data


def _record_text(path: Path) -> str | None:
    suffix = path.suffix.lower()
    if suffix == ".json":
        return path.read_text(encoding="utf-8")
    if sidecar(path).is_file():
        return sidecar(path).read_text(encoding="utf-8")
    if suffix in (".png", ".jpg", ".jpeg", ".gif", ".webp"):
        from PIL import Image

        with Image.open(path) as image:
            info = dict(image.info)
            text = getattr(image, "text", {}).get(KEY) if suffix == ".png" else info.get("comment")
        return text.decode("utf-8") if isinstance(text, bytes) else text
    if suffix == ".mp4":
        import av

        with av.open(str(path)) as container:
            return container.metadata.get("comment")
    return None


# ---- replaying ---------------------------------------------------------------------------------------------

def request_arguments(made_by: Mapping[str, Any], spec: PipelineSpec, images: bool = True
                      ) -> tuple[list[str], list[int], dict[str, Any]]:
    """Prompts, seeds and request fields that reproduce the recorded request; fields equal to the recipe's defaults
    are left to it (a recipe may refuse them given). ``images=False`` leaves the recorded images out (the caller
    gives others)."""
    request = dict(made_by["request"])
    prompts, seeds = list(request.pop("prompts")), list(request.pop("seeds"))
    recorded_images = request.pop("images", [])
    defaults = spec.recipe.defaults.model_dump()
    fields = {k: v for k, v in request.items() if v is not None and v != defaults.get(k)}
    if fields.get("negative_prompt") == "":
        fields.pop("negative_prompt")
    if recorded_images and images:
        fields.update(image_arguments(recorded_images))
    return prompts, seeds, fields


def image_arguments(images: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The recorded conditioning images, opened from their paths; each must still hash to its recorded digest."""
    from .spec.request import image_condition

    placed = []
    problems = []
    for i, entry in enumerate(images):
        path = entry.get("path")
        if not path:
            problems.append(Problem(f"request.images.{i}", "was given in memory, not as a file: pass the image "
                                    "again (--image / image=)"))
            continue
        if not Path(path).is_file():
            problems.append(Problem(f"request.images.{i}", f"{path} is gone: pass the image again (--image / image=)"))
            continue
        if image_condition(path, 0, f"request.images.{i}").digest != entry["digest"]:
            problems.append(Problem(f"request.images.{i}", f"{path} has changed since (its pixels' digest differs): "
                                    "pass the original image again (--image / image=)"))
            continue
        placed.append({"image": path, "frame": entry.get("frame", 0)})
    if problems:
        raise SpecError(problems)
    if len(placed) == 1 and placed[0]["frame"] == 0:
        return {"image": placed[0]["image"]}
    return {"conditions": placed}


def replay_spec(made_by: Mapping[str, Any], overrides: Iterable[str] = (), *, trust_code: bool = False
                ) -> PipelineSpec:
    spec = dict(made_by["spec"])
    checkpoint = made_by.get("checkpoint") or {}
    root = (checkpoint.get("roots") or {}).get(checkpoint.get("source") or "", {})
    if root.get("kind") == "hub" and root.get("revision") and not spec.get("model", {}).get("revision"):
        spec["model"] = {**spec["model"], "revision": root["revision"]}  # the same snapshot of the Hub repo
    return load_spec(spec, list(overrides), trust_code=trust_code)


def replay_problems(made_by: Mapping[str, Any], source: str | None) -> list[Problem]:
    """Why the recorded checkpoint can't make this output again here: components that were handed in memory,
    weights changed in memory, a local checkpoint whose config files differ."""
    checkpoint = made_by.get("checkpoint") or {}
    problems = []
    if checkpoint.get("in_memory"):
        problems.append(Problem("checkpoint", f"components {checkpoint['in_memory']} were handed to build() in "
                                "memory; the checkpoint alone does not make this output"))
    if made_by.get("weights_changed"):
        problems.append(Problem("checkpoint", "the weights were changed in memory after loading (RL weight sync or "
                                "set_lora); the checkpoint alone does not make this output"))
    for home, described in (checkpoint.get("roots") or {}).items():
        if described.get("kind") != "local":
            continue
        where = source if source is not None and home == checkpoint.get("source") else described["path"]
        if not Path(where).is_dir():
            problems.append(Problem("checkpoint", f"the checkpoint {described['path']} is not here; give its "
                                    "location with --source (source=)"))
            continue
        recorded = described.get("config_sha256") or {}
        now = config_hashes(Path(where), {str(Path(name).parent) if Path(name).parent != Path(".") else ""
                                          for name in recorded})
        changed = sorted(name for name, digest in recorded.items() if now.get(name) != digest)
        if changed:
            problems.append(Problem("checkpoint", f"config files of {where} differ from the ones that made this "
                                    f"output: {', '.join(changed)}"))
    for name, described in (checkpoint.get("adapters") or {}).items():
        if described.get("kind") != "local":
            continue
        weights = Path(described["path"])
        if not weights.is_file():
            problems.append(Problem(f"model.adapters.{name}", f"the LoRA file {weights} is not here"))
        elif _file_sha256(weights) != described["sha256"]:
            problems.append(Problem(f"model.adapters.{name}", f"the LoRA file {weights} has changed since (its "
                                    "SHA-256 differs)"))
    return problems


def replay(path: str | os.PathLike[str], *, source: str | os.PathLike[str] | None = None, device: str | None = None,
           overrides: Iterable[str] = (), trust_code: bool = False, pipeline_class: type | None = None) -> Output:
    """Regenerate the output at ``path`` (see ``omnispec.replay``) with a ``pipeline_class`` pipeline (default: the
    runtime's ``Pipeline``)."""
    from .runtime.build import build
    from .runtime.pipeline import Pipeline

    made_by = read(path)
    source_text = None if source is None else str(source)
    problems = replay_problems(made_by, source_text)
    if problems:
        raise SpecError(problems)
    spec = replay_spec(made_by, overrides, trust_code=trust_code)
    prompts, seeds, fields = request_arguments(made_by, spec)
    root = source_text or recorded_source(made_by)
    pipe = build(spec, source=root, device=device, trust_code=trust_code, pipeline_class=pipeline_class or Pipeline)
    output = pipe(prompts, seeds, **fields)
    sample = made_by.get("sample")
    return output if sample is None else select_sample(output, sample)


def select_sample(output: Output, i: int) -> Output:
    """Sample ``i`` of an output, as a one-sample output (its record says which sample of the request it is)."""
    import dataclasses

    return dataclasses.replace(
        output, array=output.array[i:i + 1], latents={k: v[i:i + 1] for k, v in output.latents.items()},
        images=output.images[i:i + 1], frames=output.frames[i:i + 1],
        audio=None if output.audio is None else output.audio[i:i + 1],
        provenance=None if output.provenance is None else for_sample(output.provenance, i))


def render(made_by: Mapping[str, Any], path: str | None = None) -> str:
    """``omnispec explain OUTPUT``: what made it, then the plan of its spec."""
    versions_text = ", ".join(f"{k} {v}" for k, v in made_by["versions"].items())
    request = made_by["request"]
    sample = made_by.get("sample")
    lines = [f"{path or 'output'}: made {made_by.get('created', '?')} on {made_by.get('device', '?')} ({versions_text})"]
    indices = range(len(request["prompts"])) if sample is None else [sample]
    for i in indices:
        lines.append(f"  prompt {request['prompts'][i]!r}, seed {request['seeds'][i]}"
                     + (f" (sample {i} of {len(request['prompts'])})" if sample is not None else ""))
    settings = {k: request[k] for k in ("height", "width", "frames", "fps", "steps", "sigmas", "guidance_scale",
                                        "max_sequence_length", "strength", "negative_prompt") if request.get(k) not in
                (None, "")}
    lines.append("  " + ", ".join(f"{k} {v}" for k, v in settings.items()))
    for i, image in enumerate(request.get("images", [])):
        lines.append(f"  image {i}: {image.get('path') or '(in memory)'} at frame {image['frame']}, "
                     f"sha256 {image['digest'][:16]}...")
    checkpoint = made_by.get("checkpoint") or {}
    for described in (checkpoint.get("roots") or {}).values():
        if described.get("kind") == "hub":
            lines.append(f"checkpoint: {described['repo']} (Hub, revision {described.get('revision') or 'unknown'})")
        else:
            lines.append(f"checkpoint: {described['path']} (local, {len(described.get('config_sha256', {}))} config "
                         "files hashed)")
    if checkpoint.get("in_memory"):
        lines.append(f"components given in memory: {', '.join(checkpoint['in_memory'])}")
    if made_by.get("weights_changed"):
        lines.append("weights changed in memory after loading: the checkpoint alone does not reproduce it")
    spec = load_spec(made_by["spec"], trust_code=True)  # reading only: nothing is imported
    lines.append(render_explain(explain_spec(spec, request.get("steps"))))
    return "\n".join(lines)


__all__ = ["a1111_parameters", "checkpoint_record", "for_sample", "is_output", "read", "record", "render", "replay",
           "replay_problems", "request_arguments", "sidecar", "to_text", "versions"]
