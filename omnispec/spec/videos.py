"""Conditioning videos of a request (a control video, a mask per frame), checked and brought to PIL frames.

A video is a list of frames of one size: from Python a list of frames (each a path, a PIL image or an 8-bit numpy
array, checked as a conditioning image is), an 8-bit numpy array or torch tensor (F, H, W, C) / (F, H, W); from a
file an animated image (GIF, WebP, APNG: PIL decodes them itself) or an MP4/MOV or Matroska/WebM file (decoded by
PyAV, the ``video`` extra). Float frames are refused: whether they hold [0, 1] or [-1, 1] is a guess, and a
control video is pixels. A single picture (a PIL image, an (H, W) or (H, W, C) array, a still image file) is
refused with what to do instead: a video of one frame is a list of one frame.

A video file is data, never a program: a regular file only (``files.regular_file``); the container format is
chosen from the file's first bytes and forced on FFmpeg (which may demux no other format: its format whitelist),
so no probing picks a playlist or concat demuxer that would open other files or URLs; the demuxer cannot open any
other resource (``io_open`` refuses it, and MOV data references stay off). An MP4/MOV's boxes are walked within
bounds first (``mp4_boxes``), so sample tables claiming millions of entries are refused before FFmpeg allocates
them; a GIF's blocks are measured first (``gif_blocks``), so a frame that grows the canvas past the limit, or a
truncated file, is refused before PIL decodes anything. Every frame's size is checked before it is kept (each
within ``MAX_IMAGE_PIXELS``, all of them within ``MAX_VIDEO_PIXELS`` and ``MAX_FRAMES``), so a hostile header or an
endless stream stops at a limit, not at memory's end; a decoding error is one ``SpecError``.
"""

from __future__ import annotations

import hashlib
import struct
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .base import MAX_FRAMES, MAX_IMAGE_PIXELS, MAX_VIDEO_PIXELS, SpecModel
from .errors import SpecError, SpecTypeError
from .files import regular_file
from .gif_blocks import gif_canvases, is_gif
from .images import _ALPHA_MODES, IMAGE_FORMATS, image_condition, loaded_image, mask_condition, rgb
from .mp4_boxes import iso_media

# Animated image formats PIL decodes itself (a still file of these is one frame).
ANIMATED_FORMATS = ("GIF", "WEBP", "PNG")
# Container formats FFmpeg is allowed to demux, by the magic bytes that name them: ISO media (MP4, MOV: a "ftyp"
# box at byte 4) and Matroska (MKV, WebM: the EBML header).
_CONTAINERS = (("mp4", lambda head: head[4:8] == b"ftyp"), ("matroska", lambda head: head[:4] == b"\x1a\x45\xdf\xa3"))
# What FFmpeg may do with a file we force a demuxer on: those two demuxers only (even if a format were probed), no
# protocol but the file we hand it, no MOV data reference followed to another file.
_DEMUXER_OPTIONS = {"format_whitelist": "mov,mp4,m4a,3gp,3g2,mj2,matroska,webm", "protocol_whitelist": "file",
                    "enable_drefs": "0", "use_absolute_path": "0"}
# Boxes a QuickTime movie may start with when it has no "ftyp" box (older QuickTime writers).
_QUICKTIME_FIRST_BOXES = (b"moov", b"mdat", b"wide", b"free", b"skip", b"pnot")
# Text files that name other files for FFmpeg to read: never demuxed.
_FILE_LISTS = ((b"ffconcat", "an FFmpeg concat list"), (b"#EXTM3U", "an M3U playlist"))
_EXPECTED = "omnispec reads animated GIF, WebP or PNG, MP4/MOV, WebM/Matroska"
_ONE_FRAME = "pass it as image= (--image), or give a list of frames (a video of one frame is [image])"


class VideoCondition(SpecModel):
    """A video the request conditions on: its frames as PIL images (RGB; mode L for a mask), all of one size.

    ``digest`` identifies the frames' pixels in order (prompt-encoding cache keys, provenance); ``path`` is the file
    they came from, if any. A reference video (``spec.references``) also carries its frame rate, where known, and
    its soundtrack."""

    frames: list[Any]
    digest: str
    path: str | None = None
    fps: float | None = None
    audio: Any = None  # an ``AudioCondition``

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
    else:
        frames = list(_bounded(_stacked_frames(_checked_stack(video, where), where), where))
    if not frames:
        raise SpecError.single(f"{path + ': ' if path else ''}the video has no frames", where)
    frames = [_mask_frame(f, k, where, path) for k, f in enumerate(frames)] if mask else [rgb(f, where) for f in frames]
    return VideoCondition(frames=frames, digest=_digest(frames, "mask" if mask else "video"), path=path)


def _checked_stack(video: Any, where: str) -> Any:
    """An 8-bit (F, H, W, C) / (F, H, W) array or dense tensor; anything else refused, saying what it is."""
    from PIL import Image

    if isinstance(video, Image.Image):
        raise SpecTypeError.single(f"a video was expected, got a single PIL image ({video.size[0]}x{video.size[1]}): "
                                   f"{_ONE_FRAME}", where)
    if not (hasattr(video, "dtype") and hasattr(video, "shape")):
        raise SpecTypeError.single("a video is a list of frames, an 8-bit (F, H, W, C) array or tensor, or a path, "
                                   f"got {type(video).__name__}", where)
    if getattr(video, "is_meta", False) or str(getattr(video, "layout", "torch.strided")) != "torch.strided":
        held = "on the meta device" if getattr(video, "is_meta", False) else f"with layout {video.layout}"
        raise SpecError.single(f"a tensor of frames holds its values in memory (a dense tensor), got one {held}", where)
    shape, dtype = tuple(int(n) for n in video.shape), video.dtype
    if _is_single_picture(shape, str(dtype), hasattr(video, "detach")):
        raise SpecError.single(f"a video was expected, got a single image (dtype {dtype}, shape {shape}): "
                               f"{_ONE_FRAME}", where)
    if not _is_uint8_stack(video):
        raise SpecError.single(f"a video array or tensor is 8-bit (F, H, W, C) or (F, H, W), got dtype {dtype} "
                               f"and shape {shape}: float frames are refused, their range is a guess", where)
    return video


def _is_single_picture(shape: tuple[int, ...], dtype: str, is_tensor: bool) -> bool:
    """Whether an array's shape is one picture's: (H, W), (H, W, C), or a float tensor's (C, H, W); an 8-bit
    (F, H, W) stack is told from (H, W, C) by its last axis (a video 1, 3 or 4 pixels wide is none)."""
    if len(shape) == 2:
        return True
    if len(shape) != 3:
        return False
    channels_first = is_tensor and "uint8" not in dtype and shape[0] in (1, 3)
    return shape[-1] in (1, 3, 4) or channels_first


def holds_mask_frames(mask: Any, where: str) -> bool:
    """Whether a video task's mask is a mask per frame rather than one image for every frame: a list, a file holding
    several frames, or an 8-bit (F, H, W) / (F, H, W, 1) array or tensor (an (H, W, C) one is one image)."""
    if isinstance(mask, (list, tuple)):
        return True
    if isinstance(mask, (str, Path)):
        return is_video_file(mask, where, "mask file")
    shape = tuple(int(n) for n in getattr(mask, "shape", ()))
    return _is_uint8_stack(mask) and not _is_single_picture(shape, str(mask.dtype), hasattr(mask, "detach"))


def is_video_file(path: str | Path, where: str, what: str = "file") -> bool:
    """Whether the file at ``path`` holds several frames: an animated image, or a container FFmpeg would demux (a
    GIF's blocks are measured first, so a truncated or hostile one is refused here)."""
    from PIL import Image

    file = regular_file(path, where, what)
    head = _head(file, where)
    if _container(head) is not None:
        return True
    if is_gif(head):
        return len(gif_canvases(file, str(path), where, MAX_FRAMES)) > 1
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
    head = _head(file, where)
    container = _container(head)
    if container is not None:
        yield from _demuxed(file, container, path, where)
        return
    if is_gif(head):
        _check_canvases(gif_canvases(file, path, where, MAX_FRAMES), path, where)
    yield from _animated(file, head, path, where)


def _head(file: Path, where: str) -> bytes:
    try:
        with file.open("rb") as handle:
            return handle.read(16)
    except OSError as exc:
        raise SpecError.single(f"cannot read {file}: {exc.strerror or exc}", where) from None


def _container(head: bytes) -> str | None:
    """The FFmpeg demuxer a file's first bytes name, or None (not a container omnispec demuxes)."""
    return next((name for name, matches in _CONTAINERS if matches(head)), None)


def _check_canvases(canvases: list[tuple[int, int]], path: str, where: str) -> None:
    """A GIF's canvas after each frame, from its blocks: the limits and the one size of a video's frames, checked
    before PIL allocates any frame."""
    for k, canvas in enumerate(canvases):
        _check_frame(canvas, k, path, where)
        _check_same_size(canvas, canvases[0], k, path, where)
    _check_count(len(canvases), canvases[0] if canvases else (0, 0), path, where)


def _animated(file: Path, head: bytes, path: str, where: str) -> Iterator[Any]:
    from PIL import Image, ImageSequence

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own pixel limits decide
            with Image.open(file, formats=ANIMATED_FORMATS) as opened:
                _check_frame(opened.size, 0, path, where)
                if not getattr(opened, "is_animated", False):
                    raise SpecError.single(f"{path}: a single {opened.format} image, where a video was expected: "
                                           f"{_ONE_FRAME}", where)
                for frame in ImageSequence.Iterator(opened):
                    frame.load()
                    yield frame.copy()
    except SpecError:
        raise
    except Image.UnidentifiedImageError:
        raise SpecError.single(f"{path}: not a video omnispec reads: {_found(file, head)}", where) from None
    except Image.DecompressionBombError:
        raise SpecError.single(f"{path}: its header claims more pixels than any frame omnispec reads (the limit is "
                               f"{MAX_IMAGE_PIXELS:,})", where) from None
    except (OSError, ValueError, SyntaxError, EOFError, struct.error) as exc:
        raise SpecError.single(f"{path}: not a readable video ({exc})", where) from None


def _found(file: Path, head: bytes) -> str:
    """What a file that is no video omnispec reads looks like, and what to do with it."""
    if head[4:8] in _QUICKTIME_FIRST_BOXES:
        return (f"a QuickTime movie without an 'ftyp' box (it starts with a {head[4:8].decode()!r} box), which "
                "omnispec does not demux; re-mux it (ffmpeg -i IN.mov -c copy OUT.mp4 copies the streams and writes "
                f"one), or convert it to another format ({_EXPECTED})")
    listed = next((what for magic, what in _FILE_LISTS if head.startswith(magic)), None)
    if listed is not None:
        return f"{listed}, which names other files; omnispec opens no file that a video names ({_EXPECTED})"
    still = _still_image_format(file)
    if still is not None:
        return f"a single {still} image, where a video was expected: {_ONE_FRAME}"
    return _EXPECTED


def _still_image_format(file: Path) -> str | None:
    """The format of a still image file (read from its header only), or None."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(file, formats=IMAGE_FORMATS) as opened:
                return opened.format
    except Exception:  # noqa: BLE001 - not an image either: the caller says what omnispec reads
        return None


def import_pyav(what: str, where: str = "", *, otherwise: str = "", file: str | None = None) -> Any:
    """PyAV (the ``video`` extra), imported; where it is missing, one error: ``what`` needs it, how to install it,
    and ``otherwise`` (what to do instead)."""
    try:
        import av
    except ImportError:
        raise SpecError.single(f"{what} needs PyAV: pip install 'omnispec-diffusion[video]'{otherwise}", where,
                               file) from None
    return av


def _no_other_files(url: str, flags: int, options: dict) -> Any:
    raise PermissionError(f"a video file may not open other resources ({url})")


def open_demuxer(av: Any, handle: Any, container: str) -> Any:
    """PyAV's container for an open file, its demuxer forced and fenced (see the module's docstring)."""
    return av.open(handle, format=container, io_open=_no_other_files, container_options=_DEMUXER_OPTIONS)


def checked_container(path: str | Path, where: str = "", what: str = "video file") -> str:
    """The demuxer of a container file (``mp4`` or ``matroska``), after an MP4's boxes are checked; ``SpecError``
    saying what the file is otherwise."""
    checked = regular_file(path, where, what)
    head = _head(checked, where)
    container = _container(head)
    if container is None:
        raise SpecError.single(f"{path}: not an MP4/MOV or WebM/Matroska file: {_found(checked, head)}", where)
    if container == "mp4":
        iso_media(checked, str(path), where)
    return container


def _demuxed(file: Path, container: str, path: str, where: str) -> Iterator[Any]:
    """Frames FFmpeg decodes from an MP4/MOV or Matroska/WebM file, through PyAV (the ``video`` extra)."""
    av = import_pyav(f"{path}: reading MP4/MOV or WebM/Matroska files", where,
                     otherwise=" (or give an animated GIF/WebP/PNG, or frames)")
    codec = iso_media(file, path, where).video_codec() if container == "mp4" else ""
    try:
        with file.open("rb") as handle, open_demuxer(av, handle, container) as opened:
            if not opened.streams.video:
                raise SpecError.single(f"{path}: the file has no video stream", where)
            stream = opened.streams.video[0]
            if stream.codec_context is None:
                named = f" {codec!r}" if codec else ""
                raise SpecError.single(f"{path}: its video stream's codec{named} is not one FFmpeg decodes here; "
                                       "convert it (e.g. to H.264)", where)
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


def _check_same_size(size: tuple[int, int], first: tuple[int, int], k: int, path: str | None, where: str) -> None:
    if size != first:
        raise SpecError.single(f"{path + ': ' if path else ''}frame {k} is {size[0]}x{size[1]}, frame 0 {first[0]}x"
                               f"{first[1]}: a video's frames have one size", where)


def _check_count(count: int, size: tuple[int, int], path: str | None, where: str) -> None:
    """``count`` frames of ``size``: within ``MAX_FRAMES`` and ``MAX_VIDEO_PIXELS``."""
    named = f"{path}: " if path else ""
    if count > MAX_FRAMES:
        raise SpecError.single(f"{named}more than {MAX_FRAMES:,} frames, the limit of a video", where)
    if count * size[0] * size[1] > MAX_VIDEO_PIXELS:
        raise SpecError.single(f"{named}{count} frames of {size[0]}x{size[1]} pass the limit of "
                               f"{MAX_VIDEO_PIXELS:,} pixels for a video", where)


def _bounded(frames: Iterator[Any], where: str, path: str | None = None) -> Iterator[Any]:
    """The frames, while they have the first one's size and stay within ``MAX_FRAMES`` and ``MAX_VIDEO_PIXELS``."""
    first = None
    for k, frame in enumerate(frames):
        _check_frame(frame.size, k, path, where)
        first = first or frame.size
        _check_same_size(frame.size, first, k, path, where)
        _check_count(k + 1, first, path, where)
        yield frame


def _listed_frames(items: list | tuple, where: str, mask: bool) -> Iterator[Any]:
    """Frames given one by one; a path or an array is read as a conditioning image is (as a mask is, for masks); a
    PIL image's pixels are read once its size is checked (a closed or truncated one is refused)."""
    from PIL import Image

    condition = (lambda item, at: mask_condition(item, at)) if mask else (lambda item, at: image_condition(item, 0, at))
    if len(items) > MAX_FRAMES:
        raise SpecError.single(f"{len(items):,} frames, above the limit of {MAX_FRAMES:,} for a video", where)
    for k, item in enumerate(items):
        at = f"{where}.{k}"
        if not isinstance(item, (str, Path, Image.Image)) and not _is_uint8_picture(item):
            raise SpecTypeError.single("a frame is a path, a PIL image or an 8-bit (H, W) / (H, W, C) numpy array, "
                                       f"got {_described(item)}", at)
        if isinstance(item, Image.Image):
            _check_frame(item.size, k, None, where)
            yield loaded_image(item, at)
        else:
            yield condition(item, at).image


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


__all__ = ["ANIMATED_FORMATS", "VideoCondition", "checked_container", "holds_mask_frames", "import_pyav",
           "is_video_file", "open_demuxer", "read_video", "video_condition"]
