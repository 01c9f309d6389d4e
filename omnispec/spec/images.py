"""Conditioning images of a request, checked and brought to what diffusers' image processors take.

A path is opened as data: a regular file (a FIFO or device is refused unopened), one of the plain image formats
(no format whose reader runs a helper program), its size read from the header and refused above
``MAX_IMAGE_PIXELS`` before any pixel is decoded, a truncated file refused. Every PIL mode becomes RGB as
diffusers' ``load_image`` makes it (``convert("RGB")``), with two exceptions where that conversion is wrong:
transparency is composited over white (``convert`` drops it, leaving what the transparent pixels happen to hold)
and 16-bit greyscale is scaled to 8 bits (``convert`` clips it at 255). Arrays and tensors are kept as given,
after checks of their dtype (floating point; an 8-bit numpy picture becomes the PIL image it is), dimensions,
channels (1 or 3), range ([0, 1], what diffusers' processors expect) and finiteness. ``digest`` fingerprints the pixels with their original mode and palette.
"""

from __future__ import annotations

import hashlib
import struct
import warnings
from pathlib import Path
from typing import Any

from .base import MAX_IMAGE_PIXELS, SpecModel
from .errors import SpecError, SpecTypeError
from .files import regular_file

# The formats a conditioning image may have: plain raster formats PIL decodes itself (not EPS, whose reader runs
# Ghostscript, nor the rarer formats of PIL's plugin list).
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")
_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N")


class ImageCondition(SpecModel):
    """An image the request conditions on, placed at ``frame`` of the output video (0 for image tasks).

    ``image`` is what a family hands diffusers' image processor: an RGB PIL image (a path is opened), or the
    caller's numpy array or torch tensor as given. ``digest`` identifies the pixels (prompt-encoding cache keys,
    provenance); ``path`` is the file it came from, if any.
    """

    image: Any
    frame: int = 0
    digest: str
    path: str | None = None


def image_condition(image: Any, frame: int, where: str) -> ImageCondition:
    """One conditioning image, checked and normalised (see the module's docstring), with its digest."""
    import numpy as np
    from PIL import Image

    path = None
    if isinstance(image, (str, Path)):
        path = str(image)
        image = open_image(path, where)
    if isinstance(image, np.ndarray) and image.dtype == np.uint8 and image.ndim in (2, 3):
        image = _uint8_picture(image, where)  # 8-bit pixels are a picture: the same image as its PIL form
    if isinstance(image, Image.Image):
        _check_pixels(image.size[0] * image.size[1], f"{image.size[0]}x{image.size[1]}", where)
        source_mode, palette = image.mode, image.palette.tobytes() if image.palette is not None else b""
        image = rgb(image)
        pixels = np.asarray(image)
        tag = f"{source_mode}:{hashlib.sha256(palette).hexdigest()}"
    elif hasattr(image, "detach") and hasattr(image, "dim"):  # a torch tensor (the spec layer never imports torch)
        if not image.is_floating_point():
            raise SpecError.single(f"an image tensor must be floating point with values in [0, 1] (as diffusers' "
                                   f"image processors take it), got dtype {image.dtype}", where)
        pixels = _checked_array(image.detach().cpu().float().numpy(), str(image.dtype), where, channels_first=True)
        tag = "tensor"
    elif isinstance(image, np.ndarray):
        pixels = _checked_array(image, str(image.dtype), where, channels_first=False)
        tag = "array"
    else:
        raise SpecTypeError.single(f"an image is a PIL image, numpy array, torch tensor or path, got "
                                   f"{type(image).__name__}", where)
    pixels = np.ascontiguousarray(pixels)
    digest = hashlib.sha256(f"{tag}{pixels.shape}{pixels.dtype}".encode() + pixels.tobytes()).hexdigest()[:32]
    return ImageCondition(image=image, frame=frame, digest=digest, path=path)


def open_image(path: str, where: str) -> Any:
    """The image file at ``path`` as an RGB PIL image, EXIF orientation applied (as diffusers' ``load_image``)."""
    from PIL import Image, ImageOps

    file = regular_file(path, where, "image file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own pixel limit decides
            with Image.open(file, formats=IMAGE_FORMATS) as opened:
                width, height = opened.size
                _check_pixels(width * height, f"{width}x{height}", where, path)
                opened.load()  # a truncated or corrupt file fails here, not inside a VAE
                return rgb(ImageOps.exif_transpose(opened))
    except Image.DecompressionBombError:
        raise SpecError.single(f"{path}: its header claims more pixels than any image omnispec reads (the limit is "
                               f"{MAX_IMAGE_PIXELS:,})", where) from None
    except Image.UnidentifiedImageError:
        raise SpecError.single(f"{path}: not an image in a format omnispec reads ({', '.join(IMAGE_FORMATS)})",
                               where) from None
    except (OSError, ValueError, SyntaxError, struct.error) as exc:
        raise SpecError.single(f"{path}: not a readable image ({exc})", where) from None


def rgb(image: Any) -> Any:
    """An RGB copy of a PIL image of any mode: transparency over white, 16-bit greyscale scaled to 8 bits, every
    other mode by PIL's own ``convert("RGB")``."""
    import numpy as np
    from PIL import Image

    mode = image.mode
    if mode == "RGB":
        return image
    if mode in _SIXTEEN_BIT or (mode == "I" and image.getextrema()[1] > 255):
        wide = np.asarray(image, dtype=np.float64)
        return Image.fromarray(np.clip(wide / 257.0, 0, 255).round().astype(np.uint8), "L").convert("RGB")
    if mode in _ALPHA_MODES or (mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def _uint8_picture(pixels: Any, where: str) -> Any:
    """An (H, W) or (H, W, C) uint8 array as the PIL image it is (C: 1, 3, or 4 with alpha)."""
    from PIL import Image

    if pixels.ndim == 3 and pixels.shape[-1] not in (1, 3, 4):
        raise SpecError.single(f"an 8-bit image array is (H, W) or (H, W, C) with 1, 3 or 4 channels, got shape "
                               f"{pixels.shape}", where)
    _check_pixels(pixels.shape[0] * pixels.shape[1], f"{pixels.shape[1]}x{pixels.shape[0]}", where)
    if pixels.ndim == 3 and pixels.shape[-1] == 1:
        pixels = pixels[..., 0]
    return Image.fromarray(pixels)


def _check_pixels(count: int, size: str, where: str, path: str | None = None) -> None:
    if count > MAX_IMAGE_PIXELS:
        raise SpecError.single(f"{path + ': ' if path else ''}{size} is {count:,} pixels, above the limit of "
                               f"{MAX_IMAGE_PIXELS:,} for a conditioning image", where)
    if count == 0:
        raise SpecError.single(f"{path + ': ' if path else ''}the image is empty ({size})", where)


def _checked_array(pixels: Any, dtype: str, where: str, channels_first: bool) -> Any:
    """An image given as an array: floating point in [0, 1] and finite, (H, W, C) / (B, H, W, C) for numpy or
    (C, H, W) / (B, C, H, W) for a tensor, with 1 or 3 channels."""
    import numpy as np

    kind = "tensor" if channels_first else "array"
    layout = "(C, H, W) or (B, C, H, W)" if channels_first else "(H, W, C) or (B, H, W, C)"
    if not np.issubdtype(pixels.dtype, np.floating):
        raise SpecError.single(f"an image {kind} must be floating point with values in [0, 1] (as diffusers' image "
                               f"processors take it) or, for a numpy array, 8-bit (H, W, C); got dtype {dtype}", where)
    if pixels.ndim not in (3, 4):
        raise SpecError.single(f"an image {kind} is {layout}, got shape {tuple(pixels.shape)}", where)
    channels = pixels.shape[-3] if channels_first else pixels.shape[-1]
    if channels not in (1, 3):
        raise SpecError.single(f"an image {kind} has 1 or 3 channels, got {channels} in shape "
                               f"{tuple(pixels.shape)} ({layout}; drop or composite an alpha channel first)", where)
    height, width = (pixels.shape[-2], pixels.shape[-1]) if channels_first else (pixels.shape[-3], pixels.shape[-2])
    _check_pixels(int(height) * int(width), f"{width}x{height}", where)
    if not np.isfinite(pixels).all():
        raise SpecError.single(f"the image {kind} holds NaN or infinite values", where)
    low, high = float(pixels.min()), float(pixels.max())
    if low < 0.0 or high > 1.0:
        raise SpecError.single(f"an image {kind}'s values lie in [0, 1] (as diffusers' image processors take them), "
                               f"got [{low:g}, {high:g}]", where)
    return pixels


__all__ = ["IMAGE_FORMATS", "ImageCondition", "image_condition", "open_image", "rgb"]
