"""References of a request: what the output should show or sound like, in the order the model reads them.

Each is an image (a subject, a style), a video (a motion, with its frame rate and, where it has one, its
soundtrack) or a sound (a voice, music). From Python, ``references=`` is a list whose items are an image as
``image=`` takes it, or a mapping: ``{"image": ...}``, ``{"video": ..., "fps": ..., "audio": ..., "sample_rate":
...}`` (a video file brings its own frame rate and soundtrack; ``fps`` overrides the rate, ``audio: None`` drops
the sound) or ``{"audio": ..., "sample_rate": ...}`` (a file brings its own rate). On the command line
``--reference``, ``--reference-video`` and ``--reference-audio`` add one each, in the order given. Which kinds a
model takes, and how many, is its family's to say.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .audio import AudioCondition, audio_condition, soundtrack
from .base import MAX_FPS, MAX_REFERENCES
from .errors import SpecError, SpecTypeError
from .images import ImageCondition, image_condition
from .videos import VideoCondition, checked_container, import_pyav, open_demuxer, video_condition

Reference = ImageCondition | VideoCondition | AudioCondition
_KEYS = {"image": {"image"}, "video": {"video", "fps", "audio", "sample_rate"}, "audio": {"audio", "sample_rate"}}


def reference_kind(reference: Reference) -> str:
    """``image``, ``video`` or ``audio``."""
    return ("image" if isinstance(reference, ImageCondition) else "video" if isinstance(reference, VideoCondition)
            else "audio")


def reference_key(reference: Reference) -> tuple:
    """What identifies a reference (part of the prompt-encoding cache key): its kind, its digest, and a video's rate
    and sound."""
    if isinstance(reference, VideoCondition):
        sound = reference.audio.digest if reference.audio is not None else None
        return ("video", reference.digest, reference.fps, sound)
    return (reference_kind(reference), reference.digest)


def references(given: Any) -> list[Reference]:
    """The request's references, each checked (see the module's docstring); at most ``MAX_REFERENCES``."""
    if given is None:
        return []
    items = list(given) if isinstance(given, (list, tuple)) else [given]
    if len(items) > MAX_REFERENCES:
        raise SpecError.single(f"{len(items)} references, above the limit of {MAX_REFERENCES}", "request.references")
    return [_reference(item, f"request.references.{k}") for k, item in enumerate(items)]


def _reference(item: Any, where: str) -> Reference:
    if not isinstance(item, Mapping):
        return image_condition(item, 0, where)
    kinds = [kind for kind in ("video", "audio", "image") if kind in item]
    kind = kinds[0] if kinds else None
    if kind is None or set(item) - _KEYS[kind]:
        raise SpecError.single(f"a reference is an image, or {{image}}, {{video, fps?, audio?, sample_rate?}} or "
                               f"{{audio, sample_rate?}}; got keys {sorted(map(str, item))}", where)
    if kind == "image":
        return image_condition(item["image"], 0, f"{where}.image")
    if kind == "audio":
        return audio_condition(item["audio"], item.get("sample_rate"), f"{where}.audio")
    return _video(item, where)


def _video(item: Mapping[str, Any], where: str) -> VideoCondition:
    video = video_condition(item["video"], f"{where}.video")
    fps, sound = None, None
    if video.path is not None and _is_container(video.path):
        fps = container_rate(video.path, f"{where}.video")
        if "audio" not in item:
            found = soundtrack(video.path, f"{where}.video")
            sound = None if found is None else audio_condition(found[0], found[1], f"{where}.video")
            if sound is not None:
                sound = sound.model_copy(update={"path": video.path})
    if item.get("audio") is not None:
        sound = audio_condition(item["audio"], item.get("sample_rate"), f"{where}.audio")
    elif item.get("sample_rate") is not None:
        raise SpecError.single("sample_rate is the rate of a reference video's audio, and none is given",
                               f"{where}.sample_rate")
    if item.get("fps") is not None:
        fps = _rate(item["fps"], f"{where}.fps")
    return video.model_copy(update={"fps": fps, "audio": sound})


def _rate(fps: Any, where: str) -> float:
    if isinstance(fps, bool) or not isinstance(fps, (int, float)):
        raise SpecTypeError.single(f"a frame rate is a number, got {type(fps).__name__} {fps!r}", where)
    if not 0 < fps <= MAX_FPS:
        raise SpecError.single(f"frame rate {fps} is outside (0, {MAX_FPS}]", where)
    return float(fps)


def _is_container(path: str) -> bool:
    from .videos import _container, _head

    return _container(_head(Path(path), "")) is not None


def container_rate(path: str, where: str) -> float | None:
    """The frame rate an MP4/MOV or WebM/Matroska file's video stream declares (its average rate, else FFmpeg's
    guess), or None where it declares none."""
    container = checked_container(path, where)
    av = import_pyav(f"{path}: reading MP4/MOV or WebM/Matroska files", where)
    try:
        with Path(path).open("rb") as handle, open_demuxer(av, handle, container) as opened:
            stream = opened.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
    except (av.FFmpegError, OSError, ValueError, EOFError, IndexError) as exc:
        raise SpecError.single(f"{path}: not a readable video ({exc})", where) from None
    return float(rate) if rate and 0 < float(rate) <= MAX_FPS else None


__all__ = ["Reference", "container_rate", "reference_key", "reference_kind", "references"]
