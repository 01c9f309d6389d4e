"""Write outputs: ``.png`` per image, ``.gif``/``.mp4`` per video, ``.npy`` for the whole decoded array; each
carrying the record of what made it (``omnispec.records``: PNG text chunks, the JPEG/GIF comment, MP4
metadata, a ``<file>.json`` beside ``.npy``/``.wav``/``.webp``).

``records.outputs.check_output_path`` refuses, before any work, a path that could not be written.
``save_output`` plans one writer per file
and ``write_files`` runs each into a temporary file beside its target, then renames it into place, so an
interrupted run never leaves a partial file and an existing file is never replaced unless asked.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .. import records
from ..records.outputs import IMAGE_SUFFIXES, VIDEO_SUFFIXES, check_output_path, output_paths
from ..spec import SpecError
from ..spec.videos import import_pyav

if TYPE_CHECKING:
    from .pipeline import Output

# One file's writer: it writes the whole file at the path it is given (a temporary name with the same suffix).
Writer = Callable[[Path], None]
# A media file's writer: the path, and the record of what made it (None: write none).
MediaWriter = Callable[[Path, "dict | None"], None]


def save_output(output: Output, path: Path, overwrite: bool = False) -> list[Path]:
    """Write ``output`` at ``path`` (several samples as ``name-0.ext`` ...); returns the media files written (the
    ``<file>.json`` records beside ``.npy``/``.wav``/``.webp`` files are written with them, not listed)."""
    written = write_files(planned_files(output, path), overwrite)
    return [p for p in written if not (p.suffix == ".json" and Path(p.stem).suffix in records.SIDECAR_SUFFIXES)]


def planned_files(output: Output, path: Path) -> list[tuple[Path, Writer]]:
    """Each file a save writes, with the writer that fills it; each media file records what made it (in the file,
    or in a ``<file>.json`` beside it)."""
    made_by = output.provenance
    files: list[tuple[Path, Writer]] = []
    for target, write, sample in _media_files(output, path):
        record = None
        if made_by is not None:  # an output narrowed to one sample (replay) already says which sample it is
            record = made_by if made_by.get("sample") is not None else records.for_sample(made_by, sample)
        if target.suffix.lower() in records.SIDECAR_SUFFIXES:
            files.append((target, lambda t, write=write: write(t, None)))
            if record is not None:
                files.append((records.sidecar(target),
                              lambda t, record=record: t.write_text(records.to_text(record), encoding="utf-8")))
        else:
            files.append((target, lambda t, write=write, record=record: write(t, record)))
    return files


def _media_files(output: Output, path: Path) -> list[tuple[Path, MediaWriter, int | None]]:
    """Each media file with its writer and the sample it holds (None: every sample, as ``.npy``)."""
    suffix = path.suffix.lower()
    sounds = _sound_files(output, path) if output.audio is not None and suffix in (".npy", ".wav") else []
    if suffix == ".npy":
        return [(path, lambda p, _: _write_npy(output.array, p), None), *sounds]
    if suffix == ".wav":
        return sounds
    if output.images:
        return [(p, lambda t, made_by, image=image: _write_image(image, t, IMAGE_SUFFIXES[suffix], made_by), i)
                for i, (image, p) in enumerate(zip(output.images, output_paths(path, len(output.images))))]
    fps = output.request.fps or 16
    paths = output_paths(path, len(output.frames))
    if suffix == ".mp4":
        tracks = output.audio if output.audio is not None else [None] * len(output.frames)
        return [(p, lambda t, made_by, frames=frames, track=track: _write_mp4(frames, t, fps, track,
                                                                              output.sample_rate, made_by), i)
                for i, (frames, track, p) in enumerate(zip(output.frames, tracks, paths))]
    writer = {".png": _write_strip, ".gif": _write_gif}[suffix]
    return [(p, lambda t, made_by, frames=frames: writer(frames, t, fps, made_by), i)
            for i, (frames, p) in enumerate(zip(output.frames, paths))]


def _sound_files(output: Output, path: Path) -> list[tuple[Path, MediaWriter, int | None]]:
    """One ``.wav`` per sample beside ``path`` (``name.wav``, or ``name-0.wav`` ... for several)."""
    assert output.audio is not None and output.sample_rate is not None
    paths = output_paths(path.with_suffix(".wav"), len(output.audio))
    return [(p, lambda t, _, track=track: _write_wav(track, t, output.sample_rate), i)
            for i, (track, p) in enumerate(zip(output.audio, paths))]


def write_files(files: Sequence[tuple[Path, Writer]], overwrite: bool = False) -> list[Path]:
    """Run every writer into a temporary file beside its target, then rename each into place (an existing
    target is replaced only with ``overwrite``). Temporary files are removed whatever happens."""
    temporaries: list[Path] = []
    try:
        for target, write in files:
            target.parent.mkdir(parents=True, exist_ok=True)
            temporary = target.with_name(f".{target.stem}.{secrets.token_hex(8)}.tmp{target.suffix}")
            temporaries.append(temporary)
            write(temporary)
        for (target, _), temporary in zip(files, temporaries):
            _publish(temporary, target, overwrite)
    finally:
        for temporary in temporaries:
            temporary.unlink(missing_ok=True)
    return [target for target, _ in files]


def _publish(temporary: Path, target: Path, overwrite: bool) -> None:
    if overwrite:
        os.replace(temporary, target)
        return
    try:
        os.link(temporary, target)  # fails if the target exists, even if it appeared during the run
    except FileExistsError:
        raise SpecError.single(f"{target} appeared while the run was going; not replaced (pass --overwrite / "
                               "overwrite=True to replace it)", "output") from None
    except OSError:  # a file system without hard links
        if target.exists() or target.is_symlink():
            raise SpecError.single(f"{target} exists; not replaced", "output") from None
        os.replace(temporary, target)


def _write_npy(array: np.ndarray, path: Path) -> None:
    with path.open("wb") as f:
        np.save(f, array)


def _uint8(frames: np.ndarray) -> np.ndarray:
    return (np.clip(frames, 0, 1) * 255).round().astype(np.uint8)


def _image_metadata(format: str, made_by: dict | None) -> dict:
    """``save`` keywords that put the record into an image: PNG text chunks (ours, and A1111's ``parameters``
    line that image browsers show), the JPEG or GIF comment. WEBP has none: its record is the sidecar."""
    if made_by is None:
        return {}
    text = records.to_text(made_by)
    if format == "PNG":
        from PIL.PngImagePlugin import PngInfo

        info = PngInfo()
        info.add_itxt(records.KEY, text)
        info.add_itxt("parameters", records.a1111_parameters(made_by))
        return {"pnginfo": info}
    if format in ("JPEG", "GIF"):
        return {"comment": text.encode("utf-8")}
    return {}


def _write_image(image, path: Path, format: str, made_by: dict | None) -> None:
    image.save(path, format=format, **_image_metadata(format, made_by))


def _write_strip(frames: np.ndarray, path: Path, fps: int, made_by: dict | None = None) -> None:
    """A video as one image: its frames side by side."""
    from PIL import Image

    strip = Image.fromarray(np.concatenate(list(_uint8(frames)), axis=1).squeeze())
    strip.save(path, format="PNG", **_image_metadata("PNG", made_by))


def _write_gif(frames: np.ndarray, path: Path, fps: int, made_by: dict | None = None) -> None:
    from PIL import Image

    images = [Image.fromarray(f.squeeze()) for f in _uint8(frames)]
    images[0].save(path, format="GIF", save_all=True, append_images=images[1:], duration=int(1000 / fps), loop=0,
                   **_image_metadata("GIF", made_by))


def _write_mp4(frames: np.ndarray, path: Path, fps: int, audio: np.ndarray | None = None,
               sample_rate: int | None = None, made_by: dict | None = None) -> None:
    """H.264 through diffusers' PyAV writer (``encode_video``), with the sound track muxed in as AAC when there
    is one (channels x samples in [-1, 1]); the record then goes into the container's ``comment`` tag by a
    PyAV remux (packets copied, nothing re-encoded), since ``encode_video`` takes no metadata."""
    import torch
    from diffusers.utils import encode_video

    track = None if audio is None else torch.from_numpy(np.ascontiguousarray(audio, dtype=np.float32))
    # a uint8 tensor, not a uint8 array: encode_video warns that an array outside [0, 1] is taken as 8-bit pixels
    encode_video(torch.from_numpy(_uint8(frames)), fps, str(path), audio=track, audio_sample_rate=sample_rate)
    if made_by is not None:
        _tag_mp4(path, {"comment": records.to_text(made_by)})


def _tag_mp4(path: Path, metadata: dict[str, str]) -> None:
    import av

    tagged = path.with_name(f".{path.stem}.{secrets.token_hex(8)}.tag{path.suffix}")
    try:
        with av.open(str(path)) as source, av.open(str(tagged), mode="w", format="mp4") as target:
            target.metadata.update(metadata)
            streams = {s.index: target.add_stream_from_template(s) for s in source.streams if s.type in
                       ("video", "audio")}
            for packet in source.demux(*[s for s in source.streams if s.index in streams]):
                if packet.dts is None:  # the demuxer's flush packet
                    continue
                packet.stream = streams[packet.stream.index]
                target.mux(packet)
        os.replace(tagged, path)
    finally:
        tagged.unlink(missing_ok=True)


def _write_wav(audio: np.ndarray, path: Path, sample_rate: int) -> None:
    """16-bit PCM, channels interleaved (Python's own ``wave`` writer: no dependency for a format this plain)."""
    import wave

    pcm = (np.clip(np.asarray(audio, dtype=np.float32), -1.0, 1.0) * 32767.0).round().astype("<i2")
    channels = pcm.shape[0] if pcm.ndim == 2 else 1
    with wave.open(str(path), "wb") as out:
        out.setnchannels(channels)
        out.setsampwidth(2)
        out.setframerate(int(sample_rate))
        out.writeframes((pcm.T if pcm.ndim == 2 else pcm).tobytes())
