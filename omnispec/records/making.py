"""Making a record: the spec as run, the request, which sample a file holds, the versions, and the checkpoint
(its Hub revision when it came from the Hub cache; its path and the SHA-256 of its config files when local; each
local LoRA file's SHA-256)."""

from __future__ import annotations

import datetime
import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..spec.audio import AudioCondition
from ..spec.files import path_kind, regular_file, user_path
from ..spec.videos import VideoCondition
from ..version import library_versions
from .schema import FORMAT, KEY

if TYPE_CHECKING:
    from ..spec import PipelineSpec
    from ..spec.images import ImageCondition
    from ..spec.request import Request

_CONFIG_LIMIT = 64 << 20  # config files hashed for a local checkpoint (tokenizer.json may be tens of MB)


def checkpoint_record(spec: PipelineSpec, root: str | None, in_memory: Iterable[str] = (),
                      adapter_files: Mapping[str, Path] | None = None) -> dict[str, Any]:
    """The checkpoint a pipeline loaded from (taken at build): per checkpoint root, a local path with the SHA-256
    of its config files, or a Hub id with the revision found in the cache; the components handed in memory; each
    LoRA slot's file (``adapter_files``: the files build read)."""
    given = sorted(in_memory)
    roots: dict[str, list[str]] = {}
    for name, component in spec.model.components.items():
        if name in given:
            continue
        home = component.source or root
        if home is not None:
            roots.setdefault(home, []).append(component.subfolder or "")
    files = adapter_files or {}
    return {
        "source": root, "in_memory": given,
        "roots": {home: _describe_root(home, folders, spec.model.revision) for home, folders in roots.items()},
        "adapters": {name: _describe_adapter(slot.path, slot.weight_name, files.get(name))
                     for name, slot in spec.model.adapters.items()},
    }


def _describe_adapter(path: str, weight_name: str | None, file: Path | None) -> dict[str, Any]:
    """A LoRA's weights: a local file (or ``weight_name`` in a local folder) with its SHA-256, else a Hub id."""
    if path_kind(user_path(path)) is not None and file is not None:
        return {"kind": "local", "path": str(file.resolve()), "sha256": file_sha256(file)}
    return {"kind": "hub", "repo": path, "weight_name": weight_name}


def file_sha256(path: Path) -> str:
    """SHA-256 of a regular file's bytes, reading no more than the size ``stat`` reports: a record may name any file,
    and one that reports 0 bytes but streams without end (``/proc/self/pagemap``) is hashed as the 0 bytes it claims
    (a FIFO or device is refused unopened)."""
    file = regular_file(path, what="file")
    left = file.stat().st_size
    digest = hashlib.sha256()
    with file.open("rb") as f:
        while left > 0:
            block = f.read(min(left, 1 << 20))
            if not block:
                break
            digest.update(block)
            left -= len(block)
    return digest.hexdigest()


def _describe_root(root: str, folders: list[str], revision: str | None) -> dict[str, Any]:
    local = user_path(root)
    if path_kind(local) == "dir":
        return {"kind": "local", "path": str(local.resolve()), "config_sha256": config_hashes(local, folders)}
    return {"kind": "hub", "repo": root, "revision": hub_revision(root, folders, revision)}


def config_hashes(root: Path, folders: Iterable[str]) -> dict[str, str]:
    """SHA-256 of the checkpoint's small files: ``*.json`` at its root and in each component's folder."""
    out: dict[str, str] = {}
    for folder in sorted(set(folders) | {""}):
        where = root / folder
        if path_kind(where) != "dir":
            continue
        for path in sorted(where.glob("*.json")):
            if path_kind(path) == "file" and path.stat().st_size <= _CONFIG_LIMIT:
                out[str(path.relative_to(root))] = file_sha256(path)
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
    data = request.model_dump(mode="json", exclude={"images", "video", "mask", "references"}, exclude_none=True)
    data["images"] = [_image_data(c) for c in request.images]
    if request.references:
        data["references"] = [_reference_data(c) for c in request.references]
    if request.video is not None:
        data["video"] = _video_data(request.video)
    if request.mask is not None:
        per_frame = isinstance(request.mask, VideoCondition)
        data["mask"] = _video_data(request.mask) if per_frame else _image_data(request.mask)
    return data


def _image_data(condition: ImageCondition) -> dict[str, Any]:
    return {"frame": condition.frame, "digest": condition.digest, **_path_data(condition.path)}


def _reference_data(condition: Any) -> dict[str, Any]:
    if isinstance(condition, AudioCondition):
        return {"kind": "audio", "samples": int(condition.waveform.shape[1]), "sample_rate": condition.sample_rate,
                "digest": condition.digest, **_path_data(condition.path)}
    if isinstance(condition, VideoCondition):
        sound = None if condition.audio is None else _reference_data(condition.audio)
        return {"kind": "video", **_video_data(condition), "fps": condition.fps, "audio": sound}
    return _image_data(condition)


def _video_data(condition: VideoCondition) -> dict[str, Any]:
    return {"frames": len(condition.frames), "digest": condition.digest, **_path_data(condition.path)}


def _path_data(path: str | None) -> dict[str, str]:
    return {"path": str(Path(path).resolve())} if path else {}


def make_record(spec: dict[str, Any], request: Request, device: str, checkpoint: dict[str, Any] | None,
                weights_changed: int = 0, size: tuple[int, int] | None = None,
                preset: dict[str, Any] | None = None) -> dict[str, Any]:
    """What made a request's outputs (``sample`` is filled per file when written); ``spec`` is ``spec_data``'s.
    ``size`` is the (height, width) generated: where it is not the one asked for, both are recorded. ``preset``:
    what ``policies.preset`` turned on (the spec holds those fields already)."""
    data = request_data(request)
    asked = (request.height, request.width)
    if size is not None and tuple(size) != asked:
        data.update(height=size[0], width=size[1], requested={"height": asked[0], "width": asked[1]})
    out: dict[str, Any] = {
        KEY: FORMAT,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "versions": library_versions(),
        "device": device,
        "spec": spec,
        "request": data,
        "sample": None,
        "checkpoint": checkpoint or {"source": None, "in_memory": [], "roots": {}},
    }
    if weights_changed:
        out["weights_changed"] = weights_changed  # in-memory updates (RL sync, set_lora) since build
    if preset:
        out["preset"] = preset
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


__all__ = ["a1111_parameters", "checkpoint_record", "config_hashes", "file_sha256", "for_sample", "make_record",
           "request_data", "spec_data", "to_text"]
