"""Conditioning videos of a request (a control video, a mask per frame), checked and brought to PIL frames.

A video is a list of frames of one size: from Python a list of frames (each a path, a PIL image or an 8-bit numpy
array, checked as a conditioning image is), an 8-bit numpy array or torch tensor (F, H, W, C) / (F, H, W); from a
file an animated image (GIF, WebP, APNG: PIL decodes them itself) or an MP4/MOV or Matroska/WebM file (decoded by
PyAV, the ``video`` extra). Float frames are refused: whether they hold [0, 1] or [-1, 1] is a guess, and a
control video is pixels.

A video file is data, never a program: a regular file only (``files.regular_file``); the container format is
chosen from the file's first bytes and forced on FFmpeg, so no probing picks a playlist or concat demuxer that
would open other files or URLs; the demuxer cannot open any other resource (``io_open`` refuses it). Every frame's
size is checked before it is kept (each within ``MAX_IMAGE_PIXELS``, all of them within ``MAX_VIDEO_PIXELS`` and
``MAX_FRAMES``), so a hostile header or an endless stream stops at a limit, not at memory's end; a decoding error
is one ``SpecError``.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .base import MAX_FRAMES, MAX_IMAGE_PIXELS, MAX_VIDEO_PIXELS, SpecModel
from .errors import SpecError, SpecTypeError
from .files import regular_file
from .images import _ALPHA_MODES, image_condition, mask_condition, rgb

# Animated image formats PIL decodes itself (a still file of these is one frame).
ANIMATED_FORMATS = ("GIF", "WEBP", "PNG")
# Container formats FFmpeg is allowed to demux, by the magic bytes that name them: ISO media (MP4, MOV: a "ftyp"
# box at byte 4) and Matroska (MKV, WebM: the EBML header).
_CONTAINERS = (("mp4", lambda head: head[4:8] == b"ftyp"), ("matroska", lambda head: head[:4] == b"\x1a\x45\xdf\xa3"))


class VideoCondition(SpecModel):
    """A video the request conditions on: its frames as PIL images (RGB; mode L for a mask), all of one size.

    ``digest`` identifies the frames' pixels in order (prompt-encoding cache keys, provenance); ``path`` is the file
    they came from, if any."""

    frames: list[Any]
    digest: str
    path: str | None = None

    @property
    def size(self) -> tuple[int, int]:
        """(height, width) of the frames."""
        width, height = self.frames[0].size
        return height, width


def video_condition(video: Any, where: str = "request.video", mask: bool = False) -> VideoCondition:
    """A checked video (see the module's docstring); ``mask``: a mask per frame (greyscale, no transparency)."""
    path = None
    if isinstance(video, (str, Path)):
        path = str(video)
        frames = list(_bounded(read_video(path, where), where, path))
    elif isinstance(video, (list, tuple)):
        frames = list(_bounded(_listed_frames(video, where, mask), where))
    elif _is_uint8_stack(video):
        frames = list(_bounded(_stacked_frames(video, where), where))
    elif hasattr(video, "dtype") and hasattr(video, "shape"):
        raise SpecError.single(f"a video array or tensor is 8-bit (F, H, W, C) or (F, H, W), got dtype {video.dtype} "
                               f"and shape {tuple(video.shape)}: float frames are refused, their range is a guess",
                               where)
    else:
        raise SpecTypeError.single("a video is a list of frames, an 8-bit (F, H, W, C) array or tensor, or a path, "
                                   f"got {type(video).__name__}", where)
    if not frames:
        raise SpecError.single(f"{path + ': ' if path else ''}the video has no frames", where)
    frames = [_mask_frame(f, k, where, path) for k, f in enumerate(frames)] if mask else [rgb(f, where) for f in frames]
    return VideoCondition(frames=frames, digest=_digest(frames, "mask" if mask else "video"), path=path)


def holds_mask_frames(mask: Any, where: str) -> bool:
    """Whether a video task's mask is a mask per frame rather than one image for every frame: a list, a file holding
    several frames, or an 8-bit (F, H, W) / (F, H, W, 1) array or tensor (an (H, W, 1) one is one image)."""
    if isinstance(mask, (list, tuple)):
        return True
    if isinstance(mask, (str, Path)):
        return is_video_file(mask, where, "mask file")
    shape = tuple(getattr(mask, "shape", ()))
    return _is_uint8_stack(mask) and not (len(shape) == 3 and shape[-1] == 1)


def is_video_file(path: str | Path, where: str, what: str = "file") -> bool:
    """Whether the file at ``path`` holds several frames: an animated image, or a container FFmpeg would demux."""
    from PIL import Image

    file = regular_file(path, where, what)
    if _container(file, where) is not None:
        return True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(file, formats=ANIMATED_FORMATS) as opened:
                return bool(getattr(opened, "is_animated", False))
    except Exception:  # noqa: BLE001 - not an animation: the image reader says what it is in its own words
        return False


def read_video(path: str, where: str) -> Iterator[Any]:
    """The frames of a video file, each a PIL image once its size is checked (see the module's docstring)."""
    file = regular_file(path, where, "video file")
    container = _container(file, where)
    if container is not None:
        yield from _demuxed(file, container, path, where)
        return
    yield from _animated(file, path, where)


def _container(file: Path, where: str) -> str | None:
    """The FFmpeg demuxer the file's magic bytes name, or None (not a container omnispec demuxes)."""
    try:
        with file.open("rb") as handle:
            head = handle.read(16)
    except OSError as exc:
        raise SpecError.single(f"cannot read {file}: {exc.strerror or exc}", where) from None
    return next((name for name, matches in _CONTAINERS if matches(head)), None)


def _animated(file: Path, path: str, where: str) -> Iterator[Any]:
    from PIL import Image, ImageSequence

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own pixel limits decide
            with Image.open(file, formats=ANIMATED_FORMATS) as opened:
                _check_frame(opened.size, 0, path, where)
                for frame in ImageSequence.Iterator(opened):
                    frame.load()
                    yield frame.copy()
    except SpecError:
        raise
    except Image.UnidentifiedImageError:
        raise SpecError.single(f"{path}: not a video omnispec reads (animated GIF, WebP or PNG; MP4/MOV or "
                               "WebM/Matroska)", where) from None
    except Image.DecompressionBombError:
        raise SpecError.single(f"{path}: its header claims more pixels than any frame omnispec reads (the limit is "
                               f"{MAX_IMAGE_PIXELS:,})", where) from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise SpecError.single(f"{path}: not a readable video ({exc})", where) from None


def import_pyav(what: str, where: str = "", *, otherwise: str = "", file: str | None = None) -> Any:
    """PyAV (the ``video`` extra), imported; where it is missing, one error: ``what`` needs it, how to install it,
    and ``otherwise`` (what to do instead)."""
    try:
        import av
    except ImportError:
        raise SpecError.single(f"{what} needs PyAV: pip install 'omnispec-diffusion[video]'{otherwise}", where,
                               file) from None
    return av


def _demuxed(file: Path, container: str, path: str, where: str) -> Iterator[Any]:
    """Frames FFmpeg decodes from an MP4/MOV or Matroska/WebM file, through PyAV (the ``video`` extra)."""
    av = import_pyav(f"{path}: reading MP4/MOV or WebM/Matroska files", where,
                     otherwise=" (or give an animated GIF/WebP/PNG, or frames)")

    def no_other_files(url: str, flags: int, options: dict) -> Any:
        raise PermissionError(f"a video file may not open other resources ({url})")

    try:
        with file.open("rb") as handle, av.open(handle, format=container, io_open=no_other_files) as opened:
            if not opened.streams.video:
                raise SpecError.single(f"{path}: the file has no video stream", where)
            stream = opened.streams.video[0]
            header = (stream.codec_context.width, stream.codec_context.height)
            if header[0] * header[1]:  # the size the stream declares, where it declares one
                _check_frame(header, 0, path, where)
            for k, frame in enumerate(opened.decode(stream)):
                _check_frame((frame.width, frame.height), k, path, where)
                yield frame.to_image()
    except SpecError:
        raise
    except (av.FFmpegError, OSError, ValueError, EOFError) as exc:
        raise SpecError.single(f"{path}: not a readable video ({exc})", where) from None


def _check_frame(size: tuple[int, int], k: int, path: str | None, where: str) -> None:
    width, height = size
    named = f"{path}: " if path else ""
    if width * height > MAX_IMAGE_PIXELS:
        raise SpecError.single(f"{named}frame {k} is {width}x{height}, {width * height:,} pixels, above the limit of "
                               f"{MAX_IMAGE_PIXELS:,} for a frame", where)
    if width * height == 0:
        raise SpecError.single(f"{named}frame {k} is empty ({width}x{height})", where)


def _bounded(frames: Iterator[Any], where: str, path: str | None = None) -> Iterator[Any]:
    """The frames, while they have the first one's size and stay within ``MAX_FRAMES`` and ``MAX_VIDEO_PIXELS``."""
    first, total, named = None, 0, f"{path}: " if path else ""
    for k, frame in enumerate(frames):
        if k >= MAX_FRAMES:
            raise SpecError.single(f"{named}more than {MAX_FRAMES:,} frames, the limit of a video", where)
        _check_frame(frame.size, k, path, where)
        first = first or frame.size
        if frame.size != first:
            raise SpecError.single(f"{named}frame {k} is {frame.size[0]}x{frame.size[1]}, frame 0 {first[0]}x"
                                   f"{first[1]}: a video's frames have one size", where)
        total += first[0] * first[1]
        if total > MAX_VIDEO_PIXELS:
            raise SpecError.single(f"{named}{k + 1} frames of {first[0]}x{first[1]} pass the limit of "
                                   f"{MAX_VIDEO_PIXELS:,} pixels for a video", where)
        yield frame


def _listed_frames(items: list | tuple, where: str, mask: bool) -> Iterator[Any]:
    """Frames given one by one; a path or an array is read as a conditioning image is (as a mask is, for masks)."""
    from PIL import Image

    condition = (lambda item, at: mask_condition(item, at)) if mask else (lambda item, at: image_condition(item, 0, at))
    if len(items) > MAX_FRAMES:
        raise SpecError.single(f"{len(items):,} frames, above the limit of {MAX_FRAMES:,} for a video", where)
    for k, item in enumerate(items):
        at = f"{where}.{k}"
        if not isinstance(item, (str, Path, Image.Image)) and not _is_uint8_picture(item):
            raise SpecTypeError.single("a frame is a path, a PIL image or an 8-bit (H, W) / (H, W, C) numpy array, "
                                       f"got {_described(item)}", at)
        yield item if isinstance(item, Image.Image) else condition(item, at).image


def _stacked_frames(stack: Any, where: str) -> Iterator[Any]:
    import numpy as np
    from PIL import Image

    shape = tuple(int(n) for n in stack.shape)
    if len(shape) == 4 and shape[-1] not in (1, 3):
        raise SpecError.single(f"a video array is (F, H, W) or (F, H, W, C) with 1 or 3 channels, got shape {shape}",
                               where)
    frames, height, width = shape[0], shape[1], shape[2]
    if frames > MAX_FRAMES:
        raise SpecError.single(f"{frames:,} frames, above the limit of {MAX_FRAMES:,} for a video", where)
    _check_frame((width, height), 0, None, where)
    for k in range(frames):
        frame = stack[k]
        frame = frame.detach().cpu().numpy() if hasattr(frame, "detach") else np.asarray(frame)
        grey = frame.ndim == 3 and frame.shape[-1] == 1
        yield Image.fromarray(np.ascontiguousarray(frame[..., 0] if grey else frame))


def _is_uint8_stack(value: Any) -> bool:
    dtype = str(getattr(value, "dtype", ""))
    return dtype in ("uint8", "torch.uint8") and len(getattr(value, "shape", ())) in (3, 4)


def _is_uint8_picture(value: Any) -> bool:
    import numpy as np

    return isinstance(value, np.ndarray) and value.dtype == np.uint8 and value.ndim in (2, 3)


def _described(item: Any) -> str:
    shape = getattr(item, "shape", None)
    return f"{type(item).__name__}" + (f" of dtype {item.dtype} and shape {tuple(shape)}" if shape is not None else "")


def _mask_frame(frame: Any, k: int, where: str, path: str | None) -> Any:
    """A mask frame as greyscale; a frame whose pixels are actually transparent is refused (which of alpha and
    grey marks the region is a guess), an opaque one in an alpha mode is kept (animated files store frames so)."""
    mode = frame.mode
    if mode in _ALPHA_MODES or "transparency" in frame.info:
        alpha = (frame.convert("LA") if mode == "La" else frame).convert("RGBA").getchannel("A")
        if alpha.getextrema()[0] < 255:
            raise SpecError.single(f"{path + ': ' if path else ''}mask frame {k} has transparent pixels; whether its "
                                   "alpha or its grey values mark the region to repaint is ambiguous: save it as "
                                   "greyscale, white where to repaint", where)
        frame = frame.convert("RGBA").convert("RGB")
    return frame if frame.mode == "L" else rgb(frame, where).convert("L")


def _digest(frames: list[Any], kind: str) -> str:
    import numpy as np

    digest = hashlib.sha256(f"{kind}:{len(frames)}:{frames[0].mode}:{frames[0].size}".encode())
    for frame in frames:
        digest.update(np.ascontiguousarray(np.asarray(frame)).reshape(-1).view(np.uint8))
    return digest.hexdigest()[:32]


__all__ = ["ANIMATED_FORMATS", "VideoCondition", "holds_mask_frames", "is_video_file", "read_video", "video_condition"]
