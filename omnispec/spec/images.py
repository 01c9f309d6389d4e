"""Conditioning images of a request, checked and brought to what diffusers' image processors take.

A path is opened as data: a regular file (a FIFO or device is refused unopened), one of the plain image formats
(no format whose reader runs a helper program), its size read from the header and refused above
``MAX_IMAGE_PIXELS`` before any pixel is decoded, a truncated file refused. Every PIL mode becomes RGB as
diffusers' ``load_image`` makes it (``convert("RGB")``), except where that conversion is wrong: transparency is
composited over white (``convert`` drops it, leaving what the transparent pixels happen to hold); 16-bit greyscale,
and 32-bit integer greyscale with values above 255, is scaled from 0..65535 to 8 bits (``convert`` clips it at 255;
wider integer ranges are refused, their scale unknown); float greyscale (mode F) in [0, 1] is scaled to 0..255
(other float values are clipped to 0..255, as ``convert`` does). Arrays and tensors are kept as given, after checks
of their dtype (floating point; an 8-bit numpy picture becomes the PIL image it is), dimensions, channels (1 or 3),
size (the pixels of all images of a batch count toward the limit), range ([0, 1], what diffusers' processors
expect) and finiteness. ``digest`` fingerprints the pixels with their original mode and palette.
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
# Modes PIL converts to RGBA only through another mode: premultiplied greyscale with alpha.
_VIA = {"La": "LA"}


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
        image = loaded_image(image, where)
        source_mode, palette = image.mode, image.palette.tobytes() if image.palette is not None else b""
        image = rgb(image, where)
        pixels = np.asarray(image)
        tag = f"{source_mode}:{hashlib.sha256(palette).hexdigest()}"
    elif hasattr(image, "detach") and hasattr(image, "dim"):  # a torch tensor (the spec layer never imports torch)
        pixels = _checked_values(_tensor_pixels(image, where), "tensor", where)
        tag = "tensor"
    elif isinstance(image, np.ndarray):
        _check_dtype(image.dtype, "array", where)
        _check_shape(image.shape, "array", where, channels_first=False)
        pixels = _checked_values(image, "array", where)
        tag = "array"
    else:
        raise SpecTypeError.single(f"an image is a PIL image, numpy array, torch tensor or path, got "
                                   f"{type(image).__name__}", where)
    pixels = np.ascontiguousarray(pixels)
    digest = hashlib.sha256(f"{tag}{pixels.shape}{pixels.dtype}".encode())
    digest.update(pixels.reshape(-1).view(np.uint8))  # the pixels' bytes, not a copy of them
    return ImageCondition(image=image, frame=frame, digest=digest.hexdigest()[:32], path=path)


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
                return rgb(ImageOps.exif_transpose(opened), where)
    except SpecError:  # our own refusal (a ValueError too): as it is
        raise
    except Image.DecompressionBombError:
        raise SpecError.single(f"{path}: its header claims more pixels than any image omnispec reads (the limit is "
                               f"{MAX_IMAGE_PIXELS:,})", where) from None
    except Image.UnidentifiedImageError:
        raise SpecError.single(f"{path}: not an image in a format omnispec reads ({', '.join(IMAGE_FORMATS)})",
                               where) from None
    except (OSError, ValueError, SyntaxError, struct.error) as exc:
        raise SpecError.single(f"{path}: not a readable image ({exc})", where) from None


def loaded_image(image: Any, where: str) -> Any:
    """A PIL image the caller handed over, with its pixels read (PIL reads a file's lazily): one that was closed, or
    opened from a truncated or corrupt file, is refused here instead of failing inside a conversion. Check its size
    first: loading decodes every pixel its header claims."""
    try:
        image.load()
    except (OSError, ValueError, SyntaxError, EOFError, struct.error) as exc:
        raise SpecError.single(f"the PIL image's pixels cannot be read ({exc}): it was closed, or its file is "
                               "truncated or corrupt", where) from None
    return image


def rgb(image: Any, where: str = "image") -> Any:
    """An RGB copy of a PIL image of any mode (see the module's docstring): transparency over white, wide greyscale
    scaled to 8 bits, every other mode by PIL's own ``convert("RGB")``; a mode PIL cannot convert is refused."""
    from PIL import Image

    mode = image.mode
    if mode == "RGB":
        return image
    if mode in _SIXTEEN_BIT or mode in ("I", "F"):
        return Image.fromarray(_grey_bytes(image, where), "L").convert("RGB")
    try:
        if mode in _ALPHA_MODES or (mode == "P" and "transparency" in image.info):
            rgba = (image.convert(_VIA[mode]) if mode in _VIA else image).convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, rgba).convert("RGB")
        return image.convert("RGB")
    except ValueError as exc:  # a mode without a conversion to RGB
        raise SpecError.single(f"an image of PIL mode {mode!r} cannot be converted to RGB ({exc}); save it as RGB "
                               "first", where) from None


def _grey_bytes(image: Any, where: str) -> Any:
    """A wide greyscale image (modes I;16*, I, F) as 8-bit values: 16-bit and 32-bit integers above 255 scaled from
    0..65535, integers within 0..255 kept, floats in [0, 1] scaled from it (other floats clipped to 0..255)."""
    import numpy as np

    wide = np.array(image, dtype=np.float32)  # a writable copy, exact for every 16-bit value
    low, high = (float(wide.min()), float(wide.max())) if wide.size else (0.0, 0.0)
    if not (np.isfinite(low) and np.isfinite(high)):
        raise SpecError.single(f"the image (PIL mode {image.mode}) holds NaN or infinite values", where)
    if image.mode == "F":
        scaled = wide * np.float32(255.0) if low >= 0.0 and high <= 1.0 else wide
    elif image.mode == "I" and (low < 0 or high > 65535):
        raise SpecError.single(f"a 32-bit integer image (PIL mode I) with values in [{low:g}, {high:g}]: omnispec reads "
                               "8-bit (0..255) and 16-bit (0..65535) ranges; save it with 8 or 16 bits", where)
    else:
        scaled = wide / np.float32(257.0) if image.mode in _SIXTEEN_BIT or high > 255 else wide
    return np.clip(scaled, 0, 255, out=scaled).round(out=scaled).astype(np.uint8)


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
        raise SpecError.single(f"{path + ': ' if path else ''}{size}: {count:,} pixels, above the limit of "
                               f"{MAX_IMAGE_PIXELS:,} for a conditioning image", where)
    if count == 0:
        raise SpecError.single(f"{path + ': ' if path else ''}the image is empty ({size})", where)


def _tensor_pixels(tensor: Any, where: str) -> Any:
    """A tensor's values as a float32 numpy array, after the checks that need none of them: dense with data (not on
    the meta device, not sparse), floating point, its shape within the limits, so nothing large is copied first."""
    if tensor.is_meta or str(tensor.layout) != "torch.strided":
        where_ = "on the meta device" if tensor.is_meta else f"with layout {tensor.layout}"
        raise SpecError.single(f"an image tensor holds its values in memory (a dense tensor), got one {where_}", where)
    _check_dtype(tensor.dtype, "tensor", where, floating=tensor.is_floating_point())
    _check_shape(tuple(tensor.shape), "tensor", where, channels_first=True)
    return tensor.detach().cpu().float().numpy()


def _check_dtype(dtype: Any, kind: str, where: str, floating: bool | None = None) -> None:
    import numpy as np

    if not (np.issubdtype(dtype, np.floating) if floating is None else floating):
        raise SpecError.single(f"an image {kind} must be floating point with values in [0, 1] (as diffusers' image "
                               f"processors take it) or, for a numpy array, 8-bit (H, W, C); got dtype {dtype}", where)


def _check_shape(shape: tuple[int, ...], kind: str, where: str, channels_first: bool) -> None:
    """(H, W, C) / (B, H, W, C) for numpy or (C, H, W) / (B, C, H, W) for a tensor, with 1 or 3 channels, a batch of
    at least one image, and all its images' pixels together within the limit."""
    layout = "(C, H, W) or (B, C, H, W)" if channels_first else "(H, W, C) or (B, H, W, C)"
    if len(shape) not in (3, 4):
        raise SpecError.single(f"an image {kind} is {layout}, got shape {shape}", where)
    channels = shape[-3] if channels_first else shape[-1]
    if channels not in (1, 3):
        raise SpecError.single(f"an image {kind} has 1 or 3 channels, got {channels} in shape "
                               f"{shape} ({layout}; drop or composite an alpha channel first)", where)
    batch = int(shape[0]) if len(shape) == 4 else 1
    if batch == 0:
        raise SpecError.single(f"the image {kind}'s batch is empty (shape {shape})", where)
    height, width = (shape[-2], shape[-1]) if channels_first else (shape[-3], shape[-2])
    size = f"{width}x{height}" if batch == 1 else f"{batch} images of {width}x{height}"
    _check_pixels(batch * int(height) * int(width), size, where)


def _checked_values(pixels: Any, kind: str, where: str) -> Any:
    """An image array's values: finite and in [0, 1]."""
    import numpy as np

    if not np.isfinite(pixels).all():
        raise SpecError.single(f"the image {kind} holds NaN or infinite values", where)
    low, high = float(pixels.min()), float(pixels.max())
    if low < 0.0 or high > 1.0:
        raise SpecError.single(f"an image {kind}'s values lie in [0, 1] (as diffusers' image processors take them), "
                               f"got [{low:g}, {high:g}]", where)
    return pixels


def mask_condition(mask: Any, where: str = "request.mask") -> ImageCondition:
    """An inpainting mask: white (values >= 0.5) is repainted, black kept, as diffusers' mask processors binarise it.

    A path or PIL image becomes greyscale (PIL mode L); a mask with transparency is refused, since whether its alpha
    or its colour marks the region is a guess. An 8-bit (H, W) array is the greyscale picture it is; a float array
    (H, W) or (H, W, 1) and a float tensor (H, W) or (1, H, W) hold values in [0, 1]; anything with 3 channels is
    refused (a mask has one). One image only: no batch axis."""
    import numpy as np
    from PIL import Image

    is_tensor = hasattr(mask, "detach") and hasattr(mask, "dim")
    if isinstance(mask, (str, Path)):
        path = str(mask)
        file = regular_file(path, where, "mask file")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                with Image.open(file, formats=IMAGE_FORMATS) as opened:  # the header only
                    header = opened.mode, dict(opened.info)
        except Exception:  # noqa: BLE001 - not a readable image: image_condition below says so in its words
            header = None
        if header is not None:
            _refuse_alpha(*header, where, path)
    elif isinstance(mask, Image.Image):
        _refuse_alpha(mask.mode, mask.info, where, None)
    elif isinstance(mask, np.ndarray) and mask.dtype == np.uint8:
        if mask.ndim != 2 and not (mask.ndim == 3 and mask.shape[-1] == 1):
            raise SpecError.single(f"an 8-bit mask array is (H, W) or (H, W, 1), got shape {mask.shape}", where)
    elif isinstance(mask, np.ndarray):
        if mask.ndim == 2:
            mask = mask[..., None]
        if mask.ndim != 3 or mask.shape[-1] != 1:
            raise SpecError.single(f"a mask array is (H, W) or (H, W, 1), got shape {mask.shape}", where)
    elif not is_tensor:
        raise SpecTypeError.single(f"a mask is a PIL image, a numpy array, a torch tensor or a path, got "
                                   f"{type(mask).__name__}", where)
    else:
        if mask.dim() == 2:
            mask = mask.unsqueeze(0)
        if mask.dim() != 3 or mask.shape[0] != 1:
            raise SpecError.single(f"a mask tensor is (H, W) or (1, H, W), got shape {tuple(mask.shape)}", where)
    condition = image_condition(mask, 0, where)
    if isinstance(condition.image, Image.Image):  # RGB after image_condition: back to the grey values it held
        condition = condition.model_copy(update={"image": condition.image.convert("L")})
    return condition


def _refuse_alpha(mode: str, info: dict, where: str, path: str | None) -> None:
    if mode in _ALPHA_MODES or "transparency" in info:  # an alpha channel, or a tRNS colour (any mode)
        raise SpecError.single(f"{path + ': ' if path else ''}the mask has transparency (PIL mode {mode}); "
                               "whether its alpha or its grey values mark the region to repaint is ambiguous: save it "
                               "as greyscale, white where to repaint", where)
    if mode not in ("1", "L", "P", "RGB", "I", "F", *_SIXTEEN_BIT):
        raise SpecError.single(f"{path + ': ' if path else ''}a mask is a greyscale (or RGB) image, got PIL mode "
                               f"{mode}", where)


def pixel_size(image: Any) -> tuple[int, int]:
    """(height, width) of a checked image or mask: PIL, (H, W, C) array or (C, H, W) tensor."""
    if hasattr(image, "size") and not hasattr(image, "shape"):
        width, height = image.size
        return int(height), int(width)
    if hasattr(image, "detach"):
        return int(image.shape[-2]), int(image.shape[-1])
    return int(image.shape[-3]), int(image.shape[-2])


__all__ = ["IMAGE_FORMATS", "ImageCondition", "image_condition", "loaded_image", "mask_condition", "open_image",
           "pixel_size", "rgb"]
