"""Write outputs: ``.png`` per image, ``.gif``/``.mp4`` per video, ``.npy`` for the whole decoded array."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..spec import SpecError

if TYPE_CHECKING:
    from .pipeline import Output

SUFFIXES = (".png", ".gif", ".mp4", ".npy")


def output_paths(path: Path, count: int) -> list[Path]:
    """``name.ext`` for one output, ``name-0.ext``, ``name-1.ext`` ... for several."""
    if count == 1:
        return [path]
    return [path.with_name(f"{path.stem}-{i}{path.suffix}") for i in range(count)]


def check_output_path(path: Path, video: bool) -> None:
    suffix = path.suffix.lower()
    allowed = (".gif", ".mp4", ".npy", ".png") if video else (".png", ".npy")
    if suffix not in allowed:
        kind = "video" if video else "image"
        raise SpecError.single(f"cannot write a {kind} task's output as {suffix or 'no suffix'}; use {', '.join(allowed)}",
                               "--output")


def save_output(output: Output, path: Path) -> list[Path]:
    path.parent.mkdir(parents=True, exist_ok=True)
    suffix = path.suffix.lower()
    if suffix == ".npy":
        np.save(path, output.array)
        return [path]
    if output.images:
        paths = output_paths(path, len(output.images))
        for image, p in zip(output.images, paths):
            image.save(p)
        return paths
    paths = output_paths(path, len(output.frames))
    fps = output.request.fps or 16
    for frames, p in zip(output.frames, paths):
        uint8 = (np.clip(frames, 0, 1) * 255).round().astype(np.uint8)
        if suffix == ".png":  # a video as a strip of frames side by side
            from PIL import Image

            Image.fromarray(np.concatenate(list(uint8), axis=1).squeeze()).save(p)
        elif suffix == ".gif":
            from PIL import Image

            images = [Image.fromarray(f.squeeze()) for f in uint8]
            images[0].save(p, save_all=True, append_images=images[1:], duration=int(1000 / fps), loop=0)
        else:
            try:
                import imageio.v3 as iio
            except ImportError:
                raise SpecError.single("writing .mp4 needs imageio and imageio-ffmpeg: pip install 'omnispec[video]'",
                                       "--output") from None
            iio.imwrite(p, uint8, fps=fps, codec="libx264")
    return paths
