"""Making an output again from its record: the recorded spec, request and checkpoint, through the runtime.

Since a sample never depends on its batch-mates, a file holding sample ``i`` could be regenerated from that
sample's prompt and seed alone, but kernels sum in an order that depends on the batch (5e-7 apart in float32 on a
CPU), so the whole request runs again and sample ``i`` is taken from it: the regenerated array is then identical.
Everything a record says is checked before any weight loads: the record's own fields (``records.read``), the
versions that made it, the checkpoint's config files and LoRA files, the spec (classes outside the trusted
packages refused: a record never turns ``--trust-code`` on), and the request against the recipe.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from . import records
from .records.schema import Record, RecordedImage, RecordedSound, RecordedVideo
from .spec import PipelineSpec, Problem, SpecError, SpecTypeError, load_spec
from .spec.files import path_kind
from .spec.request import resolve_request

if TYPE_CHECKING:
    from .runtime.pipeline import Output


def replay_spec(record: Record, overrides: Iterable[str] = (), *, trust_code: bool = False,
                overrides_from: str = "override") -> PipelineSpec:
    """The recorded spec (on the recorded Hub revision), with ``overrides``, validated as any spec."""
    spec = dict(record.spec)
    checkpoint = record.checkpoint
    root = checkpoint.roots.get(checkpoint.source or "")
    revision = getattr(root, "revision", None)
    model = spec.get("model")
    if revision and isinstance(model, dict) and not model.get("revision"):
        spec["model"] = {**model, "revision": revision}  # the same snapshot of the Hub repo
    return load_spec(spec, list(overrides), trust_code=trust_code, overrides_from=overrides_from)


def request_arguments(record: Record, spec: PipelineSpec, images: bool = True, mask: bool = True,
                      references: bool = True, video: bool = True) -> tuple[list[str], list[int], dict[str, Any]]:
    """Prompts, seeds and request fields that reproduce the recorded request; fields equal to the recipe's defaults
    are left to it (a recipe may refuse them given). ``images=False`` leaves the recorded images out, ``mask=False``
    the recorded mask, ``references=False`` the recorded reference images and ``video=False`` the recorded video
    (the caller gives others)."""
    request = record.request.model_dump(exclude={"prompts", "seeds", "images", "video", "mask", "references",
                                                 "requested"})
    defaults = spec.recipe.defaults.model_dump()
    fields = {k: v for k, v in request.items() if v is not None and v != defaults.get(k)}
    if fields.get("negative_prompt") == "":
        fields.pop("negative_prompt")
    requested = record.request.requested
    if requested is not None:  # the size the caller asked for, not the one the family chose
        for key in ("height", "width"):
            fields.pop(key, None)
        fields.update({k: v for k, v in requested.model_dump().items() if v is not None})
    if record.request.images and images:
        fields.update(image_arguments(record.request.images))
    if record.request.video is not None and video:
        fields["video"] = recorded_file(record.request.video, "request.video", "video", "--video / video=")
    if record.request.mask is not None and mask:
        fields["mask"] = recorded_file(record.request.mask, "request.mask", "mask", "--mask / mask=")
    if record.request.references and references:
        fields["references"] = _recorded_references(record.request.references)
    return list(record.request.prompts), list(record.request.seeds), fields


def _recorded_references(entries: list[Any]) -> list[Any]:
    """The recorded references, in order, each still at its path with its recorded digest: an image's path, a
    video's ``{video, fps, audio}`` (its soundtrack its own file's, or another file), a sound's ``{audio}``."""
    from .spec.audio import audio_condition
    from .spec.images import image_condition
    from .spec.videos import video_condition

    option = "--reference, --reference-video, --reference-audio / references="
    problems, out = [], []
    for i, entry in enumerate(entries):
        where = f"request.references.{i}"
        if isinstance(entry, RecordedImage):
            problems.append(_changed(entry, where, "image", option, lambda path, at: image_condition(path, 0, at)))
            out.append(entry.path)
        elif isinstance(entry, RecordedSound):
            problems.append(_changed(entry, where, "sound", option, lambda path, at: audio_condition(path, None, at)))
            out.append({"audio": entry.path})
        else:
            problems.append(_changed(entry, where, "video", option, video_condition))
            sound = entry.audio
            given: dict[str, Any] = {"video": entry.path, "fps": entry.fps}
            if sound is None or sound.path != entry.path:
                if sound is not None:
                    problems.append(_changed(sound, f"{where}.audio", "sound", option,
                                             lambda path, at: audio_condition(path, None, at)))
                given["audio"] = None if sound is None else sound.path
            out.append(given)
    if any(problems):
        raise SpecError([p for p in problems if p is not None])
    return out


def image_arguments(images: list[RecordedImage]) -> dict[str, Any]:
    """The recorded conditioning images, opened from their paths; each must still hash to its recorded digest."""
    placed = _recorded_files(images, "request.images", "--image / image=")
    if len(placed) == 1 and placed[0]["frame"] == 0:
        return {"image": placed[0]["image"]}
    return {"conditions": placed}


def _recorded_files(images: list[RecordedImage], where: str, option: str) -> list[dict[str, Any]]:
    """``{image: path, frame}`` of recorded images, each still at its path with its recorded digest (else one
    problem per image, naming ``option`` to pass it again)."""
    from .spec.images import image_condition

    problems = [_changed(entry, f"{where}.{i}", "image", option, lambda path, at: image_condition(path, 0, at))
                for i, entry in enumerate(images)]
    if any(problems):
        raise SpecError([p for p in problems if p is not None])
    return [{"image": entry.path, "frame": entry.frame} for entry in images]


def recorded_file(entry: RecordedImage | RecordedVideo, where: str, what: str, option: str) -> str:
    """The path of a recorded mask or video (a mask per frame is a video of masks); the file must still hash to
    its recorded digest."""
    from .spec.images import mask_condition
    from .spec.videos import video_condition

    read = ((lambda path, at: video_condition(path, at, mask=what == "mask")) if isinstance(entry, RecordedVideo)
            else mask_condition)
    problem = _changed(entry, where, what, option, read)
    if problem is not None:
        raise SpecError([problem])
    return str(entry.path)


def _changed(entry: Any, where: str, what: str, option: str, read: Any) -> Problem | None:
    """Why a recorded file cannot be passed again as it is (given in memory, gone, or its pixels changed: ``read``
    opens it as the request did), or None."""
    if not entry.path:
        return Problem(where, f"was given in memory, not as a file: pass the {what} again ({option})")
    if path_kind(entry.path) != "file":
        return Problem(where, f"{entry.path} is gone: pass the {what} again ({option})")
    if read(entry.path, where).digest != entry.digest:
        return Problem(where, f"{entry.path} has changed since (its pixels' digest differs): pass the original "
                              f"{what} again ({option})")
    return None


def replay(path: str | os.PathLike[str], *, source: str | os.PathLike[str] | None = None, device: str | None = None,
           overrides: Iterable[str] = (), trust_code: bool = False, allow_version_drift: bool = False,
           pipeline_loader: Callable[[], type] | None = None) -> Output:
    """Regenerate the output at ``path`` (see ``omnispec.replay``) with the pipeline class ``pipeline_loader()``
    returns (default: the runtime's ``Pipeline``), called once the record is checked: the runtime is imported
    only then, offline where the record's checkpoint is local."""
    from .spec.hub import offline_while_local

    _check_arguments(path, source, device, trust_code, allow_version_drift)
    record = records.read(path)
    drift = records.check_versions(record, allow_version_drift, str(path))
    source_text = None if source is None else str(source)
    problems = records.replay_problems(record, source_text)
    if problems:
        raise SpecError(problems)
    spec = replay_spec(record, overrides, trust_code=trust_code)
    prompts, seeds, fields = request_arguments(record, spec)
    resolve_request(spec, prompts, seeds, **fields)  # the request is checked before any weight loads
    root = source_text or records.recorded_source(record)
    # a record of a local checkpoint replays offline, as ``omnispec.build`` builds: the libraries imported and used
    # on the way ask the Hub nothing
    with offline_while_local(spec, root):
        from .runtime.build import build
        from .runtime.pipeline import Pipeline

        cls = pipeline_loader() if pipeline_loader is not None else Pipeline
        pipe = build(spec, source=root, device=device, trust_code=trust_code, pipeline_class=cls)
        output = pipe(prompts, seeds, **fields)
    output = marked_as_replay(output, record, drift)
    return output if record.sample is None else select_sample(output, record.sample)


def _check_arguments(path: Any, source: Any, device: Any, trust_code: Any, allow_version_drift: Any) -> None:
    """``replay``'s arguments have their types (``SpecTypeError`` naming the argument), so a wrong one is not a
    ``TypeError`` from deep inside pathlib."""
    for name, value in (("path", path), ("source", source)):
        if not (isinstance(value, (str, os.PathLike)) or (name == "source" and value is None)):
            raise SpecTypeError.single(f"expected a file path (str or os.PathLike), got {type(value).__name__}", name)
        if isinstance(value, os.PathLike) and not isinstance(os.fspath(value), str):
            raise SpecTypeError.single(f"expected a str path, got {type(os.fspath(value)).__name__}", name)
    if device is not None and not isinstance(device, str):
        raise SpecTypeError.single(f"expected a device name, got {type(device).__name__}", "device")
    for name, value in (("trust_code", trust_code), ("allow_version_drift", allow_version_drift)):
        if not isinstance(value, bool):
            raise SpecTypeError.single(f"expected True or False, got {type(value).__name__}", name)


def marked_as_replay(output: Output, record: Record, drift: list[str]) -> Output:
    """The output, its record saying which versions made the original and how they differ from these."""
    if output.provenance is not None:
        output.provenance["replay_of"] = {"versions": record.versions.model_dump(), "drift": drift}
    return output


def select_sample(output: Output, i: int) -> Output:
    """Sample ``i`` of an output, as a one-sample output (its record says which sample of the request it is)."""
    return dataclasses.replace(
        output, array=output.array[i:i + 1], latents={k: v[i:i + 1] for k, v in output.latents.items()},
        images=output.images[i:i + 1], frames=output.frames[i:i + 1],
        audio=None if output.audio is None else output.audio[i:i + 1],
        provenance=None if output.provenance is None else records.for_sample(output.provenance, i))


__all__ = ["image_arguments", "marked_as_replay", "replay", "replay_spec", "request_arguments", "select_sample"]
